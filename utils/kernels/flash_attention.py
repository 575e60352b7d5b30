"""Flash attention, causal or bidirectional (encoders), with the attention dropout drawn inside the kernel
(Pallas, TPU).

JAX's splash kernel has no dropout, and GPT-2 trains with attention dropout (`attn_pdrop` 0.1): the
stock attention then writes the [batch, heads, length, length] scores, their softmax and a dropout
mask out to HBM, and that traffic, not the products, is the layer's time. These kernels keep one
tile of scores at a time in VMEM, as flash attention does, and draw the tile's dropout mask there:
the forward kernel and the backward kernel (dq, dk and dv in one pass) seed the chip's generator with
the seed and the tile's number (`tile_number` of its batch, head, query tile and key tile) and draw
the tile's bits in one call, so both see the same mask and none stores it.

The kernels read q, k and v as the projections write them, [batch, length, heads x head_dim], in column
blocks of 128 lanes (two heads of 64, one of 128): a [batch, heads, length, head_dim] layout would cost a
transpose of each of them and of the output and gradients, and pads a head of 64 to 128 lanes in HBM (on
a v5e chip, leaving those copies out took a GPT-2-small run with dropout from 150,729 to 182,756 tokens/s).
Within a block, each head's products run over the block's whole width with the other heads' lanes zeroed,
which costs a 128-wide MXU no more.
GPT-2's fused c_attn output is read in place (`packed_dropout_attention`).

The dropout is flax's `nn.Dropout` on the softmax'd weights (as transformers' Flax attention applies
it): a weight is kept with probability 1 - rate and scaled by 1 / (1 - rate). The normaliser is the
sum of the weights before dropout, so a tile's kept weights can go into the output before the row's
softmax is complete.

Pallas' interpreter (CPUs: the tests) draws zeros from the chip's generator; there the kernels take
their bits from `hashed_bits`, a counter hash of the same seed and tile number and the place in the
tile, which a test can draw for the whole matrix at once.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # a vector register's lanes: per-row statistics are kept broadcast across them
SUBLANES = 8
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # a score no query sees (finite: no inf - inf)
# The `checkpoint_name` of what the backward kernel reads from the forward one: its output, and each row's
# logsumexp as one float rather than the forward kernel's 128 lanes of it (splash's residuals carry it too,
# utils/kernels/model_attention.py). A `jax.checkpoint` policy that keeps these keeps no more of the kernel than that
# (utils/models/remat.py, utils/models/layer_scan.py).
RESIDUALS = "flash_attention_residuals"


# The backward kernel keeps a head group's dq (length x group width, float32) in VMEM: 4 MiB of it fit beside
# the tiles in the compiler's default VMEM budget (16,384 x 128 do not, on a v5e).
MAX_DQ_ELEMENTS = 8192 * 128


def group_width(heads, head_dim):
    """Lanes of the column blocks the kernels read: whole heads side by side, 128 lanes or one head if wider
    (all the heads where they are narrower: a block as wide as its array is one the compiler takes)."""
    return min(max(head_dim, LANES), heads * head_dim)


def fits(length, heads, head_dim):
    """Whether the kernels take `length` tokens of `heads` heads of `head_dim`: length a multiple of 128,
    heads that fill 128-lane groups (head_dim dividing 128, or a multiple of it) or all of them narrower,
    dq within VMEM."""
    width = group_width(heads, head_dim)
    return (length % LANES == 0 and width % head_dim == 0 and heads * head_dim % width == 0
            and (width % LANES == 0 or width == heads * head_dim) and length * width <= MAX_DQ_ELEMENTS)


def packs(heads, head_dim):
    """Whether `packed_dropout_attention` reads q, k and v in place (its groups are whole 128-lane blocks)."""
    return group_width(heads, head_dim) % LANES == 0


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


def _visible(q_segment_ref, kv_segment_ref, query_tile, key_tile, block, causal):
    """Which keys of the (query tile, key tile) each query sees: its own segment's (and with `causal`, those
    not after it)."""
    same_segment = _lanes(q_segment_ref[...], block) == kv_segment_ref[:1, :]
    if not causal:
        return same_segment
    shape = (block, block)
    rows = query_tile * block + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    columns = key_tile * block + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return (columns <= rows) & same_segment


def _head_lanes(shape, head, head_dim):
    """Which lanes of a [rows, group width] block hold the group's `head`-th head."""
    lanes = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return (lanes >= head * head_dim) & (lanes < (head + 1) * head_dim)


def _only(x, head, head_dim):
    """`x` [rows, group width] with the lanes of the group's `head`-th head kept and the others zero: a
    product over the whole width then sees that head alone (on a 128-wide MXU, no slower than over 64)."""
    if x.shape[-1] == head_dim:
        return x
    return jnp.where(_head_lanes(x.shape, head, head_dim), x, jnp.zeros((), x.dtype))


def _scale_head(x, factor, head, head_dim):
    """`x` [rows, group width] with the lanes of `head` times `factor` (rows, 128), the others as they are."""
    scaled = x * _lanes(factor, x.shape[-1])
    if x.shape[-1] == head_dim:
        return scaled
    return jnp.where(_head_lanes(x.shape, head, head_dim), scaled, x)


def _scores(q, k, visible):
    """A tile's scores (f32), what its queries may not see at `MASKED`."""
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.where(visible, scores, MASKED)


def _lanes(stat, width):
    """A (rows, 128) statistic repeated to (rows, width)."""
    return jnp.tile(stat, (1, width // LANES)) if width > LANES else stat[:, :width]


def _forward_kernel(seed_ref, q_ref, k_ref, v_ref, q_segment_ref, kv_segment_ref, out_ref, lse_ref,
                    max_ref, sum_ref, acc_ref, *, rate, head_dim, scale, causal, interpret):
    batch, group, query_tile, key_tile = (pl.program_id(axis) for axis in range(4))
    per_group, tiles = q_ref.shape[1] // head_dim, pl.num_programs(2)
    heads = pl.num_programs(1) * per_group

    @pl.when(key_tile == 0)
    def _start():
        max_ref[...] = jnp.full(max_ref.shape, MASKED, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(key_tile <= query_tile if causal else True)  # causal: tiles above the diagonal are all masked
    def _accumulate():
        q, k, v = q_ref[...] * jnp.asarray(scale, q_ref.dtype), k_ref[...], v_ref[...]
        visible = _visible(q_segment_ref, kv_segment_ref, query_tile, key_tile, q.shape[0], causal)
        for head in range(per_group):
            scores = _scores(_only(q, head, head_dim), k, visible)
            previous = max_ref[head]
            running_max = jnp.maximum(previous, jnp.max(scores, axis=1, keepdims=True))
            weights = jnp.where(visible, jnp.exp(scores - _lanes(running_max, scores.shape[1])), 0.0)
            correction = jnp.exp(previous - running_max)
            sum_ref[head] = correction * sum_ref[head] + jnp.sum(weights, axis=1, keepdims=True)
            max_ref[head] = running_max
            if rate:
                tile = tile_number(batch, group * per_group + head, query_tile, key_tile, heads, tiles)
                weights = jnp.where(tile_keep(seed_ref, rate, interpret, tile, scores.shape), weights, 0.0)
            update = jax.lax.dot(weights.astype(v.dtype), _only(v, head, head_dim),
                                 preferred_element_type=jnp.float32)
            acc_ref[...] = _scale_head(acc_ref[...], correction, head, head_dim) + update

    @pl.when(key_tile == (query_tile if causal else tiles - 1))  # the row's last visible tile
    def _finish():
        out = acc_ref[...]
        for head in range(per_group):
            total = sum_ref[head]
            out = _scale_head(out, 1.0 / (total * (1.0 - rate)), head, head_dim)
            lse_ref[head] = max_ref[head] + jnp.log(total)
        out_ref[...] = out.astype(out_ref.dtype)


def _backward_kernel(seed_ref, q_ref, k_ref, v_ref, out_ref, do_ref, lse_ref, q_segment_ref, kv_segment_ref,
                     dq_ref, dk_ref, dv_ref, dq_acc_ref, dk_acc_ref, dv_acc_ref, *, rate, head_dim, scale,
                     causal, interpret):
    """dq, dk and dv in one pass over the tiles, key tile by key tile: each tile's scores, weights and mask
    are formed once for all three (a dq kernel of its own would form them again). dk and dv of the key
    tile accumulate over the query tiles; dq of the whole sequence stays in VMEM until the group is done."""
    batch, group, key_tile, query_tile = (pl.program_id(axis) for axis in range(4))
    per_group, tiles = q_ref.shape[1] // head_dim, pl.num_programs(3)
    heads = pl.num_programs(1) * per_group
    last = tiles - 1
    block = q_ref.shape[0]

    @pl.when((key_tile == 0) & (query_tile == 0))
    def _start_group():
        dq_acc_ref[...] = jnp.zeros(dq_acc_ref.shape, jnp.float32)

    @pl.when(query_tile == 0)
    def _start_key_tile():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    @pl.when(query_tile >= key_tile if causal else True)  # causal: earlier query tiles see none of its keys
    def _accumulate():
        q, k, v, d_out = q_ref[...] * jnp.asarray(scale, q_ref.dtype), k_ref[...], v_ref[...], do_ref[...]
        visible = _visible(q_segment_ref, kv_segment_ref, query_tile, key_tile, block, causal)
        # rowsum(dO o O) per head (the softmax's gradient term), from the output's tile
        products = d_out.astype(jnp.float32) * out_ref[...].astype(jnp.float32)
        transposed = (((0,), (0,)), ((), ()))
        rows = pl.ds(pl.multiple_of(query_tile * block, block), block)  # this query tile's rows of dq
        for head in range(per_group):
            q_head, d_out_head = _only(q, head, head_dim), _only(d_out, head, head_dim)
            scores = _scores(q_head, k, visible)
            weights = jnp.where(visible, jnp.exp(scores - _lanes(lse_ref[head], block)), 0.0)
            d_dropped = jax.lax.dot_general(d_out_head, v, (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.float32)
            dropped = weights
            if rate:
                tile = tile_number(batch, group * per_group + head, query_tile, key_tile, heads, tiles)
                keep = tile_keep(seed_ref, rate, interpret, tile, scores.shape)
                dropped = jnp.where(keep, weights * (1.0 / (1.0 - rate)), 0.0)
                d_dropped = jnp.where(keep, d_dropped * (1.0 / (1.0 - rate)), 0.0)
            delta = jnp.sum(_only(products, head, head_dim), axis=1, keepdims=True)
            d_scores = (weights * (d_dropped - delta)).astype(q.dtype)
            dv_acc_ref[...] += jax.lax.dot_general(dropped.astype(d_out.dtype), d_out_head, transposed,
                                                   preferred_element_type=jnp.float32)
            dk_acc_ref[...] += jax.lax.dot_general(d_scores, q_head, transposed, preferred_element_type=jnp.float32)
            dq_acc_ref[rows, :] += jax.lax.dot(d_scores, _only(k, head, head_dim),
                                               preferred_element_type=jnp.float32)

    @pl.when(query_tile == last)
    def _finish_key_tile():
        dk_ref[...] = dk_acc_ref[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)

    @pl.when((key_tile == last) & (query_tile == last))
    def _finish_group():
        dq_ref[...] = (dq_acc_ref[...] * scale).astype(dq_ref.dtype)  # the gradient of the unscaled queries


def _segment_layouts(segments):
    """The (query, key) [batch, length] segment ids as the kernels read them: per query row across the
    lanes, per key column down the sublanes."""
    query_segments, key_segments = segments
    batch, length = query_segments.shape
    return (jnp.broadcast_to(query_segments[:, :, None], (batch, length, LANES)),
            jnp.broadcast_to(key_segments[:, None, :], (batch, SUBLANES, length)))


class _Grid(NamedTuple):
    """What the kernels' block specs need: tile, group width, heads per group and each source's column offset
    (in groups)."""
    block: int
    width: int
    per_group: int
    offsets: tuple


def _specs(grid, row_tile, column_tile):
    """Block specs for a grid (batch, group, i, j) whose query tile is `row_tile(i, j)` and key tile
    `column_tile(i, j)`: q, k and v from their sources, [batch, length, heads x head_dim] rows and columns
    (outputs, their gradients), the per-head row statistics and the segments."""
    block, width = grid.block, grid.width
    q_offset, k_offset, v_offset = grid.offsets

    def source(offset, tile):
        return pl.BlockSpec((None, block, width), lambda b, g, i, j, seed: (b, tile(i, j), offset + g))

    rows = pl.BlockSpec((None, block, width), lambda b, g, i, j, seed: (b, row_tile(i, j), g))
    columns = pl.BlockSpec((None, block, width), lambda b, g, i, j, seed: (b, column_tile(i, j), g))
    row_stat = pl.BlockSpec((None, grid.per_group, block, LANES), lambda b, g, i, j, seed: (b, g, row_tile(i, j), 0))
    q_segment = pl.BlockSpec((None, block, LANES), lambda b, g, i, j, seed: (b, row_tile(i, j), 0))
    kv_segment = pl.BlockSpec((None, SUBLANES, block), lambda b, g, i, j, seed: (b, 0, column_tile(i, j)))
    return (source(q_offset, row_tile), source(k_offset, column_tile), source(v_offset, column_tile), rows, columns,
            row_stat, q_segment, kv_segment)


class _Call(NamedTuple):
    """What a call fixes (the custom gradient's static arguments)."""
    rate: float
    heads: int
    packed: bool  # q, k and v side by side in one source (`packed_dropout_attention`)
    causal: bool
    interpret: bool


def _grid(q_source, call):
    """(grid, tiles, groups, head_dim) of a call on `q_source`."""
    packed_width = q_source.shape[-1] // (3 if call.packed else 1)
    head_dim = packed_width // call.heads
    width = group_width(call.heads, head_dim)
    groups = packed_width // width
    offsets = (0, groups, 2 * groups) if call.packed else (0, 0, 0)
    length = q_source.shape[1]
    grid = _Grid(block_size(length), width, width // head_dim, offsets)
    return grid, length // grid.block, groups, head_dim


@functools.partial(jax.jit, static_argnums=(3,))  # traced once per shape, not per layer (utils/kernels/chip_dropout.py)
def _forward(sources, segments, seed, call):
    q_source, k_source, v_source = sources
    batch, length, _ = q_source.shape
    grid, tiles, groups, head_dim = _grid(q_source, call)
    # Causal: a key tile above the diagonal is skipped; its index stays at the diagonal's, so nothing is fetched.
    q_spec, k_spec, v_spec, rows, _, row_stat, q_segment, kv_segment = _specs(
        grid, lambda i, j: i, (lambda i, j: jnp.minimum(i, j)) if call.causal else (lambda i, j: j))
    kernel = functools.partial(_forward_kernel, rate=call.rate, head_dim=head_dim, scale=head_dim ** -0.5,
                               causal=call.causal, interpret=call.interpret)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, groups, tiles, tiles),
            in_specs=[q_spec, k_spec, v_spec, q_segment, kv_segment], out_specs=[rows, row_stat],
            scratch_shapes=[pltpu.VMEM((grid.per_group, grid.block, LANES), jnp.float32),
                            pltpu.VMEM((grid.per_group, grid.block, LANES), jnp.float32),
                            pltpu.VMEM((grid.block, grid.width), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct((batch, length, call.heads * head_dim), q_source.dtype),
                   jax.ShapeDtypeStruct((batch, call.heads, length, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=call.interpret,
    )(seed, q_source, k_source, v_source, *_segment_layouts(segments))
    return out, lse[..., 0]


@functools.partial(jax.jit, static_argnums=(6,))
def _backward(sources, segments, seed, out, lse, d_out, call):
    q_source = sources[0]
    batch, length, _ = q_source.shape
    grid, tiles, groups, head_dim = _grid(q_source, call)
    lse = jnp.broadcast_to(lse[..., None], (batch, call.heads, length, LANES))
    # Grid (b, group, key tile, query tile). Causal: a query tile before the key tile is skipped; its index
    # stays at the key tile's, so nothing is fetched. dq's block is the group's whole sequence, written once.
    q_spec, k_spec, v_spec, rows, columns, row_stat, q_segment, kv_segment = _specs(
        grid, (lambda i, j: jnp.maximum(i, j)) if call.causal else (lambda i, j: j), lambda i, j: i)
    whole = pl.BlockSpec((None, length, grid.width), lambda b, g, i, j, seed: (b, 0, g))
    shape = jax.ShapeDtypeStruct((batch, length, call.heads * head_dim), q_source.dtype)
    return pl.pallas_call(
        functools.partial(_backward_kernel, rate=call.rate, head_dim=head_dim, scale=head_dim ** -0.5,
                          causal=call.causal, interpret=call.interpret),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(batch, groups, tiles, tiles),
            in_specs=[q_spec, k_spec, v_spec, rows, rows, row_stat, q_segment, kv_segment],
            out_specs=[whole, columns, columns],
            scratch_shapes=[pltpu.VMEM((length, grid.width), jnp.float32),
                            pltpu.VMEM((grid.block, grid.width), jnp.float32),
                            pltpu.VMEM((grid.block, grid.width), jnp.float32)]),
        out_shape=[shape, shape, shape],
        # dq of a group is carried across its key tiles: they run in order, on one core
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
        interpret=call.interpret,
    )(seed, *sources, out, d_out, lse, *_segment_layouts(segments))


def _three(sources):
    return sources * 3 if len(sources) == 1 else sources


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(sources, segments, seed, call):
    return _forward(_three(sources), segments, seed, call)[0]


def _attention_forward(sources, segments, seed, call):
    out, lse = (checkpoint_name(x, RESIDUALS) for x in _forward(_three(sources), segments, seed, call))
    return out, (sources, segments, seed, out, lse)


def _attention_backward(call, residuals, d_out):
    sources, segments, seed, out, lse = residuals
    dq, dk, dv = _backward(_three(sources), segments, seed, out, lse, d_out, call)
    grads = (jnp.concatenate([dq, dk, dv], axis=-1),) if call.packed else (dq, dk, dv)
    return grads, None, None


_attention.defvjp(_attention_forward, _attention_backward)


def dropout_attention(query, key, value, segments, seed, rate, heads, interpret=False):
    """softmax(q k^T / sqrt(head_dim) + causal mask, restricted to equal `segments`) with dropout at `rate`,
    times v, per head.

    `query`, `key`, `value`: [batch, length, heads x head_dim], each token's heads side by side as the
    projections make them (no transposes: the kernels read whole heads from 128-lane column blocks), length a
    multiple of 128 and `fits`; `segments`: [batch, length] int32 (a query sees the keys before it in its
    own segment); `seed`: an int32 array of shape (1,), the mask's seed. Returns [batch, length, heads x
    head_dim]. Differentiable in query, key and value.
    """
    segments = segments.astype(jnp.int32)
    return _attention((query, key, value), (segments, segments), seed.astype(jnp.int32),
                      _Call(float(rate), int(heads), False, True, bool(interpret)))


def packed_dropout_attention(qkv, segments, seed, rate, heads, interpret=False):
    """`dropout_attention` of the queries, keys and values side by side in `qkv` [batch, length, 3 x heads x
    head_dim] (GPT-2's c_attn output), read in place: no slice of it is written out. Where `packs`."""
    segments = segments.astype(jnp.int32)
    return _attention((qkv,), (segments, segments), seed.astype(jnp.int32),
                      _Call(float(rate), int(heads), True, True, bool(interpret)))


def bidirectional_dropout_attention(query, key, value, key_mask, seed, rate, heads, interpret=False):
    """`dropout_attention` without the causal mask, as encoders attend (BERT): every query sees every key
    that `key_mask` [batch, length] marks real (1; padding 0), as the stock attention's mask has it."""
    key_mask = key_mask.astype(jnp.int32)
    return _attention((query, key, value), (jnp.ones_like(key_mask), key_mask), seed.astype(jnp.int32),
                      _Call(float(rate), int(heads), False, False, bool(interpret)))
