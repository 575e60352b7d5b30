"""End to end: run_t5_mlm_flax.py on a tiny T5 over 8 virtual devices, as a user would run it."""

import os
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from tests.script_runner import (ROOT, calls_of_steps_compiled_once, read_json, read_metrics, run_script,
                                 run_streamed_config)
from utils.data import arrow_columns, loaders
from utils.models import compat
from tasks import lm
from tasks.span_corruption import plan_span_corruption, span_corruption, span_target_loss

SCRIPT = "run_t5_mlm_flax.py"
MAX_STEPS = 40
# 32 input tokens at 15% noise in spans of 3: raw blocks of 34 tokens, 5 noise tokens in 2 spans,
# targets of 8 (2 sentinels, 5 tokens, EOS).
SEQ_LENGTH, RAW_LENGTH, TARGET_LENGTH = 32, 34, 8
# 45 eval blocks in global batches of 16: the last one is padded with 3 rows that must not count.
EVAL_SAMPLES = 45
# Calibrated: this run ends near 48 (accuracy 0.34); the untrained model scores about the vocabulary's 405.
PERPLEXITY_THRESHOLD = 100
MODEL = ["--model_type", "t5", "--tokenizer_name", "data/lm/t5_tokenizer", "--config_overrides",
         "d_model=64,d_ff=128,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=32,dropout_rate=0.0"]
DATA = ["--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt",
        "--max_seq_length", SEQ_LENGTH, "--max_eval_samples", EVAL_SAMPLES, "--per_device_eval_batch_size", 2]
TRAIN = ["--max_train_samples", 640, "--per_device_train_batch_size", 4, "--learning_rate", 3e-3,
         "--warmup_steps", 5, "--logging_steps", 5, "--eval_steps", 20, "--save_steps", 20, "--num_train_epochs", 100]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def run(args, cache_dir, **kwargs):
    result = run_script(SCRIPT, args + ["--compilation_cache_dir", cache_dir], **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    out = str(tmp_path_factory.mktemp("t5_mlm"))
    run(MODEL + DATA + TRAIN + ["--do_train", "--do_eval", "--output_dir", out, "--max_steps", MAX_STEPS], cache_dir,
        steps_report=out + "_steps.json")
    return out


@pytest.mark.slow
def test_each_step_compiles_once(trained):
    """Train steps 2..N and every eval batch (the last one padded) reuse the first call's program."""
    calls = calls_of_steps_compiled_once(trained + "_steps.json")
    assert calls["train_step"] == MAX_STEPS and calls["eval_step"] > 2


@pytest.mark.slow
def test_loss_falls_and_the_results(trained):
    train = read_metrics(trained)
    assert [row["step"] for row in train] == list(range(5, MAX_STEPS + 1, 5))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert [row["step"] for row in read_metrics(trained, "eval")] == [20, 40]
    results = read_json(os.path.join(trained, "eval_results.json"))
    assert set(results) == {"eval_loss", "eval_accuracy", "eval_perplexity", "eval_tokens", "eval_samples"}
    # Every target token of every real example, none of the padded rows'.
    assert results["eval_tokens"] == EVAL_SAMPLES * TARGET_LENGTH and results["eval_samples"] == EVAL_SAMPLES
    assert results["eval_perplexity"] < PERPLEXITY_THRESHOLD and 0.1 < results["eval_accuracy"] <= 1
    assert read_json(os.path.join(trained, "run_args.json"))["mean_noise_span_length"] == 3.0
    for name in ("config.json", "flax_model.msgpack", "tokenizer.json", "metrics.jsonl"):
        assert os.path.isfile(os.path.join(trained, name)), name
    assert sorted(os.listdir(os.path.join(trained, "checkpoints"))) == ["20", "40"]


def corrupted_eval_set(tokenizer, decoder_start_token_id, seed=42):
    """(inputs, labels) of the eval blocks as the script corrupts them with DATA's settings (and the
    default seed), rebuilt here: the same raw blocks, corrupted all at once by the eval stream (each
    example's corruption depends on its index alone, not on the script's batches of 2 x 8)."""
    import datasets

    raw = datasets.load_dataset("text", data_files={"validation": os.path.join(ROOT, "data/lm/validation.txt")},
                                keep_linebreaks=True)["validation"]
    no_workers = SimpleNamespace(preprocessing_num_workers=None, overwrite_cache=False)
    blocks = loaders.take(lm.tokenize_and_group(raw, tokenizer, "text", RAW_LENGTH, no_workers), EVAL_SAMPLES)
    input_ids = arrow_columns.to_arrays(blocks, ("input_ids",))["input_ids"]
    plan = plan_span_corruption(tokenizer, SEQ_LENGTH, 0.15, 3.0)
    assert plan.lengths.raw_length == RAW_LENGTH and plan.lengths.target_length == TARGET_LENGTH
    batch = span_corruption(plan, decoder_start_token_id, seed, lm.EVAL_STREAM)(
        {"input_ids": input_ids}, 0, np.arange(len(input_ids)))
    return batch["input_ids"], batch["labels"]


@pytest.mark.slow
def test_eval_scores_the_exported_model_on_every_target_token(trained):
    """The eval loss and accuracy are the exported model's over all target tokens of the corrupted
    blocks, with decoder inputs built here (the labels shifted right after the start token): a
    script that fed the decoder anything else, or scored other tokens, would disagree."""
    from transformers import AutoTokenizer, FlaxAutoModelForSeq2SeqLM

    compat.apply()  # the T5 family's clip shim
    model, params = FlaxAutoModelForSeq2SeqLM.from_pretrained(trained, _do_init=False)
    start = model.config.decoder_start_token_id
    assert start == model.config.pad_token_id == 0  # T5 starts decoding from pad
    inputs, labels = corrupted_eval_set(AutoTokenizer.from_pretrained(trained), start)
    decoder_inputs = np.concatenate([np.full((len(labels), 1), start), labels[:, :-1]], axis=1)
    logits = model(inputs, decoder_input_ids=decoder_inputs, params=params).logits
    label_log_probs = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), labels[..., None], -1)[..., 0]
    results = read_json(os.path.join(trained, "eval_results.json"))
    # Result files round to 4 decimals (5e-5), and the script sums 320 token losses (~2-4) in float32
    # in another order than numpy's mean (~sqrt(320) x eps32 x 4 = 1e-5): 2e-4.
    assert results["eval_loss"] == pytest.approx(-label_log_probs.mean(), abs=2e-4)
    assert results["eval_accuracy"] == pytest.approx((np.asarray(logits.argmax(-1)) == labels).mean(), abs=2e-4)


def test_span_target_loss_counts_every_target_token_of_real_rows():
    vocab = 7
    labels = np.arange(15).reshape(3, 5) % vocab
    example_weight = np.array([1.0, 1.0, 0.0])  # the last row is eval padding
    right = 30.0 * np.eye(vocab, dtype=np.float32)[labels]
    wrong = 30.0 * np.eye(vocab, dtype=np.float32)[(labels + 1) % vocab]
    real = example_weight[:, None, None] == 1
    # Right on every token of the real rows, then wrong on all of them; the padded row is the opposite
    # each time and never shows. Pad ids (0) among the labels count like any other target.
    # Logits 30 apart: a right token's loss is log(1 + 6 exp(-30)) = 6e-13 (1e-6 is float32's floor
    # for it), a wrong one's 30 + that, summed over 10 tokens in float32 (ulp 3e-6 at 300): 1e-3.
    for logits, expected_accuracy, per_token_loss in ((np.where(real, right, wrong), 10, pytest.approx(0, abs=1e-6)),
                                                      (np.where(real, wrong, right), 0, pytest.approx(30, abs=1e-3))):
        loss, sums = span_target_loss(logits, labels, example_weight)
        assert float(sums["tokens"]) == 10 and float(sums["accuracy"]) == expected_accuracy
        assert float(loss) == float(sums["loss"]) and float(loss) / 10 == per_token_loss
    # Training batches carry no example weight: every row counts.
    assert float(span_target_loss(right, labels)[1]["tokens"]) == 15


@pytest.mark.slow
def test_eval_only_from_the_saved_model(trained, tmp_path, cache_dir):
    # With the training's model arguments too, as the README's recipe passes the config: overrides
    # that agree with the saved config change nothing.
    run(MODEL + ["--model_name_or_path", trained, "--do_eval", "--output_dir", tmp_path] + DATA, cache_dir)
    again, before = (read_json(os.path.join(d, "eval_results.json")) for d in (tmp_path, trained))
    # The eval corruption is fixed too, so the saved model scores what it scored at the end of training.
    # The same numbers through a separately compiled program, rounded to 4 decimals: 2e-4 (see above).
    assert again["eval_loss"] == pytest.approx(before["eval_loss"], abs=2e-4)
    assert again["eval_accuracy"] == pytest.approx(before["eval_accuracy"], abs=2e-4)
    assert again["eval_tokens"] == before["eval_tokens"]


@pytest.mark.slow
def test_the_embedded_config_streams_and_learns(tmp_path):
    """configs/t5_mlm_tiny.json with --streaming: read, tokenized, shuffled and corrupted on the fly,
    evaluated on its validation file."""
    # 20 steps of 64 raw blocks of 70 tokens: most of the one pass over the corpus a stream makes.
    results, _ = run_streamed_config(SCRIPT, "configs/t5_mlm_tiny.json", tmp_path / "out", 20, 5,
                                     "--max_eval_samples", 32)
    # A stream has no size: the examples trained on are the steps' (64 a step, the config's total batch).
    assert results["eval_samples"] == 32 and results["eval_tokens"] == 32 * 14 and results["train_samples"] == 20 * 64


@pytest.mark.slow
@pytest.mark.parametrize("model_type, optimizer", [("mt5", ["--adafactor"]), ("longt5", [])])
def test_the_other_families_train(tmp_path, cache_dir, model_type, optimizer):
    """mT5 (with Adafactor, T5's usual optimizer) and LongT5 (local attention) through the same
    script: the span-corrupted batches, a loss that falls over 12 steps, an eval over every target token."""
    out = str(tmp_path / "out")
    args = [arg if arg != "t5" else model_type for arg in MODEL] + DATA + optimizer
    run(args + ["--do_train", "--do_eval", "--output_dir", out, "--max_train_samples", 128, "--max_steps", 12,
                "--per_device_train_batch_size", 2, "--learning_rate", 3e-3, "--logging_steps", 6], cache_dir)
    train = read_metrics(out)
    assert [row["step"] for row in train] == [6, 12] and train[1]["loss"] < train[0]["loss"]
    assert read_json(os.path.join(out, "config.json"))["model_type"] == model_type
    results = read_json(os.path.join(out, "eval_results.json"))
    assert results["eval_tokens"] == EVAL_SAMPLES * TARGET_LENGTH and np.isfinite(results["eval_loss"])
