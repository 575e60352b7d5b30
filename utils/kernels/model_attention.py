"""Self-attention through Pallas kernels on TPUs: causal (GPT-2, Llama) and bidirectional (BERT, RoBERTa).

transformers' Flax attention forms the whole [batch, heads, length, length] score matrix, masks it and
takes its softmax in HBM: at 1024 tokens that traffic, not the products, is the time (a GPT-2 layer,
forward and backward on a v5e chip: 6.3 ms; JAX's splash kernel, which never writes the scores out,
3.3 ms). `use_attention_kernels(model)` routes the self-attention of the models' training and scoring
calls through a kernel, with the causal mask and the padding mask (as segment ids: a real token sees
only the real tokens before it, as the stock mask has it) and the same scale: `utils.kernels.flash_attention`'s
flash kernel, which draws the dropout mask tile by tile on the chip, while training with attention dropout
(JAX's splash kernel has none), and for GPT-2, whose c_attn output it reads in place, always (a GPT-2-small
layer without dropout on a v5e chip: 3.79 ms forward and backward, splash with the transposes it needs
5.10 ms); JAX's splash kernel otherwise. BERT's and RoBERTa's encoder attention runs the flash kernel
without the causal mask, every query over every real key. Where the kernels would compute something else,
the stock call runs: a generation cache, attention weights asked for, cross-attention, a
sliding window, a length that is not a whole number of 128-token blocks, or attention dropout over more
tokens than the flash kernel's backward pass holds (`dropout_attention.fits`). Under fsdp's jit over a mesh the
kernels run on each device's rows through shard_map (XLA cannot split a Pallas call), as pmap gives them one
device's rows under dp.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from utils.base.arguments import tpu_lever
from utils.kernels import flash_attention
from utils.kernels.hooks import intercept_calls

BLOCK = 128  # the kernel's tile: lengths must be a multiple of it
FAMILIES = ("gpt2", "llama", "bert", "roberta")  # model types whose attention `_routes` knows


@functools.lru_cache(maxsize=None)
def _kernel(heads, length, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    block = flash_attention.block_size(length)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    mask = masks.MultiHeadMask([masks.CausalMask((length, length))] * heads)
    # The kernel is cached across traces: its block tables must be values, never one trace's tracers
    # (built inside `nn.checkpoint`, they leaked into the next step's trace). Its residuals carry the flash
    # kernel's checkpoint name, so a checkpointed layer keeps each row's logsumexp as one float, not 128 lanes.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret,
                                                    residual_checkpoint_name=flash_attention.RESIDUALS)


def _segments(attention_mask, batch, length):
    """The kernels' segment ids: 1 for real tokens, 0 for padding (all real without a mask)."""
    return jnp.ones((batch, length), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)


def on_each_device(mesh, kernel, rows, seed):
    """`kernel(*rows, seed)`, the arrays of `rows` split by their leading (batch) axis. Under a jit over `mesh`
    (fsdp) it runs on each device's rows through shard_map, its dropout seed folded with the device's place
    among the batch's devices: the kernel numbers its tiles from a device's first row, so without the fold
    every device would drop the weights of its first rows as the others drop theirs. `mesh` None (dp, whose
    pmap already gives the kernel one device's rows, with a key of its own): the call as it is."""
    if mesh is None:
        return kernel(*rows, seed)
    axes = mesh.axis_names

    def per_device(*args):
        *local_rows, seed = args
        device = jax.lax.axis_index(axes)
        return kernel(*local_rows, flash_attention.seed_of(jax.random.fold_in(jax.random.key(seed[0]), device)))

    split = PartitionSpec(axes)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(split,) * len(rows) + (PartitionSpec(),),
                         out_specs=split, check_vma=False)(*rows, seed)


def _flash(kernel, rows, dropout, heads, interpret, mesh):
    """One of `utils.kernels.flash_attention`'s flash kernels on `rows`, with `dropout`'s seed and rate (`_dropout`'s
    answer), on each device's rows."""
    seed, rate = _seed_and_rate(dropout)
    return on_each_device(mesh, functools.partial(kernel, rate=rate, heads=heads, interpret=interpret), rows, seed)


def causal_attention(query, key, value, attention_mask, interpret=False, dropout=None, mesh=None):
    """softmax(q k^T / sqrt(d) + causal and padding masks) v for [batch, length, heads, head_dim] inputs
    (keys and values with as many heads as the queries), in the queries' dtype. `attention_mask`
    [batch, length] (1 real, 0 padding) or None; `dropout`: None, or (rate, key) to drop the weights
    as `nn.Dropout` does, with a mask drawn from `key` (the flash kernel; splash without). `mesh`: the
    kernels on each device's rows (`on_each_device`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds

    batch, length, heads, head_dim = query.shape
    segments = _segments(attention_mask, batch, length)
    if dropout is not None:
        merged = [x.reshape(batch, length, heads * head_dim) for x in (query, key, value)]  # no copy
        out = _flash(flash_attention.dropout_attention, merged + [segments], dropout, heads, interpret, mesh)
        return out.reshape(query.shape).astype(query.dtype)
    kernel = _kernel(heads, length, interpret)

    def splash(query, key, value, segments, _):  # no dropout: no seed
        scaled = (query * jnp.asarray(head_dim ** -0.5, query.dtype)).transpose(0, 2, 1, 3)
        key, value = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
        if attention_mask is None:
            out = jax.vmap(kernel)(scaled, key, value)
        else:
            out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(q=s, kv=s)))(scaled, key, value,
                                                                                                    segments)
        return out.transpose(0, 2, 1, 3)

    return on_each_device(mesh, splash, [query, key, value, segments], _seed_and_rate(None)[0]).astype(query.dtype)


def _plain_self_attention(module, length, init_cache, output_attentions, deterministic, dropout_rate):
    """Whether the kernels compute what the stock call would (and, dropping weights, the flash kernel takes it)."""
    dropping = not deterministic and dropout_rate > 0.0
    return (length % BLOCK == 0 and not init_cache and not output_attentions
            and not module.has_variable("cache", "cached_key")
            and (not dropping or flash_attention.fits(length, module.num_heads, module.head_dim)))


def _seed_and_rate(dropout):
    """The flash kernel's (seed, rate) for `_dropout`'s answer: rate 0 without dropout."""
    return (flash_attention.seed_of(dropout[1]), dropout[0]) if dropout else (jnp.zeros(1, jnp.int32), 0.0)


def _dropout(module, deterministic, rate):
    """(rate, key) for `causal_attention` when the call drops attention weights, else None; the key is drawn
    where the stock attention draws its own."""
    return None if deterministic or rate == 0.0 else (rate, module.make_rng("dropout"))


def _gpt2(module, interpret, mesh, hidden_states, key_value_states=None, attention_mask=None, deterministic=True,
          init_cache=False, output_attentions=False):
    qkv = module.c_attn(hidden_states)
    dropout = _dropout(module, deterministic, module.config.attn_pdrop)
    batch, length, _ = qkv.shape
    if (flash_attention.packs(module.num_heads, module.head_dim)
            and flash_attention.fits(length, module.num_heads, module.head_dim)):
        # the flash kernel reads the queries, keys and values in place in c_attn's output (without dropout
        # too: splash would need them transposed)
        out = _flash(flash_attention.packed_dropout_attention, [qkv, _segments(attention_mask, batch, length)],
                     dropout, module.num_heads, interpret, mesh)
    else:
        query, key, value = (module._split_heads(x) for x in jnp.split(qkv, 3, axis=2))
        out = module._merge_heads(causal_attention(query, key, value, attention_mask, interpret, dropout, mesh))
    out = module.c_proj(out)
    return (module.resid_dropout(out, deterministic=deterministic),)


def _gpt2_applies(module, hidden_states, key_value_states=None, attention_mask=None, deterministic=True,
                  init_cache=False, output_attentions=False):
    return (key_value_states is None and module.causal
            and _plain_self_attention(module, hidden_states.shape[1], init_cache, output_attentions, deterministic,
                                      module.config.attn_pdrop))


def _llama(module, interpret, mesh, hidden_states, attention_mask, position_ids, deterministic=True,
           init_cache=False, output_attentions=False):
    query = module._split_heads(module.q_proj(hidden_states), module.num_heads)
    key = module._split_heads(module.k_proj(hidden_states), module.num_key_value_heads)
    value = module._split_heads(module.v_proj(hidden_states), module.num_key_value_heads)
    key, query = module.rotary_emb(key, query, position_ids)
    key = jnp.repeat(key, module.num_key_value_groups, axis=2)
    value = jnp.repeat(value, module.num_key_value_groups, axis=2)
    out = causal_attention(query, key, value, attention_mask, interpret,
                           _dropout(module, deterministic, module.config.attention_dropout), mesh)
    return (module.o_proj(module._merge_heads(out)),)


def _llama_applies(module, hidden_states, attention_mask, position_ids, deterministic=True, init_cache=False,
                   output_attentions=False):
    return (getattr(module.config, "sliding_window", None) is None
            and _plain_self_attention(module, hidden_states.shape[1], init_cache, output_attentions, deterministic,
                                      module.config.attention_dropout))


def _encoder(module, interpret, mesh, hidden_states, attention_mask, layer_head_mask, key_value_states=None,
             init_cache=False, deterministic=True, output_attentions=False):
    """BERT's (and RoBERTa's) self-attention: every query sees every real key."""
    query, key, value = (projection(hidden_states) for projection in (module.query, module.key, module.value))
    batch, length, _ = query.shape
    out = _flash(flash_attention.bidirectional_dropout_attention,
                 [query, key, value, _segments(attention_mask, batch, length)],
                 _dropout(module, deterministic, module.config.attention_probs_dropout_prob),
                 module.config.num_attention_heads, interpret, mesh)
    if layer_head_mask is not None:  # transformers passes ones unless told: a head's weights times its factor
        out = out * jnp.repeat(layer_head_mask, module.head_dim).astype(out.dtype)
    return (out,)


def _encoder_applies(module, hidden_states, attention_mask, layer_head_mask, key_value_states=None,
                     init_cache=False, deterministic=True, output_attentions=False):
    length, heads = hidden_states.shape[1], module.config.num_attention_heads
    return (not module.causal and key_value_states is None and not init_cache and not output_attentions
            and flash_attention.fits(length, heads, module.head_dim))


def _routes():
    from transformers.models.bert.modeling_flax_bert import FlaxBertSelfAttention
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2Attention
    from transformers.models.llama.modeling_flax_llama import FlaxLlamaAttention
    from transformers.models.roberta.modeling_flax_roberta import FlaxRobertaSelfAttention

    return {FlaxGPT2Attention: (_gpt2_applies, _gpt2), FlaxLlamaAttention: (_llama_applies, _llama),
            FlaxBertSelfAttention: (_encoder_applies, _encoder), FlaxRobertaSelfAttention: (_encoder_applies, _encoder)}


def supports(model):
    """Whether `model` (a transformers Flax model) is of a family whose self-attention can be routed."""
    return model.config.model_type in FAMILIES


def choose(choice, model, platform, layout_name):
    """Whether `--attention` `choice` routes `model`'s attention through the kernels on `platform` ("tpu",
    "cpu", ...) under the layout named `layout_name`; "auto": on TPUs, under dp and fsdp (each family measured
    faster under dp, GPT-2 under fsdp too: docs/performance.md). A `UsageError`
    when "splash" cannot be had."""
    return tpu_lever("attention", choice, "splash", "xla", supports(model),
                     f"the kernels know GPT-2, Llama, BERT and RoBERTa attention, not {model.config.model_type}'s",
                     platform, layout_name, layouts=("dp", "fsdp"))


def use_attention_kernels(model, interpret=False, mesh=None):
    """Make every call of `model` run its causal self-attention through the kernels where they compute
    what the stock call would (the module docstring). `interpret`: Pallas' interpreter, for CPUs (tests).
    `mesh`: the mesh a jitted step splits the batch over (fsdp's), whose devices each run the kernels on
    their rows (`on_each_device`); None under pmap."""
    routes = _routes()

    def route(next_fun, args, kwargs, context):
        found = routes.get(type(context.module)) if context.method_name == "__call__" else None
        if found is None or not found[0](context.module, *args, **kwargs):
            return next_fun(*args, **kwargs)
        return found[1](context.module, interpret, mesh, *args, **kwargs)

    intercept_calls(model, route)
