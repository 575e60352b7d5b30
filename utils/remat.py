"""Gradient checkpointing for transformers' Flax models that do not implement it (GPT-2, GPT-Neo,
OPT, Llama, Mistral, Gemma, BART, ...): each layer of the model's stacks (`utils.layers`) runs under
`flax.linen.checkpoint`, so it recomputes its activations in the backward pass instead of keeping them.
"""

from flax import linen as nn

from utils.layers import each_layer, intercept_calls


def remat_layers(model):
    """Make every call of `model` (a transformers Flax model) checkpoint each layer of its stacks."""
    intercept_calls(model, each_layer(nn.checkpoint))
