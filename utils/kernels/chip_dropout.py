"""Dropout whose mask the TPU draws inside a Pallas kernel (`--dropout_rng chip`).

flax's `nn.Dropout` draws a 32-bit number per element with XLA's generator, turns them into a mask and keeps
the mask for the backward pass. Here a kernel reads a block of the input, seeds the chip's generator with
(seed, block number), draws the block's mask and writes the dropped block: no bits or mask reach HBM.
Dropout is linear in its input, so its gradient is the same kernel, seed and mask applied to the output's
gradient. On a v5e chip, GPT-2 small with its dropouts trains as fast as with rbg's masks (XLA fuses those
into their neighbours) and plans 7.04 GiB for its train step instead of 8.12: the masks are not kept.

As `nn.Dropout` does, an element is kept with probability 1 - rate and scaled by 1 / (1 - rate). Pallas'
interpreter (CPUs: the tests) draws zeros from the chip's generator; there the bits are
`dropout_attention.hashed_bits` of the same seed and block and the element's place in it.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from utils.kernels.flash_attention import LANES, seed_of, tile_keep
from utils.kernels.hooks import intercept_calls

ROWS = 16  # a bfloat16 vector register's rows: blocks are a multiple of them
BLOCK_BYTES = 2**20  # a block, its output and their next ones (double buffering) stay well within VMEM


def block_rows(rows, width, itemsize):
    """Rows of the blocks a [rows, width] input is cut into, or None where the kernel takes no such input."""
    if width % LANES or rows % ROWS:
        return None
    block = ROWS
    while block * 2 * width * itemsize <= BLOCK_BYTES and rows % (block * 2) == 0:
        block *= 2
    return block


def _kernel(seed_ref, x_ref, out_ref, *, rate, interpret):
    keep = tile_keep(seed_ref, rate, interpret, pl.program_id(0), x_ref.shape)
    out_ref[...] = jnp.where(keep, x_ref[...].astype(jnp.float32) * (1.0 / (1.0 - rate)), 0.0).astype(out_ref.dtype)


# Jitted, as the flash kernel's calls: a train step calls the kernel at every dropout of every layer, and
# Pallas traces the kernel anew at each call (GPT-2 small: 74 kernel traces, ~2 s of tracing the step on a
# CPU); jit traces it once per shape and rate.
@functools.partial(jax.jit, static_argnums=(2, 3))
def _drop(x, seed, rate, interpret):
    rows, width = x.shape
    block = block_rows(rows, width, x.dtype.itemsize)
    spec = pl.BlockSpec((block, width), lambda i, seed: (i, 0))
    return pl.pallas_call(
        functools.partial(_kernel, rate=rate, interpret=interpret),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(rows // block,), in_specs=[spec],
                                               out_specs=spec),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)), interpret=interpret,
    )(seed, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dropout(x, seed, rate, interpret):
    return _drop(x, seed, rate, interpret)


def _dropout_forward(x, seed, rate, interpret):
    return _drop(x, seed, rate, interpret), seed


def _dropout_backward(rate, interpret, seed, d_out):
    return _drop(d_out, seed, rate, interpret), None


_dropout.defvjp(_dropout_forward, _dropout_backward)


def takes(shape, dtype):
    """Whether the kernel takes an input of `shape` and `dtype` (its last axis a multiple of 128, the rest a
    multiple of 16 rows)."""
    return len(shape) >= 2 and block_rows(math.prod(shape[:-1]), shape[-1], jnp.dtype(dtype).itemsize) is not None


def dropout(x, seed, rate, interpret=False):
    """`x` with each element kept with probability 1 - `rate` and scaled by 1 / (1 - rate), else 0; the mask
    drawn from `seed` (int32, shape (1,)). `x`'s shape must be one `takes`. Differentiable in `x`."""
    flat = x.reshape(-1, x.shape[-1])
    return _dropout(flat, seed.astype(jnp.int32), float(rate), bool(interpret)).reshape(x.shape)


def _route(interpret, next_fun, args, kwargs, context):
    module = context.module
    if not isinstance(module, nn.Dropout) or context.method_name != "__call__":
        return next_fun(*args, **kwargs)
    bound = dict(zip(("inputs", "deterministic", "rng"), args), **kwargs)
    inputs = bound["inputs"]
    deterministic = nn.merge_param("deterministic", module.deterministic, bound.get("deterministic"))
    if (deterministic or not 0.0 < module.rate < 1.0 or module.broadcast_dims
            or not takes(inputs.shape, inputs.dtype)):
        return next_fun(*args, **kwargs)
    key = bound.get("rng")
    key = module.make_rng(module.rng_collection) if key is None else key
    return dropout(inputs, seed_of(key), module.rate, interpret)


def use_chip_dropout(model, interpret=False):
    """Make every `nn.Dropout` in `model`'s calls draw its mask in the kernel where it takes the input (the
    rest as flax does). `interpret`: Pallas' interpreter, for CPUs (tests)."""
    intercept_calls(model, functools.partial(_route, interpret))
