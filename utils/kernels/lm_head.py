"""The next-token loss of a decoder without its full-vocabulary logits (`--chunked_loss`).

A decoder's LM head turns every position into vocabulary-sized logits, and the loss then holds them in
float32: for a Llama-3-style vocabulary (128,256 tokens) and 8 x 1024 positions that is 4.2 GB, as
much again for their gradient, more than a 1B model's weights. `head_inputs(model)` makes the model's
`lm_head` (a `nn.Dense` in GPT-2, Llama, Mistral and Gemma, the kernel tied to the embeddings or its
own) return what it was given, `HeadInputs`, in place of the logits; `utils.scoring.losses.cross_entropy_sums`
then forms the logits (`logits`) `CHUNK` positions at a time under `jax.checkpoint`, so one chunk's
logits exist at once, forward and backward (the backward pass forms each chunk's again).

It trades memory for time: the backward pass forms the logits again, one more product of the LM
head (a Llama-3-style 1.67B model at 4 x 1024 tokens: about 4% more arithmetic per step for 0.84 GiB
less planned memory on a TPU; `benchmarks/chunked_loss.py`), so it is off unless asked for.
"""

import contextlib
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from utils.base.errors import UsageError

CHUNK = 1024  # positions whose logits exist at once: 0.5 GB in float32 at a 128K vocabulary
FAMILIES = ("gpt2", "llama", "mistral", "gemma")  # model types whose `lm_head` output is the logits

logger = logging.getLogger(__name__)


@struct.dataclass  # not a tuple: the model's output class would take a tuple for (name, value) pairs
class HeadInputs:
    """What the LM head was given: logits = hidden @ kernel (+ bias), in `dtype`."""
    hidden: jax.Array  # [batch, length, hidden]
    kernel: jax.Array  # [hidden, vocabulary]
    bias: Optional[jax.Array]
    dtype: Any = struct.field(pytree_node=False)


def choose(enabled, config):
    """Whether `--chunked_loss` (`enabled`) applies to a model of `config` (logged); a `UsageError` for a
    family whose head it does not know."""
    if enabled and config.model_type not in FAMILIES:
        raise UsageError(f"--chunked_loss knows the LM heads of {', '.join(FAMILIES)}, not "
                         f"{config.model_type}'s: drop --chunked_loss")
    if enabled:
        logger.info("loss: the LM head's logits formed %d positions at a time (--chunked_loss)", CHUNK)
    return enabled


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


def logits(head):
    """The logits `head` stands for, as the LM head computes them."""
    out = jnp.dot(head.hidden.astype(head.dtype), head.kernel.astype(head.dtype))
    return out if head.bias is None else out + head.bias.astype(head.dtype)
