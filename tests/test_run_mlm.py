"""End to end: run_mlm_flax.py on a tiny RoBERTa over 8 virtual devices, as a user would run it."""

import os
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from tests.script_runner import (ROOT, calls_of_steps_compiled_once, read_json, read_metrics, run_script,
                                 run_streamed_config)
from tasks import lm, masked_lm
from utils.data import arrow_columns, loaders

SCRIPT = "run_mlm_flax.py"
MAX_STEPS = 40
# Calibrated: this run ends near 110; the untrained model scores ~900 (about the vocabulary's size).
PERPLEXITY_THRESHOLD = 250
MODEL = ["--model_type", "roberta", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
         "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,"
         "max_position_embeddings=34,hidden_dropout_prob=0,attention_probs_dropout_prob=0"]
DATA = ["--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--max_seq_length", "32",
        "--max_eval_samples", "40", "--per_device_eval_batch_size", "2"]
TRAIN = ["--max_train_samples", "1280", "--per_device_train_batch_size", "4",
         "--learning_rate", "3e-3", "--warmup_steps", "5", "--logging_steps", "5", "--eval_steps", "20",
         "--save_steps", "20", "--num_train_epochs", "100"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def run(args, cache_dir, **kwargs):
    result = run_script(SCRIPT, args + ["--compilation_cache_dir", cache_dir], **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    out = str(tmp_path_factory.mktemp("mlm"))
    run(MODEL + DATA + TRAIN + ["--do_train", "--do_eval", "--output_dir", out, "--max_steps", MAX_STEPS], cache_dir,
        steps_report=out + "_steps.json")
    return out


@pytest.mark.slow
def test_each_step_compiles_once(trained):
    """Train steps 2..N and every eval batch (the last one padded) reuse the first call's program."""
    calls = calls_of_steps_compiled_once(trained + "_steps.json")
    assert calls["train_step"] == MAX_STEPS and calls["eval_step"] > 2


@pytest.mark.slow
def test_loss_falls_and_max_steps_is_honoured(trained):
    train = read_metrics(trained)
    assert [row["step"] for row in train] == list(range(5, MAX_STEPS + 1, 5))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # from ~6.7 (uniform over 861 tokens) to ~4.9
    assert 0 <= train[-1]["accuracy"] <= 1
    assert [row["step"] for row in read_metrics(trained, "eval")] == [20, 40]


@pytest.mark.slow
def test_result_files(trained):
    results = read_json(os.path.join(trained, "eval_results.json"))
    assert set(results) == {"eval_loss", "eval_accuracy", "eval_perplexity", "eval_tokens", "eval_samples"}
    assert results["eval_perplexity"] < PERPLEXITY_THRESHOLD and results["eval_accuracy"] > 0.05
    assert read_json(os.path.join(trained, "all_results.json"))["eval_accuracy"] == results["eval_accuracy"]
    assert read_json(os.path.join(trained, "run_args.json"))["mlm_probability"] == 0.15
    for name in ("config.json", "flax_model.msgpack", "tokenizer.json", "metrics.jsonl"):
        assert os.path.isfile(os.path.join(trained, name)), name
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(trained))
    assert sorted(os.listdir(os.path.join(trained, "checkpoints"))) == ["20", "40"]


def masked_eval_set(tokenizer, seq_length=32, max_eval_samples=40, seed=42):
    """(inputs, labels, selected) of the eval blocks as the script masks them with DATA's settings
    (and the default seed), rebuilt here: the same blocks, masked all at once by `masked_lm.masking`'s eval
    stream (each example's mask depends on its index alone, not on the script's batches of 2 x 8)."""
    import datasets

    raw = datasets.load_dataset("text", data_files={"validation": os.path.join(ROOT, "data/lm/validation.txt")},
                                keep_linebreaks=True)["validation"]
    no_workers = SimpleNamespace(preprocessing_num_workers=None, overwrite_cache=False)
    blocks = loaders.take(lm.tokenize_and_group(raw, tokenizer, "text", seq_length, no_workers),
                                  max_eval_samples)
    input_ids = np.asarray(arrow_columns.to_arrays(blocks, ("input_ids",))["input_ids"])  # read out of the memory map
    masking = masked_lm.masking(tokenizer, 0.15, seed, lm.EVAL_STREAM)
    masked = masking({"input_ids": input_ids}, 0, np.arange(len(input_ids)))
    return masked["input_ids"], masked["labels"], masked["label_weights"]


@pytest.mark.slow
def test_eval_scores_exactly_the_masked_tokens(trained):
    """The eval counts the tokens the masking selected, and its loss and accuracy are the exported
    model's on those tokens alone (computed here). Scoring every token would also count the
    unselected ones, visible in the input and so easy to get right."""
    from transformers import AutoTokenizer, FlaxAutoModelForMaskedLM

    inputs, labels, selected = masked_eval_set(AutoTokenizer.from_pretrained(trained))
    results = read_json(os.path.join(trained, "eval_results.json"))
    assert results["eval_tokens"] == selected.sum() and 0 < selected.sum() < 0.2 * selected.size
    assert read_metrics(trained, "eval")[-1]["tokens"] == selected.sum()

    model, params = FlaxAutoModelForMaskedLM.from_pretrained(trained, _do_init=False)
    logits = model(inputs, params=params).logits
    label_log_probs = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), labels[..., None], -1)[..., 0]
    predicted = np.asarray(logits.argmax(-1))
    # Result files round to 4 decimals (5e-5), and the script sums the token losses (~3-6) in float32
    # in another order than numpy (~sqrt(N) x eps32 x 6 for a few hundred tokens: 2e-5): 2e-4.
    assert results["eval_loss"] == pytest.approx(-(label_log_probs * selected).sum() / selected.sum(), abs=2e-4)
    assert results["eval_accuracy"] == pytest.approx(((predicted == labels) * selected).sum() / selected.sum(),
                                                     abs=2e-4)


def test_masked_token_loss_counts_only_the_selected_tokens_of_real_rows():
    vocab = 7
    labels = np.arange(15).reshape(3, 5) % vocab
    label_weights = np.array([[1, 0, 0, 1, 0], [0, 1, 0, 0, 0], [1, 1, 0, 0, 0]], np.float32)
    example_weight = np.array([1.0, 1.0, 0.0])  # the last row is eval padding
    scored = label_weights * example_weight[:, None]
    right = 30.0 * np.eye(vocab, dtype=np.float32)[labels]
    wrong = 30.0 * np.eye(vocab, dtype=np.float32)[(labels + 1) % vocab]
    # Right exactly on the 3 scored tokens (selected, in real rows), then wrong exactly on them:
    # loss and accuracy follow those tokens alone.
    for logits, expected_accuracy, per_token_loss in (
            # Logits 30 apart: a right token's loss is log(1 + 6 exp(-30)) = 6e-13 (1e-6 is float32's
            # floor for it), a wrong one's 30 + that, 3 of them summed in float32 (ulp 1e-5 at 90): 1e-3.
            (np.where(scored[..., None] == 1, right, wrong), 3, pytest.approx(0, abs=1e-6)),
            (np.where(scored[..., None] == 1, wrong, right), 0, pytest.approx(30, abs=1e-3))):
        loss, sums = masked_lm.masked_token_loss(logits, labels, label_weights, example_weight)
        assert float(sums["tokens"]) == 3 and float(sums["accuracy"]) == expected_accuracy
        assert float(loss) == float(sums["loss"]) and float(loss) / 3 == per_token_loss


@pytest.mark.slow
def test_resumed_run_sees_the_same_masks(trained, tmp_path, cache_dir):
    # Masks are a function of (seed, step): resuming at step 20 must retrace the second half exactly.
    resumed = str(tmp_path / "resumed")
    shutil.copytree(trained, resumed)
    run(MODEL + DATA + TRAIN + ["--do_train", "--do_eval", "--output_dir", resumed, "--max_steps", MAX_STEPS,
                                "--resume_from_checkpoint", "20"], cache_dir)
    # The resumed run rewinds metrics.jsonl to step 20 and logs the rest again.
    original, again = read_metrics(trained), read_metrics(resumed)
    assert [row["step"] for row in again] == [row["step"] for row in original]
    for before, after in zip(original, again):
        # The same step from a bit-exact restore: equal, but for a freshly compiled program's order of
        # the float32 sums over each step's masked tokens (~sqrt(N) x eps32 = 3e-6 relative).
        assert after["loss"] == pytest.approx(before["loss"], rel=1e-5), after["step"]
    results = [read_json(os.path.join(d, "eval_results.json")) for d in (trained, resumed)]
    assert results[0] == results[1]


@pytest.mark.slow
def test_eval_only_from_the_saved_model(trained, tmp_path, cache_dir):
    run(["--model_name_or_path", trained, "--do_eval", "--output_dir", tmp_path] + DATA, cache_dir)
    again, before = (read_json(os.path.join(d, "eval_results.json")) for d in (tmp_path, trained))
    # The eval masks are fixed too, so the saved model scores what it scored at the end of training.
    # The same numbers through a separately compiled program, rounded to 4 decimals: 2e-4 (see above).
    assert again["eval_loss"] == pytest.approx(before["eval_loss"], abs=2e-4)
    assert again["eval_accuracy"] == pytest.approx(before["eval_accuracy"], abs=2e-4)


@pytest.mark.slow
def test_line_by_line(tmp_path, cache_dir):
    # Training only: padded lines take the attention-mask path through preprocessing, masking and the step.
    run(MODEL + DATA + TRAIN + ["--do_train", "--output_dir", tmp_path, "--max_steps", "2", "--line_by_line"],
        cache_dir)
    assert [row["step"] for row in read_metrics(tmp_path)] == [2]
    assert read_json(os.path.join(tmp_path, "all_results.json"))["train_samples"] == 1280


@pytest.mark.slow
def test_usage_errors_are_one_line(tmp_path):
    result = run_script(SCRIPT, MODEL + DATA + ["--output_dir", tmp_path, "--do_eval", "--mlm_probability", "1.5"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "error: --mlm_probability must be between 0 and 1, got 1.5"


@pytest.mark.slow
def test_the_embedded_config_streams_and_learns(tmp_path):
    """configs/mlm_tiny.json with --streaming: read, tokenized and shuffled on the fly, evaluated on
    its validation file; bounded to one pass over the corpus (53 steps), it ends there, before
    --max_steps, and saves that step."""
    out = tmp_path / "out"
    results, log = run_streamed_config(SCRIPT, "configs/mlm_tiny.json", out, 60, 10, "--max_stream_passes", 1,
                                       steps=53)
    assert "pass 1 of the training stream ended at step 53, the last of --max_stream_passes 1" in log
    assert "the training data ran out after step 53 of 60: training ends there" in log
    assert "pass 2" not in log and sorted(os.listdir(out / "checkpoints")) == ["53"]
    # A stream has no size: the examples trained on are the steps' (64 a step, the config's total batch).
    assert results["eval_samples"] > 0 and results["train_samples"] == 53 * 64
