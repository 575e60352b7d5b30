"""Hooks into a transformers Flax model's calls: an interceptor on every call (`intercept_calls`), and a
transform applied to each layer of the model's stacks, inside its call (`each_layer`).

transformers builds a stack's layers as submodules named by their index ("0", "1", ...), in every
family. `each_layer(transform)` is a method interceptor (`flax.linen.intercept_methods`) that runs
the call of each such module (the outermost only: a layer's own numbered parts run inside it) as
`transform(layer)(module, *arrays)`, where `layer(module, *arrays)` is the module's own call: a
lifted transform (`nn.checkpoint`, `nn.custom_vjp`) then sees the layer's parameters and array
arguments, and the model's code and parameter tree stay as they are. Arguments that are not arrays
(`deterministic`, `init_cache`, None masks) stay Python values, as the layer's code branches on them.
"""

import threading

import jax
from flax import linen as nn


def intercept_calls(model, interceptor):
    """Make every call of `model` run under the method interceptor `interceptor`
    (`flax.linen.intercept_methods`). transformers' models call `self.module.apply`: the module's own
    attribute is the one hook that leaves the model class and its parameter tree as they are (a frozen
    dataclass, hence object.__setattr__). Hooks stack: each wraps the apply before it."""
    module = model.module
    apply = module.apply

    def apply_intercepted(*args, **kwargs):
        with nn.intercept_methods(interceptor):
            return apply(*args, **kwargs)

    object.__setattr__(module, "apply", apply_intercepted)


def _is_array(x):
    return isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)


def each_layer(transform):
    """An interceptor applying `transform` to every layer call (see the module's docstring). Each
    interceptor keeps its own "inside a layer" mark, so two of them (checkpointing and the fsdp
    gradient split) nest: each wraps every layer once."""
    inside = threading.local()  # set while a wrapped layer is traced: its parts run as they are

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if getattr(inside, "active", False) or context.method_name != "__call__" or not (module.name or "").isdigit():
            return next_fun(*args, **kwargs)
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        arrays = [leaf for leaf in leaves if _is_array(leaf)]

        def layer(module, *arrays):
            given = iter(arrays)
            call_args, call_kwargs = jax.tree_util.tree_unflatten(
                treedef, [next(given) if _is_array(leaf) else leaf for leaf in leaves])
            inside.active = True
            try:
                return type(module).__call__(module, *call_args, **call_kwargs)
            finally:
                inside.active = False

        return transform(layer)(module, *arrays)

    return intercept
