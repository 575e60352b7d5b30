"""utils/models.py: configs from model_type (+ overrides), task checks, vocab fitting, offline failures."""

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import FlaxAutoModelForSeq2SeqLM, PreTrainedTokenizerFast, T5Config

from utils import compat
from utils.args import ModelArguments
from utils.errors import UsageError
from utils.models import fit_config_to_tokenizer, fit_length, load_config, load_model, load_tokenizer, max_positions

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def test_load_config_from_model_type_with_overrides():
    args = ModelArguments(model_type="t5", config_overrides="d_model=16, num_layers=1,dropout_rate=0.25,"
                                                            "tie_word_embeddings=false,feed_forward_proj=gated-gelu")
    config = load_config(args, task="seq2seq")
    assert config.model_type == "t5"
    assert config.d_model == 16 and config.num_layers == 1 and isinstance(config.num_layers, int)
    assert config.dropout_rate == 0.25 and config.tie_word_embeddings is False
    assert config.feed_forward_proj == "gated-gelu"
    assert load_config(ModelArguments(model_type="gpt2"), task="causal-lm").model_type == "gpt2"


@pytest.mark.parametrize("overrides, message", [
    ("d_model=16,no_such_key=3", "t5 config has no attribute 'no_such_key'"),
    ("d_model=big", r"d_model='big' is not a int"),
    ("d_model", r"item 'd_model' is not key=value"),
])
def test_bad_overrides(overrides, message):
    with pytest.raises(UsageError, match=message):
        load_config(ModelArguments(model_type="t5", config_overrides=overrides), task="seq2seq")


def test_unknown_model_type_lists_valid_ones():
    with pytest.raises(UsageError, match=r"unknown --model_type 't6': use one of .*\bt5\b") as info:
        load_config(ModelArguments(model_type="t6"), task="seq2seq")
    assert "bart" in str(info.value) and "gpt2" not in str(info.value)


@pytest.mark.parametrize("model_type, task", [("bert", "seq2seq"), ("t5", "causal-lm"), ("gpt2", "masked-lm")])
def test_model_type_the_task_cannot_train(model_type, task):
    with pytest.raises(UsageError, match=rf"model type '{model_type}' cannot be trained by this script \({task}\)"):
        load_config(ModelArguments(model_type=model_type), task=task)


def test_no_model_at_all():
    with pytest.raises(UsageError, match="no model"):
        load_config(ModelArguments(), task="seq2seq")


def test_local_config_dir_and_overrides(tmp_path):
    T5Config(d_model=24, num_layers=2).save_pretrained(tmp_path)
    config = load_config(ModelArguments(config_name=str(tmp_path), config_overrides="num_layers=1"), "seq2seq")
    assert config.d_model == 24 and config.num_layers == 1
    with pytest.raises(UsageError, match=r"--config_overrides would change num_layers from 2 to 1 in the config of "
                                         r".*: overrides apply only when training from scratch"):
        load_config(ModelArguments(model_name_or_path=str(tmp_path), config_overrides="num_layers=1"), "seq2seq")


def test_overrides_a_pretrained_config_already_has_are_accepted(tmp_path):
    """A config file shared by training and evaluation keeps its overrides when it loads the trained model."""
    T5Config(d_model=24, num_layers=2).save_pretrained(tmp_path)
    config = load_config(ModelArguments(model_name_or_path=str(tmp_path), config_overrides="d_model=24,num_layers=2"),
                         "seq2seq")
    assert config.d_model == 24 and config.num_layers == 2


def test_nonexistent_local_model_path_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(UsageError, match=r"could not load model config .*nope"):
        load_config(ModelArguments(model_name_or_path=str(tmp_path / "nope")), task="seq2seq")
    with pytest.raises(UsageError, match=r"could not load tokenizer .*nope"):
        load_tokenizer(ModelArguments(model_name_or_path=str(tmp_path / "nope")))
    assert time.monotonic() - start < 10


def test_fit_config_from_scratch(tokenizer):
    args = ModelArguments(model_type="t5", config_overrides="d_model=16")
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    assert config.vocab_size == len(tokenizer) == 11
    assert config.pad_token_id == 1 and config.eos_token_id == 2


def test_fit_config_keeps_explicit_overrides(tokenizer):
    args = ModelArguments(model_type="t5", config_overrides="vocab_size=64,pad_token_id=0")
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    assert config.vocab_size == 64 and config.pad_token_id == 0 and config.eos_token_id == 2


def test_fit_config_pretrained_vocab_must_cover_tokenizer(tokenizer, tmp_path):
    args = ModelArguments(model_name_or_path=str(tmp_path))
    small = T5Config(vocab_size=5, pad_token_id=0)
    with pytest.raises(UsageError, match="the tokenizer has 11 tokens but the model only 5"):
        fit_config_to_tokenizer(small, tokenizer, args)
    big = fit_config_to_tokenizer(T5Config(vocab_size=32, pad_token_id=0), tokenizer, args)
    assert big.vocab_size == 32 and big.pad_token_id == 0  # a pretrained model keeps its own


def test_load_tokenizer_from_local_dir(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(ModelArguments(tokenizer_name=str(tmp_path)))
    assert len(loaded) == 11 and loaded("the cat ran")["input_ids"] == [3, 4, 10]
    with pytest.raises(UsageError, match="no tokenizer"):
        load_tokenizer(ModelArguments(model_type="t5"))


@pytest.mark.parametrize("model_type, overrides, limit", [
    ("bart", "max_position_embeddings=128", 128),
    ("gpt2", "n_positions=64", 64),  # gpt2 calls it n_positions
    ("roberta", "max_position_embeddings=514,pad_token_id=1", 512),  # positions start after the padding id
    ("t5", "", None),  # relative positions
    ("bloom", "", None),  # ALiBi
])
def test_max_positions(model_type, overrides, limit):
    task = "seq2seq" if model_type in ("bart", "t5") else "masked-lm" if model_type == "roberta" else "causal-lm"
    config = load_config(ModelArguments(model_type=model_type, config_overrides=overrides or None), task)
    assert max_positions(config) == limit


def test_fit_length(caplog):
    logger = logging.getLogger("flaxtune.test")
    with caplog.at_level(logging.WARNING):
        assert fit_length(1024, 128, "max_source_length", logger) == 128
        assert fit_length(64, 128, "max_target_length", logger) == 64
        assert fit_length(1024, None, "block_size", logger) == 1024  # no limit
    assert caplog.messages == ["--max_source_length 1024 is more than the model's 128 positions: using 128"]


@pytest.mark.parametrize("dtype, param_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                                ("bfloat16", "bfloat16")])
def test_load_model_compute_and_parameter_dtypes(tokenizer, dtype, param_dtype):
    compat.apply()  # the T5 clip shim
    args = ModelArguments(model_type="t5", config_overrides="d_model=16,d_ff=32,num_layers=1,num_heads=2,d_kv=8",
                          dtype=dtype, param_dtype=param_dtype)
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    model = load_model(FlaxAutoModelForSeq2SeqLM, args, config, dtype=jnp.dtype(dtype), seed=0)
    assert {x.dtype for x in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(param_dtype)}
    ids = np.ones((1, 4), np.int32)
    logits = model(ids, decoder_input_ids=ids).logits
    assert logits.dtype == jnp.dtype(dtype) and bool(jnp.isfinite(logits).all())
