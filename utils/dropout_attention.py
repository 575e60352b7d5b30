"""Causal flash attention with the attention dropout drawn inside the kernel (Pallas, TPU).

JAX's splash kernel has no dropout, and GPT-2 trains with attention dropout (`attn_pdrop` 0.1): the
stock attention then writes the [batch, heads, length, length] scores, their softmax and a dropout
mask out to HBM, and that traffic, not the products, is the layer's time. These kernels keep one
tile of scores at a time in VMEM, as flash attention does, and draw the tile's dropout mask there:
the forward kernel and the backward kernel (dq, dk and dv in one pass) seed the chip's generator with
the seed and the tile's number (`tile_number` of its batch, head, query tile and key tile) and draw
the tile's bits in one call, so both see the same mask and none stores it.

The dropout is flax's `nn.Dropout` on the softmax'd weights (as transformers' Flax attention applies
it): a weight is kept with probability 1 - rate and scaled by 1 / (1 - rate). The normaliser is the
sum of the weights before dropout, so a tile's kept weights can go into the output before the row's
softmax is complete.

Pallas' interpreter (CPUs: the tests) draws zeros from the chip's generator; there the kernels take
their bits from `hashed_bits`, a counter hash of the same seed and tile number and the place in the
tile, which a test can draw for the whole matrix at once.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # a vector register's lanes: per-row statistics are kept broadcast across them
SUBLANES = 8
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a score no query sees (finite: no inf - inf)


# The backward kernel keeps a head's dq (length x head_dim, float32) in VMEM: 4 MiB of it fit beside the tiles
# in the compiler's default VMEM budget (16,384 x 128 do not, on a v5e).
MAX_DQ_ELEMENTS = 8192 * 128


def fits(length, head_dim):
    """Whether the kernels take `length` tokens of `head_dim` per head (a multiple of 128, dq within VMEM)."""
    return length % LANES == 0 and length * head_dim <= MAX_DQ_ELEMENTS


def block_size(length):
    """The tile the kernels use for `length` tokens (a multiple of 128)."""
    return next(size for size in (512, 256, 128) if length % size == 0)


def _mix(x):
    """murmur3's 32-bit finaliser: every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def hashed_bits(seed, tile, rows, columns):
    """31 random bits (int32, non-negative) for each (row, column) place of the tile numbered `tile`
    (`tile_number`)."""
    stream = _mix(_mix(seed.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9)) ^ tile.astype(jnp.uint32))
    counter = rows.astype(jnp.uint32) * jnp.uint32(0x10001) ^ (columns.astype(jnp.uint32) << 3)
    return (_mix(stream ^ _mix(counter)) >> 1).astype(jnp.int32)


def keep_threshold(rate):
    """Bits (31 of them) at or above this keep their weight: a fraction 1 - rate."""
    return int(round(rate * 2**31))


def seed_of(key):
    """A kernel seed (int32, shape (1,)) drawn from a JAX key."""
    return jax.lax.bitcast_convert_type(jax.random.bits(key, (1,), jnp.uint32), jnp.int32)


def tile_number(batch, head, query_tile, key_tile, heads, tiles):
    """The tile's place among all (batch, head, query tile, key tile): with the seed, what the chip's
    generator is seeded with (it takes two numbers)."""
    return ((batch * heads + head) * tiles + query_tile) * tiles + key_tile


def _grid_tile(swapped=False):
    """This grid step's tile number (grid (batch, head, query tile, key tile), or key tile before query tile
    when `swapped`). Read at the kernel's top: the interpreter gives grid positions only there."""
    batch, head, first, second = (pl.program_id(axis) for axis in range(4))
    query_tile, key_tile = (second, first) if swapped else (first, second)
    return tile_number(batch, head, query_tile, key_tile, pl.num_programs(1), pl.num_programs(2))


def tile_keep(seed_ref, rate, interpret, tile, shape):
    """The dropout mask (True: kept) of the tile numbered `tile`: the chip's generator seeded with (seed, tile),
    or in the interpreter `hashed_bits`."""
    if interpret:
        bits = hashed_bits(seed_ref[0], tile, jax.lax.broadcasted_iota(jnp.int32, shape, 0),
                           jax.lax.broadcasted_iota(jnp.int32, shape, 1))
    else:
        pltpu.prng_seed(seed_ref[0], tile)
        bits = pltpu.prng_random_bits(shape) & jnp.int32(0x7FFFFFFF)
    return bits >= keep_threshold(rate)


def _tile_scores(q_ref, k_ref, q_segment_ref, kv_segment_ref, query_tile, key_tile):
    """Scores of one tile (f32), with what the queries may not see at `MASKED`, and where they see."""
    rows_count, columns_count = q_ref.shape[0], k_ref.shape[0]
    scores = jax.lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    rows = query_tile * rows_count + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 0)
    columns = key_tile * columns_count + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    visible = (columns <= rows) & (_lanes(q_segment_ref[...], columns_count) == kv_segment_ref[:1, :])
    return jnp.where(visible, scores, MASKED), visible


def _lanes(stat, width):
    """A (rows, 128) statistic repeated to (rows, width)."""
    return jnp.tile(stat, (1, width // LANES)) if width > LANES else stat[:, :width]


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, q_segment_ref, kv_segment_ref, out_ref, lse_ref,
                    max_ref, sum_ref, acc_ref, *, rate, interpret):
    query_tile, key_tile = pl.program_id(2), pl.program_id(3)
    tile = _grid_tile()

    @pl.when(key_tile == 0)
    def _start():
        max_ref[...] = jnp.full(max_ref.shape, MASKED, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(key_tile <= query_tile)  # tiles above the diagonal are all masked
    def _accumulate():
        scores, visible = _tile_scores(q_ref, k_ref, q_segment_ref, kv_segment_ref, query_tile,
                                                      key_tile)
        previous = max_ref[...]
        running_max = jnp.maximum(previous, jnp.max(scores, axis=1, keepdims=True))
        weights = jnp.where(visible, jnp.exp(scores - _lanes(running_max, scores.shape[1])), 0.0)
        correction = jnp.exp(previous - running_max)
        sum_ref[...] = correction * sum_ref[...] + jnp.sum(weights, axis=1, keepdims=True)
        max_ref[...] = running_max
        if rate:
            weights = jnp.where(tile_keep(seed_ref, rate, interpret, tile, scores.shape), weights, 0.0)
        update = jax.lax.dot(weights.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * _lanes(correction, acc_ref.shape[1]) + update

    @pl.when(key_tile == query_tile)  # the row's last visible tile
    def _finish():
        total = sum_ref[...]
        scale = 1.0 / (total * (1.0 - rate))
        out_ref[...] = (acc_ref[...] * _lanes(scale, acc_ref.shape[1])).astype(out_ref.dtype)
        lse_ref[...] = max_ref[...] + jnp.log(total)


def _tile_gradients(seed_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_segment_ref, kv_segment_ref,
                    tile, query_tile, key_tile, rate, interpret):
    """The tile's dropped weights (for dv) and the scores' gradient (for dq, dk), both f32."""
    scores, visible = _tile_scores(q_ref, k_ref, q_segment_ref, kv_segment_ref, query_tile, key_tile)
    weights = jnp.where(visible, jnp.exp(scores - _lanes(lse_ref[...], scores.shape[1])), 0.0)
    d_dropped = jax.lax.dot_general(do_ref[...], v_ref[...], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
    dropped = weights
    if rate:
        keep = tile_keep(seed_ref, rate, interpret, tile, scores.shape)
        dropped = jnp.where(keep, weights * (1.0 / (1.0 - rate)), 0.0)
        d_dropped = jnp.where(keep, d_dropped * (1.0 / (1.0 - rate)), 0.0)
    d_scores = weights * (d_dropped - _lanes(delta_ref[...], scores.shape[1]))
    return dropped, d_scores


def _backward_kernel(seed_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_segment_ref, kv_segment_ref,
                     dq_ref, dk_ref, dv_ref, dq_acc_ref, dk_acc_ref, dv_acc_ref, *, rate, interpret):
    """dq, dk and dv in one pass over the tiles, key tile by key tile: each tile's scores, weights and mask
    are formed once for all three (a dq kernel of its own would form them again). dk and dv of the key
    tile accumulate over the query tiles; dq of the whole sequence stays in VMEM until the head is done."""
    key_tile, query_tile = pl.program_id(2), pl.program_id(3)
    tile = _grid_tile(swapped=True)
    last = pl.num_programs(3) - 1
    block = q_ref.shape[0]

    @pl.when((key_tile == 0) & (query_tile == 0))
    def _start_head():
        dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)

    @pl.when(query_tile == 0)
    def _start_key_tile():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    @pl.when(query_tile >= key_tile)  # query tiles before the key tile see none of its keys
    def _accumulate():
        dropped, d_scores = _tile_gradients(seed_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_segment_ref,
                                            kv_segment_ref, tile, query_tile, key_tile, rate, interpret)
        transposed = (((0,), (0,)), ((), ()))
        dv_acc_ref[...] += jax.lax.dot_general(dropped.astype(do_ref.dtype), do_ref[...], transposed,
                                               preferred_element_type=jnp.float32)
        d_scores = d_scores.astype(q_ref.dtype)
        dk_acc_ref[...] += jax.lax.dot_general(d_scores, q_ref[...], transposed, preferred_element_type=jnp.float32)
        rows = pl.ds(pl.multiple_of(query_tile * block, block), block)
        dq_acc_ref[rows, :] += jax.lax.dot(d_scores, k_ref[...], preferred_element_type=jnp.float32)

    @pl.when(query_tile == last)
    def _finish_key_tile():
        dk_ref[...] = dk_acc_ref[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)

    @pl.when((key_tile == last) & (query_tile == last))
    def _finish_head():
        dq_ref[...] = dq_acc_ref[...].astype(dq_ref.dtype)


def _segment_layouts(segments):
    """[batch, length] segment ids as the kernels read them: per query row across the lanes, per key
    column down the sublanes."""
    batch, length = segments.shape
    return (jnp.broadcast_to(segments[:, :, None], (batch, length, LANES)),
            jnp.broadcast_to(segments[:, None, :], (batch, SUBLANES, length)))


def _specs(block, head_dim, row_tile, column_tile):
    """Block specs of q, k, v-shaped inputs and the row/column statistics for a grid whose tile indices are
    picked by `row_tile(grid...)` (the query tile) and `column_tile(grid...)` (the key tile)."""
    rows = pl.BlockSpec((None, None, block, head_dim), lambda b, h, i, j, seed: (b, h, row_tile(i, j), 0))
    columns = pl.BlockSpec((None, None, block, head_dim), lambda b, h, i, j, seed: (b, h, column_tile(i, j), 0))
    row_stat = pl.BlockSpec((None, None, block, LANES), lambda b, h, i, j, seed: (b, h, row_tile(i, j), 0))
    q_segment = pl.BlockSpec((None, block, LANES), lambda b, h, i, j, seed: (b, row_tile(i, j), 0))
    kv_segment = pl.BlockSpec((None, SUBLANES, block), lambda b, h, i, j, seed: (b, 0, column_tile(i, j)))
    return rows, columns, row_stat, q_segment, kv_segment


def _forward(q, k, v, segments, seed, rate, interpret):
    batch, heads, length, head_dim = q.shape
    block = block_size(length)
    tiles = length // block
    # A key tile above the diagonal is skipped: its index stays at the diagonal's, so nothing is fetched.
    rows, columns, row_stat, q_segment, kv_segment = _specs(block, head_dim, lambda i, j: i,
                                                            lambda i, j: jnp.minimum(i, j))
    kernel = functools.partial(_forward_kernel, rate=rate, interpret=interpret)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads, tiles, tiles),
            in_specs=[rows, columns, columns, q_segment, kv_segment], out_specs=[rows, row_stat],
            scratch_shapes=[pltpu.VMEM((block, LANES), jnp.float32), pltpu.VMEM((block, LANES), jnp.float32),
                            pltpu.VMEM((block, head_dim), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, length, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(seed, q, k, v, *_segment_layouts(segments))
    return out, lse[..., 0]


def _backward(q, k, v, segments, seed, out, lse, d_out, rate, interpret):
    batch, heads, length, head_dim = q.shape
    block = block_size(length)
    tiles = length // block
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # rowsum(dO o O)
    stats = [jnp.broadcast_to(x[..., None], (batch, heads, length, LANES)) for x in (lse, delta)]
    # Grid (b, h, key tile, query tile); a query tile before the key tile is skipped: its index stays at the
    # key tile's, so nothing is fetched. dq's block is the head's whole sequence, written once per head.
    rows, columns, row_stat, q_segment, kv_segment = _specs(block, head_dim, lambda i, j: jnp.maximum(i, j),
                                                            lambda i, j: i)
    whole = pl.BlockSpec((None, None, length, head_dim), lambda b, h, i, j, seed: (b, h, 0, 0))
    return pl.pallas_call(
        functools.partial(_backward_kernel, rate=rate, interpret=interpret),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, heads, tiles, tiles),
            in_specs=[rows, columns, columns, rows, row_stat, row_stat, q_segment, kv_segment],
            out_specs=[whole, columns, columns],
            scratch_shapes=[pltpu.VMEM((length, head_dim), jnp.float32), pltpu.VMEM((block, head_dim), jnp.float32),
                            pltpu.VMEM((block, head_dim), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)],
        # dq of a head is carried across its key tiles: they run in order, on one core
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(seed, q, k, v, d_out, *stats, *_segment_layouts(segments))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, segments, seed, rate, interpret):
    return _forward(q, k, v, segments, seed, rate, interpret)[0]


def _attention_forward(q, k, v, segments, seed, rate, interpret):
    out, lse = _forward(q, k, v, segments, seed, rate, interpret)
    return out, (q, k, v, segments, seed, out, lse)


def _attention_backward(rate, interpret, residuals, d_out):
    q, k, v, segments, seed, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, segments, seed, out, lse, d_out, rate, interpret)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_forward, _attention_backward)


def dropout_attention(query, key, value, segments, seed, rate, interpret=False):
    """softmax(q k^T + causal mask, restricted to equal `segments`) with dropout at `rate`, times v.

    `query` (already scaled), `key`, `value`: [batch, heads, length, head_dim], length a multiple of 128;
    `segments`: [batch, length] int32 (a query sees the keys before it in its own segment); `seed`: an
    int32 array of shape (1,), the mask's seed. Differentiable in query, key and value.
    """
    return _attention(query, key, value, segments.astype(jnp.int32), seed.astype(jnp.int32), float(rate),
                      bool(interpret))
