"""The project's own decoder family (`utils.models.decoders`) behind the interface the engine uses for a
transformers Flax causal LM, for the architectures transformers 4.57 has no Flax class for.

`FamilyModel` is an adapter, not a copy of transformers' `FlaxPreTrainedModel`: it holds the transformers
config (`config`, a `PretrainedConfig`: AutoConfig reads these architectures without torch), the
`generation_config`, the linen module (`module`, whose `apply` the engine's hooks wrap: LoRA, gradient
checkpointing), and answers the calls the engine makes: `model(input_ids, attention_mask=..., params=...,
dropout_rng=..., train=...)[0]` (float32 logits), `params_shape_tree`, `init_weights`, `generate_tokens` (the
KV-cache loop with the caller's chooser) and `save_pretrained` (a hub checkpoint PyTorch transformers loads:
PyTorch-named safetensors, config.json naming the PyTorch class, generation_config.json).

The family has no dropout: a config with a dropout rate above 0 is refused (`check`).
"""

import os

import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict
from transformers import AutoConfig, GenerationConfig

from utils.base.errors import UsageError
from utils.models import decoders, hub_checkpoint

# The model types run through the family, each with the PyTorch class its exports name. Llama, Mistral and Gemma
# stay on transformers' Flax classes, whose attention kernels, scanned layers and checkpointing policies the
# family does not have yet.
PYTORCH_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                   "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
FAMILY_TYPES = tuple(PYTORCH_CLASSES)
_DROPOUT_RATES = ("attention_dropout", "resid_pdrop", "embd_pdrop")


def routed(config):
    """Whether a model of `config` runs through the family."""
    return config.model_type in FAMILY_TYPES


def hub_dict(config):
    """The config.json dict of `config` as transformers saves it (every setting of the architecture, the
    generic ones where they differ from the defaults)."""
    return config.to_diff_dict()


def check(config, model_name_or_path=None):
    """A `UsageError` for what the family cannot run: a setting `decoders.config_from_hub` refuses, a dropout
    rate above 0, or pretrained weights that are not a local folder. Runs before any weights are read."""
    decoders.config_from_hub(hub_dict(config))
    for name in _DROPOUT_RATES:
        rate = getattr(config, name, 0.0) or 0.0
        if rate > 0:
            raise UsageError(f"the {config.model_type} config sets {name}={rate}, but this project's decoder family "
                             f"has no dropout: set {name} to 0 (in config.json, or --config_overrides {name}=0 for a "
                             "new model)")
    if model_name_or_path and not os.path.isdir(model_name_or_path):
        raise UsageError(f"--model_name_or_path {model_name_or_path}: a {config.model_type} model is read from a local "
                         "folder of safetensors weights: download it first (huggingface-cli download "
                         f"{model_name_or_path} --local-dir DIR) and pass DIR")


class FamilyModel:
    """A causal LM of the family with the interface of a transformers Flax model (the module docstring).
    `dtype` is the compute dtype; the weights keep whatever dtype `params` has."""

    base_model_prefix = "model"
    input_shape = (1, 1)

    def __init__(self, config, dtype=jnp.float32, generation_config=None):
        self.config = config
        self.module = decoders.DecoderLM(decoders.config_from_hub(hub_dict(config)), dtype)
        self.generation_config = generation_config or GenerationConfig.from_model_config(config)

    @classmethod
    def from_pretrained(cls, folder, dtype=jnp.float32):
        """(model, host params) of a hub checkpoint folder (config.json, safetensors, generation_config.json
        if there is one)."""
        config = AutoConfig.from_pretrained(folder)
        check(config)
        generation = (GenerationConfig.from_pretrained(folder)
                      if os.path.isfile(os.path.join(folder, "generation_config.json")) else None)
        model = cls(config, dtype, generation)
        return model, model.read_params(folder)

    @property
    def params_shape_tree(self):
        return decoders.param_shapes(self.module)

    def init_weights(self, rng, input_shape=input_shape):
        """Fresh float32 weights drawn from the key `rng`."""
        ids = jnp.zeros(input_shape, jnp.int32)
        return self.module.init(rng, ids, ids, jnp.ones(input_shape, jnp.int32))["params"]

    def read_params(self, folder):
        """The host parameters of the hub checkpoint in `folder` (`hub_checkpoint.read_checkpoint`)."""
        return hub_checkpoint.read_checkpoint(folder, self.params_shape_tree)

    def __call__(self, input_ids, attention_mask=None, params=None, dropout_rng=None, train=False):
        """(float32 logits [batch, length, vocab],) of input_ids, positions from the attention mask (left or
        right padding). `dropout_rng` reaches the modules that draw (LoRA's dropout) when training."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        rngs = {"dropout": dropout_rng} if train and dropout_rng is not None else {}
        logits, _ = self.module.apply({"params": params}, input_ids, decoders.positions_of(attention_mask),
                                      attention_mask, rngs=rngs)
        return (logits,)

    def generate_tokens(self, params, input_ids, attention_mask, max_new_tokens, choose, end_id=None):
        """The new tokens [batch, max_new_tokens] after left-padded prompts, through the KV cache
        (`decoders.generate`: `choose(logits, drawn)` picks each token; a row stops at `end_id`)."""
        return decoders.generate(self.module, params, input_ids, attention_mask, max_new_tokens, choose, end_id)

    def save_pretrained(self, directory, params, max_shard_bytes=5 * 1024**3):
        """A hub checkpoint of `params` (host arrays) in `directory`: model.safetensors (or shards of at most
        `max_shard_bytes` with their index), config.json naming the PyTorch class and the weights' dtype,
        generation_config.json."""
        hub = hub_dict(self.config)
        hub["architectures"] = [PYTORCH_CLASSES[self.config.model_type]]
        embedding = flatten_dict(params)[("model", "embed_tokens", "embedding")]
        hub["dtype"] = np.dtype(embedding.dtype).name  # the dtype transformers loads the weights in
        hub_checkpoint.write_checkpoint(params, directory, hub, max_shard_bytes)
        self.generation_config.save_pretrained(directory)
