"""Scaling end to end through run_summarization_flax.py: multi-host, gradient accumulation, bf16.

Runs, all on the tiny T5 and shapes of test_run_summarization.py (20 optimizer steps, global batch 64):
- reference: 1 process x 8 virtual devices, per-device batch 2 x 4 accumulated micro-batches;
- multihost: the same config on 2 processes x 4 devices (loopback coordinator, gloo collectives).
  Process 1 gets its own output_dir, as a second host has its own disk: it must stay empty;
- big_batch: per-device batch 8 x 1 (the same global batch without accumulation);
- bf16: bfloat16 computation and parameters (10 steps);
- fsdp: the reference's config with the state split over the devices, on 1 x 8 and on 2 x 4.
"""

import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import serialization

from script_runner import ROOT, read_json, read_metrics, script_env
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
TIMEOUT = 600  # seconds for a whole run (shared CPUs are slow); then the watchdog kills its processes
SAME_FILES = ("eval_results.json", "test_results.json", "generated_predictions.txt")


def flags(config):
    return [item for key, value in config.items() for item in (f"--{key}", str(value))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(commands, logs, envs):
    """Run the commands side by side; fail (and kill the rest) as soon as one fails or the time is up.

    A dead process would leave its peers blocked in a collective: nothing here waits on them.
    """
    handles = [open(log, "w") for log in logs]
    procs = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
             for command, env, f in zip(commands, envs, handles)]
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            codes = [p.poll() for p in procs]  # every process, every time: a failure must not wait its turn
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                why, culprit = f"exited with {codes[failed[0]]}", failed[0]
            elif None not in codes:
                return
            elif time.monotonic() > deadline:
                why, culprit = f"still running after {TIMEOUT} s", codes.index(None)
            else:
                time.sleep(0.2)
                continue
            pytest.fail(f"{logs[culprit]}: {why}:\n" + open(logs[culprit]).read()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in handles:
            f.close()


def command(config):
    return [sys.executable, os.path.join(ROOT, SCRIPT), *flags(config)]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process runs, side by side (independent: two cores do them in about half the time)."""
    tmp = tmp_path_factory.mktemp("single")
    runs = {"reference": {}, "big_batch": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                                           **TRAIN_ONLY},
            # bf16 matmuls are emulated on CPUs, twice as slow: 10 steps show the loss falling.
            "bf16": {"dtype": "bfloat16", "param_dtype": "bfloat16", "learning_rate": 0.01, "max_steps": 10,
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
    run_processes(commands, logs, [script_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")] * 2)
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
                  [script_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")] * 2)
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


@pytest.mark.slow
def test_bf16_trains(single):
    bf16 = single["bf16"]
    train = [loss for _, loss in losses(bf16)]
    assert np.all(np.isfinite(train)) and train[-1] < 0.8 * train[0]
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(saved_params(bf16))}
    assert dtypes == {np.dtype(jax.numpy.bfloat16)}


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
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT", 1)
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
        run_processes(commands, logs, [script_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")] * 2)
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
    change: utils/stream.py), 200 lines: a pass is 12 global batches of 16, so 20 steps start a
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
    run_processes(commands, logs, [script_env()] + [script_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")] * 2)
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
# T5 span corruption on 2 processes: each corrupts its own rows of the global batch as one process would
# ---------------------------------------------------------------------------------------------
T5_MLM = ["--model_type", "t5", "--tokenizer_name", "data/lm/t5_tokenizer", "--config_overrides",
          "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0",
          "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--max_seq_length", "32",
          "--max_train_samples", "320", "--max_eval_samples", "40", "--do_train", "--do_eval", "--max_steps", "20",
          "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2", "--learning_rate", "3e-3",
          "--logging_steps", "1", "--eval_steps", "10", "--save_steps", "100", "--compilation_cache_dir", "none"]


@pytest.fixture(scope="module")
def t5_mlm(tmp_path_factory):
    """run_t5_mlm_flax.py on 1 process x 8 devices and on 2 x 4, side by side: 20 steps of 16 raw
    blocks, evaluated on 40 (the last eval batch padded) at steps 10 and 20."""
    tmp = tmp_path_factory.mktemp("t5_mlm")
    script, port = [sys.executable, os.path.join(ROOT, "run_t5_mlm_flax.py"), *T5_MLM], free_port()
    commands = [script + ["--output_dir", str(tmp / "single")]]
    commands += [script + ["--output_dir", str(tmp / f"host{i}"), "--coordinator_address", f"127.0.0.1:{port}",
                           "--num_processes", "2", "--process_id", str(i)] for i in range(2)]
    logs = [tmp / "single.log", tmp / "process0.log", tmp / "process1.log"]
    run_processes(commands, logs, [script_env()] + [script_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")] * 2)
    return tmp


@pytest.mark.slow
def test_t5_span_corruption_on_two_processes_matches_one(t5_mlm):
    """The corruption of an example depends on the step and its row in the global batch, not on the
    process that loads it: the same inputs, hence the same losses and evaluations."""
    single, multi = t5_mlm / "single", t5_mlm / "host0"
    assert [step for step, _ in losses(multi)] == [step for step, _ in losses(single)] == list(range(1, 21))
    assert [loss for _, loss in losses(multi)] == pytest.approx([loss for _, loss in losses(single)], rel=LOSS_RTOL)
    evals = [read_metrics(out, "eval") for out in (single, multi)]
    assert [row["step"] for row in evals[1]] == [row["step"] for row in evals[0]] == [10, 20]
    # Loss: LOSS_RTOL. Accuracy counts exact argmax matches of 320 tokens: equal, or 1/320 apart if a
    # rounding flips a near-tie, which LOSS_RTOL also allows.
    for key in ("loss", "accuracy"):
        assert [row[key] for row in evals[1]] == pytest.approx([row[key] for row in evals[0]], rel=LOSS_RTOL), key
    assert [row["tokens"] for row in evals[1]] == [row["tokens"] for row in evals[0]] == [40 * 8] * 2
    assert read_json(multi / "all_results.json")["train_samples"] == 320
    assert os.listdir(t5_mlm / "host1") == []


# ---------------------------------------------------------------------------------------------
# Question answering on 2 processes: every example answered once, from windows gathered in order
# ---------------------------------------------------------------------------------------------
QA = ["--model_type", "bert", "--tokenizer_name", "data/qa/tokenizer", "--config_overrides",
      "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,max_position_embeddings=64,"
      "hidden_dropout_prob=0,attention_probs_dropout_prob=0", "--train_file", "data/qa/train_v2.json.gz",
      "--validation_file", "data/qa/validation_v2.json", "--version_2_with_negative", "--max_seq_length", "64",
      "--doc_stride", "16", "--max_train_samples", "60", "--max_eval_samples", "23", "--do_train", "--do_eval",
      "--max_steps", "10", "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
      "--learning_rate", "3e-3", "--logging_steps", "1", "--eval_steps", "5", "--save_steps", "100",
      "--compilation_cache_dir", "none"]


@pytest.fixture(scope="module")
def question_answering(tmp_path_factory):
    """run_qa.py on 1 process x 8 devices and on 2 x 4, side by side: 10 steps, evaluated at 5 and 10
    on 23 examples (their windows fill batches of 16 with padded rows to spare)."""
    tmp = tmp_path_factory.mktemp("qa")
    script, port = [sys.executable, os.path.join(ROOT, "run_qa.py"), *QA], free_port()
    commands = [script + ["--output_dir", str(tmp / "single")]]
    commands += [script + ["--output_dir", str(tmp / f"host{i}"), "--coordinator_address", f"127.0.0.1:{port}",
                           "--num_processes", "2", "--process_id", str(i)] for i in range(2)]
    logs = [tmp / "single.log", tmp / "process0.log", tmp / "process1.log"]
    four_devices = script_env(XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run_processes(commands, logs, [script_env(), four_devices, four_devices])
    return tmp


@pytest.mark.slow
def test_question_answering_on_two_processes_matches_one(question_answering):
    """Each process feeds its rows; the windows' logits come back from both in order, so every
    example is answered from all of its windows: the same answers and scores as one process."""
    single, multi = question_answering / "single", question_answering / "host0"
    assert [loss for _, loss in losses(multi)] == pytest.approx([loss for _, loss in losses(single)], rel=LOSS_RTOL)
    evals = [read_metrics(out, "eval") for out in (single, multi)]
    assert [row["step"] for row in evals[1]] == [row["step"] for row in evals[0]] == [5, 10]
    # Loss: LOSS_RTOL; the scores count answers, which flip only at a near-tie LOSS_RTOL would not cover.
    for key in ("loss", "exact", "f1", "HasAns_f1", "NoAns_exact"):
        assert [row[key] for row in evals[1]] == pytest.approx([row[key] for row in evals[0]], rel=LOSS_RTOL), key
    assert [row["total"] for row in evals[1]] == [23, 23]
    assert (multi / "eval_predictions.json").read_text() == (single / "eval_predictions.json").read_text()
    assert os.listdir(question_answering / "host1") == []
