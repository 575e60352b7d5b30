#!/usr/bin/env python
"""One benchmark process: run a flaxtune script, then time its own compiled steps in a tight loop.

    python benchmarks/measure.py --repeats 10 OUT.json -- run_clm_flax.py config.json [flags...]
    python benchmarks/measure.py --profile DIR OUT.json -- ...   # also where the train step's time goes

The script runs as usual (its `main`, in this process) with `utils.run.perf.StepRecorder` watching
every step its layout builds. Afterwards each recorded step is called again, `--repeats` times, on the
last device batches the script fed it (already sharded, already on the devices): nothing but the
compiled program runs between calls, so that is the speed limit the script's loop is measured
against. `benchmarks/run.py` drives this file; OUT.json gets, per step: calls, which calls compiled,
seconds per call in the tight loop, tokens and examples per call; plus peak memory and the device.
With `--profile DIR`, three more train steps run under JAX's profiler (the trace in DIR, for TensorBoard or
Perfetto) and DIR/profile.json lists the device's operations by their time per step, each with the model
code it comes from.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from utils.run import perf  # noqa: E402


def batch_size(batch):
    """(examples, tokens) of a placed batch over all processes: `[local devices, rows, length]` per
    process under "dp", one global `[rows, length]` array under "fsdp"."""
    ids = batch["input_ids"]
    processes = jax.process_count() if ids.ndim == 3 else 1
    return ids.size // ids.shape[-1] * processes, ids.size * processes


def seconds_per_train_step(step, repeats):
    """The train step chained on its own output state, cycling through its last batches."""
    state, batches = step.outputs[0], [args[1] for args in step.inputs]
    state, sums = step.function(state, batches[0])  # warm-up (and a first sync)
    jax.block_until_ready(sums)
    start = time.perf_counter()
    for i in range(repeats):
        state, sums = step.function(state, batches[i % len(batches)])
    jax.block_until_ready((state, sums))
    step.outputs = (state, sums)  # the state it started from is donated: a later call chains on this one
    return (time.perf_counter() - start) / repeats


def seconds_per_call(step, repeats):
    """An eval/generate step on its last inputs (params, batch), cycled."""
    jax.block_until_ready(step.function(*step.inputs[-1]))
    start = time.perf_counter()
    outputs = None
    for i in range(repeats):
        outputs = step.function(*step.inputs[i % len(step.inputs)])
    jax.block_until_ready(outputs)
    return (time.perf_counter() - start) / repeats


def profile_train_step(step, out_dir, calls=3, top=80):
    """The train step (after `seconds_per_train_step`) run `calls` times under the profiler; per operation of
    the first TPU (a fusion as one), its milliseconds per step and the JAX source it was traced from, the
    costliest first."""
    from jax.profiler import ProfileData

    state, batches = step.outputs[0], [args[1] for args in step.inputs]
    state, sums = step.function(state, batches[0])
    jax.block_until_ready(sums)
    with jax.profiler.trace(out_dir):
        for i in range(calls):
            state, sums = step.function(state, batches[i % len(batches)])
        jax.block_until_ready((state, sums))
    [path] = [os.path.join(folder, name) for folder, _, names in os.walk(out_dir) for name in names
              if name.endswith(".xplane.pb")]
    totals, sources, lines = {}, {}, {}
    for plane in ProfileData.from_file(path).planes:
        lines[plane.name] = [line.name for line in plane.lines]
        if not plane.name.startswith("/device:TPU:0"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for event in line.events:
                totals[event.name] = totals.get(event.name, 0) + event.duration_ns
                if event.name not in sources:
                    sources[event.name] = {key: str(value)[:300] for key, value in event.stats}
    ops = [{"op": name, "ms_per_step": ns / calls / 1e6, **sources[name]}
           for name, ns in sorted(totals.items(), key=lambda item: -item[1])]
    summary = {"ms_per_step": sum(op["ms_per_step"] for op in ops), "ops": ops[:top], "profiled_lines": lines}
    with open(os.path.join(out_dir, "profile.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=10, help="Tight-loop calls per step.")
    parser.add_argument("--profile", metavar="DIR", help="Also profile the train step into DIR (profile.json).")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args()
    script, *script_args = args.script[1:] if args.script[:1] == ["--"] else args.script

    recorder = perf.StepRecorder(keep_inputs=4)
    code = perf.run_script(os.path.join(ROOT, script), script_args, recorder)
    if code:
        sys.exit(f"{script} failed (exit {code})")

    steps = {}
    # The train step last: it donates the final state, whose params the other steps' inputs share.
    for name, step in sorted(recorder.steps.items(), key=lambda item: item[0] == "train_step"):
        if not step.calls:
            continue
        timing = seconds_per_train_step if name == "train_step" else seconds_per_call
        examples, tokens = batch_size(step.inputs[-1][1])
        steps[name] = {"calls": step.calls, "calls_that_compiled": step.calls_that_compiled(),
                       "seconds_per_call": timing(step, args.repeats), "examples_per_call": examples,
                       "tokens_per_call": tokens}
    if args.profile and "train_step" in steps:
        profile_train_step(recorder.steps["train_step"], args.profile)
    result = {"device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(), "steps": steps,
              "peak_host_memory": perf.peak_host_memory(), "peak_device_memory": perf.peak_device_memory()}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
