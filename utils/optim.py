"""Learning-rate schedules, weight-decay masks and the optimizer factory."""

import re

import optax
from flax import traverse_util

from utils.errors import UsageError

# Module names of normalisation layers across the supported families: T5 `layer_norm`,
# BART `self_attn_layer_norm` / `layernorm_embedding`, GPT-2 `ln_1` / `ln_f`, BERT `LayerNorm`,
# Llama / Mistral / Gemma `input_layernorm` / `post_attention_layernorm` / `norm`, BLOOM
# `word_embeddings_layernorm`, OPT `final_layer_norm`, DINOv2 `norm1` / `norm2`, ResNet / RegNet
# batch norm `normalization`.
# Vision transformers' learned tokens, position tables and layer scales (ViT, BEiT, DINOv2): not
# weight matrices, so no decay either (as timm and big_vision leave them).
_NO_DECAY_LEAVES = {"cls_token", "mask_token", "position_embeddings", "relative_position_bias_table", "lambda_1",
                    "lambda_2", "lambda1"}
_NORM_MODULE = re.compile(r"(layer_?norm|(^|_)ln(_|\d|$)|(^|_)norm\d*($|_)|rms_?norm|layernorm_embedding|"
                          r"^normalization$)", re.I)


def learning_rate_schedule(kind, peak, warmup_steps, total_steps):
    """Linear warmup from 0 to `peak`, then linear decay to 0, cosine decay to 0, or constant.

    `total_steps` counts optimizer steps (after gradient accumulation), so the decay ends exactly
    at the last step of the run.
    """
    warmup_steps = min(warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup_steps, 1)
    warmup = optax.linear_schedule(0.0, peak, transition_steps=max(warmup_steps, 1))
    if kind == "linear":
        after = optax.linear_schedule(peak, 0.0, transition_steps=decay_steps)
    elif kind == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps=decay_steps)
    elif kind == "constant":
        after = optax.constant_schedule(peak)
    else:
        raise UsageError(f"unknown learning-rate schedule {kind!r}: use linear, cosine or constant")
    if warmup_steps == 0:
        return after
    return optax.join_schedules([warmup, after], boundaries=[warmup_steps])


def decay_mask(params):
    """True for parameters that get weight decay: everything but biases, normalisation scales,
    batch-norm statistics (`batch_stats`, which are not trained) and `_NO_DECAY_LEAVES`."""
    flat = traverse_util.flatten_dict(params)

    def decays(path):
        # `bias`, and BART's top-level `final_logits_bias`
        if path[0] == "batch_stats" or str(path[-1]).endswith("bias") or path[-1] in _NO_DECAY_LEAVES:
            return False
        return not any(_NORM_MODULE.search(str(name)) for name in path[:-1])

    return traverse_util.unflatten_dict({path: decays(path) for path in flat})


def create_optimizer(schedule, adafactor, adam_beta1, adam_beta2, adam_epsilon, weight_decay):
    """AdamW with the decay mask, or Adafactor (`--adafactor`)."""
    if adafactor:
        return optax.adafactor(learning_rate=schedule)
    return optax.adamw(learning_rate=schedule, b1=adam_beta1, b2=adam_beta2, eps=adam_epsilon,
                       weight_decay=weight_decay, mask=decay_mask)
