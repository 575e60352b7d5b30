"""run_speech_recognition_seq2seq.py with a speech encoder-decoder (a tiny wav2vec2 encoder + GPT-2
decoder, configs/speech_encoder_decoder_tiny.json) end to end on the espeak-ng clips: a few training
steps on one CPU device (tests/test_run_speech_recognition.py runs Whisper on 8) with eval WER, then
prediction from the saved dir alone, which the demo's predictor repeats; a decoder it cannot generate
with, or --language (Whisper's), stops the run with one error line."""

import csv
import os

import pytest

import run_speech_recognition_seq2seq as script
from script_runner import ROOT, directory_state, read_json, run_script, script_env
from test_errors_cli import check_failure, run_in_process

from tasks import speech_recognition as speech

SCRIPT = "run_speech_recognition_seq2seq.py"
CONFIG = "configs/speech_encoder_decoder_tiny.json"
DATA = os.path.join(ROOT, "data", "speech")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the training run's output dir, the predict-only run's), both compiling into one cache."""
    tmp = tmp_path_factory.mktemp("speech_encoder_decoder")
    out, again, cache = tmp / "trained", tmp / "again", tmp / "compiled"
    result = run_script(SCRIPT, [CONFIG, "--max_steps", 10, "--logging_steps", 5, "--eval_steps", 1000,
                                 "--max_eval_samples", 8, "--do_predict", "false", "--output_dir", out,
                                 "--compilation_cache_dir", cache], env=script_env(devices=1))
    assert result.returncode == 0, result.stderr[-3000:]
    predicted = run_script(SCRIPT, ["--model_name_or_path", out, "--test_file", os.path.join(DATA, "test.csv"),
                                    "--do_predict", "--predict_with_generate", "--max_label_length", 12,
                                    "--max_duration_in_seconds", 2, "--per_device_eval_batch_size", 8,
                                    "--max_predict_samples", 8, "--output_dir", again,
                                    "--compilation_cache_dir", cache], env=script_env(devices=1))
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    return out, again


@pytest.mark.slow
def test_trains_evaluates_and_predicts_from_the_saved_dir(trained):
    out, again = trained
    results = read_json(out / "all_results.json")
    assert results["train_samples"] == 239 and results["eval_samples"] == 8
    assert 0 <= results["eval_cer"] and 0 < results["eval_wer"] <= 1.5  # generated and scored
    assert read_json(out / "config.json")["model_type"] == "speech-encoder-decoder"
    assert read_json(out / "preprocessor_config.json")["feature_extractor_type"] == "Wav2Vec2FeatureExtractor"
    tested = read_json(again / "all_results.json")
    generated = (again / speech.PREDICTIONS_FILE).read_text().splitlines()
    with open(os.path.join(DATA, "test.csv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:8]
    assert len(generated) == len(rows) == tested["test_samples"] == 8
    assert tested["test_wer"] == round(speech.word_error_rate([row["text"] for row in rows], generated), 4)
    # No Whisper prefix is generated: the transcripts are the decoder's words alone.
    assert not any("<|" in line for line in generated)

    # The demo's predictor on a test clip's bytes writes the line the predict-only run wrote for it.
    from tasks import demo

    task, predictor = demo.load(str(out))
    assert task == "speech-recognition"
    with open(os.path.join(DATA, rows[0]["audio"]), "rb") as f:
        assert predictor(f.read()).text == generated[0]


@pytest.mark.parametrize("flags, pattern", [
    (["--decoder_model_type", "t5", "--decoder_config_overrides", ""],
     r"model type 't5' cannot be trained by this script: use one of gpt2, bart, bert, roberta"),
    (["--language", "english"], r"--language 'english' picks a Whisper language token; .* drop --language"),
], ids=["t5 decoder", "--language"])
def test_a_decoder_it_cannot_generate_with_or_a_whisper_flag_is_one_error_line(monkeypatch, capsys, tmp_path, flags,
                                                                              pattern):
    def load_composed_model(*args, **kwargs):
        raise AssertionError("the model was built before the error was found")

    monkeypatch.setattr(script, "load_composed_model", load_composed_model)
    out = tmp_path / "out"
    out.mkdir()
    before = directory_state(str(out))
    returncode = run_in_process(script, [CONFIG, *flags, "--output_dir", out], tmp_path)
    check_failure(2, returncode, capsys.readouterr().err, pattern)
    assert directory_state(str(out)) == before
