#!/usr/bin/env python
"""Where a TPU run's start-up goes: benchmarks/tpu.py's GPT-2-small row, cold, warm and rerun, every compile timed.

    python benchmarks/tpu_startup.py                         # on a TPU VM, ~3 min
    python benchmarks/tpu_startup.py -- --scan_layers yes    # flags after -- go to run_clm_flax.py

Runs run_clm_flax.py for 2 steps three times on one compilation cache, each in a fresh process with JAX's
compile, compilation-cache read and the cache's compression wrapped in timers: first with the cache empty
(cold), then filled (warm), then filled and with other numbers (rerun: another learning rate, warmup, seed
and step count, which the train step takes as an argument, so its program is read from the cache). Per run:
the first step's seconds after start (the script's own log line), the three slowest compiles or cache reads
(on a chip the train step's is the slowest), and the largest cache entry's bytes and the seconds to compress
or decompress them.
Refuses to run without TPU chips; adds its record to --output (replacing one with the same flags and cache
compression).
"""

import argparse
import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The rerun's other numbers (the flags after the command's own win).
RERUN = ["--learning_rate", "1e-4", "--warmup_steps", "1", "--seed", "7", "--max_steps", "3"]
TIMED = re.compile(r"^TIMED (\w+) (\S+) ([0-9.]+) s ([0-9]+) bytes$", re.M)


def run_timed(script, args):
    """Run `script` with `args` in this process, printing a TIMED line per compile, cache read and
    (de)compression: JAX's private hooks, so this follows JAX's internals (written for JAX 0.10)."""
    from jax._src import compilation_cache, compiler

    def timed(kind, function, describe):
        def wrapper(*call_args):
            start = time.perf_counter()
            result = function(*call_args)
            name, size = describe(call_args, result)
            print(f"TIMED {kind} {name} {time.perf_counter() - start:.3f} s {size} bytes", flush=True)
            return result
        return wrapper

    # The program's name, and for the cache's (de)compression the bytes uncompressed.
    compiler.backend_compile_and_load = timed(
        "compile", compiler.backend_compile_and_load,
        lambda call, _: (str(call[1].operation.attributes["sym_name"]).strip('"'), 0))
    compiler._cache_read = timed("read", compiler._cache_read, lambda call, _: (call[0], 0))
    compilation_cache.compress_executable = timed("compress", compilation_cache.compress_executable,
                                                  lambda call, _: ("-", len(call[0])))
    compilation_cache.decompress_executable = timed("decompress", compilation_cache.decompress_executable,
                                                    lambda _, result: ("-", len(result)))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def summary(log):
    """The first step's seconds, the three slowest compiles or cache reads, and the largest cache entry's
    (de)compression."""
    from benchmarks.run import FIRST_STEP

    lines = [(kind, name, float(seconds), int(size)) for kind, name, seconds, size in TIMED.findall(log)]
    coding = [line for line in lines if line[0] in ("compress", "decompress")]
    largest = max(coding, key=lambda line: line[3], default=None)
    slowest = sorted((line for line in lines if line[0] in ("compile", "read")), key=lambda line: -line[2])[:3]
    first = FIRST_STEP.search(log)
    return {"first_step_seconds": float(first.group(1)) if first else None,
            "slowest_programs": [{"what": what, "program": name, "seconds": seconds}
                                 for what, name, seconds, _ in slowest],
            "largest_cache_entry": largest and {"what": largest[0], "seconds": largest[2],
                                                "bytes": largest[3]}}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--timed":  # the child: python tpu_startup.py --timed SCRIPT ARGS
        return run_timed(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results_tpu_startup.json"))
    parser.add_argument("extra", nargs="*", help="flags for run_clm_flax.py (after --)")
    args = parser.parse_args()
    from benchmarks.run import environment, save_records
    from benchmarks.tpu import ROWS, config_dir, make_data, on_tpu

    if not on_tpu():
        sys.exit("error: benchmarks/tpu_startup.py measures a TPU, and this machine has no TPU chips: "
                 "run it on a TPU VM")
    work = tempfile.mkdtemp(prefix="flaxtune-startup-")
    try:
        data = make_data(work, 40000)
        task, model_type, overrides, flags = ROWS["gpt2_small"]
        config = config_dir(work, "gpt2_small", model_type, overrides, data[task][1])
        command = [sys.executable, os.path.abspath(__file__), "--timed", "run_clm_flax.py", "--config_name", config,
                   *data[task], *flags, *args.extra, "--dtype", "bfloat16", "--do_train", "--do_eval", "false",
                   "--output_dir", os.path.join(work, "out"), "--overwrite_output_dir", "--max_steps", "2",
                   "--save_steps", "1000000", "--seed", "42", "--compilation_cache_dir", os.path.join(work, "cache")]
        compression = "zstandard" if importlib.util.find_spec("zstandard") else "zlib"  # JAX's choice
        record = {"row": "gpt2_small", "flags": flags + args.extra, "cache_compression": compression,
                  "date": time.strftime("%Y-%m-%d")}
        for state, numbers in (("cold", []), ("warm", []), ("rerun", RERUN)):
            result = subprocess.run(command + numbers, cwd=ROOT, env=environment(os.path.join(work, "datasets")),
                                    capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"error: the {state} run failed:\n{result.stderr[-3000:]}")
            record[state] = summary(result.stdout + result.stderr)
            print(state, json.dumps(record[state]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # one record per flags and compression: this run's replaces its own
    save_records(args.output, [record], key=lambda record: (tuple(record["flags"]), record["cache_compression"]))


if __name__ == "__main__":
    main()
