"""The positions of the rotary decoders (Llama, Mistral, Gemma) as their configs define them.

transformers 4.57's Flax Llama, Mistral and Gemma build their rotary tables with base 10000 whatever
the config says: `rope_theta` (500000 in Llama 3, 1e6 in Mistral v0.2+) and `rope_scaling` are
ignored; Flax Llama and Mistral size their heads hidden_size / heads whatever `head_dim` says; Flax
Mistral's sliding window is one token wider than the window, and without one (`sliding_window:
null`, Mistral v0.2+) each token attends to itself alone. Such a checkpoint loads without a word and
computes something else than it was trained to. transformers' PyTorch code is the reference (its
`modeling_rope_utils.py`): `install()`, run by `utils.models.compat.apply`, gives the Flax classes

- rotary angles from the config: `rope_theta` and every `rope_scaling` type transformers' PyTorch
  decoders implement (linear, dynamic, yarn, longrope, llama3), computed from the position ids of
  each call (the dynamic types look at the longest position, as PyTorch does), never a table;
- heads of `head_dim` (Llama, Mistral; Gemma already had them);
- Mistral's window of `sliding_window` keys, or the whole past without one.

The attention itself (its `__call__`) stays transformers'. `check(config)` stops, before any work,
a config with a setting these classes cannot compute.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from utils.base.errors import UsageError

ROTARY_FAMILIES = ("llama", "mistral", "gemma")
# The rope_scaling types of transformers' ROPE_INIT_FUNCTIONS, each computed here.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_REQUIRED_SCALING_KEYS = {
    "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",), "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_type(config):
    """The config's rope_scaling type ("type" in older configs); "default" without scaling."""
    scaling = getattr(config, "rope_scaling", None)
    if not isinstance(scaling, dict):
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def head_dim(config):
    """The size of each attention head: `head_dim`, or hidden_size / heads where the config has none."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check(config):
    """A `UsageError` naming the setting when the config of a rotary decoder asks for positions or
    layers this project's Flax classes do not compute."""
    if config.model_type not in ROTARY_FAMILIES:
        return
    fix = "use a checkpoint without it, or train with PyTorch"
    kind = rope_type(config)
    if kind not in ROPE_TYPES:
        raise UsageError(f"the {config.model_type} config's rope_scaling has rope_type {kind!r}, which this project "
                         f"does not compute (it computes {', '.join(ROPE_TYPES)}): {fix}")
    scaling = config.rope_scaling if kind != "default" else {}
    missing = [key for key in _REQUIRED_SCALING_KEYS.get(kind, ()) if scaling.get(key) is None]
    if missing:
        raise UsageError(f"the {config.model_type} config's rope_scaling of type {kind!r} lacks {', '.join(missing)}: "
                         "add it to the config's rope_scaling")
    if kind == "longrope":
        half = head_dim(config) // 2
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != half:
                raise UsageError(f"the {config.model_type} config's rope_scaling {key} has {len(scaling[key])} "
                                 f"values where its heads of {head_dim(config)} need {half}: fix the config")
        if _longrope_factor(config) is None and scaling.get("attention_factor") is None:
            raise UsageError(f"the {config.model_type} config's longrope rope_scaling has neither factor nor "
                             "attention_factor (nor original_max_position_embeddings): add one to the config")
    partial = getattr(config, "partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise UsageError(f"the {config.model_type} config sets partial_rotary_factor={partial}, which "
                         f"{config.model_type} layers do not compute (they rotate whole heads): {fix}")
    if getattr(config, "mlp_bias", False):
        raise UsageError(f"the {config.model_type} config sets mlp_bias=true, which transformers' Flax "
                         f"{config.model_type} layers do not have: {fix}")


# ----------------------------------------------------------------------------------------------
# Rotary angles (transformers' modeling_rope_utils, the same formulas)
# ----------------------------------------------------------------------------------------------
def _base_frequencies(config, base=None):
    dim = head_dim(config)
    base = config.rope_theta if base is None else base
    return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _llama3(config, scaling):
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    inv_freq = _base_frequencies(config)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    # blend is 0 past context / low (divided), 1 below context / high (kept)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def _yarn_scale(factor, mscale=1.0):
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(config, scaling):
    """YaRN: interpolated (divided by `factor`) below a band of dimensions, extrapolated above it,
    a linear ramp across it; the angles' cos/sin scaled by the attention factor."""
    dim, base, factor = head_dim(config), config.rope_theta, scaling["factor"]
    context = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_scale(factor, mscale) / _yarn_scale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _yarn_scale(factor))

    def dimension_of(rotations):  # the dimension that turns `rotations` times over the pretrained context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(scaling.get("beta_fast") or 32), dimension_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = _base_frequencies(config)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp), float(attention)


def _longrope_factor(config):
    original = getattr(config, "original_max_position_embeddings", None)
    return config.max_position_embeddings / original if original else config.rope_scaling.get("factor")


def _longrope(config, scaling, longest):
    """LongRoPE: per-dimension factors, the long ones once a call's positions pass the pretrained
    context (`original_max_position_embeddings`)."""
    context = getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
    factor, attention = _longrope_factor(config), scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))
    base = _base_frequencies(config)
    short = base / np.asarray(scaling["short_factor"], np.float64)
    long = base / np.asarray(scaling["long_factor"], np.float64)
    return jnp.where(longest > context, long.astype(np.float32), short.astype(np.float32)), float(attention)


def _dynamic(config, scaling, longest):
    """Dynamic NTK: past `max_position_embeddings`, a base grown with the longest position of the call."""
    dim, factor, context = head_dim(config), scaling["factor"], config.max_position_embeddings
    length = jnp.maximum(longest, context).astype(jnp.float32)
    base = config.rope_theta * ((factor * length / context) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def inverse_frequencies(config, longest):
    """(inverse frequencies [head_dim / 2], cos/sin scale) of a call whose longest position is
    `longest` - 1 (a traced scalar; only the dynamic and longrope types look at it)."""
    kind = rope_type(config)
    scaling = config.rope_scaling if kind != "default" else {}
    if kind == "linear":
        return _base_frequencies(config) / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(config, scaling), 1.0
    if kind == "yarn":
        return _yarn(config, scaling)
    if kind == "longrope":
        return _longrope(config, scaling, longest)
    if kind == "dynamic":
        return _dynamic(config, scaling, longest), 1.0
    return _base_frequencies(config), 1.0


def rotary_cos_sin(config, position_ids):
    """(cos, sin) [..., head_dim] in float32 of each position in `position_ids` [...]."""
    inv_freq, scale = inverse_frequencies(config, jnp.max(position_ids) + 1)
    angles = jnp.asarray(position_ids, jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate((angles, angles), axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1) * sin


class ConfigRotaryEmbedding(nn.Module):
    """Rotates keys and queries [batch, length, heads, head_dim] by the config's rotary angles
    (the same call as transformers' Flax rotary modules)."""

    config: object
    dtype: jnp.dtype = jnp.float32

    def __call__(self, key, query, position_ids):
        cos, sin = rotary_cos_sin(self.config, position_ids)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # one angle per position, for every head
        return (jnp.asarray(_rotate(key, cos, sin), self.dtype), jnp.asarray(_rotate(query, cos, sin), self.dtype))


# ----------------------------------------------------------------------------------------------
# Attention set up with the config's head size, window and rotary angles (Llama, Mistral)
# ----------------------------------------------------------------------------------------------
def causal_window_mask(config):
    """[1, 1, positions, positions] bool: each query attends to itself and the keys before it, the
    last `sliding_window` keys only where the config has one (PyTorch: key > query - window)."""
    mask = nn.make_causal_mask(jnp.ones((1, config.max_position_embeddings), dtype="bool"), dtype="bool")
    window = getattr(config, "sliding_window", None)
    return jnp.triu(mask, k=1 - window) if window else mask


def _set_up_attention(module, use_bias, kernel_init):
    """The attributes and layers transformers' Flax Llama / Mistral attention `__call__` uses, with
    the config's `head_dim`, window and rotary angles."""
    config = module.config
    module.num_heads = config.num_attention_heads
    module.head_dim = head_dim(config)
    module.num_key_value_heads = config.num_key_value_heads
    module.num_key_value_groups = module.num_heads // module.num_key_value_heads
    module.attention_softmax_in_fp32 = module.dtype is not jnp.float32
    dense = dict(use_bias=use_bias, dtype=module.dtype, **({"kernel_init": kernel_init} if kernel_init else {}))
    module.q_proj = nn.Dense(module.num_heads * module.head_dim, **dense)
    module.k_proj = nn.Dense(module.num_key_value_heads * module.head_dim, **dense)
    module.v_proj = nn.Dense(module.num_key_value_heads * module.head_dim, **dense)
    module.o_proj = nn.Dense(config.hidden_size, **dense)
    module.causal_mask = causal_window_mask(config)
    module.rotary_emb = ConfigRotaryEmbedding(config, dtype=module.dtype)


def _merge_heads(module, hidden_states):
    return hidden_states.reshape(hidden_states.shape[:2] + (module.num_heads * module.head_dim,))


def _llama_attention(original):
    class LlamaAttentionWithConfigPositions(original):
        def setup(self):
            # Llama's own initialisers and biases, so a fresh model's weights are what they were
            initializer = jax.nn.initializers.normal(self.config.initializer_range)
            _set_up_attention(self, self.config.attention_bias, initializer)
            self.embed_dim = self.config.hidden_size

        def _merge_heads(self, hidden_states):
            return _merge_heads(self, hidden_states)

    return LlamaAttentionWithConfigPositions


def _mistral_attention(original):
    class MistralAttentionWithConfigPositions(original):
        def setup(self):
            _set_up_attention(self, False, None)  # Mistral's: no biases, Flax's default initialiser
            self.hidden_size = self.config.hidden_size

        def _merge_heads(self, hidden_states):
            return _merge_heads(self, hidden_states)

    return MistralAttentionWithConfigPositions


def install():
    """Give transformers' Flax Llama, Mistral and Gemma the positions their configs define: their
    layers look these classes up by module-level name when they are set up."""
    from transformers.models.gemma import modeling_flax_gemma
    from transformers.models.llama import modeling_flax_llama
    from transformers.models.mistral import modeling_flax_mistral

    modeling_flax_llama.FlaxLlamaAttention = _llama_attention(modeling_flax_llama.FlaxLlamaAttention)
    modeling_flax_mistral.FlaxMistralAttention = _mistral_attention(modeling_flax_mistral.FlaxMistralAttention)
    modeling_flax_gemma.FlaxGemmaRotaryEmbedding = ConfigRotaryEmbedding
