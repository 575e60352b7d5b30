"""End-to-end runs of run_summarization_flax.py on the shipped data, 8 virtual CPU devices."""

import json
import os

import numpy as np
import pytest

from script_runner import ROOT, calls_of_steps_compiled_once, read_json, read_metrics, run_script
from tasks.summarization import summary_loss

SCRIPT = "run_summarization_flax.py"
DATA = os.path.join(ROOT, "data", "summarization")
TINY_T5 = "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.0"
# 160 training examples / (2 per device x 8 devices) = 10 steps per epoch.
T5_CONFIG = {
    "model_type": "t5",
    "config_overrides": TINY_T5,
    "tokenizer_name": os.path.join(DATA, "tokenizer"),
    "train_file": os.path.join(DATA, "train.jsonl"),
    "validation_file": os.path.join(DATA, "validation.jsonl"),
    "test_file": os.path.join(DATA, "test.jsonl"),
    "max_source_length": 96,
    "max_target_length": 16,
    "max_train_samples": 160,
    "max_eval_samples": 37,
    "max_predict_samples": 21,
    "do_train": True,
    "do_eval": True,
    "do_predict": True,
    "predict_with_generate": True,
    "num_beams": 2,
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 2,
    "learning_rate": 0.001,
    "num_train_epochs": 3,
    "logging_steps": 5,
    "eval_steps": 10,
    "save_steps": 100,
    "compilation_cache_dir": "none",
}
RESULT_KEYS = ("loss", "tokens", "rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len")


def run_ok(args, **kwargs):
    result = run_script(SCRIPT, args, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny T5 run from a JSON config with a CLI override (learning rate raised to 1e-2)."""
    tmp = tmp_path_factory.mktemp("t5")
    config = tmp / "config.json"
    config.write_text(json.dumps({**T5_CONFIG, "output_dir": str(tmp / "out")}))
    run_ok([config, "--learning_rate", "1e-2"], steps_report=tmp / "steps.json")
    return tmp / "out"


@pytest.mark.slow
def test_each_step_compiles_once(trained):
    """Train steps 2..N, every eval and every generate batch (the last one padded) reuse the first
    call's program: 30 train steps, 3 evaluations of 3 batches and a 2-batch test set."""
    assert calls_of_steps_compiled_once(trained.parent / "steps.json") == {
        "train_step": 30, "eval_step": 3 * 3 + 2, "generate_step": 3 * 3 + 2}


@pytest.mark.slow
def test_result_files_and_keys(trained):
    for name in ("eval_results.json", "test_results.json", "all_results.json", "generated_predictions.txt",
                 "run_args.json", "metrics.jsonl", "flax_model.msgpack", "config.json", "tokenizer.json"):
        assert (trained / name).exists(), name
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(trained))
    eval_results, test_results = read_json(trained / "eval_results.json"), read_json(trained / "test_results.json")
    assert all(f"eval_{key}" in eval_results for key in RESULT_KEYS)
    assert all(f"test_{key}" in test_results for key in RESULT_KEYS)
    assert read_json(trained / "all_results.json").items() >= {**eval_results, **test_results}.items()


@pytest.mark.slow
def test_cli_overrides_json_and_secrets_are_not_saved(trained):
    saved = read_json(trained / "run_args.json")
    assert saved["learning_rate"] == 1e-2
    assert saved["num_train_epochs"] == 3
    assert "hub_token" not in saved and "token" not in saved


@pytest.mark.slow
def test_loss_falls_and_rouge_rises(trained):
    train = read_metrics(trained, "train")
    assert train[-1]["loss"] < 0.8 * train[0]["loss"]
    evals = read_metrics(trained, "eval")
    assert [row["step"] for row in evals] == [10, 20, 30]
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert evals[-1]["rougeL"] > evals[0]["rougeL"]


@pytest.mark.slow
def test_samples_limits_and_every_example_counted(trained):
    assert read_metrics(trained, "train")[-1]["step"] == 30  # 3 epochs of 160 / 16
    results = read_json(trained / "all_results.json")
    assert results["train_samples"] == 160
    assert results["eval_samples"] == 37 and results["test_samples"] == 21
    lines = (trained / "generated_predictions.txt").read_text().splitlines()
    assert len(lines) == 21
    # The loss counts each summary token (up to max_target_length, the end token included) once.
    from transformers import AutoTokenizer

    with open(T5_CONFIG["validation_file"], encoding="utf-8") as f:
        summaries = [json.loads(line)["summary"] for line in f][:37]
    labels = AutoTokenizer.from_pretrained(T5_CONFIG["tokenizer_name"])(
        text_target=summaries, max_length=T5_CONFIG["max_target_length"], truncation=True)["input_ids"]
    assert results["eval_tokens"] == sum(map(len, labels))


@pytest.mark.slow
def test_eval_only_from_saved_dir_matches_and_is_batch_size_independent(trained, tmp_path):
    """Padding the last batch must not change the loss: every example counts exactly once."""
    losses = []
    for batch_size in (1, 3):
        out = tmp_path / f"eval{batch_size}"
        run_ok(["--model_name_or_path", trained, "--validation_file", T5_CONFIG["validation_file"],
                "--max_eval_samples", 37, "--max_source_length", 96, "--max_target_length", 16,
                "--do_eval", "--per_device_eval_batch_size", batch_size, "--output_dir", out,
                "--compilation_cache_dir", "none"])
        losses.append(read_json(out / "eval_results.json")["eval_loss"])
    # Result files round to 4 decimals (each value within 5e-5: 1e-4 apart); the float32 sums over
    # 37 x 16 tokens in other batches differ by ~sqrt(592) x eps32 x loss (~3) = 1e-5. So 2e-4.
    assert losses[0] == pytest.approx(losses[1], abs=2e-4)
    assert losses[0] == pytest.approx(read_json(trained / "eval_results.json")["eval_loss"], abs=2e-4)


@pytest.mark.slow
def test_eval_only_with_the_training_config(trained, tmp_path):
    """The README's recipe: the config the model was trained with, pointed at the trained model. Its
    --config_overrides agree with the saved config, so they are no conflict."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**T5_CONFIG, "output_dir": str(tmp_path / "unused"), "overwrite_output_dir": True}))
    out = tmp_path / "eval"
    run_ok([config, "--model_name_or_path", trained, "--do_train", "false", "--do_predict", "false",
            "--output_dir", out])
    # 2e-4: the results' 4-decimal rounding plus float32 sums in other orders (see above).
    assert read_json(out / "eval_results.json")["eval_loss"] == pytest.approx(
        read_json(trained / "eval_results.json")["eval_loss"], abs=2e-4)
    assert not (out / "checkpoints").exists() and not (tmp_path / "unused").exists()


@pytest.mark.slow
def test_predict_only_from_saved_dir(trained, tmp_path):
    out = tmp_path / "predict"
    run_ok(["--model_name_or_path", trained, "--test_file", T5_CONFIG["test_file"], "--max_predict_samples", 21,
            "--max_source_length", 96, "--max_target_length", 16, "--do_predict", "--predict_with_generate",
            "--num_beams", 2, "--output_dir", out, "--compilation_cache_dir", "none"])
    assert not (out / "eval_results.json").exists()
    again, before = read_json(out / "test_results.json"), read_json(trained / "test_results.json")
    assert again["test_loss"] == pytest.approx(before["test_loss"], abs=2e-4)  # as in the eval-only tests
    # Beam search of a barely trained model sits on near-ties, so a separately compiled program
    # may flip a token: compare the summaries as a whole (one flipped token of ~300 moves ROUGE-L
    # by ~0.3-1 point; 3 points is a few of them, a broken predict path scores tens of points off).
    assert again["test_rougeL"] == pytest.approx(before["test_rougeL"], abs=3)
    assert len((out / "generated_predictions.txt").read_text().splitlines()) == 21


@pytest.mark.slow
def test_untrained_model_scores_lower(trained, tmp_path):
    out = tmp_path / "untrained"
    run_ok(["--model_type", "t5", "--config_overrides", TINY_T5, "--tokenizer_name", T5_CONFIG["tokenizer_name"],
            "--test_file", T5_CONFIG["test_file"], "--max_predict_samples", 21, "--max_source_length", 96,
            "--max_target_length", 16, "--do_predict", "--predict_with_generate", "--output_dir", out,
            "--compilation_cache_dir", "none"])
    untrained = read_json(out / "test_results.json")["test_rougeL"]
    assert untrained < 5
    assert read_json(trained / "test_results.json")["test_rougeL"] > untrained + 10


@pytest.mark.slow
def test_output_dir_protection(trained):
    before = {name: os.path.getmtime(trained / name) for name in os.listdir(trained)}
    result = run_script(SCRIPT, ["--model_type", "t5", "--tokenizer_name", T5_CONFIG["tokenizer_name"],
                                 "--train_file", T5_CONFIG["train_file"], "--do_train", "--output_dir", trained])
    assert result.returncode == 2
    assert "--overwrite_output_dir" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    assert {name: os.path.getmtime(trained / name) for name in os.listdir(trained)} == before


def test_summary_loss_counts_the_summary_tokens_of_real_rows():
    vocab = 5
    labels = np.array([[3, 4, 2, 0], [4, 2, 0, 0]])  # summaries, then padding (id 0)
    decoder_attention_mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    example_weight = np.array([1.0, 0.0])  # the second row is eval padding
    # Right on the summary tokens of the real row, wrong on everything that must not count.
    logits = 30.0 * np.eye(vocab, dtype=np.float32)[(labels + 1) % vocab]
    logits[0, :3] = 30.0 * np.eye(vocab, dtype=np.float32)[labels[0, :3]]
    loss, sums = summary_loss(logits, labels, decoder_attention_mask, example_weight)
    assert float(sums["tokens"]) == 3
    assert float(loss) == float(sums["loss"]) and float(loss) / 3 < 1e-6
