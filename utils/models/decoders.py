"""The project's own decoder family (Flax linen): Llama 1-3.x, Mistral, Qwen2 / Qwen2.5, Qwen3, Gemma,
Gemma 2, Gemma 3 (text) and Phi-3 / Phi-4-mini, configured from a hub `config.json` alone.

transformers 5 has no Flax classes; its PyTorch modelling code is the reference these modules are
checked against (tests/test_decoder_family.py). `config_from_hub` reads a config.json dict with
transformers 5's rules (and defaults, where the file leaves a key out) into a `DecoderConfig`, one
set of switches the layers read, and refuses by name, before any weights are read, an architecture
or a setting it does not compute. The parameter tree mirrors the PyTorch names
(`model.layers.0.self_attn.q_proj.weight` is params["model"]["layers"]["0"]["self_attn"]["q_proj"]
["kernel"], transposed), so `hub_checkpoint` converts between the two by rule.

`DecoderLM` computes logits of a batch with left padding (positions from the attention mask, as
transformers' `generate` computes them) and, given a KV cache, one step of incremental decoding;
`forward` and `generate` (any chooser of the next token; `greedy_generate`) are the calls built on it.
"""

import dataclasses
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp

from utils.base.errors import UsageError
from utils.models import hub_checkpoint, rotary

FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
_GEMMAS = ("gemma", "gemma2", "gemma3_text")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu": lambda x: jax.nn.gelu(x, approximate=False)}
# The keys rope scaling of each type cannot do without (transformers 5 fills in the others).
_REQUIRED_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",), "yarn": (),
                       "longrope": ("short_factor", "long_factor"),
                       "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
# The settings transformers 5's config classes take when a config.json leaves them out, where they differ
# from the family's common ones below.
_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(sliding_window=4096, max_position_embeddings=131072),
    "qwen2": dict(max_position_embeddings=32768, sliding_window=4096),
    "qwen3": dict(max_position_embeddings=32768, sliding_window=4096),
    "gemma": dict(head_dim=256, tie_word_embeddings=True, max_position_embeddings=8192, hidden_act="gelu_pytorch_tanh"),
    "gemma2": dict(head_dim=256, tie_word_embeddings=True, max_position_embeddings=8192, sliding_window=4096,
                   query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(head_dim=256, tie_word_embeddings=True, max_position_embeddings=131072, sliding_window=4096,
                        query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=1e4),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=4096),
}
_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e4, hidden_act="silu",
               attention_bias=False, mlp_bias=False, use_sliding_window=False, max_window_layers=28,
               initializer_range=0.02)
_FIX = "use a checkpoint without it, or train it with PyTorch"


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """What the layers compute, every default resolved. `layer_windows[i]` is layer i's sliding window
    (the number of keys up to and including its own position a query sees; None: the whole past) and
    `ropes[layer_ropes[i]]` its rotary embedding."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str
    tie_word_embeddings: bool
    qkv_bias: bool
    output_bias: bool
    mlp_bias: bool
    fused_projections: bool  # Phi-3: one qkv_proj, one gate_up_proj
    qk_norm: bool  # Qwen3, Gemma 3: an RMSNorm over each head of queries and keys
    norm_plus_one: bool  # Gemma: x * (1 + w), computed in float32
    scale_embeddings: bool  # Gemma: embeddings times sqrt(hidden_size), in the compute dtype
    sandwich_norms: bool  # Gemma 2 and 3: norms after attention and around the MLP
    query_scale: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    layer_windows: tuple
    layer_ropes: tuple
    ropes: tuple
    initializer_range: float


def _setting(hub, model_type, key):
    """The config.json's value of `key` (null included: `sliding_window: null` is no window), or the one
    transformers 5's config class gives it without."""
    if key in hub:
        return hub[key]
    return _DEFAULTS[model_type].get(key, _COMMON.get(key))


def _refuse(model_type, what):
    raise UsageError(f"the {model_type} config {what}, which this project's decoder family does not compute: {_FIX}")


def _rope_settings(hub, model_type):
    """{layer type: rope settings dict} as transformers 5 reads them: the new `rope_parameters`
    (nested by layer type for Gemma 3), or the older rope_theta / rope_scaling (and Gemma 3's
    rope_local_base_freq for its sliding layers)."""
    parameters = hub.get("rope_parameters")
    if parameters is None:
        parameters = dict(hub.get("rope_scaling") or {})
        parameters.setdefault("rope_theta", _setting(hub, model_type, "rope_theta"))
        if model_type == "gemma3_text":
            local = {"rope_type": "default", "rope_theta": _setting(hub, model_type, "rope_local_base_freq")}
            parameters = {"full_attention": parameters, "sliding_attention": local}
    if any(key in parameters for key in _LAYER_TYPES):
        return {key: dict(parameters.get(key) or {}) for key in _LAYER_TYPES}
    return {key: dict(parameters) for key in _LAYER_TYPES}


def _rope(settings, hub, model_type, head_dim):
    """The `rotary.Rope` of one rope settings dict, resolved as transformers 5's modeling_rope_utils does."""
    kind = settings.get("rope_type", settings.get("type")) or "default"
    if model_type == "phi3" and kind in ("su", "yarn"):  # Phi-3's older names of its longrope
        kind = "longrope"
    if kind not in rotary.ROPE_TYPES:
        raise UsageError(f"the {model_type} config's rope has rope_type {kind!r}, which this project's decoder "
                         f"family does not compute (it computes {', '.join(rotary.ROPE_TYPES)}): {_FIX}")
    missing = [key for key in _REQUIRED_ROPE_KEYS.get(kind, ()) if settings.get(key) is None]
    if missing:
        raise UsageError(f"the {model_type} config's rope of type {kind!r} lacks {', '.join(missing)}: "
                         "add it to the config's rope_parameters (or rope_scaling)")
    partial = settings.get("partial_rotary_factor", hub.get("partial_rotary_factor")) or 1.0
    if partial != 1.0 and model_type != "phi3":
        _refuse(model_type, f"sets partial_rotary_factor={partial} (only Phi-3 layers rotate part of a head)")
    theta = settings.get("rope_theta") or _setting(hub, model_type, "rope_theta")
    rope = rotary.Rope(dim=int(head_dim * partial), theta=float(theta), kind=kind)
    max_positions = _setting(hub, model_type, "max_position_embeddings")
    # The pretrained context of the scaled types: a config.json's original_max_position_embeddings beside the
    # rope settings wins over theirs (Phi-3 always has one), except in Gemma 3's settings per layer type.
    beside = None if model_type == "gemma3_text" else _setting(hub, model_type, "original_max_position_embeddings")
    context = beside or settings.get("original_max_position_embeddings") or max_positions
    if kind in ("linear", "dynamic"):
        return dataclasses.replace(rope, factor=float(settings["factor"]), context=max_positions)
    if kind == "llama3":
        return dataclasses.replace(rope, factor=float(settings["factor"]), context=context,
                                   low_freq_factor=float(settings["low_freq_factor"]),
                                   high_freq_factor=float(settings["high_freq_factor"]))
    if kind == "yarn":
        factor = settings.get("factor") or max_positions / context
        attention = settings.get("attention_factor")
        if attention is None:
            attention = rotary.yarn_attention_factor(factor, settings.get("mscale"), settings.get("mscale_all_dim"))
        return dataclasses.replace(rope, factor=float(factor), context=context, attention_factor=float(attention),
                                   beta_fast=float(settings.get("beta_fast") or 32),
                                   beta_slow=float(settings.get("beta_slow") or 1),
                                   truncate=bool(settings.get("truncate", True)))
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(settings[key]) != rope.dim // 2:
                raise UsageError(f"the {model_type} config's rope {key} has {len(settings[key])} values where its "
                                 f"rotated {rope.dim} dimensions of a head need {rope.dim // 2}: fix the config")
        factor = settings.get("factor") or max_positions / context
        attention = settings.get("attention_factor")
        if attention is None:
            attention = rotary.longrope_attention_factor(factor, context)
        return dataclasses.replace(rope, factor=float(factor), context=context, attention_factor=float(attention),
                                   short_factor=tuple(map(float, settings["short_factor"])),
                                   long_factor=tuple(map(float, settings["long_factor"])))
    return rope


def _layer_types(hub, model_type, layers):
    """Each layer's "full_attention" or "sliding_attention", as transformers 5's config classes lay them out."""
    # Mistral's and Phi-3's PyTorch layers ignore layer_types (transformers 5 warns that Mistral does).
    if hub.get("layer_types") is not None and model_type not in ("mistral", "phi3"):
        types = list(hub["layer_types"])
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown:
            _refuse(model_type, f"has layer_types {', '.join(unknown)}")
        if len(types) != layers:
            raise UsageError(f"the {model_type} config has {len(types)} layer_types for {layers} layers: "
                             "fix the config")
        return types
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if model_type == "gemma3_text":
        pattern = hub.get("sliding_window_pattern") or 6
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if model_type in ("qwen2", "qwen3"):
        first = _setting(hub, model_type, "max_window_layers")
        return ["sliding_attention" if _window(hub, model_type) and i >= first else "full_attention"
                for i in range(layers)]
    # Mistral and Phi-3: every layer has the config's window, when it has one; Llama and Gemma none.
    return ["sliding_attention" if _window(hub, model_type) else "full_attention"] * layers


def _window(hub, model_type):
    """The sliding window of the config's sliding layers: Qwen's only with use_sliding_window, none in
    Llama and Gemma (whose PyTorch layers ignore the key)."""
    if model_type in ("llama", "gemma"):
        return None
    if model_type in ("qwen2", "qwen3") and not _setting(hub, model_type, "use_sliding_window"):
        return None
    return _setting(hub, model_type, "sliding_window")


def _activation(hub, model_type):
    if model_type in ("gemma2", "gemma3_text"):
        name = hub.get("hidden_activation") or "gelu_pytorch_tanh"
    else:
        name = _setting(hub, model_type, "hidden_act")
        if model_type == "gemma" and name == "gelu":  # Gemma's released configs: "gelu" meant its tanh form
            name = "gelu_pytorch_tanh"
    if name not in _ACTIVATIONS:
        _refuse(model_type, f"sets the activation {name!r} (the family computes {', '.join(_ACTIVATIONS)})")
    return name


def config_from_hub(hub):
    """The `DecoderConfig` of a hub config.json dict; a `UsageError` naming the architecture or setting
    this family does not compute."""
    model_type = hub.get("model_type")
    if model_type not in FAMILY:
        raise UsageError(f"the config's model_type {model_type!r} is not in this project's decoder family "
                         f"({', '.join(FAMILY)}): use one of those, or train it with PyTorch")
    if hub.get("quantization_config"):
        _refuse(model_type, "holds quantized weights (quantization_config)")
    if hub.get("use_bidirectional_attention"):
        _refuse(model_type, "sets use_bidirectional_attention=true")
    heads, hidden = hub["num_attention_heads"], hub["hidden_size"]
    kv_heads = hub.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UsageError(f"the {model_type} config has {heads} attention heads, not a multiple of its {kv_heads} "
                         "key/value heads: fix the config")
    head_dim = _setting(hub, model_type, "head_dim") or hidden // heads
    layers = hub["num_hidden_layers"]
    types = _layer_types(hub, model_type, layers)
    rope_settings = _rope_settings(hub, model_type)
    kinds = sorted(set(types))
    ropes = tuple(_rope(rope_settings[kind], hub, model_type, head_dim) for kind in kinds)
    window = _window(hub, model_type)
    capped = model_type in ("gemma2", "gemma3_text")
    gemma_like = model_type in _GEMMAS
    query_scalar = _setting(hub, model_type, "query_pre_attn_scalar") if capped else head_dim
    attention_bias = bool(_setting(hub, model_type, "attention_bias"))
    return DecoderConfig(
        model_type=model_type, vocab_size=hub["vocab_size"], hidden_size=hidden,
        intermediate_size=hub["intermediate_size"], num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=float(_setting(hub, model_type, "rms_norm_eps")),
        activation=_activation(hub, model_type),
        tie_word_embeddings=bool(_setting(hub, model_type, "tie_word_embeddings")),
        # Qwen2 has biases on q, k and v whatever the config says, and none on o; Mistral and Phi-3 have none.
        qkv_bias=model_type == "qwen2" or (attention_bias and model_type not in ("mistral", "phi3")),
        output_bias=attention_bias and model_type not in ("qwen2", "mistral", "phi3"),
        mlp_bias=model_type == "llama" and bool(_setting(hub, model_type, "mlp_bias")),
        fused_projections=model_type == "phi3", qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_plus_one=gemma_like, scale_embeddings=gemma_like,
        sandwich_norms=model_type in ("gemma2", "gemma3_text"), query_scale=float(query_scalar) ** -0.5,
        attn_logit_softcapping=_setting(hub, model_type, "attn_logit_softcapping") if capped else None,
        final_logit_softcapping=_setting(hub, model_type, "final_logit_softcapping") if capped else None,
        layer_windows=tuple(window if kind == "sliding_attention" else None for kind in types),
        layer_ropes=tuple(kinds.index(kind) for kind in types), ropes=ropes,
        initializer_range=float(_setting(hub, model_type, "initializer_range")))


def read_config(folder):
    """(config.json as a dict, its `DecoderConfig`) of a checkpoint folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"{folder!r} has no config.json: point at a hub checkpoint folder")
    with open(path, encoding="utf-8") as f:
        hub = json.load(f)
    return hub, config_from_hub(hub)


def load_checkpoint(folder, dtype=jnp.float32):
    """(config.json as a dict, `DecoderLM` computing in `dtype`, its params in the checkpoint's dtype) of
    a hub checkpoint folder; the config is checked before any weights are read."""
    hub, config = read_config(folder)
    model = DecoderLM(config, dtype)
    return hub, model, hub_checkpoint.read_checkpoint(folder, param_shapes(model))


# ----------------------------------------------------------------------------------------------
# The layers
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, in float32. Gemma scales by (1 + w) before going back
    to the input's dtype; the others go back first and scale by w (transformers' order, which bfloat16
    rounding can tell apart)."""

    eps: float
    plus_one: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), jnp.float32)
        wide = x.astype(jnp.float32)
        normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        return weight.astype(x.dtype) * normed.astype(x.dtype)


def _dense(config, features, use_bias, dtype, name):
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=jnp.float32,
                    kernel_init=nn.initializers.normal(config.initializer_range), name=name)


class Attention(nn.Module):
    """Grouped-query attention with the config's head size, biases, q/k norms, rotary angles, query
    scale, soft-capping and this layer's window; with a cache, this call's keys and values are written
    at its slots first and every slot of the cache is attended to."""

    config: DecoderConfig
    window: int | None
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, allowed, cache=None, cache_index=None):
        config, dtype = self.config, self.dtype
        heads, kv_heads, size = config.num_heads, config.num_kv_heads, config.head_dim
        batch, length = x.shape[:2]
        if config.fused_projections:
            qkv = _dense(config, (heads + 2 * kv_heads) * size, False, dtype, "qkv_proj")(x)
            query, key, value = jnp.split(qkv, [heads * size, (heads + kv_heads) * size], axis=-1)
        else:
            query = _dense(config, heads * size, config.qkv_bias, dtype, "q_proj")(x)
            key = _dense(config, kv_heads * size, config.qkv_bias, dtype, "k_proj")(x)
            value = _dense(config, kv_heads * size, config.qkv_bias, dtype, "v_proj")(x)
        query = query.reshape(batch, length, heads, size)
        key = key.reshape(batch, length, kv_heads, size)
        value = value.reshape(batch, length, kv_heads, size)
        if config.qk_norm:
            query = RMSNorm(config.rms_norm_eps, config.norm_plus_one, dtype, name="q_norm")(query)
            key = RMSNorm(config.rms_norm_eps, config.norm_plus_one, dtype, name="k_norm")(key)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # one angle per position, for every head
        query = rotary.rotate(query, cos, sin).astype(dtype)
        key = rotary.rotate(key, cos, sin).astype(dtype)
        if cache is not None:
            key = jax.lax.dynamic_update_slice_in_dim(cache[0], key.astype(cache[0].dtype), cache_index, axis=1)
            value = jax.lax.dynamic_update_slice_in_dim(cache[1], value.astype(cache[1].dtype), cache_index, axis=1)
            cache = (key, value)
        # [batch, kv heads, group, queries, keys]: the queries of a group share one key/value head
        grouped = query.reshape(batch, length, kv_heads, heads // kv_heads, size)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, key.astype(dtype),
                            preferred_element_type=jnp.float32) * config.query_scale
        if config.attn_logit_softcapping:
            scores = jnp.tanh(scores / config.attn_logit_softcapping) * config.attn_logit_softcapping
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, value.astype(dtype)).reshape(batch, length, heads * size)
        return _dense(config, config.hidden_size, config.output_bias, dtype, "o_proj")(out), cache


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)); Phi-3 keeps gate and up in one matrix, gate first."""

    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        config, dtype = self.config, self.dtype
        act = _ACTIVATIONS[config.activation]
        if config.fused_projections:
            gate, up = jnp.split(_dense(config, 2 * config.intermediate_size, False, dtype, "gate_up_proj")(x), 2,
                                 axis=-1)
        else:
            gate = _dense(config, config.intermediate_size, config.mlp_bias, dtype, "gate_proj")(x)
            up = _dense(config, config.intermediate_size, config.mlp_bias, dtype, "up_proj")(x)
        return _dense(config, config.hidden_size, config.mlp_bias, dtype, "down_proj")(act(gate) * up)


class DecoderLayer(nn.Module):
    config: DecoderConfig
    window: int | None
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, cos, sin, allowed, cache=None, cache_index=None):
        config = self.config

        def norm(name):
            return RMSNorm(config.rms_norm_eps, config.norm_plus_one, self.dtype, name=name)

        attended, cache = Attention(config, self.window, self.dtype, name="self_attn")(
            norm("input_layernorm")(x), cos, sin, allowed, cache, cache_index)
        if config.sandwich_norms:  # Gemma 2 and 3: each branch normed on its way in and on its way out
            x = x + norm("post_attention_layernorm")(attended)
            return x + norm("post_feedforward_layernorm")(
                MLP(config, self.dtype, name="mlp")(norm("pre_feedforward_layernorm")(x))), cache
        x = x + attended
        return x + MLP(config, self.dtype, name="mlp")(norm("post_attention_layernorm")(x)), cache


class DecoderLayers(nn.Module):
    """The layer stack (PyTorch's `model.layers`), each layer a submodule named by its index as in
    transformers' Flax stacks: the engine's per-layer hooks (`utils.kernels.hooks.each_layer`: gradient
    checkpointing, fsdp's gradient split) find the family's layers as they find those."""

    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, angles, query_slots, key_mask, cache=None, cache_index=None):
        config = self.config
        key_slots = jnp.arange(key_mask.shape[1])
        causal = key_slots[None, :] <= query_slots[:, None]
        new_cache = []
        for index, window in enumerate(config.layer_windows):
            allowed = causal
            if window:  # the last `window` slots, its own included
                allowed = allowed & (key_slots[None, :] > query_slots[:, None] - window)
            allowed = allowed[None] & key_mask[:, None, :].astype(bool)
            cos, sin = angles[config.layer_ropes[index]]
            x, layer_cache = DecoderLayer(config, window, self.dtype, name=str(index))(
                x, cos, sin, allowed, None if cache is None else cache[index], cache_index)
            new_cache.append(layer_cache)
        return x, (None if cache is None else tuple(new_cache))


class Decoder(nn.Module):
    """Embeddings, layers and the final norm (PyTorch's `model.`)."""

    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        config = self.config
        self.embed_tokens = nn.Embed(config.vocab_size, config.hidden_size, dtype=self.dtype, param_dtype=jnp.float32,
                                     embedding_init=nn.initializers.normal(config.initializer_range))
        self.layers = DecoderLayers(config, self.dtype)
        self.norm = RMSNorm(config.rms_norm_eps, config.norm_plus_one, self.dtype)

    def __call__(self, input_ids, positions, key_mask, cache=None, cache_index=None):
        config = self.config
        x = self.embed_tokens(input_ids)
        if config.scale_embeddings:  # Gemma: the factor rounded to the compute dtype first, as in PyTorch
            x = x * jnp.asarray(math.sqrt(config.hidden_size), self.dtype)
        start = 0 if cache is None else cache_index
        query_slots = start + jnp.arange(input_ids.shape[1])
        angles = [rotary.cos_sin(rope, positions) for rope in config.ropes]
        x, cache = self.layers(x, angles, query_slots, key_mask, cache, cache_index)
        return self.norm(x), cache


class DecoderLM(nn.Module):
    """The causal LM (PyTorch's `*ForCausalLM`): `model` and `lm_head` (none with tied embeddings).

    Called with input_ids [batch, length], their positions and `key_mask` [batch, keys] (1 for a real
    token: without a cache keys are this call's tokens, with one every slot of the cache); with a
    `cache` (`init_cache`), this call's tokens sit at slots cache_index... and the updated cache comes
    back. Returns (float32 logits [batch, length, vocab], cache or None)."""

    config: DecoderConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.model = Decoder(self.config, self.dtype)
        if not self.config.tie_word_embeddings:
            self.lm_head = _dense(self.config, self.config.vocab_size, False, self.dtype, "lm_head")

    def __call__(self, input_ids, positions, key_mask, cache=None, cache_index=None):
        hidden, cache = self.model(input_ids, positions, key_mask, cache, cache_index)
        logits = (self.model.embed_tokens.attend(hidden) if self.config.tie_word_embeddings
                  else self.lm_head(hidden)).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return (jnp.tanh(logits / cap) * cap if cap else logits), cache


def init_params(model, seed=0):
    """Fresh float32 weights of `model` (normal(initializer_range) matrices, neutral norms)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    return model.init(jax.random.PRNGKey(seed), ids, ids, jnp.ones((1, 1), jnp.int32))["params"]


def param_shapes(model):
    """The parameter tree of `model` as jax.ShapeDtypeStruct leaves (float32), no weights made."""
    return jax.eval_shape(lambda: init_params(model))


def positions_of(attention_mask):
    """Each token's position: the real tokens before it (left padding moves none); pads get 0."""
    return jnp.maximum(jnp.cumsum(attention_mask, axis=-1) - 1, 0).astype(jnp.int32)


def forward(model, params, input_ids, attention_mask=None, positions=None):
    """Float32 logits [batch, length, vocab] of input_ids [batch, length]: positions from the attention
    mask (1 for real tokens, 0 for left padding) unless given; no mask: every token is real."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    if positions is None:
        positions = positions_of(attention_mask)
    return model.apply({"params": params}, input_ids, positions, attention_mask)[0]


def init_cache(config, batch, slots, dtype=jnp.float32):
    """An empty KV cache: for each layer (keys, values) [batch, slots, kv heads, head_dim]."""
    shape = (batch, slots, config.num_kv_heads, config.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.num_layers))


def _recomputed_step(config, width, max_new_tokens):
    """The decoding step at which Phi-3 computes the whole sequence again, or None.

    PyTorch transformers' Phi-3 generation drops its cache at the call whose sequence (slots, padding
    included) first passes the pretrained context of its longrope, so that every key, in every layer,
    is computed again with the long factors; a cache kept across that point would hold keys rotated by
    the short ones. Other rope types and models keep their cache."""
    contexts = [rope.context for rope in config.ropes if rope.kind == "longrope"]
    if config.model_type != "phi3" or not contexts:
        return None
    step = contexts[0] - width
    return step if 0 <= step < max_new_tokens - 1 else None


def greedy(logits, drawn):
    """The likeliest token of each row's logits [batch, vocab] (a `generate` chooser)."""
    return jnp.argmax(logits, axis=-1)


def generate(model, params, input_ids, attention_mask, max_new_tokens, choose=greedy, end_id=None):
    """The `max_new_tokens` [batch, max_new_tokens] tokens after each left-padded prompt of input_ids
    [batch, width]: the prompt in one call into a KV cache, then one token a call (traceable: jit it with
    max_new_tokens, `choose` and `end_id` static).

    `choose(logits, drawn)` picks each row's next token from its float32 logits [batch, vocab]; `drawn`
    is how many tokens were generated before it (0 for the first). With `end_id`, a row that has picked
    it goes on with it, whatever `choose` says (transformers' generate pads a finished row with its pad
    id, which the caller makes the end id)."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    attention_mask = jnp.asarray(attention_mask, jnp.int32)
    batch, width = input_ids.shape
    key_mask = jnp.concatenate([attention_mask, jnp.ones((batch, max_new_tokens), jnp.int32)], axis=1)

    def pick(logits, drawn, finished):
        token = choose(logits, drawn).astype(jnp.int32)
        if end_id is None:
            return token, finished
        token = jnp.where(finished, end_id, token)
        return token, finished | (token == end_id)

    def prefill(ids, finished):  # ids fill the first slots of a fresh cache; the token after them
        cache = init_cache(model.config, batch, width + max_new_tokens, model.dtype)
        positions = positions_of(key_mask[:, :ids.shape[1]])
        logits, cache = model.apply({"params": params}, ids, positions, key_mask, cache, 0)
        token, finished = pick(logits[:, -1], ids.shape[1] - width, finished)
        return token, positions[:, -1] + 1, cache, finished

    def step(carry, drawn):  # the last token picked (the `drawn - 1`th) into its slot; the next one
        token, position, cache, finished = carry
        logits, cache = model.apply({"params": params}, token[:, None], position[:, None], key_mask, cache,
                                    width + drawn - 1)
        following, finished = pick(logits[:, -1], drawn, finished)
        return (following, position + 1, cache, finished), following

    carry = prefill(input_ids, jnp.zeros((batch,), bool))
    first = carry[0]
    again = _recomputed_step(model.config, width, max_new_tokens)
    if again is None:
        carry, tokens = jax.lax.scan(step, carry, jnp.arange(1, max_new_tokens))
    else:  # the tokens up to the `again`th from the cache, the next from the whole sequence, then the cache again
        carry, before = jax.lax.scan(step, carry, jnp.arange(1, again + 1))
        sequence = jnp.concatenate([input_ids, first[:, None], before.T], axis=1)
        carry = prefill(sequence, carry[3])
        recomputed = carry[0]
        carry, after = jax.lax.scan(step, carry, jnp.arange(again + 2, max_new_tokens))
        tokens = jnp.concatenate([before, recomputed[None], after], axis=0)
    return jnp.concatenate([first[:, None], tokens.T], axis=1)


def greedy_generate(model, params, input_ids, attention_mask, max_new_tokens):
    """The `max_new_tokens` greedy tokens after each left-padded prompt (`generate` with `greedy`)."""
    return generate(model, params, input_ids, attention_mask, max_new_tokens)
