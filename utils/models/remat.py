"""Gradient checkpointing through `flax.linen.checkpoint` on each layer of a transformers Flax model's stacks
(`utils.kernels.hooks`): for the families transformers does not implement it for (GPT-2, GPT-Neo, OPT, Llama,
Mistral, Gemma, BART, ...), and for every family when a layer keeps its kernels' outputs
(`--gradient_checkpointing_policy kernels`), which transformers' own checkpointing cannot be told. The model's
code and parameter tree stay as they are.
"""

from flax import linen as nn

from utils.kernels import flash_attention
from utils.kernels.hooks import each_layer, intercept_calls


def keep_kernels(primitive, *args, **params):
    """`--gradient_checkpointing_policy kernels` (a `jax.checkpoint` policy): a layer keeps the outputs of its
    Pallas kernels (the attention's, the chip's dropout) for the backward pass, which then runs every kernel's
    forward once, not twice; all else is recomputed. Of the attention kernels (flash and splash), what their
    backward kernels read, named `dropout_attention.RESIDUALS`: the output and each row's logsumexp as one
    float, not the forward kernel's 128 lanes of it (`utils.models.layer_scan`). On one v5e chip a few hundred MiB
    more than keeping nothing, for faster steps; keeping every weight product's output as well planned about
    what no checkpointing needs, so it is not offered (docs/performance.md)."""
    if primitive.name == "name":  # jax.ad_checkpoint.checkpoint_name
        return params["name"] == flash_attention.RESIDUALS
    return primitive.name == "pallas_call"


POLICIES = {"nothing": None, "kernels": keep_kernels}


def remat_layers(model, policy="nothing"):
    """Make every call of `model` (a transformers Flax model) checkpoint each layer of its stacks, keeping
    what `policy` (a name of `POLICIES`) says."""
    intercept_calls(model, each_layer(lambda layer: nn.checkpoint(layer, policy=POLICIES[policy])))
