#!/usr/bin/env python
"""One benchmark process: run a flaxtune script, then time its own compiled steps in a tight loop.

    python benchmarks/measure.py --repeats 10 OUT.json -- run_clm_flax.py config.json [flags...]

The script runs as usual (its `main`, in this process) with `utils.perf.StepRecorder` watching
every step its layout builds. Afterwards each recorded step is called again, `--repeats` times, on the
last device batches the script fed it (already sharded, already on the devices): nothing but the
compiled program runs between calls, so that is the speed limit the script's loop is measured
against. `benchmarks/run.py` drives this file; OUT.json gets, per step: calls, which calls compiled,
seconds per call in the tight loop, tokens and examples per call; plus peak memory and the device.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from utils import perf  # noqa: E402


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--repeats", type=int, default=10, help="Tight-loop calls per step.")
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
    result = {"device_kind": jax.devices()[0].device_kind, "device_count": jax.device_count(), "steps": steps,
              "peak_host_memory": perf.peak_host_memory(), "peak_device_memory": perf.peak_device_memory()}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
