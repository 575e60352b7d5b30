#!/usr/bin/env python
"""Time a classic examples/flax script's train step, call by call, without changing the script.

    python benchmarks/classic_timer.py OUT.json STEPS -- path/to/classic/run_clm_flax.py [args...]

The classic scripts log no throughput. This runs one in this process with `jax.pmap` wrapped: the
pmap'd function named `train_step` is timed on each call until its outputs are ready (the classic
loop does not wait on them itself, so per-call waiting costs it nothing but the host's next batch),
and the run stops after STEPS calls. OUT.json gets the seconds of every call; benchmarks/tpu.py takes
the median after compiling as the classic's steady state.

The classic scripts (transformers' examples/flax of late 2022) import a name transformers 4.57 no
longer has, pass datasets 5 an argument it no longer takes (`use_auth_token`), and summarization
loads ROUGE from the network at start: stand-ins are given for those, none of which the train step
touches. Flax T5 gets the project's JAX-version shims (`utils.models.compat`), without which it cannot run.
"""

import json
import os
import runpy
import sys
import time
import types

import datasets
import jax
import transformers.utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from utils.models import compat  # noqa: E402


class Enough(Exception):
    """The timed steps are done: the rest of the classic run is not needed."""


def main():
    out, steps, separator, script, *argv = sys.argv[1:]
    if separator != "--":
        sys.exit(__doc__)
    steps, seconds, pmap = int(steps), [], jax.pmap

    def timed_pmap(fun, *args, **kwargs):
        compiled = pmap(fun, *args, **kwargs)
        if getattr(getattr(fun, "func", fun), "__name__", "") != "train_step":  # summarization pmaps a partial
            return compiled

        def call(*call_args, **call_kwargs):
            start = time.perf_counter()
            outputs = jax.block_until_ready(compiled(*call_args, **call_kwargs))
            seconds.append(time.perf_counter() - start)
            if len(seconds) >= steps:
                raise Enough
            return outputs

        return call

    jax.pmap = timed_pmap
    compat.apply()  # the JAX-version shims Flax T5 needs to run at all, the same as ours get
    transformers.utils.send_example_telemetry = lambda *args, **kwargs: None
    load_dataset = datasets.load_dataset
    datasets.load_dataset = lambda *args, use_auth_token=None, **kwargs: load_dataset(*args, **kwargs)
    sys.modules.setdefault("evaluate", types.SimpleNamespace(load=lambda *args, **kwargs: None))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except Enough:
        pass
    if len(seconds) < steps:
        sys.exit(f"{script} ran only {len(seconds)} train steps of {steps}")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"script": os.path.basename(script), "seconds_per_step": seconds}, f)


if __name__ == "__main__":
    main()
