"""utils/models/flax_msgpack.py: the export's files are transformers' own, byte for byte, written without building them
in memory."""

import io
import os
import tracemalloc

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import serialization
from transformers import BertConfig, FlaxBertForSequenceClassification, FlaxGPT2LMHeadModel, GPT2Config

from utils.models import flax_msgpack


def streamed(tree):
    f = io.BytesIO()
    flax_msgpack.write(f, serialization.to_state_dict(tree))
    return f.getvalue()


def test_write_gives_flax_bytes_for_every_kind_of_leaf():
    rng = np.random.default_rng(0)
    tree = {"layer": {"kernel": rng.normal(size=(3, 5)).astype(np.float32), "ids": np.arange(7, dtype=np.int32)},
            "bf16": rng.normal(size=(40, 33)).astype(ml_dtypes.bfloat16), "empty": np.zeros((0, 4)),
            "zero_d": np.array(3.5), "jax": jnp.ones((2, 2)), "np_scalar": np.float32(2), "python": 3,
            "strided": np.arange(12.0).reshape(3, 4).T, "bin16": np.ones(70000, np.uint8)}
    tree.update({f"bytes{n}": np.ones(n, np.uint8) for n in range(1, 40)})  # every ext and bin header size
    tree.update({f"map{n}": {str(i): np.ones(i) for i in range(n)} for n in (0, 15, 16, 20)})
    tree["big_map"] = {str(i): np.float32(i) for i in range(70000)}  # a map header of 32 bits
    assert streamed(tree) == serialization.to_bytes(tree)


def test_arrays_over_flax_chunk_size_are_chunked_as_flax_chunks_them(monkeypatch):
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", 100)
    tree = {"x": np.arange(1000, dtype=np.float32).reshape(10, 100), "y": np.ones(3)}
    assert streamed(tree) == serialization.to_bytes(tree)
    np.testing.assert_array_equal(serialization.msgpack_restore(streamed(tree))["x"], tree["x"])


@pytest.mark.parametrize("make, shard", [
    (lambda: FlaxGPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100), seed=0), "10GB"),
    (lambda: FlaxGPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100), seed=0), "20KB"),
    (lambda: FlaxBertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=37, vocab_size=99), seed=0), "10GB"),
])
def test_save_pretrained_writes_transformers_files(tmp_path, make, shard):
    """One file, shards with their index, a model that generates (its generation config) and one that does not."""
    model = make()
    params = model.params
    model.save_pretrained(tmp_path / "transformers", params=params, max_shard_size=shard)
    os.makedirs(tmp_path / "ours")
    flax_msgpack.save_pretrained(make(), tmp_path / "ours", params, max_shard_size=shard)
    names = sorted(os.listdir(tmp_path / "transformers"))
    assert sorted(os.listdir(tmp_path / "ours")) == names
    assert len(names) > (4 if shard == "20KB" else 1)
    for name in names:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "transformers" / name).read_bytes(), name


def test_write_allocates_no_copy_of_the_weights():
    """flax's `to_bytes` holds ~3 copies of the weights at its peak (Llama row on a TPU host: 5 GiB for 1.7 GiB)."""
    tree = {"a": np.ones((4, 1 << 20), np.float32), "b": {"c": np.ones((2, 1 << 20), np.float32)}}  # 24 MiB
    with open(os.devnull, "wb") as f:
        tracemalloc.start()
        try:
            flax_msgpack.write(f, tree)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 2**20, f"{peak / 2**20:.1f} MiB allocated to write 24 MiB of weights"
