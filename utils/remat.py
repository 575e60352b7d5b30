"""Gradient checkpointing for transformers' Flax models that do not implement it (GPT-2, GPT-Neo,
OPT, Llama, Mistral, Gemma, BART, ...): each layer of the model's stack recomputes its activations
in the backward pass instead of keeping them.

transformers builds a stack's layers as submodules named by their index ("0", "1", ...), in every
family. `remat_layers` intercepts the call of each such module (the outermost only: a layer's own
numbered parts recompute with it) and runs it under `flax.linen.checkpoint`, so the model's code and
its parameter tree stay as they are. Keyword and positional arguments that are not arrays
(`deterministic`, `init_cache`, None masks) stay Python values, as the layer's code branches on them.
"""

import threading

import jax
from flax import linen as nn

_inside_layer = threading.local()  # set while a checkpointed layer is traced: its parts run as they are


def _is_array(x):
    return isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)


def _checkpointed_layer(next_fun, args, kwargs, context):
    module = context.module
    if (getattr(_inside_layer, "active", False) or context.method_name != "__call__"
            or not (module.name or "").isdigit()):
        return next_fun(*args, **kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    arrays = [leaf for leaf in leaves if _is_array(leaf)]

    def layer(module, *arrays):
        given = iter(arrays)
        call_args, call_kwargs = jax.tree_util.tree_unflatten(
            treedef, [next(given) if _is_array(leaf) else leaf for leaf in leaves])
        _inside_layer.active = True
        try:
            return type(module).__call__(module, *call_args, **call_kwargs)
        finally:
            _inside_layer.active = False

    return nn.checkpoint(layer)(module, *arrays)


def remat_layers(model):
    """Make every call of `model` (a transformers Flax model) checkpoint each layer of its stacks."""
    module = model.module
    apply = module.apply

    def apply_with_checkpointed_layers(*args, **kwargs):
        with nn.intercept_methods(_checkpointed_layer):
            return apply(*args, **kwargs)

    # transformers' models call `self.module.apply`: the module's own attribute is the one hook that
    # leaves the model class and its parameters untouched (a frozen dataclass, hence object.__setattr__).
    object.__setattr__(module, "apply", apply_with_checkpointed_layers)
