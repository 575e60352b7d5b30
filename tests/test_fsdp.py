"""`--sharding fsdp` end to end, 8 virtual CPU devices: every script gives the numbers `dp` gives,
writes its train step's memory, moves checkpoints between layouts, and stops before training when
its step cannot fit the device.

Each script layout_runs once per layout on the same tiny config and seed, dropout off (dp draws a
dropout key per device, fsdp one for the global batch: with dropout on they would differ by design).
"""

import json
import re

import jax
import numpy as np
import pytest

import run_clm_flax as clm
from layout_runs import PREDICTIONS, SCRIPTS, command
from script_runner import directory_state, read_json, read_metrics, run_script
from utils.base.errors import run_main
from utils.layout import memory

pytestmark = pytest.mark.slow


def losses(out):
    return [(row["step"], row["loss"]) for row in read_metrics(out)]


@pytest.mark.parametrize("name", SCRIPTS)
def test_fsdp_trains_and_evaluates_as_dp_does(layout_runs, name):
    dp, fsdp = layout_runs[(name, "dp")], layout_runs[(name, "fsdp")]
    assert [step for step, _ in losses(fsdp)] == [step for step, _ in losses(dp)] == list(range(1, 11))
    # Mean losses over >= 500 tokens summed in another order (per device vs the global array): ~sqrt(N)
    # x eps32 = 3e-6 relative; 10 steps of lr-sized updates add parameter differences as small.
    assert [loss for _, loss in losses(fsdp)] == pytest.approx([loss for _, loss in losses(dp)], rel=1e-5)
    dp_results, fsdp_results = read_json(dp / "all_results.json"), read_json(fsdp / "all_results.json")
    for key, value in dp_results.items():
        if key in ("train_runtime", "train_step_device_bytes"):
            continue
        # Counts alike; losses and ROUGE of a float32 run differ in the last digits at most: the results
        # round to 4 decimals (abs 1e-3 covers that with the float32 sums), rel 1e-4 a ROUGE near 10-50.
        assert fsdp_results[key] == pytest.approx(value, rel=1e-4, abs=1e-3), key
    if name in PREDICTIONS:
        assert (fsdp / PREDICTIONS[name]).read_text() == (dp / PREDICTIONS[name]).read_text()
    # The exported models are the same model.
    with open(fsdp / "config.json") as a, open(dp / "config.json") as b:
        assert json.load(a) == json.load(b)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_train_step_memory_is_written(layout_runs, name):
    for sharding in ("dp", "fsdp"):
        out = layout_runs[(name, sharding)]
        memory = read_metrics(out, "memory")
        assert len(memory) == 1 and memory[0]["step"] == 0
        written = read_json(out / "all_results.json")["train_step_device_bytes"]
        assert written == memory[0]["train_step_device_bytes"] > 0
        assert {"train_step_device_bytes_arguments", "train_step_device_bytes_temporaries"} <= set(memory[0])
    dp, fsdp = (read_metrics(layout_runs[(name, sharding)], "memory")[0] for sharding in ("dp", "fsdp"))
    # Tiny models: most leaves are below the size worth splitting (utils/layout/layouts.py), yet the state shrinks.
    assert fsdp["train_step_device_bytes_arguments"] < 0.7 * dp["train_step_device_bytes_arguments"]


def test_fsdp_needs_less_memory_for_a_model_that_dominates_its_step(layout_runs):
    """The clm model (GPT-2 n_embd 64, ~900-token vocabulary) outweighs its 2 x 32-token batch."""
    dp, fsdp = (read_json(layout_runs[("clm", sharding)] / "all_results.json")["train_step_device_bytes"]
                for sharding in ("dp", "fsdp"))
    assert fsdp < dp


def test_the_log_says_how_the_state_is_split(layout_runs):
    log = (layout_runs[("clm", "fsdp")].parent / "clm_fsdp.log").read_text()
    assert re.search(r"fsdp: parameters and optimizer state take \S+ \w+ per device split 8 ways \+ \S+ \w+ whole",
                     log)
    assert re.search(r"train step \(fsdp\): \S+ \w+ per device \(arguments ", log)


@pytest.mark.parametrize("saved, resumed", [("dp", "fsdp"), ("fsdp", "dp")])
def test_a_checkpoint_moves_to_the_other_layout(layout_runs, tmp_path, saved, resumed):
    """The run of one layout goes on in the other from its step-5 checkpoint: the weights and optimizer
    state continue exactly (tests/test_layout.py compares them), and the steps after 5 are those the
    other layout would have taken from there (the dropout keys are the step's: `Layout.dropout_key`)."""
    import shutil

    out = tmp_path / "moved"
    shutil.copytree(layout_runs[("clm", saved)], out)
    result = run_script("run_clm_flax.py", command("clm", str(out), "--sharding", resumed,
                                                   "--resume_from_checkpoint", "5")[1:])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from the checkpoint of step 5" in result.stderr
    # Dropout is off: the continuation is the original one, summed in the other layout's order (rel 1e-5
    # as above).
    assert [loss for _, loss in losses(out)] == pytest.approx([loss for _, loss in losses(layout_runs[("clm", saved)])],
                                                               rel=1e-5)


def test_fsdp_with_accumulation_bf16_and_gradient_checkpointing(tmp_path):
    out = tmp_path / "out"  # RoBERTa: GPT-2's Flax code has no gradient checkpointing
    result = run_script("run_mlm_flax.py", command("mlm", str(out), "--sharding", "fsdp", "--fsdp_size", 4,
                                                   "--gradient_accumulation_steps", 2, "--dtype", "bfloat16",
                                                   "--param_dtype", "bfloat16", "--gradient_checkpointing",
                                                   "--learning_rate", 1e-2, "--do_eval", "false")[1:])
    assert result.returncode == 0, result.stderr[-3000:]
    train = [loss for _, loss in losses(out)]
    assert np.all(np.isfinite(train)) and train[-1] < 0.9 * train[0]
    assert "2 x 4 (data x fsdp) mesh" in result.stderr
    from flax import serialization

    with open(out / "flax_model.msgpack", "rb") as f:
        exported = serialization.msgpack_restore(f.read())
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(exported)} == {np.dtype(jax.numpy.bfloat16)}


def test_a_step_too_big_for_the_device_stops_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """A device that reports a memory limit (TPU, GPU): faked here at 64 KiB."""
    monkeypatch.setattr(memory, "device_memory_limit", lambda: 64 * 2**10)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    before = directory_state(out)
    argv = [str(a) for a in command("clm", str(out), "--overwrite_output_dir")[1:]]
    assert run_main(lambda: clm.main(argv), argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"error: the train step needs \S+ \w+ per device but a device has 64\.0 KiB: use --sharding "
                        r"fsdp, a smaller --per_device_train_batch_size with more --gradient_accumulation_steps "
                        r"\(now 1\), --dtype bfloat16, or --gradient_checkpointing", last), last
    assert directory_state(out) == before


def test_a_step_the_compiler_refuses_stops_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """A TPU's compiler does not compile a step whose temporaries alone exceed the device's memory
    (RESOURCE_EXHAUSTED, its message below): the same levers, in one line. Faked here on the CPU."""
    def refuse(lowered):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                                         "for HLO temporaries (22.04G) exceeds available HBM (15.48G).")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    before = directory_state(out)
    argv = [str(a) for a in command("clm", str(out), "--overwrite_output_dir", "--gradient_checkpointing")[1:]]
    assert run_main(lambda: clm.main(argv), argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("error: the train step does not fit a device (the compiler: Ran out of memory on HBM, the total "
                    "memory required for HLO temporaries (22.04G) exceeds available HBM (15.48G)): use --sharding "
                    "fsdp, a smaller --per_device_train_batch_size with more --gradient_accumulation_steps (now 1), "
                    "--dtype bfloat16 (--gradient_checkpointing is on)"), last
    assert directory_state(out) == before
