"""run_speech_recognition_seq2seq.py end to end on the espeak-ng clips (data/make_speech_data.py), 8
virtual CPU devices: one training run of configs/speech_recognition_tiny.json, shortened, then one
evaluation and prediction from its output dir alone; bad inputs stop with one error line before a
model is built, the output dir untouched."""

import csv
import os
import shutil
import subprocess
import sys

import pytest

import run_speech_recognition_seq2seq as script
from script_runner import ROOT, directory_state, read_json, read_metrics, run_script, script_env
from test_errors_cli import check_failure, run_in_process
from test_run_image_classification import WITH_MODULES, imported_modules

from tasks import speech_recognition as speech

SCRIPT = "run_speech_recognition_seq2seq.py"
CONFIG = "configs/speech_recognition_tiny.json"
DATA = os.path.join(ROOT, "data", "speech")
# 120 of the config's 210 steps, evaluated once at the end: eval WER ~0.5 where the untrained model's is 1.0.
SHORT = ["--max_steps", 120, "--logging_steps", 30, "--eval_steps", 1000, "--warmup_steps", 20]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(output dir, the eval-only run's output dir, the eval-only run's stderr)."""
    tmp = tmp_path_factory.mktemp("speech")
    out, again = tmp / "trained", tmp / "again"
    # Optimized code: its 120 steps cost more than compiling them (39 s -> 31 s alone).
    result = run_script(SCRIPT, [CONFIG, *SHORT, "--output_dir", out, "--compilation_cache_dir", "none"],
                        env=script_env(optimized_code=True))
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = subprocess.run(
        [sys.executable, "-c", WITH_MODULES, os.path.join(ROOT, SCRIPT), "--model_name_or_path", str(out),
         "--validation_file", os.path.join(DATA, "validation.csv"), "--test_file", os.path.join(DATA, "test.csv"),
         "--do_eval", "--do_predict", "--predict_with_generate", "--language", "english", "--max_label_length", "12",
         "--max_duration_in_seconds", "2", "--per_device_eval_batch_size", "8", "--output_dir", str(again),
         "--compilation_cache_dir", "none"],
        cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    return out, again, evaluated.stderr


def transcripts(split):
    with open(os.path.join(DATA, f"{split}.csv"), encoding="utf-8") as f:
        return [row["text"] for row in csv.DictReader(f)]


@pytest.mark.slow
def test_learns_to_transcribe(trained):
    out = trained[0]
    results = read_json(out / "all_results.json")
    assert results["train_samples"] == 239  # one training clip is longer than the 2-second chunk: skipped
    assert results["eval_samples"] == 40 and results["test_samples"] == 24
    # Untrained, every word is wrong (WER ~1.0: tests/test_speech_recognition.py's scale); the full
    # config reaches ~0.05.
    assert results["eval_wer"] < 0.75 and results["eval_cer"] < results["eval_wer"]
    losses = [row["loss"] for row in read_metrics(out)]
    assert losses[-1] < 0.4 * losses[0]


@pytest.mark.slow
def test_wer_is_computed_from_the_written_transcripts(trained):
    """test_wer is the corpus WER of generated_predictions.txt against the test transcripts, computed here."""
    out = trained[0]
    generated = (out / speech.PREDICTIONS_FILE).read_text().splitlines()
    references = transcripts("test")
    assert len(generated) == len(references) == 24
    wer = speech.word_error_rate(references, generated)
    assert read_json(out / "test_results.json")["test_wer"] == round(wer, 4)


@pytest.mark.slow
def test_eval_only_from_the_saved_dir_reproduces_the_run(trained):
    """The exported model, tokenizer and feature extractor are all a later run needs; no torch."""
    out, again, stderr = trained
    assert read_json(again / "eval_results.json") == read_json(out / "eval_results.json")
    assert (again / speech.PREDICTIONS_FILE).read_text() == (out / speech.PREDICTIONS_FILE).read_text()
    assert (out / "preprocessor_config.json").exists()
    imported = imported_modules(stderr)
    assert {"jax", "transformers", "scipy"} <= imported  # the check sees the imports
    assert not {"torch", "torchaudio", "torchcodec", "tensorflow"} & imported


# ---------------------------------------------------------------------------------------------
# Bad inputs: one error line, before a model is built, the output dir as it was
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fails(monkeypatch, capsys, tmp_path):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was built before the error was found")

    monkeypatch.setattr(script, "load_model", load_model)

    def run(argv, pattern):
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        (out / "all_results.json").write_text("{}")  # an earlier run's
        before = directory_state(str(out))
        returncode = run_in_process(script, [CONFIG, *argv, "--output_dir", out, "--do_eval", "false",
                                             "--do_predict", "false"], tmp_path)
        check_failure(2, returncode, capsys.readouterr().err, pattern)
        assert directory_state(str(out)) == before

    return run


def data_file(tmp_path, rows, header=("audio", "text")):
    path = tmp_path / "train.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_a_text_column_absent_is_named(fails, tmp_path):
    train = data_file(tmp_path, [[os.path.join(DATA, "clips", "train_0000.wav"), "one"]], header=("audio", "words"))
    fails(["--train_file", train], r"--text_column_name 'text' is not a column of the train data; its columns: "
                                   r"audio, words")


def test_a_file_that_is_not_audio_is_named(fails, tmp_path):
    shutil.copy(os.path.join(DATA, "clips", "train_0000.wav"), tmp_path / "good.wav")
    (tmp_path / "notes.wav").write_text("not a clip")
    train = data_file(tmp_path, [["good.wav", "one red cat"], ["notes.wav", "two red cats"]])
    fails(["--train_file", train], r"audio notes\.wav of the train data \(row 1\) cannot be read: not a WAV file")


def test_a_missing_audio_file_is_named(fails, tmp_path):
    train = data_file(tmp_path, [["gone.wav", "one red cat"]])
    fails(["--train_file", train], r"audio file .*gone\.wav of the train data \(row 0\) not found: check the path")


@pytest.mark.slow
def test_the_demo_transcribes_as_the_script_predicts(trained):
    """The demo's predictor on a test clip's bytes writes the line generated_predictions.txt holds for it;
    a file that is not audio is a message, not a crash."""
    from tasks import demo

    out = trained[0]
    task, predictor = demo.load(str(out))
    assert task == "speech-recognition"
    with open(os.path.join(DATA, "test.csv"), encoding="utf-8") as f:
        first = next(csv.DictReader(f))
    with open(os.path.join(DATA, first["audio"]), "rb") as f:
        answer = predictor(f.read())
    assert answer.text == (out / speech.PREDICTIONS_FILE).read_text().splitlines()[0]
    with pytest.raises(demo.BadInput, match="not audio that can be read"):
        predictor(b"plain text")
