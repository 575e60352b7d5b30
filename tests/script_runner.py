"""Run a flaxtune script as a user would: a process of its own with 8 virtual CPU devices, offline
(forked from a process that imported the libraries already: tests/script_launcher.py)."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest

import script_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600  # seconds for a whole run of run_processes (shared CPUs are slow); then it kills them


# XLA's CPU backend without LLVM's optimizations, unless a run asks for them. The tests' models are tiny
# and most runs take a few steps, so compiling them takes far longer than running them, and unoptimized
# code compiles in about two thirds of the time (a tiny BERT's 10-step run: 14.3 user CPU-seconds cold,
# 9.7 without; its 200-step run 18.8 and 15.6). The programs are the same; their float results may
# differ in the last bits, as they do between two CPUs.
UNOPTIMIZED = "--xla_backend_optimization_level=0"


def xla_flags(devices=8, optimized_code=False):
    """XLA_FLAGS for a test process on `devices` virtual CPU devices. `optimized_code` for the runs whose
    steps cost more than their compiles (the QA and NER training runs, the shipped MLM config): they
    took up to 3 times as long unoptimized."""
    count = f"--xla_force_host_platform_device_count={devices}" if devices > 1 else ""
    return " ".join(flag for flag in ("" if optimized_code else UNOPTIMIZED, count) if flag)


def script_env(devices=8, optimized_code=False, **extra):
    """The environment of a script process on `devices` virtual CPU devices (`xla_flags`), offline."""
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=xla_flags(devices, optimized_code),
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_script(script, args, timeout=600, env=None, cwd=ROOT, steps_report=None):
    """Run `python script *args`; returns the CompletedProcess (stdout/stderr as text).

    With `steps_report`, the script runs under `python -m utils.run.perf`, which writes there which calls
    of each pmap'd step compiled (`utils.run.perf.step_report`).
    """
    recorder = ["-m", "utils.run.perf", str(steps_report)] if steps_report else []
    return script_launcher.run([sys.executable, *recorder, os.path.join(ROOT, script), *map(str, args)],
                               cwd=cwd, env=env or script_env(), timeout=timeout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(commands, logs, envs):
    """Run the commands side by side; fail (and kill the rest) as soon as one fails or the time is up.

    A dead process would leave its peers blocked in a collective: nothing here waits on them.
    """
    handles = [open(log, "w") for log in logs]
    procs = [script_launcher.popen(command, ROOT, env, stdout=f, stderr=subprocess.STDOUT)
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


def directory_state(path):
    """{relative path: (sha256, mtime_ns)} of every file under `path`; None if it does not exist.

    Equal states before and after a run mean the run wrote nothing there: no file added, removed,
    rewritten or even touched.
    """
    if not os.path.exists(path):
        return None
    state = {}
    for root, _, names in os.walk(path):
        for name in names:
            file = os.path.join(root, name)
            with open(file, "rb") as f:
                state[os.path.relpath(file, path)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(file).st_mtime_ns)
    return state


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_metrics(output_dir, split="train"):
    """The lines of `metrics.jsonl` for one split."""
    with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if row["split"] == split]


def calls_of_steps_compiled_once(steps_report):
    """{step name: calls} from a `steps_report` file, after checking that each step compiled on its
    first call only (steps 2..N reused its program)."""
    report = read_json(steps_report)
    assert all(step["calls_that_compiled"] == [1] for step in report.values()), report
    return {name: step["calls"] for name, step in report.items()}


def run_streamed_config(script, config, output_dir, max_steps, logging_steps, *extra, steps=None):
    """(all_results.json, log) of `config` run with --streaming for `max_steps` (evaluated at the end),
    after checking it succeeded, trained `steps` steps (default `max_steps`; fewer when
    --max_stream_passes ends it), logged every `logging_steps` and its loss fell by a fifth or more.
    Optimized code: the configs' steps cost more than compiling them (clm's 60: 14.8 s -> 9.5 s alone)."""
    result = run_script(script, [config, "--streaming", "--max_steps", max_steps, "--logging_steps", logging_steps,
                                 "--eval_steps", max_steps, "--output_dir", output_dir, "--compilation_cache_dir",
                                 "none", *extra], env=script_env(optimized_code=True))
    assert result.returncode == 0, result.stderr[-3000:]
    train = read_metrics(str(output_dir))
    assert [row["step"] for row in train] == list(range(logging_steps, (steps or max_steps) + 1, logging_steps))
    assert train[-1]["loss"] < 0.8 * train[0]["loss"]
    return read_json(os.path.join(output_dir, "all_results.json")), result.stderr
