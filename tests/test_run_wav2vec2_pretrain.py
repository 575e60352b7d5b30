"""run_wav2vec2_pretrain_flax.py end to end on the espeak-ng clips (data/make_speech_data.py), 8 virtual
CPU devices: a short run of configs/wav2vec2_pretrain_tiny.json (evaluation padded to whole devices of
padding), the same run killed after its first checkpoint and resumed, the export read back as an
encoder and by the demo; bad inputs stop with one error line before a model is built, the output dir
untouched."""

import csv
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import run_wav2vec2_pretrain_flax as script
import script_launcher
from script_runner import ROOT, directory_state, read_json, read_metrics, run_script, script_env
from test_errors_cli import check_failure, run_in_process

SCRIPT = "run_wav2vec2_pretrain_flax.py"
CONFIG = "configs/wav2vec2_pretrain_tiny.json"
DATA = os.path.join(ROOT, "data", "speech")
# 6 steps of 16 clips, a checkpoint at 3; 16 validation clips in one eval batch of 8 devices x 8 rows:
# six devices hold padding only.
SHORT = [CONFIG, "--max_steps", 6, "--logging_steps", 1, "--save_steps", 3, "--eval_steps", 1000,
         "--warmup_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16, "--compilation_cache_dir", "none"]
EVAL_KEYS = {"eval_loss", "eval_contrastive_loss", "eval_diversity_loss", "eval_codevector_perplexity", "eval_tokens",
             "eval_samples"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("wav2vec2") / "trained"
    result = run_script(SCRIPT, [*SHORT, "--output_dir", out])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_short_run_logs_every_measure_and_exports_an_encoder(trained):
    results = read_json(trained / "all_results.json")
    assert EVAL_KEYS <= set(results) and results["eval_samples"] == 16 and results["train_samples"] == 64
    assert read_json(trained / "eval_results.json") == {k: v for k, v in results.items() if k.startswith("eval_")}
    # The mean over the masked frames: the contrastive loss of 21 candidates starts near log(21), not at a
    # sum over hundreds of frames; the loss adds the weighted diversity loss.
    assert 1.0 < results["eval_contrastive_loss"] < 2 * math.log(21)
    assert results["eval_loss"] == pytest.approx(results["eval_contrastive_loss"] + 0.1 * results["eval_diversity_loss"],
                                                 abs=2e-4)
    assert 2 <= results["eval_codevector_perplexity"] <= 64
    assert results["eval_tokens"] > 16 * 20  # every validation clip masked, the padding rows not
    rows = read_metrics(trained)
    assert [row["step"] for row in rows] == list(range(1, 7))
    assert all(np.isfinite(row["loss"]) and 2 <= row["codevector_perplexity"] <= 64 for row in rows)
    temperatures = [row["gumbel_temperature"] for row in rows]
    assert temperatures == pytest.approx([max(2.0 * 0.995 ** step, 0.5) for step in range(6)], rel=1e-6)
    config = read_json(trained / "config.json")
    assert config["architectures"] == ["Wav2Vec2ForPreTraining"]  # transformers saves it without "Flax"
    assert (trained / "preprocessor_config.json").exists() and (trained / "flax_model.msgpack").exists()
    card = (trained / "README.md").read_text()
    assert "pipeline_tag: feature-extraction" in card and "from scratch (a `data/speech/wav2vec2_tiny` config)" in card

    from transformers import FlaxWav2Vec2ForPreTraining, FlaxWav2Vec2Model

    _, encoder = FlaxWav2Vec2Model.from_pretrained(trained, _do_init=False)  # what fine-tuning starts from
    _, full = FlaxWav2Vec2ForPreTraining.from_pretrained(trained, _do_init=False)
    assert set(full) == {"wav2vec2", "quantizer", "project_q", "project_hid"} and set(encoder) == set(full["wav2vec2"])
    np.testing.assert_array_equal(encoder["feature_projection"]["projection"]["kernel"],
                                  full["wav2vec2"]["feature_projection"]["projection"]["kernel"])


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_is_exact(trained, tmp_path):
    """Masks, negatives and Gumbel noise are drawn from (seed, step): the resumed run is the same run."""
    out = str(tmp_path / "run")
    argv = [sys.executable, os.path.join(ROOT, SCRIPT), *map(str, SHORT), "--output_dir", out]
    process = script_launcher.popen(argv, ROOT, script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.isdir(os.path.join(out, "checkpoints", "3")):
        assert process.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not os.path.exists(os.path.join(out, "all_results.json"))
    resumed = run_script(SCRIPT, [*SHORT, "--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the checkpoint of step 3" in resumed.stderr
    assert (tmp_path / "run" / "flax_model.msgpack").read_bytes() == (trained / "flax_model.msgpack").read_bytes()
    assert read_json(os.path.join(out, "eval_results.json")) == read_json(trained / "eval_results.json")
    keys = ("step", "loss", "codevector_perplexity", "gumbel_temperature")
    assert [[row[k] for k in keys] for row in read_metrics(out)] == [[row[k] for k in keys] for row in
                                                                      read_metrics(trained)]


@pytest.mark.slow
def test_the_demo_reports_the_codebook_use_of_a_clip(trained):
    from tasks import demo
    from tasks import wav2vec2_pretraining as w2v

    task, predictor = demo.load(str(trained))
    assert task == "wav2vec2-pretraining"
    with open(os.path.join(DATA, "validation.csv"), encoding="utf-8") as f:
        first = next(csv.DictReader(f))
    with open(os.path.join(DATA, first["audio"]), "rb") as f:
        clip = f.read()
    answer = predictor(clip)
    frames = int(w2v.frame_lengths(predictor.config, predictor.waveforms(clip)["attention_mask"].sum()))
    assert answer.text.startswith(f"{frames} frames; codevector perplexity ")
    assert 1 <= float(answer.text.split("perplexity ")[1].split()[0]) <= 64
    with pytest.raises(demo.BadInput, match="not audio"):
        predictor(b"not a clip")


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
        returncode = run_in_process(script, [CONFIG, *argv, "--output_dir", out, "--do_eval", "false"], tmp_path)
        check_failure(2, returncode, capsys.readouterr().err, pattern)
        assert directory_state(str(out)) == before

    return run


def data_file(tmp_path, rows, header=("audio",)):
    path = tmp_path / "train.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_an_audio_column_absent_is_named(fails, tmp_path):
    train = data_file(tmp_path, [[os.path.join(DATA, "clips", "train_0000.wav")]], header=("file",))
    fails(["--train_file", train], r"--audio_column_name 'audio' is not a column of the train data; its columns: file")


def test_a_file_that_is_not_audio_is_named(fails, tmp_path):
    shutil.copy(os.path.join(DATA, "clips", "train_0000.wav"), tmp_path / "good.wav")
    (tmp_path / "notes.wav").write_text("not a clip")
    train = data_file(tmp_path, [["good.wav"], ["notes.wav"]])
    fails(["--train_file", train], r"audio notes\.wav of the train data \(row 1\) cannot be read: not a WAV file")


def test_a_missing_audio_file_is_named(fails, tmp_path):
    train = data_file(tmp_path, [["gone.wav"]])
    fails(["--train_file", train], r"audio file .*gone\.wav of the train data \(row 0\) not found: check the path")


def test_the_classic_flag_names_the_audio_column(fails, tmp_path):
    train = data_file(tmp_path, [["gone.wav"]], header=("file",))
    fails(["--train_file", train, "--speech_file_column", "file"], r"audio file .*gone\.wav of the train data")


def test_settings_without_meaning_here_are_refused(fails):
    fails(["--min_gumbel_temperature", "3"], r"--min_gumbel_temperature \(3\) <= --max_gumbel_temperature \(2\)")
    fails(["--label_smoothing_factor", "0.1"], r"--label_smoothing_factor has no labels to smooth")


@pytest.mark.parametrize("flags, pattern", [
    # Not numbers a run could train with: the loss or the temperature schedule would be nan or inf
    (["--max_gumbel_temperature", "inf"], r"--max_gumbel_temperature \(inf\), both finite"),
    (["--diversity_loss_weight", "nan"], r"--diversity_loss_weight must be >= 0 and finite, got nan"),
    (["--mask_time_prob", "nan"], r"--mask_time_prob must be in \(0, 1\], got nan"),
])
def test_pretraining_settings_out_of_range_are_refused(fails, flags, pattern):
    fails(flags, pattern)
