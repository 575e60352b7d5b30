"""Hub checkpoints of PyTorch-named safetensors, read into and written from a Flax parameter tree
that mirrors the PyTorch names (the decoder family's, `utils.models.decoders`).

The names convert by rule: `model.layers.3.mlp.up_proj.weight` is ("model", "layers", "3", "mlp",
"up_proj", "kernel"), transposed (a Linear's weight is [out, in], a Dense kernel [in, out]); an
embedding's weight is its "embedding"; norms' weights and biases keep their names. Reading goes
shard by shard and tensor by tensor on the host, each checked against the tree the model expects;
writing gives each tensor its PyTorch name, shape and dtype, in shards of at most `max_shard_bytes`
with transformers' index, beside the config.json the checkpoint came with, so PyTorch transformers'
`AutoModelForCausalLM.from_pretrained` loads it as it is.
"""

import json
import os
import re

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors import safe_open
from safetensors.flax import save_file

from utils.base.errors import UsageError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Buffers some older PyTorch checkpoints saved beside their weights; nothing the model reads.
_NOT_PARAMETERS = re.compile(r".*\.rotary_emb\.inv_freq$")


def _pytorch_name(path):
    return ".".join(list(path[:-1]) + ["bias" if path[-1] == "bias" else "weight"])


def pytorch_names(shapes):
    """{PyTorch name: (Flax path, transposed)} of every leaf of a parameter tree (`shapes` may hold
    arrays or jax.ShapeDtypeStruct leaves)."""
    return {_pytorch_name(path): (path, path[-1] == "kernel") for path in flatten_dict(shapes)}


def weight_files(folder):
    """The safetensors files of a checkpoint folder: model.safetensors, or the shards its index names."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [shard for shard in shards if not os.path.isfile(os.path.join(folder, shard))]
        if missing:
            raise UsageError(f"{folder!r} names weight shards it does not hold ({', '.join(missing)}) in {INDEX}: "
                             "download the checkpoint again")
        return [os.path.join(folder, shard) for shard in shards]
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return [os.path.join(folder, WEIGHTS)]
    raise UsageError(f"{folder!r} holds neither {WEIGHTS} nor {INDEX}: point at a hub checkpoint saved as safetensors")


def read_checkpoint(folder, shapes, tied_head="lm_head.weight"):
    """The parameter tree of the checkpoint in `folder` (host arrays in the checkpoint's dtype) for a
    model whose tree is `shapes`. A name it does not expect, a missing one, or a shape that differs
    stops with a `UsageError` naming it; `tied_head`, which some checkpoints of tied models hold too,
    is left out where the tree has no head of its own."""
    names = pytorch_names(shapes)
    expected = flatten_dict(shapes)
    params, unexpected = {}, []
    cpu = jax.local_devices(backend="cpu")[0]
    for path in weight_files(folder):
        # "flax": numpy has no bfloat16 of its own; the arrays stay on the host's CPU
        with jax.default_device(cpu), safe_open(path, framework="flax") as f:
            for name in f.keys():
                if name not in names:
                    if not (_NOT_PARAMETERS.match(name) or name == tied_head):
                        unexpected.append(name)
                    continue
                flax_path, transposed = names[name]
                tensor = np.asarray(f.get_tensor(name))
                tensor = tensor.T if transposed else tensor
                if tensor.shape != tuple(expected[flax_path].shape):
                    shape = tensor.T.shape if transposed else tensor.shape
                    want = expected[flax_path].shape[::-1] if transposed else expected[flax_path].shape
                    raise UsageError(f"the checkpoint's {name} has shape {list(shape)} where the config makes "
                                     f"{list(want)}: the weights and config.json are of different models")
                params[flax_path] = tensor
    if unexpected:
        raise UsageError(f"the checkpoint in {folder!r} holds weights the config's model does not have "
                         f"({', '.join(sorted(unexpected)[:5])}): the weights and config.json are of different models")
    missing = sorted(name for name, (path, _) in names.items() if path not in params)
    if missing:
        raise UsageError(f"the checkpoint in {folder!r} lacks {', '.join(missing[:5])}: the weights and config.json "
                         "are of different models")
    return unflatten_dict(params)


def write_checkpoint(params, folder, hub_config, max_shard_bytes=5 * 1024**3):
    """Write `params` as PyTorch-named safetensors (each tensor in its own dtype) and `hub_config` as
    config.json into `folder`; more than `max_shard_bytes` of weights go into shards with an index."""
    os.makedirs(folder, exist_ok=True)
    names = pytorch_names(params)
    flat = flatten_dict(params)
    shards, sizes, current = [], [], {}
    for name in sorted(names):
        path, transposed = names[name]
        tensor = np.asarray(flat[path])
        size = tensor.nbytes
        if current and sum(sizes) + size > max_shard_bytes:
            shards.append(current)
            current, sizes = {}, []
        current[name] = path, transposed
        sizes.append(size)
    shards.append(current)
    files = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    weight_map, total = {}, 0
    for file, shard in zip(files, shards):
        # one shard's tensors at a time, each a host copy in PyTorch's [out, in] order
        tensors = {}
        for name, (path, transposed) in shard.items():
            tensor = np.asarray(flat[path])
            tensors[name] = np.ascontiguousarray(tensor.T if transposed else tensor)
            total += tensors[name].nbytes
            weight_map[name] = file
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
    if len(files) > 1:
        with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
            f.write("\n")
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hub_config, f, indent=2, sort_keys=True)
        f.write("\n")
