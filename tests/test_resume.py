"""Never lose a run: kill a training run at any moment and the resumed run ends exactly as if nothing happened
(end to end), and the fingerprint a resumed run must share with its checkpoint (utils/checkpoints/resume.py).

Summarization and clm: tiny models with dropout (so every device's dropout key matters, under "dp" and
"fsdp"), 8 virtual CPU devices, 12 steps of 6 per epoch, a checkpoint every 4. The other scripts: their
dp runs of tests/layout_runs.py (10 steps, a checkpoint every 5), which the cross-layout tests make
anyway: dropout off there, as the layouts draw different masks by design. Each scenario is compared
with one uninterrupted run of the same command: the exported parameters byte for byte, and every
logged loss and learning rate.
"""

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import T5Config

import script_launcher
from layout_runs import command as layout_command
from script_runner import ROOT, directory_state, read_metrics, script_env
from utils.checkpoints.resume import fingerprint_difference, run_fingerprint
from utils.checkpoints.store import checkpoint_steps


# ---------------------------------------------------------------------------------------------
# The fingerprint a resumed run is checked against
# ---------------------------------------------------------------------------------------------
def fingerprint(train_examples=160, config=None, global_batch_size=16, seed=42, adafactor=False):
    return run_fingerprint(config or T5Config(d_model=32, num_layers=1), train_examples, global_batch_size, seed,
                           adafactor)


def test_fingerprint_names_what_fixes_the_run():
    saved = fingerprint()
    assert set(saved) == {"model config", "global batch size", "training examples", "seed", "optimizer", "adapters"}
    assert saved["global batch size"] == 16 and saved["training examples"] == 160 and saved["adapters"] is None
    assert saved["seed"] == 42 and saved["optimizer"] == "adamw"
    assert saved["model config"]["d_model"] == 32 and "transformers_version" not in saved["model config"]


def test_compatible_changes_are_no_difference():
    saved = fingerprint()
    assert fingerprint_difference(saved, fingerprint()) is None
    # Checkpoints written before the dropout keys were derived from (seed, step) also recorded the
    # layout and the device count: a run on another of either continues what it would have done itself.
    assert fingerprint_difference({**saved, "layout": "dp", "devices": 4}, saved) is None
    config = T5Config(d_model=32, num_layers=1, name_or_path="elsewhere")  # where a config came from is no matter
    assert fingerprint_difference(saved, fingerprint(config=config)) is None


def test_each_incompatible_change_is_named():
    saved = fingerprint()
    cases = [
        (fingerprint(global_batch_size=32),
         "global batch size is 16 in the checkpoint but 32 in this run (set by per_device_train_batch_size x devices"),
        (fingerprint(train_examples=150), "training examples is 160 in the checkpoint but 150 in this run"),
        (fingerprint(seed=1), "seed is 42 in the checkpoint but 1 in this run (set by --seed)"),
        (fingerprint(adafactor=True), "optimizer is 'adamw' in the checkpoint but 'adafactor' in this run"),
        (fingerprint(config=T5Config(d_model=64, num_layers=1)),
         "model config 'd_model' is 32 in the checkpoint but 64 in this run (set by the model config"),
    ]
    for current, message in cases:
        assert fingerprint_difference(saved, current).startswith(message)


def test_eval_only_runs_compare_the_model_config_only():
    current = run_fingerprint(T5Config(d_model=32, num_layers=1))
    assert set(current) == {"model config"}
    assert fingerprint_difference(fingerprint(), current) is None


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------
TRAINING = ["--do_train", "--per_device_train_batch_size", 2, "--max_steps", 12, "--learning_rate", 1e-3,
            "--logging_steps", 1, "--save_steps", 4]
SCRIPTS = {
    "summarization": ("run_summarization_flax.py", [
        "--model_type", "t5", "--tokenizer_name", "data/summarization/tokenizer",
        "--config_overrides",
        "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.1",
        "--train_file", "data/summarization/train.jsonl", "--max_source_length", 32, "--max_target_length", 16,
        "--max_train_samples", 96]),
    "clm": ("run_clm_flax.py", [
        "--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer",
        "--config_overrides", "n_embd=32,n_layer=1,n_head=2,n_positions=32",  # GPT-2's dropouts are 0.1
        "--train_file", "data/lm/train.txt", "--block_size", 16]),
}
# The same runs streamed: the stream's shuffle pool and position are in every checkpoint. The corpus
# is the first 75 lines (86 blocks): a pass is 5 steps (2 with the fsdp run's batch of 32), so every
# resume below continues across the end of a pass into the next, reshuffled one.
STREAM_CORPUS = "the first lines of data/lm/train.txt"  # written by the `command` fixture
SCRIPTS["clm stream"] = (SCRIPTS["clm"][0], [STREAM_CORPUS if arg == "data/lm/train.txt" else arg for arg in
                                             SCRIPTS["clm"][1]] + ["--streaming", "--shuffle_buffer_size", 64])
SCRIPTS["clm"][1].extend(["--max_train_samples", 96])
# The same run with the state split over the devices (one dropout key for the whole batch).
SCRIPTS["clm fsdp"] = (SCRIPTS["clm"][0], SCRIPTS["clm"][1] + ["--sharding", "fsdp"])
# Streamed, split over the devices and accumulated at once (stopped by SIGTERM below).
SCRIPTS["clm stream fsdp"] = (SCRIPTS["clm stream"][0], SCRIPTS["clm stream"][1] + [
    "--sharding", "fsdp", "--gradient_accumulation_steps", 2])
# The other scripts resume from their layout runs' checkpoints: span corruption corrupts, denoising permutes
# and masks, images crop and flip, question answering windows its batches, speech featurises its clips as the
# uninterrupted run did.
LAYOUT_RUNS = ["t5 mlm", "bart dlm", "glue", "ner", "image", "qa", "chat", "speech"]
# Plain clm (in-memory blocks, dp) resumes as summarization does: it is here streamed and under fsdp.
KILLED = ["summarization", "clm stream", "clm fsdp", *LAYOUT_RUNS]


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    """command(name, output_dir, *extra): the script and its arguments (one compilation cache for all runs)."""
    cache = str(tmp_path_factory.mktemp("jax_cache"))
    corpus = tmp_path_factory.mktemp("stream") / "train.txt"
    with open(os.path.join(ROOT, "data", "lm", "train.txt"), encoding="utf-8") as f:
        corpus.write_text("".join(f.readlines()[:75]), encoding="utf-8")

    def make(name, output_dir, *extra):
        script, args = SCRIPTS[name]
        args = [corpus if arg == STREAM_CORPUS else arg for arg in args]
        return [os.path.join(ROOT, script), *map(str, args + TRAINING + ["--compilation_cache_dir", cache,
                                                                          "--output_dir", output_dir, *extra])]

    return make


def run(argv, wrapper=()):
    """Run `python [wrapper] script args` to the end; returns the CompletedProcess."""
    return script_launcher.run([sys.executable, *wrapper, *argv], ROOT, script_env(), timeout=600)


def run_ok(argv):
    result = run(argv)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def interrupted(mode, step, argv):
    return run(argv, wrapper=[os.path.join(ROOT, "tests", "interrupted_run.py"), mode, str(step)])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, command):
    """uninterrupted(name): the output dir of the script's run that nothing stopped (made once)."""
    runs = {}

    def get(name):
        if name not in runs:
            out = str(tmp_path_factory.mktemp(f"{name}_uninterrupted"))
            run_ok(command(name, out))
            runs[name] = out
        return runs[name]

    return get


def last_line(result):
    return result.stderr.strip().splitlines()[-1]


def logged(output_dir):
    return [(row["step"], row["loss"], row["learning_rate"]) for row in read_metrics(output_dir)]


def assert_same_run(output_dir, reference, steps=12):
    """Same final parameters (bytes), same loss and learning rate at every step, TensorBoard without repeats."""
    with open(os.path.join(output_dir, "flax_model.msgpack"), "rb") as a, \
            open(os.path.join(reference, "flax_model.msgpack"), "rb") as b:
        assert a.read() == b.read(), "final parameters differ from the uninterrupted run"
    assert logged(output_dir) == logged(reference)
    assert [step for step, _, _ in logged(output_dir)] == list(range(1, steps + 1))
    events = EventAccumulator(output_dir)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (step, pytest.approx(loss)) for step, loss, _ in logged(reference)]  # TensorBoard keeps float32: 6e-8 off


@pytest.mark.slow
@pytest.mark.parametrize("name", KILLED)
def test_sigkill_after_a_checkpoint_then_resume_is_exact(tmp_path, command, uninterrupted, layout_runs, name):
    out = str(tmp_path / "run")
    if name in LAYOUT_RUNS:
        reference, make, first_save, steps = layout_runs[(name, "dp")], partial(layout_command, name), 5, 10
    else:
        reference, make, first_save, steps = uninterrupted(name), partial(command, name), 4, 12
    process = script_launcher.popen([sys.executable, *make(out)], ROOT, script_env(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.isdir(os.path.join(out, "checkpoints", str(first_save))):
        assert process.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not os.path.exists(os.path.join(out, "all_results.json"))  # killed before the end

    resumed = run_ok(make(out, "--resume_from_checkpoint", "latest"))
    assert "resumed from the checkpoint of step" in resumed.stderr
    if name == "clm stream":  # resumed at step 4 (pass 1) or 8 (pass 2), on into pass 3
        assert "pass 3 of the training stream starts at step 11" in resumed.stderr
    assert_same_run(out, reference, steps)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["summarization", "clm stream fsdp"])
def test_sigterm_mid_epoch_saves_stops_and_says_how_to_resume(tmp_path, command, uninterrupted, name):
    reference, out = uninterrupted(name), str(tmp_path / "run")
    stopped = interrupted("sigterm-after-step", 3, command(name, out))  # summarization's epochs are 6 steps
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    message = last_line(stopped)
    assert message.startswith(f"stopped: SIGTERM received: saved the checkpoint of step 3 in {out}/checkpoints. "
                              "To resume, rerun the same command with --resume_from_checkpoint latest: python ")
    assert "Traceback" not in stopped.stderr
    assert checkpoint_steps(os.path.join(out, "checkpoints")) == [3]
    assert [step for step, _, _ in logged(out)] == [1, 2, 3]  # logs flushed up to the stop

    # The printed command, as a user would paste it.
    resume = shlex.split(message.split("latest: ", 1)[1])
    assert resume[0] == "python" and resume[-2:] == ["--resume_from_checkpoint", "latest"]
    run_ok(resume[1:])
    assert_same_run(out, reference)


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, command, uninterrupted):
    reference, out = uninterrupted("summarization"), str(tmp_path / "run")
    crashed = interrupted("sigkill-during-save", 8, command("summarization", out))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    checkpoints = os.path.join(out, "checkpoints")
    assert glob.glob(os.path.join(checkpoints, "8.orbax-checkpoint-tmp*"))  # the half-written save
    assert checkpoint_steps(checkpoints) == [4]

    resumed = run_ok(command("summarization", out, "--resume_from_checkpoint", "latest"))
    assert "resumed from the checkpoint of step 4" in resumed.stderr
    assert_same_run(out, reference)
    assert checkpoint_steps(checkpoints) == [8, 12]


@pytest.mark.slow
def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, command):
    # A learning rate of 1e30 after a warmup step at 0: step 2 takes the parameters near 1e30, which
    # still give a finite loss in step 3 (the RMS norms overflow to zero) but non-finite parameters;
    # step 4's loss is nan. The save check at step 4 finds it in the window and keeps checkpoint 2.
    # (A non-finite state is refused by `Outputs.save` too: tests/test_run.py.)
    out = str(tmp_path / "run")
    result = run(command("summarization", out, "--learning_rate", 1e30, "--warmup_steps", 2, "--save_steps", 2,
                         "--logging_steps", 100))
    assert result.returncode == 1, result.stderr[-3000:]
    checkpoints = os.path.join(out, "checkpoints")
    assert last_line(result) == ("error: the training loss became nan at step 4: lower --learning_rate or use --dtype "
                                 f"float32; the checkpoint of step 2 is kept in {checkpoints}: resume from step 2 with "
                                 "--resume_from_checkpoint latest")
    assert checkpoint_steps(checkpoints) == [2]


@pytest.mark.slow
def test_output_dir_with_checkpoints_needs_resume_or_overwrite(command, uninterrupted):
    reference = uninterrupted("summarization")
    before = directory_state(reference)
    result = run(command("summarization", reference))
    assert result.returncode == 2
    message = last_line(result)
    assert message.startswith("error: output directory") and "Traceback" not in result.stderr
    assert "--resume_from_checkpoint latest" in message and "--overwrite_output_dir" in message
    assert directory_state(reference) == before


@pytest.mark.parametrize("change, difference", [
    (["--per_device_train_batch_size", 1], "global batch size is 16 in the checkpoint but 8 in this run"),
    (["--config_overrides", "d_model=64,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16"],
     "model config 'd_model' is 32 in the checkpoint but 64 in this run"),
    (["--max_train_samples", 80], "training examples is 96 in the checkpoint but 80 in this run"),
])
@pytest.mark.slow
def test_incompatible_resume_is_refused_before_anything_is_written(tmp_path, command, uninterrupted, change,
                                                                     difference):
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted("summarization"), out)
    before = directory_state(out)
    result = run(command("summarization", out, "--resume_from_checkpoint", "latest", *change))
    assert result.returncode == 2
    assert last_line(result).startswith(f"error: cannot resume from {out}/checkpoints/12: {difference} (set by ")
    assert directory_state(out) == before


@pytest.mark.parametrize("change, message", [
    (["--max_steps", 8], r"the checkpoint .*/checkpoints/12 is at step 12, past the 8 steps of this run: raise "
                         r"--max_steps or --num_train_epochs"),
    (["--param_dtype", "bfloat16"], r"cannot resume from .*/checkpoints/12: checkpoint at step 12 has dtype float32 "
                                    r"for params/\S+, model has bfloat16: the model config or dtype changed"),
    (["--seed", -1], r"--seed must be an integer from 0 to 2\*\*32 - 1, got -1"),
])
@pytest.mark.slow
def test_a_resume_that_cannot_continue_writes_nothing(tmp_path, command, uninterrupted, change, message):
    """Found once the model and the training plan are known, after data and model loading, but still
    before the run directory is opened: every file keeps its bytes and its modification time."""
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted("summarization"), out)
    before = directory_state(out)
    result = run(command("summarization", out, "--resume_from_checkpoint", "latest", *change))
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.fullmatch(f"error: {message}", last_line(result)), last_line(result)
    assert directory_state(out) == before


@pytest.mark.slow
def test_overwrite_removes_everything_the_previous_run_wrote(tmp_path, command, uninterrupted):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted("summarization"), out)
    (out / "test_results.json").write_text("{}")  # as an earlier predict would have left
    (out / "generated_predictions.txt").write_text("an old summary\n")
    (out / "notes.md").write_text("not a run's output")
    before = directory_state(out)
    refused = run(command("summarization", str(out), "--overwrite_output_dir", "--max_steps", 4))
    assert refused.returncode == 2 and "holds files no run of this script writes (notes.md)" in last_line(refused)
    assert directory_state(out) == before

    os.remove(out / "notes.md")
    run_ok(command("summarization", str(out), "--overwrite_output_dir", "--max_steps", 4))
    names = os.listdir(out)
    assert len([name for name in names if name.startswith("events.out.tfevents")]) == 1
    assert "test_results.json" not in names and "generated_predictions.txt" not in names
    assert checkpoint_steps(out / "checkpoints") == [4]
    assert [step for step, _, _ in logged(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_compatible_changes_continue_the_run(tmp_path, command, uninterrupted):
    """More steps, other logging and save intervals: the finished run goes on from its last checkpoint."""
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted("summarization"), out)
    run_ok(command("summarization", out, "--resume_from_checkpoint", "latest", "--max_steps", 14,
                   "--logging_steps", 2, "--save_steps", 7))
    assert [step for step, _, _ in logged(out)] == list(range(1, 13)) + [14]
    assert checkpoint_steps(os.path.join(out, "checkpoints")) == [12, 14]
