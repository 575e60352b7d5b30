"""The token-summed losses every task's loss is built from: cross entropy over the scored tokens (also of an LM
head's inputs under --chunked_loss), with label smoothing; sums, never means, so any layout adds them up."""

import jax
import jax.numpy as jnp
import optax

from utils.kernels import lm_head


def cross_entropy_sums(logits, labels, weights, label_smoothing=0.0):
    """(sum of weighted token losses, sum of weights); loss computed in float32. `logits` may be an LM
    head's `utils.kernels.lm_head.HeadInputs`: the logits are then formed chunk by chunk."""
    if isinstance(logits, lm_head.HeadInputs):
        return _chunked_cross_entropy_sums(logits, labels, weights, label_smoothing)
    weights = weights.astype(jnp.float32)
    return (_token_losses(logits, labels, label_smoothing) * weights).sum(), weights.sum()


def _chunked_cross_entropy_sums(head, labels, weights, label_smoothing):
    """`cross_entropy_sums` of the logits `head` (`utils.kernels.lm_head.HeadInputs`) stands for, formed
    `lm_head.CHUNK` positions at a time."""
    width, chunk = head.hidden.shape[-1], lm_head.CHUNK
    hidden, labels, weights = head.hidden.reshape(-1, width), labels.reshape(-1), weights.reshape(-1)
    pad = -hidden.shape[0] % chunk
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    labels, weights = jnp.pad(labels, (0, pad)), jnp.pad(weights.astype(jnp.float32), (0, pad))

    @jax.checkpoint  # the backward pass forms each chunk's logits again instead of keeping them
    def chunk_sum(part):
        hidden, labels, weights = part
        return (_token_losses(lm_head.logits(head.replace(hidden=hidden)), labels, label_smoothing) * weights).sum()

    parts = tuple(x.reshape((-1, chunk) + x.shape[1:]) for x in (hidden, labels, weights))
    return jax.lax.map(chunk_sum, parts).sum(), weights.sum()


def _token_losses(logits, labels, label_smoothing=0.0):
    """Each token's cross-entropy (float32) against its label, or against the label smoothed."""
    logits = logits.astype(jnp.float32)
    if label_smoothing:
        vocab = logits.shape[-1]
        confidence, off = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
        # Subtract the entropy of the smoothed target so a perfect prediction scores 0.
        floor = -(confidence * jnp.log(confidence) + (vocab - 1) * off * jnp.log(off + 1e-20))
        targets = jax.nn.one_hot(labels, vocab) * (confidence - off) + off
        losses = optax.softmax_cross_entropy(logits, targets) - floor
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return losses
