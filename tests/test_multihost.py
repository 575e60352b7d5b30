"""Scaling end to end, mostly through run_summarization_flax.py: multi-host, gradient accumulation, fsdp.

Runs, all on the tiny T5 and shapes of test_run_summarization.py (20 optimizer steps, global batch 64):
- reference: 1 process x 8 virtual devices, per-device batch 2 x 4 accumulated micro-batches;
- multihost: the same config on 2 processes x 4 devices (loopback coordinator, gloo collectives).
  Process 1 gets its own output_dir, as a second host has its own disk: it must stay empty;
- big_batch: per-device batch 8 x 1 (the same global batch without accumulation);
- fsdp: the reference's config with the state split over the devices, on 1 x 8 and on 2 x 4;
and every other script but clm, glue and ner on 2 x 4 against its 1 x 8 run (tests/layout_runs.py).
"""

import os
import sys
import time

import jax
import numpy as np
import pytest
from flax import serialization

import script_runner
from layout_runs import PREDICTIONS, SCRIPTS
from script_runner import ROOT, free_port, read_json, read_metrics, run_processes, script_env
from test_run_summarization import SCRIPT, T5_CONFIG

# 160 examples / global batch 64 (2 per device x 8 devices x 4) = 2 steps per epoch: 20 steps.
# The runs compared here sum the same numbers in other orders (micro-batches, devices, processes).
# Adam's eps at 1e-3, not 1e-8: Adam's update m / (sqrt(v) + eps) of a parameter whose gradient is
# near zero (terms that cancel) is the sign of that gradient's rounding, so with 1e-8 another order
# can flip a whole lr-sized step (measured: 4.7e-5 apart after 20 steps here, 7e-5 on another CPU).
# With 1e-3 the update moves by at most 1/eps times the gradient's rounding (2.4e-7 apart).
CONFIG = {**T5_CONFIG, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "num_train_epochs": 10,
          "learning_rate": 0.003, "adam_epsilon": 1e-3, "logging_steps": 1, "eval_steps": 10, "save_steps": 10,
          "num_beams": 1}
# Parameters after 20 steps of runs summing in other orders. Per step Adam moves a parameter by
# lr x dg / eps at most, dg the rounding of its gradient: sqrt(1024 target tokens) x eps32 (1.2e-7) x
# per-token |g| (< 1: a softmax output) = 3.8e-6, so 3e-3 x 3.8e-6 / 1e-3 = 1.1e-5; 20 steps: 2.3e-4.
PARAMS_ATOL = 2.5e-4
# Mean losses over 1024 target tokens: a float32 sum in another order rounds by ~sqrt(1024) x eps32 =
# 3.8e-6 relative (measured 2.2e-7, across processes and micro-batches alike).
LOSS_RTOL = 1e-5
TRAIN_ONLY = {"do_eval": False, "do_predict": False}
SAME_FILES = ("eval_results.json", "test_results.json", "generated_predictions.txt")


def flags(config):
    return [item for key, value in config.items() for item in (f"--{key}", str(value))]


def command(config):
    return [sys.executable, os.path.join(ROOT, SCRIPT), *flags(config)]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process runs, side by side (independent: two cores do them in about half the time)."""
    tmp = tmp_path_factory.mktemp("single")
    runs = {"reference": {}, "big_batch": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                                           **TRAIN_ONLY},
            "fsdp": {"sharding": "fsdp"}}
    commands = [command({**CONFIG, **overrides, "output_dir": tmp / name}) for name, overrides in runs.items()]
    run_processes(commands, [tmp / f"{name}.log" for name in runs], [script_env()] * len(runs))
    return {name: tmp / name for name in runs}


@pytest.fixture(scope="module")
def multihost(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    outs, port = [tmp / "host0", tmp / "host1"], free_port()
    commands = [command({**CONFIG, "output_dir": outs[i], "coordinator_address": f"127.0.0.1:{port}",
                         "num_processes": 2, "process_id": i}) for i in range(2)]
    logs = [tmp / "process0.log", tmp / "process1.log"]
    run_processes(commands, logs, [script_env(devices=4)] * 2)
    return outs, logs


@pytest.fixture(scope="module")
def multihost_fsdp(tmp_path_factory):
    """fsdp on 2 x 4: one --output_dir for both, as on shared storage (every process writes its
    shards of each checkpoint into it); a second run points process 1 at a disk of its own."""
    tmp = tmp_path_factory.mktemp("multihost_fsdp")
    out, port = tmp / "shared", free_port()
    commands = [command({**CONFIG, "sharding": "fsdp", "output_dir": out, "coordinator_address": f"127.0.0.1:{port}",
                         "num_processes": 2, "process_id": i}) for i in range(2)]
    run_processes(commands, [tmp / "process0.log", tmp / "process1.log"],
                  [script_env(devices=4)] * 2)
    return out


def losses(out, split="train"):
    return [(row["step"], row["loss"]) for row in read_metrics(out, split)]


def saved_params(out):
    with open(out / "flax_model.msgpack", "rb") as f:
        return serialization.msgpack_restore(f.read())


@pytest.mark.slow
def test_two_processes_match_one(single, multihost):
    reference = single["reference"]
    (out, _), _ = multihost
    single, multi = losses(reference), losses(out)
    assert [step for step, _ in multi] == [step for step, _ in single] == list(range(1, 21))
    # Only the order of the cross-device sums differs (LOSS_RTOL).
    assert [loss for _, loss in multi] == pytest.approx([loss for _, loss in single], rel=LOSS_RTOL)
    assert [loss for _, loss in losses(out, "eval")] == pytest.approx([loss for _, loss in losses(reference, "eval")],
                                                                      rel=LOSS_RTOL)
    for name in SAME_FILES:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert len((out / "generated_predictions.txt").read_text().splitlines()) == 21
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=PARAMS_ATOL),
                           saved_params(out), saved_params(reference))


@pytest.mark.slow
def test_only_process_zero_writes(single, multihost):
    reference = single["reference"]
    (out, other), logs = multihost
    assert sorted(os.listdir(other)) == []
    def names(directory):
        return sorted("events" if name.startswith("events.out.tfevents") else name for name in os.listdir(directory))

    assert names(out) == names(reference) and names(out).count("events") == 1
    assert sorted(os.listdir(out / "checkpoints")) == ["10", "20"]
    quiet, main = logs[1].read_text(), logs[0].read_text()
    assert "process 0 of 2" in main and "INFO" not in quiet and "step/s" not in quiet


@pytest.mark.slow
def test_accumulation_matches_one_big_batch(single):
    reference, big_batch = single["reference"], single["big_batch"]
    accumulated, big = read_metrics(reference), read_metrics(big_batch)
    # Schedules and logs count optimizer steps, not micro-batches.
    assert [row["step"] for row in accumulated] == [row["step"] for row in big] == list(range(1, 21))
    assert [row["learning_rate"] for row in accumulated] == [row["learning_rate"] for row in big]
    assert [row["loss"] for row in accumulated] == pytest.approx([row["loss"] for row in big], rel=LOSS_RTOL)
    assert read_json(reference / "all_results.json")["train_samples"] == 160
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=PARAMS_ATOL),
                           saved_params(reference), saved_params(big_batch))


def test_watchdog_kills_the_peers_of_a_failed_process(tmp_path):
    sleeper = [sys.executable, "-c", f"import os, time; open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()));"
                                     " time.sleep(600)"]
    failing = [sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(3)"]
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="b.log: exited with 3"):
        run_processes([sleeper, failing], [tmp_path / "a.log", tmp_path / "b.log"], [None, None])
    assert time.monotonic() - start < 60
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)


def test_watchdog_kills_a_straggler(tmp_path, monkeypatch):
    monkeypatch.setattr(script_runner, "TIMEOUT", 1)
    with pytest.raises(pytest.fail.Exception, match="still running after 1 s"):
        run_processes([[sys.executable, "-c", "import time; time.sleep(600)"]], [tmp_path / "a.log"], [None])


@pytest.mark.slow
def test_fsdp_two_processes_match_one(single, multihost_fsdp):
    """The mesh spans both processes' devices: each process places its rows of the global batch and
    writes its shards of every checkpoint; the numbers are those of one process with 8 devices."""
    reference, out = single["fsdp"], multihost_fsdp
    assert [loss for _, loss in losses(out)] == pytest.approx([loss for _, loss in losses(reference)], rel=LOSS_RTOL)
    for name in SAME_FILES:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=PARAMS_ATOL),
                           saved_params(out), saved_params(reference))
    assert sorted(os.listdir(out / "checkpoints")) == ["10", "20"]
    # And fsdp is dp's run: same losses as the data-parallel reference.
    assert [loss for _, loss in losses(reference)] == pytest.approx([loss for _, loss in losses(single["reference"])],
                                                                    rel=LOSS_RTOL)


@pytest.mark.slow
def test_fsdp_on_hosts_without_shared_storage_says_so(tmp_path):
    """Process 1 on a disk of its own would wait for ever for the checkpoint directory process 0
    makes: the run stops at its start instead, with the fix."""
    outs, port = [tmp_path / "host0", tmp_path / "host1"], free_port()
    config = {**CONFIG, **TRAIN_ONLY, "sharding": "fsdp", "max_steps": 2}
    commands = [command({**config, "output_dir": outs[i], "coordinator_address": f"127.0.0.1:{port}",
                         "num_processes": 2, "process_id": i}) for i in range(2)]
    logs = [tmp_path / "process0.log", tmp_path / "process1.log"]
    with pytest.raises(pytest.fail.Exception, match="exited with 1"):
        run_processes(commands, logs, [script_env(devices=4)] * 2)
    last = logs[0].read_text().strip().splitlines()[-1]
    assert last.startswith(f"error: --output_dir {outs[0]} is not shared by all hosts (--sharding fsdp: every "
                           "process writes its shards of each checkpoint there): put it on storage every host mounts")


# ---------------------------------------------------------------------------------------------
# A streamed corpus on 2 processes: each reads its own rows, and all end a pass together when one runs dry
# ---------------------------------------------------------------------------------------------
STREAMED = ["--model_type", "roberta", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
            "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,max_position_embeddings=34,"
            "hidden_dropout_prob=0,attention_probs_dropout_prob=0", "--max_seq_length", "32", "--line_by_line",
            "--streaming", "--shuffle_buffer_size", "0", "--do_train", "--max_steps", "20",
            "--per_device_train_batch_size", "2", "--learning_rate", "3e-3", "--logging_steps", "1", "--save_steps",
            "100", "--compilation_cache_dir", "none"]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """mlm --streaming, one example per line in stream order (an order the process count does not
    change: utils/data/stream.py), 200 lines: a pass is 12 global batches of 16, so 20 steps start a
    second pass at step 13."""
    tmp = tmp_path_factory.mktemp("streamed")
    with open(os.path.join(ROOT, "data", "lm", "train.txt"), encoding="utf-8") as f:
        lines = [line for line in f if line.strip()][:200]
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(lines), encoding="utf-8")
    script = [sys.executable, os.path.join(ROOT, "run_mlm_flax.py"), *STREAMED, "--train_file", str(corpus)]
    port = free_port()
    commands = [script + ["--output_dir", str(tmp / "single")]]
    commands += [script + ["--output_dir", str(tmp / f"host{i}"), "--coordinator_address", f"127.0.0.1:{port}",
                           "--num_processes", "2", "--process_id", str(i)] for i in range(2)]
    logs = [tmp / "single.log", tmp / "process0.log", tmp / "process1.log"]
    run_processes(commands, logs, [script_env()] + [script_env(devices=4)] * 2)
    return tmp


@pytest.mark.slow
def test_a_stream_read_by_two_processes_trains_as_one_pass_after_pass(streamed):
    single, multi = streamed / "single", streamed / "host0"
    assert [step for step, _ in losses(multi)] == [step for step, _ in losses(single)] == list(range(1, 21))
    # The same sums in another order across processes, as in LOSS_RTOL.
    assert [loss for _, loss in losses(multi)] == pytest.approx([loss for _, loss in losses(single)], rel=LOSS_RTOL)
    for log in ("single.log", "process0.log"):
        text = (streamed / log).read_text()
        assert "pass 2 of the training stream starts at step 13" in text and "ran out" not in text
    assert read_json(multi / "all_results.json")["train_samples"] == 20 * 16
    assert sorted(os.listdir(multi / "checkpoints")) == ["20"] and os.listdir(streamed / "host1") == []


# ---------------------------------------------------------------------------------------------
# Every script on 2 processes x 4 devices: the run of 1 process x 8 (tests/layout_runs.py)
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
# Summarization is tested above; clm, glue and ner feed plain token batches as it does (nothing drawn per row
# or per step, no windows): the same path through the spine, so two processes there show nothing new.
@pytest.mark.parametrize("name", [name for name in SCRIPTS if name not in ("summarization", "clm", "glue", "ner")])
def test_every_script_on_two_processes_matches_one(layout_runs, name):
    """Each process loads its rows of the global batch, masks / corrupts / windows them as one process
    would (the masks depend on the step and the row in the global batch, not on the process), and
    process 0 alone writes: the losses, evaluations and predictions of one process with 8 devices."""
    single, (multi, other) = layout_runs[(name, "dp")], layout_runs[(name, "2x4")]
    assert [step for step, _ in losses(multi)] == [step for step, _ in losses(single)] == list(range(1, 11))
    assert [loss for _, loss in losses(multi)] == pytest.approx([loss for _, loss in losses(single)], rel=LOSS_RTOL)
    single_results, multi_results = read_json(single / "all_results.json"), read_json(multi / "all_results.json")
    assert set(multi_results) == set(single_results)
    for key, value in single_results.items():
        if key != "train_runtime":
            # Counts alike; metrics over the same predictions alike; eval losses sum in another order
            # (LOSS_RTOL) and are rounded to 4 decimals (abs 1e-4).
            assert multi_results[key] == pytest.approx(value, rel=LOSS_RTOL, abs=1e-4), key
    if name in PREDICTIONS:
        assert (multi / PREDICTIONS[name]).read_text() == (single / PREDICTIONS[name]).read_text()
    assert os.listdir(other) == []
