"""A Flax model's export, its msgpack weights written leaf by leaf.

transformers' `save_pretrained` writes what `flax.serialization.to_bytes` returns: the whole file built in
memory, each array copied twice on the way. Exporting the Llama row's 455M float32 parameters (1.7 GiB) took
5 GiB of a TPU host's memory above the parameters themselves. `save_pretrained` here writes the same files,
byte for byte, streamed: each array's data goes to the file from its own memory, after a header of a few
bytes.
"""

import json
import os
import struct

import msgpack
import numpy as np
from flax import serialization
from flax.traverse_util import unflatten_dict
from transformers.dynamic_module_utils import custom_object_save
from transformers.modeling_flax_utils import flax_shard_checkpoint
from transformers.utils import FLAX_WEIGHTS_INDEX_NAME

NDARRAY = 1  # flax's msgpack extension type of an array (`flax.serialization._MsgpackExtType.ndarray`)
CHUNKED = "__msgpack_chunked_array__"  # marks flax's form of an array over `serialization.MAX_CHUNK_SIZE` bytes


def save_pretrained(model, directory, params, max_shard_size="10GB"):
    """What `model.save_pretrained(directory, params=params)` writes (transformers 4.x: the config, the
    generation config of a model that generates, the weights in `flax_model.msgpack`, or in shards of at most
    `max_shard_size` with their index), with the weights streamed."""
    model.config.architectures = [type(model).__name__[len("Flax"):]]
    if model._auto_class is not None:  # a model of --trust_remote_code: its code goes beside it
        custom_object_save(model, directory, config=model.config)
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)
    shards, index = flax_shard_checkpoint(params, max_shard_size)
    if index is None:
        shards = {name: params for name in shards}  # one file: the tree as it is, not its flattened copy
    else:
        with open(os.path.join(directory, FLAX_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        shards = {name: unflatten_dict(shard, sep="/") for name, shard in shards.items()}
    for name, tree in shards.items():
        with open(os.path.join(directory, name), "wb") as f:
            write(f, serialization.to_state_dict(tree))


def write(f, tree):
    """Write `tree` (a state dict: nested dicts of arrays) to the binary file `f`: the bytes that
    `flax.serialization.msgpack_serialize(tree)` returns."""
    if isinstance(tree, dict):
        f.write(_map_header(len(tree)))
        for key, value in tree.items():
            f.write(msgpack.packb(key))
            write(f, value)
    elif hasattr(tree, "__array__") and not isinstance(tree, np.generic):
        array = np.asarray(tree)
        if array.nbytes > serialization.MAX_CHUNK_SIZE:
            write(f, _chunked(array))
        else:
            _write_array(f, array)
    else:  # a scalar: packed whole, as flax packs it
        f.write(serialization.msgpack_serialize(tree))


def _write_array(f, array):
    if array.dtype.hasobject or array.dtype.isalignedstruct:
        raise ValueError(f"an array of dtype {array.dtype} has no msgpack form")
    array = array if array.flags.c_contiguous else array.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
    # flax's form: the extension holds msgpack's (shape, dtype name, raw bytes)
    inner = (b"\x93" + msgpack.packb(array.shape) + msgpack.packb(array.dtype.name)
             + _sized_header(array.nbytes, (0xc4, 0xc5, 0xc6)))
    f.write(_ext_header(len(inner) + array.nbytes, NDARRAY) + inner)
    f.write(array.reshape(-1).view(np.uint8))


def _chunked(array):
    """flax's canonical form of an array over `MAX_CHUNK_SIZE` bytes: its flat data in chunks (views)."""
    size = max(1, int(serialization.MAX_CHUNK_SIZE / array.dtype.itemsize))
    flat = array.reshape(-1)
    chunks = [flat[i:i + size] for i in range(0, flat.size, size)]
    return {CHUNKED: True, "shape": {str(i): n for i, n in enumerate(array.shape)},
            "chunks": {str(i): chunk for i, chunk in enumerate(chunks)}}


def _map_header(n):
    if n < 16:
        return bytes([0x80 | n])
    return struct.pack(">BH", 0xde, n) if n < 2**16 else struct.pack(">BI", 0xdf, n)


def _sized_header(n, codes):
    """msgpack's header of `n` bytes of str/bin/ext data: 8-, 16- or 32-bit length (`codes`, in that order)."""
    if n < 2**8:
        return struct.pack(">BB", codes[0], n)
    return struct.pack(">BH", codes[1], n) if n < 2**16 else struct.pack(">BI", codes[2], n)


def _ext_header(n, kind):
    fixed = {1: 0xd4, 2: 0xd5, 4: 0xd6, 8: 0xd7, 16: 0xd8}
    if n in fixed:
        return bytes([fixed[n], kind])
    return _sized_header(n, (0xc7, 0xc8, 0xc9)) + bytes([kind])
