"""Learning-rate schedules, weight-decay masks and the optimizer factory."""

import re
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from utils.base.arguments import SCHEDULES
from utils.base.errors import UsageError

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


class Schedule(NamedTuple):
    """The learning rate at each optimizer step: linear warmup from 0 to the peak, then linear decay to 0,
    cosine decay to 0, or constant (`kind`). `settings` holds its numbers ("peak", "warmup_steps",
    "decay_steps"): numpy scalars on the host, or the train step's copies of them, which it takes as an
    argument: its program holds no run's numbers, so the compilation cache serves a rerun with another
    learning rate, step count or data size."""

    kind: str
    settings: dict

    def __call__(self, count):
        peak, warmup, decay = (self.settings[key] for key in ("peak", "warmup_steps", "decay_steps"))
        # optax's linear_schedule, cosine_decay_schedule and join_schedules, op for op, on numbers that may be traced
        ramp = jnp.maximum(warmup, 1)
        warming = -peak * (1 - jnp.clip(count, 0, ramp) / ramp) + peak
        after = count - warmup
        if self.kind == "linear":
            decayed = peak * (1 - jnp.clip(after, 0, decay) / decay)
        elif self.kind == "cosine":
            decayed = peak * (0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(after, decay) / decay)))
        else:
            decayed = jnp.full(jnp.shape(count), peak)
        return jnp.where(count < warmup, warming, decayed)


def learning_rate_schedule(kind, peak, warmup_steps, total_steps):
    """The `Schedule` of `kind` to `peak` after `warmup_steps` (at most `total_steps`), decaying to 0 at
    `total_steps`, which counts optimizer steps (after gradient accumulation): the decay ends exactly at
    the last step of the run."""
    if kind not in SCHEDULES:
        raise UsageError(f"unknown learning-rate schedule {kind!r}: use linear, cosine or constant")
    warmup_steps = min(warmup_steps, total_steps)
    return Schedule(kind, {"peak": np.float32(peak), "warmup_steps": np.int32(warmup_steps),
                           "decay_steps": np.int32(max(total_steps - warmup_steps, 1))})


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
