"""The next-token loss of a decoder without its full-vocabulary logits (`--chunked_loss`).

A decoder's LM head turns every position into vocabulary-sized logits, and the loss then holds them in
float32: for a Llama-3-style vocabulary (128,256 tokens) and 8 x 1024 positions that is 4.2 GB, as
much again for their gradient, more than a 1B model's weights. `head_inputs(model)` makes the model's
`lm_head` (a `nn.Dense` in GPT-2, Llama, Mistral and Gemma, the kernel tied to the embeddings or its
own) return what it was given, `HeadInputs`, in place of the logits; `cross_entropy_sums` then forms
the logits `CHUNK` positions at a time, and while a chunk's logits exist it also takes their share
of the gradients (of the kernel, and of the chunk's hidden states), so one chunk's logits exist at
once, forward and backward, and none is formed twice.
"""

import contextlib
import functools
import logging
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

CHUNK = 1024  # positions whose logits exist at once: 0.5 GB in float32 at a 128K vocabulary
FAMILIES = ("gpt2", "llama", "mistral", "gemma")  # model types whose `lm_head` output is the logits
AUTO_VOCABULARY = 32768  # `--chunked_loss auto`: on from this vocabulary size up

logger = logging.getLogger(__name__)


@struct.dataclass  # not a tuple: the model's output class would take a tuple for (name, value) pairs
class HeadInputs:
    """What the LM head was given: logits = hidden @ kernel (+ bias), in `dtype`."""
    hidden: jax.Array  # [batch, length, hidden]
    kernel: jax.Array  # [hidden, vocabulary]
    bias: Optional[jax.Array]
    dtype: Any = struct.field(pytree_node=False)


def supports(model):
    return model.config.model_type in FAMILIES


def choose(choice, model):
    """Whether `--chunked_loss` `choice` ("auto", "true", "false") applies to `model`; "auto": for the
    families whose head it knows, at vocabularies of `AUTO_VOCABULARY` tokens and more (logged)."""
    chunked = (choice != "false" and supports(model)
               and (choice == "true" or model.config.vocab_size >= AUTO_VOCABULARY))
    if chunked:
        logger.info("loss: the LM head's logits formed %d positions at a time (--chunked_loss %s)", CHUNK, choice)
    return chunked


def _return_inputs(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or module.name != "lm_head" or not isinstance(module, nn.Dense):
        return next_fun(*args, **kwargs)
    params = module.variables["params"]
    return HeadInputs(args[0], params["kernel"], params.get("bias"), module.dtype or args[0].dtype)


@contextlib.contextmanager
def head_inputs(enabled=True):
    """Inside (when `enabled`), a model's `lm_head` returns `HeadInputs` where it would return logits."""
    if not enabled:
        yield
        return
    with nn.intercept_methods(_return_inputs):
        yield


def without_last_position(head):
    """`head` for every position but the last (a block's last token predicts nothing)."""
    return head.replace(hidden=head.hidden[:, :-1])


def _target(labels, vocab, smoothing):
    """The target distribution of each label: 1 - s on it and s / (V - 1) on every other token."""
    off = smoothing / (vocab - 1)
    return jax.nn.one_hot(labels, vocab, dtype=jnp.float32) * (1.0 - smoothing - off) + off


def _entropy(vocab, smoothing):
    """The target's entropy, taken off every loss so that a perfect prediction scores 0 (as
    `utils.steps.cross_entropy_sums` does)."""
    if not smoothing:
        return 0.0
    confidence, off = 1.0 - smoothing, smoothing / (vocab - 1)
    return -(confidence * math.log(confidence) + (vocab - 1) * off * math.log(off + 1e-20))


def _chunk_scores(hidden, kernel, bias, dtype):
    """A chunk's logits, in float32 (the products accumulate in float32)."""
    scores = jnp.dot(hidden.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)
    return scores if bias is None else scores + bias.astype(jnp.float32)


def _chunk_losses(scores, labels, smoothing):
    """Each position's cross-entropy against the (smoothed) target, and its log-normaliser."""
    normaliser = jax.nn.logsumexp(scores, axis=-1)
    expected = (_target(labels, scores.shape[-1], smoothing) * scores).sum(-1)
    return normaliser - expected - _entropy(scores.shape[-1], smoothing), normaliser


def _chunks(*arrays):
    return tuple(x.reshape((-1, CHUNK) + x.shape[1:]) for x in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _loss_sum(hidden, kernel, bias, labels, weights, dtype, smoothing):
    def chunk_sum(total, chunk):
        hidden, labels, weights = chunk
        losses, _ = _chunk_losses(_chunk_scores(hidden, kernel, bias, dtype), labels, smoothing)
        return total + (losses * weights).sum(), None

    return jax.lax.scan(chunk_sum, jnp.float32(0.0), _chunks(hidden, labels, weights))[0]


def _loss_sum_and_gradients(hidden, kernel, bias, labels, weights, dtype, smoothing):
    """The loss sum and its gradients, chunk by chunk: a chunk's logits give its share of the kernel's
    gradient and its positions' gradient at once, so no logits are kept for the backward pass and none
    are formed twice (the products are the ones the whole logits' backward pass computes)."""
    def chunk_step(carry, chunk):
        total, d_kernel, d_bias = carry
        hidden, labels, weights = chunk
        scores = _chunk_scores(hidden, kernel, bias, dtype)
        losses, normaliser = _chunk_losses(scores, labels, smoothing)
        d_scores = ((jnp.exp(scores - normaliser[:, None]) - _target(labels, scores.shape[-1], smoothing))
                    * weights[:, None]).astype(dtype)
        d_hidden = jnp.dot(d_scores, kernel.astype(dtype).T, preferred_element_type=jnp.float32)
        d_kernel = d_kernel + jnp.dot(hidden.astype(dtype).T, d_scores, preferred_element_type=jnp.float32)
        if d_bias is not None:
            d_bias = d_bias + d_scores.astype(jnp.float32).sum(0)
        return (total + (losses * weights).sum(), d_kernel, d_bias), d_hidden.astype(hidden.dtype)

    start = (jnp.float32(0.0), jnp.zeros(kernel.shape, jnp.float32),
             None if bias is None else jnp.zeros(bias.shape, jnp.float32))
    (total, d_kernel, d_bias), d_hidden = jax.lax.scan(chunk_step, start, _chunks(hidden, labels, weights))
    return total, (d_hidden.reshape(hidden.shape), d_kernel.astype(kernel.dtype),
                   None if bias is None else d_bias.astype(bias.dtype))


def _loss_sum_backward(dtype, smoothing, gradients, cotangent):
    d_hidden, d_kernel, d_bias = gradients
    scale = lambda x: None if x is None else (x * cotangent).astype(x.dtype)  # noqa: E731
    # Labels and weights are data: no gradient flows to them.
    return scale(d_hidden), scale(d_kernel), scale(d_bias), None, None


_loss_sum.defvjp(_loss_sum_and_gradients, _loss_sum_backward)


def cross_entropy_sums(head, labels, weights, label_smoothing=0.0):
    """(sum of weighted token losses, sum of weights) of `head`'s logits against `labels` [batch, length],
    as `utils.steps.cross_entropy_sums` computes them from the logits (float32), `CHUNK` positions at a
    time; differentiable in the head's inputs (hidden states, kernel, bias)."""
    width = head.hidden.shape[-1]
    hidden, labels, weights = head.hidden.reshape(-1, width), labels.reshape(-1), weights.reshape(-1)
    pad = -hidden.shape[0] % CHUNK
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    labels, weights = jnp.pad(labels, (0, pad)), jnp.pad(weights.astype(jnp.float32), (0, pad))
    return _loss_sum(hidden, head.kernel, head.bias, labels, weights, head.dtype, float(label_smoothing)), weights.sum()
