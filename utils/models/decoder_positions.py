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

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from utils.base.errors import UsageError
from utils.models import rotary

ROTARY_FAMILIES = ("llama", "mistral", "gemma")
ROPE_TYPES = rotary.ROPE_TYPES
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
# Rotary angles: the formulas are utils.models.rotary's, resolved here with transformers 4.57's rules
# ----------------------------------------------------------------------------------------------
def _longrope_factor(config):
    original = getattr(config, "original_max_position_embeddings", None)
    return config.max_position_embeddings / original if original else config.rope_scaling.get("factor")


def rope_of(config):
    """The `rotary.Rope` of a checked config as transformers 4.57 reads it."""
    kind = rope_type(config)
    rope = rotary.Rope(dim=head_dim(config), theta=config.rope_theta, kind=kind)
    scaling = config.rope_scaling if kind != "default" else {}
    if kind in ("linear", "dynamic"):
        return dataclasses.replace(rope, factor=scaling["factor"], context=config.max_position_embeddings)
    if kind == "llama3":
        return dataclasses.replace(rope, factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                                   high_freq_factor=scaling["high_freq_factor"],
                                   context=scaling["original_max_position_embeddings"])
    if kind == "yarn":
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = rotary.yarn_attention_factor(scaling["factor"], scaling.get("mscale"),
                                                     scaling.get("mscale_all_dim"))
        return dataclasses.replace(
            rope, factor=scaling["factor"], attention_factor=float(attention),
            context=scaling.get("original_max_position_embeddings") or config.max_position_embeddings,
            beta_fast=scaling.get("beta_fast") or 32, beta_slow=scaling.get("beta_slow") or 1,
            truncate=scaling.get("truncate", True))
    if kind == "longrope":
        context = getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
        factor, attention = _longrope_factor(config), scaling.get("attention_factor")
        if attention is None:
            attention = rotary.longrope_attention_factor(factor, context)
        return dataclasses.replace(rope, factor=factor, context=context, attention_factor=float(attention),
                                   short_factor=tuple(scaling["short_factor"]),
                                   long_factor=tuple(scaling["long_factor"]))
    return rope


def inverse_frequencies(config, longest):
    """(inverse frequencies [head_dim / 2], cos/sin scale) of a call whose longest position is
    `longest` - 1 (a traced scalar; only the dynamic and longrope types look at it)."""
    return rotary.inverse_frequencies(rope_of(config), longest)


def rotary_cos_sin(config, position_ids):
    """(cos, sin) [..., head_dim] in float32 of each position in `position_ids` [...]."""
    return rotary.cos_sin(rope_of(config), position_ids)


class ConfigRotaryEmbedding(nn.Module):
    """Rotates keys and queries [batch, length, heads, head_dim] by the config's rotary angles
    (the same call as transformers' Flax rotary modules)."""

    config: object
    dtype: jnp.dtype = jnp.float32

    def __call__(self, key, query, position_ids):
        cos, sin = rotary_cos_sin(self.config, position_ids)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # one angle per position, for every head
        return (jnp.asarray(rotary.rotate(key, cos, sin), self.dtype),
                jnp.asarray(rotary.rotate(query, cos, sin), self.dtype))


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
