"""Token-weighted gradients of a loss in any layout: micro-batches (gradient accumulation) under a `lax.scan`,
summed before one division by the tokens scored."""

import contextlib

import jax
import jax.numpy as jnp


def split_micro_batches(batch, steps, shards=1):
    """`[rows, ...]` -> `[steps, rows / steps, ...]`, micro-batch i made of the i-th part of each of the
    batch's `shards` (the devices holding its rows), so every micro-batch spans all of them and holds
    the same rows in every layout."""

    def split(x):
        parts = x.reshape((shards, steps, -1) + x.shape[1:]).swapaxes(0, 1)
        return parts.reshape((steps, -1) + x.shape[1:])

    return jax.tree_util.tree_map(split, batch)


def token_weighted_grads(loss_fn, params, batch, rng, accumulation_steps, layout, split_layers=True):
    """Gradients of the mean token loss over the global batch, and the batch's metric sums.

    `loss_fn(params, batch, rng) -> (loss_sum, sums)` where `sums` is a dict of per-batch sums
    holding at least "loss" and "tokens"; `layout` (`utils.layout.layouts`) sums over the global batch and
    says how its rows lie over the devices. With accumulation the rows are split into
    `accumulation_steps` micro-batches scanned in sequence: one compiled body, activation memory of
    a single micro-batch, and exactly the gradient of the whole batch. `split_layers=False` leaves the
    layers' gradients to XLA (`Layout.split_layer_gradients` would compute and keep those of parameters
    `params` does not hold: a frozen base's).
    """
    # Why a scan and not optax.MultiSteps (one pmap call per micro-batch), measured with
    # benchmarks/gradient_accumulation.py (tiny T5, 1M params, 4 micro-batches of 8 x 112 tokens,
    # one CPU device, min of 20 steps over 5 runs): 202-216 ms per optimizer step vs 285-445 ms;
    # peak memory of a step 41.8 MiB vs 47.9 MiB (MultiSteps keeps a float32 gradient buffer in the
    # optimizer state for the whole run: +33% state). The whole 32-row batch at once: 126 MiB.
    # MultiSteps would also all-reduce gradients after every micro-batch instead of once, count
    # micro-batches in `state.step`, and average per-micro-batch means instead of weighting tokens.
    grad_fn = jax.grad(loss_fn, has_aux=True)
    rows = len(jax.tree_util.tree_leaves(batch)[0]) // accumulation_steps
    split = layout.split_layer_gradients() if split_layers else contextlib.nullcontext()
    with layout.keep_batch_split(rows), split:
        grads, sums = _summed_grads(grad_fn, params, batch, rng, accumulation_steps, layout)
    sums, grads = layout.batch_sum((sums, grads))
    # In the gradient's own dtype: a float32 count would turn bf16 gradients (--param_dtype bfloat16)
    # into float32 ones, and with them the optimizer state after the first step.
    grads = jax.tree_util.tree_map(lambda g: (g / jnp.maximum(sums["tokens"], 1.0)).astype(g.dtype), grads)
    return grads, sums


def _summed_grads(grad_fn, params, batch, rng, accumulation_steps, layout):
    """(gradient sums, metric sums) of the rows in hand, micro-batch by micro-batch with accumulation."""
    if accumulation_steps == 1:
        grads, sums = grad_fn(params, batch, rng)
    else:
        micro = split_micro_batches(batch, accumulation_steps, layout.batch_shards)

        def accumulate(carry, inputs):
            index, micro_batch = inputs
            step = grad_fn(params, micro_batch, jax.random.fold_in(rng, index))
            return jax.tree_util.tree_map(jnp.add, carry, step), None

        first = jax.tree_util.tree_map(lambda x: x[0], micro)
        shapes = jax.eval_shape(grad_fn, params, first, rng)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (grads, sums), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(accumulation_steps), micro))
    return grads, sums
