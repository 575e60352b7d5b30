"""utils/models/weights.py: pretrained weights in the formats checkpoints come in, loaded as transformers loads them.

Each checkpoint is written here the way it is found on the hub: PyTorch names and `format: pt`
metadata in `model.safetensors` (whole, bfloat16, or sharded with an index), Flax safetensors,
sharded Flax msgpack. The reference is transformers' own `from_pretrained` with `_do_init=True`,
the path that builds the model's weights first and so converts PyTorch weights.
"""

import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.flax
import safetensors.numpy
from flax.traverse_util import flatten_dict
from transformers import (AutoConfig, BartConfig, BertConfig, FlaxAutoModelForCausalLM, FlaxAutoModelForMaskedLM,
                          FlaxAutoModelForSeq2SeqLM, FlaxAutoModelForSequenceClassification, FlaxBertModel,
                          GPT2Config)

from script_runner import ROOT, read_metrics, run_script
from utils.base.arguments import ModelArguments
from utils.base.errors import UsageError
from utils.layout.layouts import DataParallel, FullySharded
from utils.models.loading import load_model

VOCAB = 40
FAMILIES = {  # an encoder, a decoder and an encoder-decoder, each a couple of layers wide
    "bert": (FlaxAutoModelForMaskedLM, BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                                  num_attention_heads=2, intermediate_size=32,
                                                  max_position_embeddings=32)),
    "gpt2": (FlaxAutoModelForCausalLM, GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32)),
    "bart": (FlaxAutoModelForSeq2SeqLM, BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)),
}
# Buffers PyTorch checkpoints of these families carry beside their weights (no Flax parameter), by
# their name inside the base model.
PYTORCH_BUFFERS = {"bert": ("bert", {"embeddings.position_ids": np.arange(32, dtype=np.int64)[None]}),
                   "gpt2": ("transformer", {"h.0.attn.masked_bias": np.array(-1e4, np.float32)})}


def pytorch_state_dict(params, family, legacy_norm_names=False):
    """{name: array} of `params` as PyTorch's `save_pretrained` names and lays them out: Dense and
    Conv1D kernels transposed to `weight`, embeddings and norm scales as `weight` (bert-base's own
    checkpoint still says `gamma` / `beta` for its norms), plus the family's buffers."""
    state = {}
    for key, value in flatten_dict(params).items():
        *path, leaf = key
        value = np.asarray(value)
        if leaf == "kernel":
            leaf, value = "weight", value.T
        elif leaf in ("embedding", "scale"):
            leaf = "weight"
        if legacy_norm_names and "LayerNorm" in path:
            leaf = {"weight": "gamma", "bias": "beta"}[leaf]
        state[".".join(path + [leaf])] = np.ascontiguousarray(value)
    prefix, buffers = PYTORCH_BUFFERS.get(family, ("", {}))
    within = f"{prefix}." if prefix in params else ""  # a base model's checkpoint names no prefix
    return {**state, **{within + name: value for name, value in buffers.items()}}


def write_pytorch_safetensors(directory, config, state, shards=1, bfloat16=False):
    """`model.safetensors` (or `shards` files and their index) with PyTorch metadata, and the config."""
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    names = sorted(state)
    if bfloat16:
        state = {name: jnp.asarray(value, jnp.bfloat16 if value.dtype == np.float32 else value.dtype)
                 for name, value in state.items()}
    save = safetensors.flax.save_file if bfloat16 else safetensors.numpy.save_file
    if shards == 1:
        save(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    for i, part in enumerate(np.array_split(names, shards)):
        filename = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save({name: state[name] for name in part}, os.path.join(directory, filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return directory


def fresh_model(family):
    auto_class, config = FAMILIES[family]
    return auto_class.from_config(config, seed=1)


def loaded(family, directory, layout=None):
    """(model, host params) of `directory` through the scripts' own loading."""
    auto_class, _ = FAMILIES[family]
    layout = layout or DataParallel()
    model, params = load_model(auto_class, ModelArguments(model_name_or_path=str(directory)),
                               AutoConfig.from_pretrained(directory), 0, layout)
    return model, layout.params_to_host(params)


def logits(model, params):
    ids = np.arange(2 * 12, dtype=np.int32).reshape(2, 12) % VOCAB
    extra = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    return np.asarray(model(ids, params=params, **extra).logits)


def assert_same_weights(params, reference):
    ours, theirs = flatten_dict(params), flatten_dict(reference)
    assert set(ours) == set(theirs)
    for key in theirs:
        assert ours[key].dtype == jnp.float32, key
        np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(theirs[key]), err_msg="/".join(key))


@pytest.mark.parametrize("family", FAMILIES)
def test_pytorch_safetensors_load_as_transformers_loads_them(family, tmp_path):
    """The hub's most common format: the weights equal those transformers' own loader makes of the
    file, and so does the model's output (exactly: the same numbers through the same model)."""
    model = fresh_model(family)
    state = pytorch_state_dict(model.params, family, legacy_norm_names=family == "bert")
    directory = write_pytorch_safetensors(tmp_path / "pt", model.config, state)
    reference = FAMILIES[family][0].from_pretrained(directory)
    assert_same_weights(reference.params, model.params)  # the checkpoint written here is what it claims to be
    ours_model, ours = loaded(family, directory)
    assert_same_weights(ours, reference.params)
    np.testing.assert_array_equal(logits(ours_model, ours), logits(reference, reference.params))


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_pytorch_safetensors(family, tmp_path):
    """Large hub models come as shards with an index (transformers' Flax loader cannot read them)."""
    model = fresh_model(family)
    directory = write_pytorch_safetensors(tmp_path / "pt", model.config,
                                          pytorch_state_dict(model.params, family), shards=3)
    assert len([name for name in os.listdir(directory) if name.endswith(".safetensors")]) == 3
    _, ours = loaded(family, directory, FullySharded(8))
    assert_same_weights(ours, model.params)


def test_a_pytorch_checkpoints_generation_config_is_read(tmp_path):
    """Its end ids (Llama 3 Instruct's and Gemma's list several), as transformers reads them beside Flax weights;
    without the file, the model config's."""
    from transformers import GenerationConfig

    model = fresh_model("gpt2")
    directory = write_pytorch_safetensors(tmp_path / "pt", model.config, pytorch_state_dict(model.params, "gpt2"))
    assert loaded("gpt2", directory)[0].generation_config.eos_token_id == model.config.eos_token_id
    GenerationConfig(eos_token_id=[5, 7], bos_token_id=1).save_pretrained(directory)
    assert loaded("gpt2", directory)[0].generation_config.eos_token_id == [5, 7]


def test_bfloat16_pytorch_weights_become_float32_master_weights(tmp_path):
    model = fresh_model("gpt2")
    directory = write_pytorch_safetensors(tmp_path / "pt", model.config, pytorch_state_dict(model.params, "gpt2"),
                                          bfloat16=True)
    reference = FlaxAutoModelForCausalLM.from_pretrained(directory, dtype=jnp.float32)
    _, ours = loaded("gpt2", directory)
    rounded = jax.tree_util.tree_map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), model.params)
    assert_same_weights(ours, rounded)  # bfloat16 to float32 is exact
    assert_same_weights(ours, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), reference.params))


@pytest.mark.parametrize("family", ["bert", "bart"])
def test_flax_safetensors_and_sharded_msgpack(family, tmp_path):
    """What transformers' Flax `save_pretrained` writes, whole as safetensors or sharded as msgpack."""
    model = fresh_model(family)
    model.save_pretrained(tmp_path / "safetensors", safe_serialization=True)
    model.save_pretrained(tmp_path / "shards", max_shard_size="4KB")
    assert os.path.isfile(tmp_path / "safetensors" / "model.safetensors")
    assert os.path.isfile(tmp_path / "shards" / "flax_model.msgpack.index.json")
    for directory in ("safetensors", "shards"):
        _, ours = loaded(family, tmp_path / directory)
        assert_same_weights(ours, model.params)


def test_a_base_model_checkpoint_gets_a_fresh_head_named_in_a_warning(tmp_path, caplog):
    """A PyTorch BertModel checkpoint (no `bert.` prefix, no head) fine-tuned as a masked LM."""
    base = FlaxBertModel(FAMILIES["bert"][1], seed=1)
    directory = write_pytorch_safetensors(tmp_path / "pt", base.config, pytorch_state_dict(base.params, "bert"))
    with caplog.at_level(logging.WARNING):
        _, ours = loaded("bert", directory)
    without_pooler = {key: value for key, value in base.params.items() if key != "pooler"}  # a masked LM has none
    assert_same_weights(ours["bert"], without_pooler)
    assert "cls" in ours and "initialised fresh" in caplog.text and "cls/predictions/bias" in caplog.text
    assert "has no place for, left out: embeddings/position_ids, pooler/dense/bias, pooler/dense/kernel" in caplog.text


def test_a_checkpoint_for_another_config_is_one_clear_error(tmp_path):
    model = fresh_model("bert")
    directory = write_pytorch_safetensors(tmp_path / "pt", model.config, pytorch_state_dict(model.params, "bert"))
    wider = FAMILIES["bert"][1].to_dict() | {"intermediate_size": 48}
    with pytest.raises(UsageError, match="do not fit the model: .* use the checkpoint's own config"):
        load_model(FlaxAutoModelForMaskedLM, ModelArguments(model_name_or_path=str(directory)),
                   BertConfig(**wider), 0, DataParallel())


def test_pytorch_bin_without_torch_says_what_to_install(tmp_path, monkeypatch):
    model = fresh_model("bert")
    model.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK")  # never opened: torch is asked for first
    monkeypatch.setitem(__import__("sys").modules, "torch", None)
    with pytest.raises(UsageError, match="pytorch_model.bin, which needs PyTorch to read: pip install torch"):
        loaded("bert", tmp_path)


@pytest.mark.parametrize("shards", [1, 2])
def test_pytorch_bin_with_torch_installed(tmp_path, shards):
    """Older hub checkpoints: `pytorch_model.bin` pickles (sharded with an index for large ones).
    Runs where torch is installed; the tests' requirements leave it out (see the test above)."""
    torch = pytest.importorskip("torch")
    model = fresh_model("bert")
    model.config.save_pretrained(tmp_path)
    state = {name: torch.from_numpy(np.array(value)) for name, value in pytorch_state_dict(model.params, "bert").items()}
    if shards == 1:
        torch.save(state, tmp_path / "pytorch_model.bin")
        reference = FlaxAutoModelForMaskedLM.from_pretrained(tmp_path, from_pt=True).params
    else:
        names = sorted(state)
        weight_map = {name: f"pytorch_model-0000{1 + (i % 2)}-of-00002.bin" for i, name in enumerate(names)}
        for filename in set(weight_map.values()):
            torch.save({name: state[name] for name in names if weight_map[name] == filename}, tmp_path / filename)
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
        reference = model.params
    _, ours = loaded("bert", tmp_path)
    assert_same_weights(ours, reference)


def test_a_shard_the_index_names_but_the_checkpoint_lacks(tmp_path):
    model = fresh_model("gpt2")
    directory = write_pytorch_safetensors(tmp_path / "pt", model.config, pytorch_state_dict(model.params, "gpt2"),
                                          shards=2)
    os.remove(os.path.join(directory, "model-00002-of-00002.safetensors"))
    with pytest.raises(UsageError, match="names weight shard 'model-00002-of-00002.safetensors'"):
        loaded("gpt2", directory)


# ----------------------------------------------------------------------------------------------
# End to end: every script fine-tunes a PyTorch-format checkpoint laid out as on the hub
# ----------------------------------------------------------------------------------------------
LM_DATA = ["--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt",
           "--max_train_samples", "64"]
SCRIPTS = {  # script: (its auto class, the family and its size, tokenizer, data arguments)
    "run_clm_flax.py": (FlaxAutoModelForCausalLM, "gpt2", "n_embd=32,n_layer=1,n_head=2,n_positions=64",
                        "data/lm/tokenizer", LM_DATA + ["--block_size", "32"]),
    "run_mlm_flax.py": (FlaxAutoModelForMaskedLM, "bert", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,"
                        "intermediate_size=64,max_position_embeddings=64", "data/lm/tokenizer",
                        LM_DATA + ["--max_seq_length", "32"]),
    "run_summarization_flax.py": (FlaxAutoModelForSeq2SeqLM, "t5", "d_model=32,d_ff=64,num_layers=1,"
                                  "num_decoder_layers=1,num_heads=2,d_kv=16", "data/summarization/tokenizer",
                                  ["--train_file", "data/summarization/train.jsonl", "--max_source_length", "96",
                                   "--max_target_length", "16", "--max_train_samples", "32"]),
    "run_flax_glue.py": (FlaxAutoModelForSequenceClassification, "bert", "hidden_size=32,num_hidden_layers=1,"
                         "num_attention_heads=2,intermediate_size=64,max_position_embeddings=64", "data/glue/tokenizer",
                         ["--train_file", "data/glue/sst2/train.csv", "--max_seq_length", "16",
                          "--max_train_samples", "32"]),
}


def hub_style_checkpoint(directory, auto_class, family, overrides, tokenizer_name):
    """A directory as `save_pretrained` in PyTorch leaves it: config, tokenizer, `model.safetensors`."""
    from utils.models import compat
    from utils.models.loading import fit_config_to_tokenizer, load_config, load_tokenizer

    compat.apply()  # the T5 clip shim
    args = ModelArguments(model_type=family, config_overrides=overrides, tokenizer_name=os.path.join(ROOT, tokenizer_name))
    tokenizer = load_tokenizer(args)
    model = auto_class.from_config(fit_config_to_tokenizer(load_config(args, _task(auto_class)), tokenizer, args),
                                   seed=3)
    write_pytorch_safetensors(directory, model.config, pytorch_state_dict(model.params, family))
    tokenizer.save_pretrained(directory)
    return tokenizer


def _task(auto_class):
    return {FlaxAutoModelForCausalLM: "causal-lm", FlaxAutoModelForMaskedLM: "masked-lm",
            FlaxAutoModelForSeq2SeqLM: "seq2seq", FlaxAutoModelForSequenceClassification: "sequence-classification",
            }[auto_class]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_fine_tunes_a_pytorch_checkpoint(script, tmp_path):
    """The script trains from the PyTorch checkpoint, and its first loss is the one it computes from
    the Flax checkpoint that transformers' own loader (`_do_init=True`) makes of the same file."""
    auto_class, family, overrides, tokenizer_name, data_args = SCRIPTS[script]
    tokenizer = hub_style_checkpoint(tmp_path / "pt", auto_class, family, overrides, tokenizer_name)
    auto_class.from_pretrained(tmp_path / "pt").save_pretrained(tmp_path / "flax")
    tokenizer.save_pretrained(tmp_path / "flax")
    first_losses = []
    for checkpoint in ("pt", "flax"):
        out = tmp_path / f"out_{checkpoint}"
        result = run_script(script, ["--model_name_or_path", tmp_path / checkpoint, *data_args, "--do_train",
                                     "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "2",
                                     "--output_dir", out, "--compilation_cache_dir", tmp_path / "jax_cache"])
        assert result.returncode == 0, result.stderr[-3000:]
        losses = [row["loss"] for row in read_metrics(out)]
        assert len(losses) == 2 and all(np.isfinite(losses))
        first_losses.append(losses[0])
    # The same weights, batch and seed: the same float32 operations in the same order, so exactly equal.
    assert first_losses[0] == first_losses[1]
