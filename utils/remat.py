"""Gradient checkpointing for transformers' Flax models that do not implement it (GPT-2, GPT-Neo,
OPT, Llama, Mistral, Gemma, BART, ...): each layer of the model's stacks (`utils.layers`) runs under
`flax.linen.checkpoint`, so it recomputes its activations in the backward pass instead of keeping them.
"""

from flax import linen as nn

from utils.layers import each_layer


def remat_layers(model):
    """Make every call of `model` (a transformers Flax model) checkpoint each layer of its stacks."""
    module = model.module
    apply = module.apply
    checkpointed = each_layer(nn.checkpoint)

    def apply_with_checkpointed_layers(*args, **kwargs):
        with nn.intercept_methods(checkpointed):
            return apply(*args, **kwargs)

    # transformers' models call `self.module.apply`: the module's own attribute is the one hook that
    # leaves the model class and its parameters untouched (a frozen dataclass, hence object.__setattr__).
    object.__setattr__(module, "apply", apply_with_checkpointed_layers)
