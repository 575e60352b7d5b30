"""Pretrained weights in every format a checkpoint comes in, read into host memory as Flax parameters.

transformers 4.x reads Flax msgpack (whole or sharded) and Flax safetensors without building the
model's weights (`_do_init=False`), but its PyTorch-to-Flax conversion asks the model for its weights
(`model.params`), which such a model does not have, and it cannot read sharded safetensors at all.
Most hub checkpoints are PyTorch weights in `model.safetensors` (sharded for large models), so those
formats are read here: the tensors into host memory, renamed by transformers' own PyTorch-to-Flax
rules against the model's parameter shapes, never through an accelerator.
"""

import json
import logging
import os

import jax
from flax.core.frozen_dict import unfreeze
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors import safe_open
from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax
from transformers.utils import cached_file

from utils.base.errors import UsageError

logger = logging.getLogger(__name__)

# The files a checkpoint's weights can be in, in the order transformers' Flax loader prefers them.
FLAX_MSGPACK = ("flax_model.msgpack", "flax_model.msgpack.index.json")
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
TORCH_BIN = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def on_host():
    """Where weights that must be made whole are made: the host's CPU device, never an accelerator."""
    return jax.default_device(jax.local_devices(backend="cpu")[0])


def find_weights(name, cache_dir=None, token=None):
    """(file name, local path) of the checkpoint's weights: the first of the known weight files that
    the local directory or hub repository `name` holds, or (None, None)."""
    for filename in FLAX_MSGPACK + SAFETENSORS + TORCH_BIN:
        path = cached_file(name, filename, cache_dir=cache_dir, token=token,
                           _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
        if path:
            return filename, path
    return None, None


def _shard_paths(name, index_path, cache_dir, token):
    """The local paths of every shard an index names (downloaded into the cache for a hub id)."""
    with open(index_path, encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    paths = []
    for shard in shards:
        path = cached_file(name, shard, cache_dir=cache_dir, token=token,
                           _raise_exceptions_for_missing_entries=False)
        if not path:
            raise UsageError(f"the checkpoint {name!r} names weight shard {shard!r} in {os.path.basename(index_path)} "
                             "but does not hold it: download the checkpoint again")
        paths.append(path)
    return paths


def _read_safetensors(paths):
    """({name: host array}, format) of safetensors files: "pt" for PyTorch names, "flax" for Flax ones."""
    tensors, formats = {}, set()
    for path in paths:
        with safe_open(path, framework="flax") as f:  # "flax": numpy has no bfloat16
            formats.add((f.metadata() or {}).get("format", "pt"))
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    if len(formats) > 1:
        raise UsageError(f"the checkpoint's safetensors shards mix formats ({', '.join(sorted(formats))}): "
                         "save it again with save_pretrained")
    return tensors, formats.pop()


def _read_torch(paths):
    """{name: torch tensor} of PyTorch `.bin` files (pickles: only torch can read them)."""
    try:
        import torch
    except ImportError:
        raise UsageError("the checkpoint holds its weights only as pytorch_model.bin, which needs PyTorch to read: "
                         "pip install torch (the CPU build is enough), or save the model as safetensors")
    tensors = {}
    for path in paths:
        tensors.update(torch.load(path, map_location="cpu", weights_only=True))
    return tensors


class _ShapesOnly:
    """What transformers' PyTorch-to-Flax conversion reads of a model: its parameter tree, for which
    the shapes are enough, and the name of its base model."""

    def __init__(self, model):
        self.params = unfreeze(model.params_shape_tree)
        self.base_model_prefix = model.base_model_prefix


def _from_flax_names(tensors, model):
    """Flax safetensors hold `a.b.c` names of the tree; a base model's weights fit a model with a
    head under its base-model prefix, and the other way round, as transformers' loader does."""
    state = unflatten_dict(tensors, sep=".")
    expected, prefix = unfreeze(model.params_shape_tree), model.base_model_prefix
    if prefix not in expected and prefix in state:
        return state[prefix]
    if prefix in expected and prefix not in state:
        return {prefix: state}
    return state


def _matched_to_model(state, model, name):
    """`state` with what the model has no place for dropped (named in a warning) and every shape
    checked; what the checkpoint lacks is left for the caller to initialise."""
    expected, loaded = flatten_dict(unfreeze(model.params_shape_tree)), flatten_dict(state)
    unexpected = sorted(set(loaded) - set(expected))
    if unexpected:
        logger.warning("weights of %s that %s has no place for, left out: %s", name, type(model).__name__,
                       ", ".join("/".join(key) for key in unexpected))
    for key in set(loaded) & set(expected):
        if tuple(loaded[key].shape) != tuple(expected[key].shape):
            raise mismatch(name, f"{'/'.join(key)} has shape {tuple(loaded[key].shape)} where the model needs "
                                  f"{tuple(expected[key].shape)}.")
    return unflatten_dict({key: loaded[key] for key in set(loaded) & set(expected)})


def read_converted(model, name, filename, path, cache_dir=None, token=None):
    """The Flax parameters (host arrays) of a safetensors or PyTorch `.bin` checkpoint, whole or sharded."""
    paths = _shard_paths(name, path, cache_dir, token) if filename.endswith(".index.json") else [path]
    with on_host():
        if filename in SAFETENSORS:
            tensors, kind = _read_safetensors(paths)
        else:
            tensors, kind = _read_torch(paths), "pt"
        logger.info("reading %s weights from %s (%d tensors in %d file%s)", "PyTorch" if kind == "pt" else "Flax",
                    filename, len(tensors), len(paths), "" if len(paths) == 1 else "s")
        try:
            state = (convert_pytorch_state_dict_to_flax(tensors, _ShapesOnly(model)) if kind == "pt"
                     else _from_flax_names(tensors, model))
        except ValueError as e:  # the conversion checks every shape it renames
            raise mismatch(name, str(e))
    return _matched_to_model(state, model, name)


def mismatch(name, detail):
    return UsageError(f"the weights of {name!r} do not fit the model: {detail} The config does not match the "
                      "checkpoint: use the checkpoint's own config (no --config_name, no --config_overrides)")
