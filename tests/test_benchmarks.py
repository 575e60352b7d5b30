"""The benchmark's own arithmetic, and one real (small) run of its documented command.

Figures are only checked for sense here (positive, consistent); the targets are read off the
benchmark's output, never asserted on timings. The benchmarks run with XLA's optimized code, as the
scripts do outside the tests (`script_runner.xla_flags`).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from script_runner import ROOT, script_env

_spec = importlib.util.spec_from_file_location("benchmark_run", os.path.join(ROOT, "benchmarks", "run.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_script_rate_weighs_each_window_by_its_steps(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # Windows: steps 2-4 (3 steps at 100 tok/s), 5-8 (4 steps at 200 tok/s); an eval row in between.
    write_rows(metrics, [{"step": 4, "split": "train", "tokens_per_second": 100.0, "mfu": 0.2},
                         {"step": 4, "split": "eval", "loss": 1.0},
                         {"step": 8, "split": "train", "tokens_per_second": 200.0, "mfu": 0.4}])
    rate, mfu, steps = bench.script_tokens_per_second(metrics)
    assert steps == 7
    # float64 arithmetic on the same few numbers in another order: approx's default rel 1e-6.
    assert rate == pytest.approx(7 / (3 / 100 + 4 / 200))
    assert mfu == pytest.approx(0.3)


def test_script_rate_without_mfu(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_rows(metrics, [{"step": 5, "split": "train", "tokens_per_second": 50.0}])
    assert bench.script_tokens_per_second(metrics) == (50.0, None, 4)


def test_table_leaves_missing_figures_as_dashes():
    text = bench.table([{"task": "clm", "size": "tiny", "limit_tokens_per_second": 1234.5,
                         "script_tokens_per_second": 1200.0, "script_vs_limit": 0.972}])
    header, rule, row = text.splitlines()
    assert header.startswith("task") and set(rule) <= {"-", "|"}
    cells = [cell.strip() for cell in row.split("|")]
    assert cells[:5] == ["clm", "tiny", "1,234", "1,200", "97.2%"] and set(cells[5:]) == {"-"}


def test_too_few_steps_for_two_windows_is_refused():
    result = subprocess.run([sys.executable, "benchmarks/run.py", "--steps", "5", "--logging_steps", "4"], cwd=ROOT,
                            env=script_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--steps must cover at least two logging windows" in result.stderr


@pytest.mark.slow
def test_documented_command_on_one_small_row(tmp_path):
    output = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--tasks", "clm", "--sizes", "tiny", "--steps", "6",
         "--logging_steps", "3", "--repeats", "2", "--output", str(output)],
        cwd=ROOT, env=script_env(optimized_code=True), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = json.loads(output.read_text())
    assert (record["task"], record["size"], record["device_kind"], record["device_count"]) == ("clm", "tiny", "cpu", 8)
    assert record["script_timed_steps"] == 5  # steps 2..6: the compiling first step is left out
    assert record["train_step_compiled_at_calls"] == [1] and record["eval_step_compiled_at_calls"] == [1]
    for key in ("limit_tokens_per_second", "script_tokens_per_second", "eval_examples_per_second",
                "startup_cold_seconds", "startup_compile_cache_seconds", "startup_compile_and_datasets_cache_seconds",
                "peak_host_memory_gib"):
        assert record[key] > 0, key
    assert record["script_vs_limit"] == pytest.approx(  # a float64 ratio, maybe rounded once: default rel
        record["script_tokens_per_second"] / record["limit_tokens_per_second"])
    assert record["peak_device_memory_gib"] is None and record["script_mfu"] is None  # CPU: unknown peak
    assert "clm  | tiny" in result.stdout


@pytest.mark.slow
def test_data_benchmark_on_small_sizes(tmp_path):
    """benchmarks/data.py end to end on a tiny cache and a 1 MB stream: every figure there and sensible."""
    output = tmp_path / "data.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/data.py", "--sizes", "3000", "5000", "--steps", "20", "--old_steps", "3",
         "--stream_megabytes", "1", "--resume_steps", "1", "3", "--workdir", str(tmp_path), "--output", str(output)],
        cwd=ROOT, env=script_env(optimized_code=True), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(output.read_text())
    assert [row["blocks"] for row in record["memory"]] == [3000, 5000]
    for row in record["memory"]:
        assert row["step_s"] > 0 and row["old_step_s"] > 0 and row["anon_peak"] >= row["anon_opened"] > 0
        assert row["mapped_step_s"] > 0 and row["ram_copy_step_s"] > 0 and row["page_faults_per_step"] >= 0
        assert row["file_bytes"] > row["blocks"] * 128 * 4
    assert [row["workers"] for row in record["stream"]] == [1, 2]
    assert all(row["tokens"] > 0 and row["tokens_per_second"] > 0 for row in record["stream"])
    assert [[row["step"] for row in part["rows"]] for part in record["resume"]] == [[1, 3], [1, 3]]
    assert [part["file"] for part in record["resume"]] == ["resume.txt", "resume.txt.gz"]
    assert all(row["first_batch_s"] > 0 for part in record["resume"] for row in part["rows"])
    assert os.listdir(tmp_path) == ["data.json"]  # the cache files are gone
    assert "| 5,000 |" in result.stdout and "tokens/s" in result.stdout


def test_a_run_of_some_rows_replaces_their_records_and_keeps_the_others(tmp_path):
    from benchmarks.run import save_records

    path = tmp_path / "results.json"
    save_records(path, [{"row": "a", "x": 1}, {"row": "b", "x": 2}], key=lambda record: record["row"])
    save_records(path, [{"row": "c", "x": 3}, {"row": "a", "x": 4}], key=lambda record: record["row"])
    assert json.loads(path.read_text()) == [{"row": "a", "x": 4}, {"row": "b", "x": 2}, {"row": "c", "x": 3}]


def test_tpu_benchmark_refuses_a_machine_without_tpu_chips():
    result = subprocess.run([sys.executable, "benchmarks/tpu.py", "--rows", "gpt2_small"], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: benchmarks/tpu.py measures a TPU, and this machine has no TPU chips: run it "
                                     "on a TPU VM")


CLASSIC_STAND_IN = """
from functools import partial
import jax, jax.numpy as jnp

def train_step(state, batch, scale):
    return state + scale * batch.sum(), {"loss": batch.mean()}

def eval_step(state, batch):
    return batch.sum()

p_train_step, p_eval_step = jax.pmap(partial(train_step, scale=2), "batch"), jax.pmap(eval_step, "batch")
state = jnp.zeros((1,))
for step in range(100):
    state, metrics = p_train_step(state, jnp.ones((1, 4)) * step)
    print("step", step, float(p_eval_step(state, jnp.ones((1, 4)))[0]))
"""


def test_tpu_classic_only_adds_the_classic_figures_to_the_rows_already_measured(tmp_path, monkeypatch):
    """`tpu.py --classic_only` (the chip check passed by hand; the classic scripts stand-ins): the row already in
    --output gets the classic figures, its own figures and date stay, the other rows are untouched; a row not
    measured yet is refused before anything runs."""
    sys.path.insert(0, ROOT)
    from benchmarks import tpu

    monkeypatch.setattr(tpu, "on_tpu", lambda: True)
    classic = tmp_path / "classic"
    classic.mkdir()
    for script in ("run_summarization_flax.py", "run_mlm_flax.py"):
        (classic / script).write_text(CLASSIC_STAND_IN)
    output = tmp_path / "results.json"
    other = {"row": "gpt2_small", "script_tokens_per_second": 1.0}
    ours = {"row": "t5_small", "tokens_per_step": 8192, "script_tokens_per_second": 400000.0, "date": "2026-01-02"}
    output.write_text(json.dumps([other, ours]))

    def classic_only(*rows):
        monkeypatch.setattr(sys, "argv", ["tpu.py", "--rows", *rows, "--steps", "7", "--corpus_lines", "200",
                                          "--classic", str(classic), "--classic_only", "--output", str(output)])
        tpu.main()

    before = output.read_bytes()
    with pytest.raises(SystemExit, match=f"{output} lacks bert_base: run benchmarks/tpu.py --rows bert_base first"):
        classic_only("t5_small", "bert_base")
    assert output.read_bytes() == before
    classic_only("t5_small")
    saved_other, t5 = json.loads(output.read_text())
    assert saved_other == other
    assert {key: t5[key] for key in ours} == ours
    assert t5["classic_date"] == time.strftime("%Y-%m-%d") and t5["classic_tokens_per_second"] > 0
    assert t5["vs_classic"] == pytest.approx(400000.0 / t5["classic_tokens_per_second"])
    (classic / "run_summarization_flax.py").write_text("raise SystemExit('out of memory, say')")
    classic_only("t5_small")  # a failed classic run: the row says why, and keeps no earlier classic figure
    saved_other, t5 = json.loads(output.read_text())
    assert {key: t5[key] for key in ours} == ours and "classic_tokens_per_second" not in t5 and "vs_classic" not in t5
    assert t5["classic_failed"] == "(exit 1) out of memory, say"


def test_a_failed_row_is_recorded_by_the_exception_it_died_of():
    """The classic Llama row on a v5e chip died of this (its log's tail); JAX's note after it is not the why."""
    from benchmarks import tpu

    log = ("benchmarks/classic_timer.py failed (exit 1), log llama.log:\n"
           "Training...:   0%|          | 0/87 [00:00<?, ?it/s]\x1b[A\r  \x1b[AEpoch ... :   0%|\n"
           "Traceback (most recent call last):\n"
           "  File \"run_clm_flax.py\", line 789, in main\n"
           "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: E0101: RuntimeProgramAllocationFailure:\n"
           "Error loading program 'jit__fun': Attempting to reserve 9.59G at the bottom of memory.\n"
           "--------------------\n"
           "For simplicity, JAX has removed its internal frames from the traceback of the following exception.\n")
    assert tpu.last_line(log) == ("(exit 1) jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: E0101: "
                                  "RuntimeProgramAllocationFailure: Error loading program 'jit__fun': "
                                  "Attempting to reserve 9.59G at the bottom of memory.")
    killed = "run_clm_flax.py failed (exit -9), log gpt2.log:\nstep 3\r\x1b[2KTraining:  40%|####\n"
    assert tpu.last_line(killed) == "(exit -9) Training:  40%|####"


def test_classic_timer_times_the_train_step_and_stops_after_the_steps_asked(tmp_path):
    """A classic-style script (pmap'd `train_step`, a partial as in summarization, in a loop of 100): 7 calls
    timed, the run stopped there."""
    script, out = tmp_path / "run_classic.py", tmp_path / "timings.json"
    script.write_text(CLASSIC_STAND_IN)
    result = subprocess.run([sys.executable, "benchmarks/classic_timer.py", str(out), "7", "--", str(script)], cwd=ROOT,
                            env=script_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("step ") == 6  # the 7th call was timed, then the run stopped
    seconds = json.loads(out.read_text())["seconds_per_step"]
    assert len(seconds) == 7 and all(s > 0 for s in seconds)
    short = subprocess.run([sys.executable, "benchmarks/classic_timer.py", str(out), "200", "--", str(script)],
                           cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=120)
    assert short.returncode == 1 and "ran only 100 train steps of 200" in short.stderr


def test_fingerprints_leave_out_the_machine_and_name_each_file_that_differs(tmp_path):
    """benchmarks/fingerprints.py: two runs that differ only in timings and workdir have the same fingerprint; a changed
    loss, a changed prediction or a file only one run wrote are each named."""
    spec = importlib.util.spec_from_file_location("fingerprints", os.path.join(ROOT, "benchmarks", "fingerprints.py"))
    fingerprints = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fingerprints)

    def run(name, loss, runtime, prediction, extra=False):
        work = tmp_path / name  # each run under a workdir of its own, which its arguments name
        out = work / "summarization_tiny"
        (out / "checkpoints" / "10").mkdir(parents=True)
        (out / "run_args.json").write_text(json.dumps({"output_dir": str(out)}))
        (out / "checkpoints" / "10" / "state").write_text(f"{runtime}")
        (out / "events.out.tfevents.1").write_text(f"{runtime}")
        (out / "all_results.json").write_text(json.dumps({"eval_loss": loss, "train_runtime": runtime,
                                                          "train_samples_per_second": 1 / runtime}))
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": loss, "step_seconds": runtime}) + "\n")
        (out / "generated_predictions.txt").write_text(prediction)
        (out / "README.md").write_text(f"# model\n\n| eval_loss | {loss} |\n| train_runtime | {runtime} |\n")
        if extra:
            (out / "extra.txt").write_text("")
        return {"summarization_tiny": fingerprints.fingerprint(str(out), str(work))}

    before = run("a", 0.5, 1.0, "a cat\n")
    assert sorted(before["summarization_tiny"]) == ["README.md", "all_results.json", "generated_predictions.txt",
                                                     "metrics.jsonl", "run_args.json"]
    assert fingerprints.compare(before, run("b", 0.5, 2.0, "a cat\n")) == []
    assert fingerprints.compare(before, run("c", 0.25, 1.0, "a dog\n", extra=True)) == [
        "summarization_tiny: README.md differs", "summarization_tiny: all_results.json differs",
        "summarization_tiny: extra.txt only after",
        "summarization_tiny: generated_predictions.txt differs", "summarization_tiny: metrics.jsonl differs"]
