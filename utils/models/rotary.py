"""Rotary position embeddings: the angles every rope type of transformers' PyTorch decoders computes
(default, linear, dynamic, yarn, longrope, llama3), from one resolved description of a rope (`Rope`).

Two readers resolve a config into a `Rope`: `decoder_positions` (transformers 4.57's Flax classes, read
with 4.57's rules) and `decoders` (the project's own family, read with transformers 5's rules); the
formulas are shared here. The dynamic and longrope types depend on the longest position of a call,
as in PyTorch, so the angles are computed from each call's positions, never from a table.
"""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

# The rope types of transformers' ROPE_INIT_FUNCTIONS that are computed here.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """One rotary embedding, every default already resolved.

    `dim` is the number of dimensions of a head it rotates (head_dim * partial_rotary_factor); `context`
    the positions the scaling refers to (llama3, yarn, longrope: the pretrained context; dynamic:
    max_position_embeddings); `attention_factor` the scale of cos and sin (yarn, longrope)."""

    dim: int
    theta: float
    kind: str = "default"
    factor: float = 1.0
    context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple = ()
    long_factor: tuple = ()


def yarn_attention_factor(factor, mscale=None, mscale_all_dim=None):
    """YaRN's cos/sin scale: 0.1 ln(factor) + 1, or the ratio of two such scales with DeepSeek's mscales."""
    def scale(multiplier):
        return 1.0 if factor <= 1 else 0.1 * multiplier * math.log(factor) + 1.0

    return scale(mscale) / scale(mscale_all_dim) if mscale and mscale_all_dim else scale(1.0)


def longrope_attention_factor(factor, context):
    """LongRoPE's cos/sin scale: sqrt(1 + ln(factor) / ln(pretrained context)), 1 without extension."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))


def base_frequencies(dim, theta):
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _llama3(rope):
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    inv_freq = base_frequencies(rope.dim, rope.theta)
    wavelength = 2 * math.pi / inv_freq
    blend = np.clip((rope.context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor),
                    0.0, 1.0)
    # blend is 0 past context / low (divided), 1 below context / high (kept)
    return (1 - blend) * inv_freq / rope.factor + blend * inv_freq


def _yarn(rope):
    """YaRN: interpolated (divided by `factor`) below a band of dimensions, extrapolated above it,
    a linear ramp across it."""
    dim = rope.dim

    def dimension_of(rotations):  # the dimension that turns `rotations` times over the pretrained context
        return dim * math.log(rope.context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension_of(rope.beta_fast), dimension_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = base_frequencies(dim, rope.theta)
    return extrapolated / rope.factor * ramp + extrapolated * (1 - ramp)


def _longrope(rope, longest):
    """LongRoPE: per-dimension factors, the long ones once a call's positions pass the pretrained context."""
    base = base_frequencies(rope.dim, rope.theta)
    short = base / np.asarray(rope.short_factor, np.float64)
    long = base / np.asarray(rope.long_factor, np.float64)
    return jnp.where(longest > rope.context, long.astype(np.float32), short.astype(np.float32))


def _dynamic(rope, longest):
    """Dynamic NTK: past `context` (max_position_embeddings), a base grown with the longest position of the call."""
    dim, factor = rope.dim, rope.factor
    length = jnp.maximum(longest, rope.context).astype(jnp.float32)
    base = rope.theta * ((factor * length / rope.context) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def inverse_frequencies(rope, longest):
    """(inverse frequencies [rope.dim / 2], cos/sin scale) of a call whose longest position is
    `longest` - 1 (a traced scalar; only the dynamic and longrope types look at it)."""
    if rope.kind == "linear":
        return base_frequencies(rope.dim, rope.theta) / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(rope), 1.0
    if rope.kind == "yarn":
        return _yarn(rope), rope.attention_factor
    if rope.kind == "longrope":
        return _longrope(rope, longest), rope.attention_factor
    if rope.kind == "dynamic":
        return _dynamic(rope, longest), 1.0
    return base_frequencies(rope.dim, rope.theta), 1.0


def cos_sin(rope, position_ids):
    """(cos, sin) [..., rope.dim] in float32 of each position in `position_ids` [...]."""
    inv_freq, scale = inverse_frequencies(rope, jnp.max(position_ids) + 1)
    angles = jnp.asarray(position_ids, jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate((angles, angles), axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def rotate(x, cos, sin):
    """`x` [..., head_dim] with its first cos.shape[-1] dimensions rotated (the rest, under a partial
    rotary factor, passed through); cos and sin broadcast against x's leading dimensions."""
    rotated = cos.shape[-1]
    part, rest = x[..., :rotated], x[..., rotated:]
    half = rotated // 2
    turned = part * cos + jnp.concatenate((-part[..., half:], part[..., :half]), axis=-1) * sin
    return jnp.concatenate((turned, rest), axis=-1) if rest.shape[-1] else turned
