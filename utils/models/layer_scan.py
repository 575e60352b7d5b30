"""Scanned layer stacks (`--scan_layers`): a decoder's layers traced and compiled once, not once each.

transformers' Flax decoders (GPT-2, Llama, Mistral, Gemma) run their stack of identical layers as a
Python loop, so every layer is traced and then compiled on its own: on a TPU the train step's compile
grows by about 3 s a layer. `scan_layers(model)` makes every call of `model` run the stack under
`jax.lax.scan` over the layers' parameters stacked leaf by leaf inside the call, one layer module
applied in its body; the parameter tree (checkpoints, exports, LoRA, resume) stays as it is, and the
gradient of the stacking is its unstacking. A layer keeps its products' and kernels' outputs for the
backward pass (`products_and_kernels`), nothing with `--gradient_checkpointing`. Dropout: the stack
draws one key and layer i masks with `fold_in(key, i)`, so the masks are not the loop's (the
arithmetic is the same). Where the scan would compute something else, the loop runs: initialising, a
generation cache, attention weights or hidden states asked for, or layers whose parameters differ.
"""

import inspect

import jax
import jax.numpy as jnp

from utils.base.arguments import tpu_lever
from utils.kernels.hooks import intercept_calls
from utils.models import remat

FAMILIES = ("gpt2", "llama", "mistral", "gemma")  # model types whose stack `_stacks` knows


def _stacks():
    """{collection class: how many outputs its call returns}: (hidden states, then Nones where no layer's
    hidden states or attention weights were asked for)."""
    from transformers.models.gemma.modeling_flax_gemma import FlaxGemmaLayerCollection
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2BlockCollection
    from transformers.models.llama.modeling_flax_llama import FlaxLlamaLayerCollection
    from transformers.models.mistral.modeling_flax_mistral import FlaxMistralLayerCollection

    return {FlaxGPT2BlockCollection: 4, FlaxLlamaLayerCollection: 3, FlaxMistralLayerCollection: 3,
            FlaxGemmaLayerCollection: 3}


def supports(model):
    """Whether `model` (a transformers Flax model) is of a family whose layer stack can be scanned."""
    return model.config.model_type in FAMILIES


def choose(choice, model, platform, layout_name):
    """Whether `--scan_layers` `choice` scans `model`'s layers on `platform` ("tpu", "cpu", ...) under the
    layout named `layout_name`; "auto": on TPUs under dp, for the families it knows. A `UsageError` when
    "yes" cannot be had (under fsdp, which splits each layer's gradients as the loop calls that layer)."""
    return tpu_lever("scan_layers", choice, "yes", "no", supports(model),
                     f"the scan knows the layer stacks of {', '.join(FAMILIES)}, not {model.config.model_type}'s",
                     platform, layout_name)


def products_and_kernels(primitive, *args, **params):
    """What a scanned layer keeps of its forward pass for the backward one (a `jax.checkpoint` policy):
    its matrix products' and Pallas kernels' outputs, so the backward pass runs no product or kernel
    again; the elementwise work between them (layer norms, GELU, dropout masks) runs again there, fused
    into its consumers. The loop leaves what to keep to XLA; a scan keeps every intermediate of every
    layer unless told (GPT-2 small, 16 x 1024 tokens, bf16, planned for a v5e chip: 16.5 GiB of
    temporaries, which the TPU compiler refuses; 10.7 with this policy, the loop's 9.2;
    benchmarks/scan_layers.py). Of the attention kernels, what their backward kernels read: each row's logsumexp
    as one float, not the forward kernel's 128 lanes of it (stacking those took 8.8 ms of a 107 ms GPT-2
    small step on a v5e chip, and 1.1 GiB)."""
    return remat.keep_kernels(primitive, *args, **params) or jax.checkpoint_policies.dots_saveable(
        primitive, *args, **params)


def _passable(value):
    return value is None or isinstance(value, (bool, jax.Array))  # traced values are jax.Arrays too


def _layer_params(module):
    """The layers' parameter trees in order, or None where they are not N alike trees named "0".."N-1"."""
    params = module.variables["params"]
    names = [str(i) for i in range(len(module.blocks))]
    if set(params) != set(names):
        return None
    layers = [params[name] for name in names]
    shapes = [jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), layer) for layer in layers]
    return layers if all(shape == shapes[0] for shape in shapes) else None


def _scanned(next_fun, args, kwargs, context, outputs, checkpointed):
    """The stack's call (`outputs` long) under the scan, or the loop's (`next_fun`) where the scan would
    compute something else."""
    module = context.module
    if module.is_initializing() or set(module.variables) != {"params"}:  # init, or a generation cache
        return next_fun(*args, **kwargs)
    call = inspect.signature(type(module).__call__).bind(module, *args, **kwargs)
    call.apply_defaults()
    given = dict(call.arguments)
    del given["self"], given["return_dict"]
    hidden = given.pop("hidden_states")
    if (given.pop("output_hidden_states") or given["output_attentions"] or given["init_cache"]
            or not all(_passable(value) for value in given.values())):
        return next_fun(*args, **kwargs)
    layers = _layer_params(module)
    if layers is None:
        return next_fun(*args, **kwargs)
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *layers)
    layer = type(module.blocks[0])(module.config, dtype=module.dtype, parent=None)  # unbound: applied per layer
    # Drawn wherever the loop's layers could draw theirs: LoRA's adapters drop inputs whenever a key is given.
    key = module.make_rng("dropout") if module.has_rng("dropout") else None

    def body(hidden, inputs):
        params, index = inputs
        rngs = {} if key is None else {"dropout": jax.random.fold_in(key, index)}
        return layer.apply({"params": params}, hidden, **given, rngs=rngs)[0], None

    # prevent_cse=False: inside a scan nothing can merge the recomputation away.
    body = jax.checkpoint(body, prevent_cse=False,
                          policy=remat.POLICIES[checkpointed] if checkpointed else products_and_kernels)
    hidden, _ = jax.lax.scan(body, hidden, (stacked, jnp.arange(len(layers))))
    return (hidden,) + (None,) * (outputs - 1)


def scan_layers(model, checkpointed=False):
    """Make every call of `model` run its layer stack under `jax.lax.scan` where it computes what the loop
    would (the module's docstring); `checkpointed` (False, or a `--gradient_checkpointing_policy`): each layer
    recomputes its activations in the backward pass but what the policy keeps (`utils.models.remat`, whose per-layer
    checkpoint then acts only where the loop runs)."""
    stacks = _stacks()

    def scan(next_fun, args, kwargs, context):
        outputs = stacks.get(type(context.module)) if context.method_name == "__call__" else None
        if outputs is None:
            return next_fun(*args, **kwargs)
        return _scanned(next_fun, args, kwargs, context, outputs, checkpointed)

    intercept_calls(model, scan)
