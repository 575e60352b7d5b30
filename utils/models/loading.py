"""Config, tokenizer and model loading shared by the scripts (pretrained or from a config)."""

import contextlib
import copy
import dataclasses
import json
import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core.frozen_dict import unfreeze
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers import AutoConfig, AutoTokenizer, FlaxPreTrainedModel, GenerationConfig
from transformers.models.auto import modeling_flax_auto

from utils.base import hub_probe
from utils.base.errors import UsageError
from utils.layout import devices
from utils.models import decoder_positions, family_model, lora, remat, weights

logger = logging.getLogger(__name__)

# The model types each Auto class can build, straight from transformers' own registry.
TASK_MODEL_TYPES = {
    "seq2seq": modeling_flax_auto.FLAX_MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    "causal-lm": modeling_flax_auto.FLAX_MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "masked-lm": modeling_flax_auto.FLAX_MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    "sequence-classification": modeling_flax_auto.FLAX_MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    "token-classification": modeling_flax_auto.FLAX_MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    "image-classification": modeling_flax_auto.FLAX_MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    "question-answering": modeling_flax_auto.FLAX_MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
}
# The settings a config class derives its layer_types from (Qwen2/3's windows, Gemma 2/3's local layers): an
# override of one of them derives the layer types again, as the class does when built with it.
LAYER_TYPE_SOURCES = ("num_hidden_layers", "use_sliding_window", "max_window_layers", "sliding_window_pattern")


# The special token each sequence-to-sequence family starts decoding from, by its own convention
# (transformers' config defaults and docs; tests/test_models.py checks them against the defaults):
# T5, mT5, LongT5, Pegasus and Marian start from pad, BART from eos, Blenderbot from bos, and an
# encoder-decoder from its decoder's bos (BERT-style tokenizers call it cls). mBART has no single start
# id: its decoder inputs begin with each summary's last token, so generation starts from the token
# the tokenizer ends every summary with ("last": eos, or mBART's language code). The first of the
# tokens the tokenizer has; pad when it has none.
DECODER_START_TOKENS = {
    "t5": ("pad",), "mt5": ("pad",), "longt5": ("pad",), "pegasus": ("pad",), "marian": ("pad",),
    "bart": ("eos",), "mbart": ("last",), "blenderbot": ("bos",), "blenderbot-small": ("bos",),
    "encoder-decoder": ("bos", "cls"),
}
LAST_TOKEN_STARTS_DECODER = ("mbart",)
# Families whose positions count from pad_token_id + 1, so their table holds that many fewer.
PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "roberta-prelayernorm")


def _hub_error(what, name, error):
    offline = hub_probe.offline_reason()
    if offline and not os.path.exists(name):
        return UsageError(f"could not load {what} {name!r}: it is neither a local path nor in the local cache, and "
                          f"{offline}; pass a local path or run where the hub is reachable")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = "a local directory" if os.path.isdir(name) else "a local directory or a hub id reachable from here"
    return UsageError(f"could not load {what} {name!r}: {first} (check it is {where}; offline, use a local path)")


def _parse_overrides(text):
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--config_overrides item {item!r} is not key=value (e.g. 'n_embd=64,n_layer=2')")
        overrides[key.strip()] = value.strip()
    return overrides


def _attribute(config, key):
    """The attribute of `config` that the setting `key` is kept in: `key`, or `_key` for a setting the class
    takes by that name and keeps privately (Gemma 3's sliding_window_pattern)."""
    name = key if hasattr(config, key) else "_" + key
    if not hasattr(config, name):
        raise UsageError(f"--config_overrides: {config.model_type} config has no attribute {key!r}")
    return name


def _apply_overrides(config, text):
    for key, value in _parse_overrides(text).items():
        name = _attribute(config, key)
        current = getattr(config, name)
        try:
            if isinstance(current, bool):
                value = value.lower() in ("1", "true", "yes")
            elif isinstance(current, (int, float)):
                value = type(current)(value)
            elif current is None:  # unset (Qwen's sliding_window): a number, true, false or null is one
                value = _literal(value)
        except ValueError:
            raise UsageError(f"--config_overrides: {key}={value!r} is not a {type(current).__name__}")
        setattr(config, name, value)
    return config


def _literal(text):
    """`text` as the JSON number, boolean or null it spells (any case), else as it is."""
    try:
        value = json.loads(text.lower() if text.lower() in ("true", "false", "null") else text)
    except json.JSONDecodeError:
        return text
    return value if value is None or isinstance(value, (bool, int, float)) else text


def _changed_by_overrides(config, text):
    """[(key, current value, overridden value)] for the overrides that differ from `config`'s values."""
    overridden = _apply_overrides(copy.deepcopy(config), text)
    names = {key: _attribute(config, key) for key in _parse_overrides(text)}
    return [(key, getattr(config, name), getattr(overridden, name)) for key, name in names.items()
            if getattr(overridden, name) != getattr(config, name)]


def load_config(model_args, task, model_types=None):
    """The model config from `config_name`, `model_name_or_path` or `model_type` (+ overrides).

    `model_types` narrows the families `task` allows to those a script supports (T5 span corruption:
    the T5 family only)."""
    allowed = model_types or (tuple(TASK_MODEL_TYPES[task]) + (family_model.FAMILY_TYPES if task == "causal-lm"
                                                                else ()))
    kwargs = dict(cache_dir=model_args.cache_dir, token=model_args.token, trust_remote_code=model_args.trust_remote_code)
    name = model_args.config_name or model_args.model_name_or_path
    if name:
        try:
            config = AutoConfig.from_pretrained(name, **kwargs)
        except (OSError, ValueError) as e:
            raise _hub_error("model config", name, e)
    elif model_args.model_type:
        try:
            config = AutoConfig.for_model(model_args.model_type)
        except ValueError:
            raise UsageError(f"unknown --model_type {model_args.model_type!r}: use one of {', '.join(allowed)}")
    else:
        raise UsageError("no model: pass --model_name_or_path, or --model_type/--config_name to train from scratch")
    if model_args.config_overrides and model_args.model_name_or_path:
        # A config file shared by training and evaluation holds the overrides the model was built with:
        # they are harmless as long as they agree with the pretrained config.
        changed = _changed_by_overrides(config, model_args.config_overrides)
        if changed:
            key, old, new = changed[0]
            raise UsageError(f"--config_overrides would change {key} from {old!r} to {new!r} in the config of "
                             f"{model_args.model_name_or_path}: overrides apply only when training from scratch "
                             "(without --model_name_or_path); drop them")
    elif model_args.config_overrides:
        config = _derived_again(_apply_overrides(config, model_args.config_overrides), model_args.config_overrides)
    if config.model_type not in allowed:
        scope = "" if model_types else f" ({task})"
        raise UsageError(f"model type {config.model_type!r} cannot be trained by this script{scope}: "
                         f"use one of {', '.join(allowed)}")
    decoder_positions.check(config)
    if family_model.routed(config):
        family_model.check(config, model_args.model_name_or_path)
    return config


def _derived_again(config, overrides):
    """`config` with its layer_types derived again where an override changed what they follow
    (`LAYER_TYPE_SOURCES`): set after the class built them, the overrides left 32 layer types on a 2-layer
    Qwen3."""
    given = _parse_overrides(overrides)
    if getattr(config, "layer_types", None) is None or "layer_types" in given or not set(given) & set(
            LAYER_TYPE_SOURCES):
        return config
    settings = {key: value for key, value in config.to_dict().items() if key != "layer_types"}
    # what the class keeps privately, given back under the name it takes
    settings.update({key: settings["_" + key] for key in LAYER_TYPE_SOURCES if "_" + key in settings})
    return type(config).from_dict(settings)


def _vocabulary_configs(config):
    """The configs that size a vocabulary: the config itself, or a composed model's (encoder-decoder) parts."""
    return [getattr(config, name) for name in config.sub_configs] or [config]


def _special_ids(config):
    """{attribute: id} of every special token the config or one of its parts names."""
    names = ("pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id", "forced_bos_token_id",
             "forced_eos_token_id")
    parts = [("", config)] + [(f"{sub}.", getattr(config, sub)) for sub in config.sub_configs]
    return {prefix + name: getattr(part, name) for prefix, part in parts for name in names
            if getattr(part, name, None) is not None}


def _token_id(tokenizer, role):
    if role == "last":
        ending = tokenizer(text_target="")["input_ids"]
        return ending[-1] if ending else None
    return getattr(tokenizer, f"{role}_token_id", None)


def fit_config_to_tokenizer(config, tokenizer, model_args):
    """A model built from scratch takes its vocabulary size and special ids from the tokenizer, and
    starts decoding by its family's convention (`DECODER_START_TOKENS`); explicit overrides stay.

    A pretrained model keeps its own, but must cover every id the tokenizer can produce: JAX
    does not bounds-check embedding lookups, so larger ids would silently read garbage.
    """
    vocabularies = _vocabulary_configs(config)
    if model_args.model_name_or_path:
        smallest = min(part.vocab_size for part in vocabularies)
        if len(tokenizer) > smallest:
            raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but the model only {smallest}: "
                             "use the model's own tokenizer (--tokenizer_name)")
        return config
    overridden = _parse_overrides(model_args.config_overrides or "")
    vocab_size = int(overridden.get("vocab_size", len(tokenizer)))
    special = {}
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        token_id = getattr(tokenizer, name, None)
        # A family default for a token the tokenizer lacks would name some other token: none then. Except
        # pad, which roberta-style positions need (the range check below still catches a meaningless one).
        keep = name in overridden or (token_id is None and name == "pad_token_id")
        special[name] = getattr(config, name) if keep else token_id
    # Generation forces these first / last where the family does: the tokenizer's bos / eos.
    forced = {"forced_bos_token_id": special["bos_token_id"], "forced_eos_token_id": special["eos_token_id"]}
    for part in [config] + [part for part in vocabularies if part is not config]:
        for name, token_id in special.items():
            setattr(part, name, token_id)
        for name, token_id in forced.items():
            if getattr(part, name, None) is not None and name not in overridden:
                setattr(part, name, token_id)
    for part in vocabularies:
        part.vocab_size = vocab_size
    roles = DECODER_START_TOKENS.get(config.model_type)
    if roles and "decoder_start_token_id" not in overridden:
        starts = [_token_id(tokenizer, role) for role in roles]
        config.decoder_start_token_id = next((i for i in starts if i is not None), config.pad_token_id)
    outside = {name: i for name, i in _special_ids(config).items() if not 0 <= i < vocab_size}
    if outside:
        listed = ", ".join(f"{name}={i}" for name, i in outside.items())
        raise UsageError(f"the {config.model_type} config names ids outside the tokenizer's {vocab_size} tokens "
                         f"({listed}), tokens the tokenizer lacks: use a tokenizer that has them, or set the ids "
                         "in --config_overrides")
    return config


def decoder_input_ids(labels, config):
    """The decoder inputs for `labels`: shifted one to the right behind the start token, exactly as the
    family's own `shift_tokens_right` builds them (in numpy: jnp's compile op by op, seconds on a CPU)."""
    labels = np.where(labels == -100, config.pad_token_id, labels)
    shifted = np.empty_like(labels)
    shifted[:, 1:] = labels[:, :-1]
    if config.model_type in LAST_TOKEN_STARTS_DECODER:
        last = np.count_nonzero(labels != config.pad_token_id, axis=1) - 1
        shifted[:, 0] = labels[np.arange(len(labels)), last]
    else:
        shifted[:, 0] = config.decoder_start_token_id
    return shifted


def max_positions(config):
    """The longest sequence the model's position embeddings cover; None when it has no table of them
    (relative positions of the T5 family, ALiBi of BLOOM)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and config.model_type in PADDING_OFFSET_POSITIONS:
        limit -= config.pad_token_id + 1
    return limit


def fit_length(value, limit, flag, logger):
    """`value`, lowered to `limit` with a warning: JAX does not bounds-check the position lookup, so
    longer sequences would silently compute with wrong positions."""
    if limit is not None and value is not None and value > limit:
        logger.warning("--%s %d is more than the model's %d positions: using %d", flag, value, limit, limit)
        return limit
    return value


def load_tokenizer(model_args, **kwargs):
    """The tokenizer of `--tokenizer_name` or the model; `kwargs` go to `from_pretrained` (add_prefix_space)."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if not name:
        raise UsageError("no tokenizer: pass --tokenizer_name (a new model needs an existing tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(
            name, cache_dir=model_args.cache_dir, use_fast=model_args.use_fast_tokenizer,
            token=model_args.token, trust_remote_code=model_args.trust_remote_code, **kwargs,
        )
    except (OSError, ValueError) as e:
        raise _hub_error("tokenizer", name, e)


def cast_floats(tree, dtype):
    """Every floating-point leaf of `tree` as `dtype` (host arrays, or traced ones inside a jit)."""
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _with_missing_initialised(model, params, name):
    """`params` plus fresh weights for what the checkpoint `name` lacks (a task head, say), made on the host."""
    expected, loaded = flatten_dict(unfreeze(model.params_shape_tree)), flatten_dict(params)
    missing = set(expected) - set(loaded)
    if not missing:
        return params
    logger.warning("weights of %s that %s lacks, initialised fresh (train them): %s", type(model).__name__, name,
                   ", ".join(sorted("/".join(key) for key in missing)))
    with weights.on_host():
        fresh = flatten_dict(jax.jit(model.init_weights, static_argnums=1)(model.key, model.input_shape))
    return unflatten_dict({**loaded, **{key: fresh[key] for key in missing}})


def _drop_mismatched_head(model, params, name):
    """`params` without the weights outside the base model whose shapes `model`'s differ from (a task
    head for another number of labels): they are initialised fresh, and a warning names them. A
    mismatch inside the base model means another config: the same error as any shape mismatch."""
    expected, loaded = flatten_dict(unfreeze(model.params_shape_tree)), flatten_dict(params)
    mismatched = sorted(key for key in set(expected) & set(loaded)
                        if tuple(loaded[key].shape) != tuple(expected[key].shape))
    in_body = [key for key in mismatched if key[0] == model.base_model_prefix]
    if in_body:
        key = in_body[0]
        raise weights.mismatch(name, f"{'/'.join(key)} has shape {tuple(loaded[key].shape)} where the model needs "
                                     f"{tuple(expected[key].shape)}.")
    if mismatched:
        logger.warning("weights of %s whose shapes do not fit %s (another number of labels), initialised fresh "
                       "(train them): %s", name, type(model).__name__,
                       ", ".join(f"{'/'.join(key)} {tuple(loaded[key].shape)} -> {tuple(expected[key].shape)}"
                                 for key in mismatched))
    return unflatten_dict({key: value for key, value in loaded.items() if key not in mismatched})


def _pretrained(auto_class, model_args, config, kwargs):
    """(model, host params) of the checkpoint `--model_name_or_path`, in whichever format it holds."""
    name = model_args.model_name_or_path
    filename, path = weights.find_weights(name, model_args.cache_dir, model_args.token)
    load_kwargs = dict(config=config, cache_dir=model_args.cache_dir, token=model_args.token, _do_init=False, **kwargs)
    if filename is None or filename in weights.FLAX_MSGPACK:
        # Flax weights (or nothing found, which transformers explains best): transformers reads them.
        try:
            with weights.on_host():  # its key (and any weights it reads) made on the host, not in a program of the chip
                return auto_class.from_pretrained(name, **load_kwargs)
        except ValueError:
            # FlaxVisionTextDualEncoderModel refuses to be built without its weights: it reads them on the host
            # (any other error comes back from this second try).
            with weights.on_host():
                model = auto_class.from_pretrained(name, **{**load_kwargs, "_do_init": True})
            return model, model.params
    # PyTorch or safetensors weights: the model from its config, the weights read here.
    model = _from_config(auto_class, config, kwargs)
    if model.can_generate():
        model.generation_config = _saved_generation_config(model_args) or model.generation_config
    return model, weights.read_converted(model, name, filename, path, model_args.cache_dir, model_args.token)


def _saved_generation_config(model_args):
    """The checkpoint's generation_config.json (its end ids: Llama 3 Instruct's or Gemma's several), which
    transformers reads itself only with Flax weights; None where there is none."""
    try:
        return GenerationConfig.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir,
                                                token=model_args.token)
    except OSError:
        return None


def _saved_config(model_args):
    name = model_args.model_name_or_path
    try:
        return AutoConfig.from_pretrained(name, cache_dir=model_args.cache_dir, token=model_args.token,
                                          trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as e:
        raise _hub_error("model config", name, e)


def _from_config(auto_class, config, kwargs):
    """The model of `config`, without weights where the family allows it."""
    try:
        with weights.on_host():  # transformers draws the model's key: on the chip that is three more programs
            return auto_class.from_config(config, _do_init=False, **kwargs)
    except ValueError:
        # FlaxEncoderDecoderModel refuses to be built without its weights: it makes them itself, on the host, in
        # one program where its class is known (not for remote code).
        mapping = auto_class._model_mapping
        drawn = init_in_one_program(mapping[type(config)]) if type(config) in mapping else contextlib.nullcontext()
        with weights.on_host(), drawn:
            return auto_class.from_config(config, **kwargs)


def load_model(auto_class, model_args, config, seed, layout, new_head_if_mismatched=False, added_groups=()):
    """(model, params): the model (its code and config, no weights) and its parameters, placed by
    `layout` (`utils.layout.layouts`): pretrained, or fresh ones from `config`.

    No device ever holds weights it would not hold in training: pretrained ones are read into host memory
    (`utils.models.weights`: any checkpoint format) and placed leaf by leaf; fresh ones come from one compiled init
    that writes them where they belong (transformers inits op by op, a hundred or so small programs compiled on
    every start); on one host, without adapters, a `utils.layout.layouts.Pending` of them, made while the train step
    compiles (`utils.layout.layouts.finished` waits for their values). `--dtype` is the compute dtype (activations); the
    weights are stored in `--param_dtype`, float32 master weights by default whatever the checkpoint holds (hub
    Flax weights are sometimes bf16). With `new_head_if_mismatched`, a pretrained head of other shapes than
    `config`'s (another number of labels) is replaced by a fresh one, with a warning (`_drop_mismatched_head`).
    Planning for a TPU (`layout.plan`), the parameters are shapes from `config` alone: no weights are read or
    made.

    With `--lora_rank`, the adapters `utils.models.lora` plans for the model are checked first, then added to
    the parameters (float32) and attached to the model; the frozen base is stored in `--lora_base_dtype`.
    `added_groups`: see `plan_adapters`. The architectures transformers 4.57 has no Flax class for run through
    the project's own decoder family (`utils.models.family_model`), read from a local hub checkpoint folder.
    """
    if family_model.routed(config):
        return _load_family_model(auto_class, model_args, config, seed, layout, added_groups)
    kwargs = dict(seed=seed, dtype=devices.to_dtype(model_args.dtype), trust_remote_code=model_args.trust_remote_code)
    # With LoRA, checked on the model of `config` before any weight is read
    adapters = plan_adapters(_from_config(auto_class, config, kwargs), model_args, auto_class.__name__, added_groups)
    cast = storage_cast(model_args, adapters)
    if model_args.model_name_or_path and not layout.plan:
        name = model_args.model_name_or_path
        # Read with the checkpoint's own config, whose shapes its weights have; then fitted to `config`'s.
        saved_config = _saved_config(model_args) if new_head_if_mismatched else config
        try:
            model, params = _pretrained(auto_class, model_args, saved_config, kwargs)
        except (OSError, ValueError) as e:
            raise _hub_error("model", name, e)
        if new_head_if_mismatched:
            model = _from_config(auto_class, config, kwargs)
            params = _drop_mismatched_head(model, params, name)
        params = _with_missing_initialised(model, params, name)
        params = layout.place_params(cast(params))
    else:
        model = _from_config(auto_class, config, kwargs)
        if model._is_initialized and not layout.plan:
            params = layout.place_params(cast(model.params))
        else:
            init = lambda key: cast(model.init_weights(key, model.input_shape))  # noqa: E731
            key = np.asarray(model.key)  # the seed's: an argument, so the program serves every seed
            # Without adapters to join, made while the train step compiles (`utils.layout.layouts.Pending`)
            params = layout.init_params(init, key) if adapters else layout.init_params_in_background(init, key)
    return with_adapters(model, params, adapters, model_args, seed, layout)


def _load_family_model(auto_class, model_args, config, seed, layout, added_groups):
    """`load_model` for the architectures the project's own decoder family runs (`utils.models.family_model`):
    the weights of a local hub checkpoint folder (safetensors, PyTorch names, any float dtype) and its
    generation_config.json, or fresh ones from `config` drawn from `seed`; stored, placed and adapted as
    `load_model` does for the others."""
    model = family_model.FamilyModel(config, devices.to_dtype(model_args.dtype))
    adapters = plan_adapters(model, model_args, auto_class.__name__, added_groups)
    cast = storage_cast(model_args, adapters)
    if model_args.model_name_or_path and not layout.plan:
        params = model.read_params(model_args.model_name_or_path)
        model.generation_config = _saved_generation_config(model_args) or model.generation_config
        params = layout.place_params(cast(params))
    else:
        init = lambda key: cast(model.init_weights(key))  # noqa: E731
        with jax.default_device(devices.host_cpu()):
            key = np.asarray(jax.random.PRNGKey(seed))  # an argument, so the program serves every seed
        params = layout.init_params(init, key) if adapters else layout.init_params_in_background(init, key)
    return with_adapters(model, params, adapters, model_args, seed, layout)


def plan_adapters(model, model_args, class_name, added_groups=()):
    """The `utils.models.lora.Adapters` of --lora_rank for `model` (built from `class_name`), checked; None
    without --lora_rank. `added_groups`: top-level parameter groups a task adds beside the model's (a
    head the stock model lacks), trained in full."""
    return lora.plan(model, model_args, class_name, added_groups) if model_args.lora_rank else None


def storage_cast(model_args, adapters):
    """params -> params in the dtypes they are stored in: --param_dtype; with LoRA the frozen base in
    --lora_base_dtype (the heads in --param_dtype)."""
    param_dtype = jnp.dtype(model_args.param_dtype)
    if adapters is None:
        return lambda params: cast_floats(params, param_dtype)
    base_dtype = jnp.dtype(model_args.lora_base_dtype or model_args.param_dtype)
    return lambda params: {name: cast_floats(group, param_dtype if name in adapters.heads else base_dtype)
                           for name, group in params.items()}


def with_adapters(model, params, adapters, model_args, seed, layout):
    """(model, params): with `adapters` (None: as they are), fresh adapters (float32, placed by `layout`;
    a PEFT adapter's with --model_name_or_path ADAPTER_DIR) joined to `params` and attached to `model`."""
    if adapters is None:
        return model, params
    new = lora.new_weights(adapters, seed, shapes_only=bool(layout.plan))
    if model_args.lora_adapter_dir and not layout.plan:  # continuing a PEFT adapter: its weights and heads
        loaded = lora.load_peft_weights(model_args.lora_adapter_dir, adapters, lora.join(new, params))
        new = unflatten_dict({**flatten_dict(new), **{k: v for k, v in loaded.items() if k[-1] in lora.ADAPTER_LEAVES}})
        heads = {k: v.astype(model_args.param_dtype) for k, v in loaded.items() if k[-1] not in lora.ADAPTER_LEAVES}
        if heads:
            params = lora.join(layout.place_params(unflatten_dict(heads)), params)
        logger.info("LoRA: continuing the adapter in %s", model_args.lora_adapter_dir)
    lora.attach(model, adapters)
    logger.info("LoRA: rank %d, alpha %g, adapters on %d layers (%s), trained in full: %s", adapters.rank,
                adapters.alpha, len(adapters.targets), adapters.target_rule, ", ".join(adapters.heads) or "nothing else")
    return model, lora.join(new if layout.plan else layout.place_params(new), params)


def pretrained_params(auto_class, model_args, config, seed):
    """Host parameters of the checkpoint `--model_name_or_path` (any format) read with `config`, the
    weights it lacks initialised fresh (a warning names them): what a model composed of pretrained
    parts (a dual encoder's text and vision encoders) is assembled from."""
    kwargs = dict(seed=seed, dtype=devices.to_dtype(model_args.dtype), trust_remote_code=model_args.trust_remote_code)
    name = model_args.model_name_or_path
    try:
        model, params = _pretrained(auto_class, model_args, config, kwargs)
    except (OSError, ValueError) as e:
        raise _hub_error("model", name, e)
    return _with_missing_initialised(model, params, name)


def _overlaid(fresh, loaded, name, what):
    """`fresh` parameters with `loaded`'s in their place; a warning names what `loaded` lacks (kept fresh)."""
    fresh, loaded = flatten_dict(unfreeze(fresh)), flatten_dict(loaded)
    missing = sorted("/".join(key) for key in set(fresh) - set(loaded))
    if missing:
        logger.warning("weights of %s that %s lacks, initialised fresh (train them): %s", what, name,
                       ", ".join(missing))
    return unflatten_dict({**fresh, **{key: loaded[key] for key in set(fresh) & set(loaded)}})



# ----------------------------------------------------------------------------------------------
# A model joined from an encoder and a decoder (`utils.base.arguments.EncoderDecoderModelArguments`):
# FlaxVisionEncoderDecoderModel (captioning), FlaxSpeechEncoderDecoderModel (speech recognition)
# ----------------------------------------------------------------------------------------------
PART_FLAGS = ("model_name_or_path", "config_name", "model_type", "config_overrides")


def part_arguments(model_args, part):
    """The `ModelArguments` of the encoder or decoder (`part`), from the --{part}_* flags."""
    return dataclasses.replace(model_args, **{what: getattr(model_args, f"{part}_{what}") for what in PART_FLAGS})


def arguments_of(model_args, part):
    """Where the run reads what comes with `part` (the decoder: the tokenizer; the encoder: the image
    processor or feature extractor): `model_args` for a saved joined model, else the part's own arguments."""
    return model_args if model_args.model_name_or_path else part_arguments(model_args, part)


def pretrained_part(model_args, part):
    """The arguments naming the checkpoint of `part` ("encoder", "decoder"), or None: a part of a saved
    joined model, or one built from its config."""
    if model_args.model_name_or_path or not getattr(model_args, f"{part}_model_name_or_path"):
        return None
    return part_arguments(model_args, part)


def joins_parts(model_args):
    """Whether any --encoder_* / --decoder_* flag is given (a model to join from its parts)."""
    return any(getattr(model_args, f"{part}_{what}") for part in ("encoder", "decoder") for what in PART_FLAGS)


def check_joined_arguments(model_args, what):
    """A saved `what` (e.g. "captioning model"), or an encoder and a decoder each from a checkpoint or a
    config; every local path named exists. Runs before any work; the hub is probed for the names that are
    not paths."""
    given = [f"{part}_{flag}" for part in ("encoder", "decoder") for flag in PART_FLAGS
             if getattr(model_args, f"{part}_{flag}")]
    if model_args.model_name_or_path:
        if given:
            raise UsageError(f"--model_name_or_path loads a saved {what}; --{given[0]} builds a new one: "
                             "pass one or the other")
        return
    if model_args.model_type or model_args.config_overrides:
        raise UsageError(f"--model_type and --config_overrides name no part of a {what}: use "
                         "--encoder_model_type / --decoder_model_type and --encoder_config_overrides / "
                         "--decoder_config_overrides")
    for part in ("encoder", "decoder"):
        if not any(getattr(model_args, f"{part}_{flag}") for flag in ("model_name_or_path", "config_name",
                                                                        "model_type")):
            raise UsageError(f"no {part}: pass --{part}_model_name_or_path (a pretrained {part}), --{part}_config_name "
                             f"or --{part}_model_type, or --model_name_or_path (a saved {what})")
    names = {flag: getattr(model_args, flag) for flag in ("encoder_model_name_or_path", "encoder_config_name",
                                                          "decoder_model_name_or_path", "decoder_config_name")}
    for flag, name in names.items():
        if name and hub_probe.looks_like_path(name) and not os.path.exists(name):
            raise UsageError(f"--{flag} {name} not found: check the path")
    hub_probe.check_access(names.values())


class SpecialTokens(NamedTuple):
    start: int  # the decoder's first input
    end: int  # closes every target; generation stops there
    pad: int


def special_tokens(tokenizer):
    """The start (bos, else cls), end (eos, else sep) and pad (pad, else the end) ids of `tokenizer`."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if start is None or end is None:
        raise UsageError("the tokenizer has no start token (bos or cls) or no end token (eos or sep) for the "
                         "decoder: use a tokenizer that has both (--tokenizer_name)")
    return SpecialTokens(start, end, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end)


def join_configs(config_class, model_args, tokenizer, encoder_types, decoder_types):
    """The `config_class` (e.g. `VisionEncoderDecoderConfig`): the saved joined model's
    (--model_name_or_path), or one joining the encoder's config and the decoder's (made a decoder with
    cross-attention, fitted to the tokenizer when new), each of the families allowed, its start, end
    and pad ids the tokenizer's (`special_tokens`)."""
    if model_args.model_name_or_path:
        config = load_config(model_args, None, model_types=(config_class.model_type,))
        fit_config_to_tokenizer(config.decoder, tokenizer, model_args)  # the tokenizer's ids fit its vocabulary
        return config
    encoder = load_config(part_arguments(model_args, "encoder"), None, model_types=encoder_types)
    decoder_args = part_arguments(model_args, "decoder")
    decoder = load_config(decoder_args, None, model_types=decoder_types)
    encoder.is_decoder, encoder.add_cross_attention = False, False
    decoder.is_decoder, decoder.add_cross_attention = True, True
    decoder = fit_config_to_tokenizer(decoder, tokenizer, decoder_args)
    config = config_class.from_encoder_decoder_configs(encoder, decoder)
    tokens = special_tokens(tokenizer)
    config.decoder_start_token_id, config.eos_token_id, config.pad_token_id = tokens.start, tokens.end, tokens.pad
    config.decoder.pad_token_id = tokens.pad
    return config


@contextlib.contextmanager
def init_in_one_program(model_class):
    """Models of `model_class` built inside make their fresh weights in one compiled program. transformers
    builds a composed model only with weights, drawn op by op: ~180 small programs compiled at every start
    (7.6 s for a tiny ViT + GPT-2 on a 2-core CPU, 3.2 s as one program). The same random draws (float32
    rounding apart); the class is restored on leaving."""
    draw = model_class.init_weights

    def init_weights(self, rng, input_shape, params=None):
        if params is not None:  # weights to complete: as transformers does it
            return draw(self, rng, input_shape, params)
        return jax.jit(lambda rng: draw(self, rng, input_shape))(rng)

    model_class.init_weights = init_weights
    try:
        yield
    finally:
        model_class.init_weights = draw


def load_composed_model(model_class, config, model_args, parts, seed, layout):
    """(model, params) of a model made of others (`FlaxVisionEncoderDecoderModel`): the whole
    checkpoint --model_name_or_path, or each part's. `parts` maps a part's name (its sub-config and
    its parameters' key: "encoder", "decoder") to (the Auto class that reads its checkpoint, the
    `ModelArguments` naming that checkpoint, or None for a part from its config alone).

    transformers builds such a model only with weights (`_do_init=False` is refused), so it is made on the host
    with fresh ones (`init_in_one_program`); pretrained weights, in any checkpoint format (`utils.models.weights`),
    then replace them part by part, and what a part's checkpoint lacks (a GPT-2's cross-attention) stays fresh,
    with a warning. Weights are stored in --param_dtype and placed by `layout` like `load_model`'s; planning for
    a TPU, only their shapes are kept. With `--lora_rank`, adapters as `load_model`'s (a GPT-2 decoder's
    cross-attention among the attention layers)."""
    kwargs = dict(seed=seed, dtype=devices.to_dtype(model_args.dtype))
    name = model_args.model_name_or_path
    with weights.on_host(), init_in_one_program(model_class):
        if name and not layout.plan:
            filename, path = weights.find_weights(name, model_args.cache_dir, model_args.token)
            try:
                if filename is None or filename in weights.FLAX_MSGPACK:
                    model = model_class.from_pretrained(name, config=config, cache_dir=model_args.cache_dir,
                                                        token=model_args.token, **kwargs)
                    params = model.params
                else:
                    model = model_class(config, **kwargs)
                    loaded = weights.read_converted(model, name, filename, path, model_args.cache_dir,
                                                    model_args.token)
                    params = _overlaid(model.params, loaded, name, type(model).__name__)
            except (OSError, ValueError) as e:
                raise _hub_error("model", name, e)
        else:
            model = model_class(config, **kwargs)
            params = unfreeze(model.params)
            for part, (auto_class, part_args) in parts.items():
                if part_args is None or layout.plan:
                    continue
                part_name = part_args.model_name_or_path
                try:
                    _, loaded = _pretrained(auto_class, part_args, getattr(config, part), dict(kwargs))
                except (OSError, ValueError) as e:
                    raise _hub_error(f"{part} model", part_name, e)
                params[part] = _overlaid(params[part], loaded, part_name, f"the {part}")
    adapters = plan_adapters(model, model_args, model_class.__name__)
    cast = storage_cast(model_args, adapters)
    params = layout.init_params(lambda: cast(model.params)) if layout.plan else layout.place_params(cast(params))
    return with_adapters(model, params, adapters, model_args, seed, layout)


def enable_gradient_checkpointing(model, policy="nothing"):
    """--gradient_checkpointing: recompute each layer's activations in the backward pass, keeping what
    `policy` (--gradient_checkpointing_policy) says. The families transformers implements it for do it
    their way where a layer keeps nothing; the others (GPT-2, Llama, OPT, BART, ..., the project's own decoder
    family), and every family under another policy, get each layer of their stacks checkpointed by
    `utils.models.remat`."""
    own = getattr(type(model), "enable_gradient_checkpointing", None)  # none on the family's models
    transformers_lacks_it = own is None or own is FlaxPreTrainedModel.enable_gradient_checkpointing
    if policy != "nothing" or transformers_lacks_it:
        remat.remat_layers(model, policy)
    else:
        model.enable_gradient_checkpointing()  # a new module: LoRA's adapters are attached to it again
        adapters = lora.adapters_of(model)
        if adapters:
            lora.attach(model, adapters)
