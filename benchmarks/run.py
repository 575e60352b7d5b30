#!/usr/bin/env python
"""Speed of the summarization, clm and mlm scripts against their own compiled step (not t5 mlm).

Throughput, start-up, eval/generate, memory.

    python benchmarks/run.py                                  # the three scripts, tiny + medium: ~20 min on 2 CPU cores
    python benchmarks/run.py --tasks clm --sizes tiny         # one row
    python benchmarks/run.py --dtype bfloat16 --output gpu.json   # on an accelerator

For each script and size (tiny: the shipped config; medium: the same data, a model with ~8x the
FLOPs per token and longer sequences):
  limit     tokens/s of the script's compiled train step in a tight loop on pre-sharded device batches
  script    steady-state tokens/s of the real run, from its metrics.jsonl (the compiling first step
            excluded); target: >= 95% of the limit
  start-up  seconds from the script's first line to the first finished train step ("first step done" in the
            log): cold (empty caches), with the persistent compilation cache, and with the datasets
            cache too; target: warm <= 50% of cold
  eval      examples/s of the eval-loss step; summarization also `generate`, greedy and 4 beams
            (fresh weights, so every sequence runs to --val_max_target_length), each compiled once
  memory    peak host RSS of the training run, and peak device memory where the backend reports it
Each measurement runs in its own process with 8 virtual CPU devices when there is no accelerator.
Prints a table and writes everything to --output (JSON).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"summarization": "run_summarization_flax.py", "clm": "run_clm_flax.py", "mlm": "run_mlm_flax.py"}
# Flags over configs/<task>_tiny.json; global batches as 8 devices run them (the tiny ones: those the
# configs had per device before they fixed the global batch). Medium: a model ~8x the FLOPs per token
# of the tiny one and a step of 1-2 s on 2 CPU cores, far longer than the loop's host work.
SIZES = {
    "tiny": {
        "summarization": ["--total_train_batch_size", "32", "--max_eval_samples", "200",
                          "--max_predict_samples", "77"],
        "clm": ["--total_train_batch_size", "128", "--max_eval_samples", "200"],
        "mlm": ["--total_train_batch_size", "512", "--max_eval_samples", "400"],
    },
    "medium": {
        "summarization": ["--config_overrides", "d_model=256,d_ff=1024,num_layers=4,num_decoder_layers=4,num_heads=4,"
                          "d_kv=64,dropout_rate=0.0", "--max_source_length", "192", "--max_target_length", "32",
                          "--total_train_batch_size", "32", "--max_eval_samples", "100",
                          "--max_predict_samples", "77"],
        "clm": ["--config_overrides", "n_embd=256,n_layer=4,n_head=4,n_positions=256", "--block_size", "256",
                "--total_train_batch_size", "32", "--max_eval_samples", "100"],
        "mlm": ["--config_overrides", "hidden_size=256,num_hidden_layers=4,num_attention_heads=4,intermediate_size=1024,"
                "max_position_embeddings=130,hidden_dropout_prob=0,attention_probs_dropout_prob=0",
                "--max_seq_length", "128", "--total_train_batch_size", "64", "--max_eval_samples", "200"],
    },
}
FIRST_STEP = re.compile(r"first step done ([0-9.]+) s after start")


def environment(datasets_cache):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=datasets_cache)
    # Only the host platform reads this: 8 CPU devices stand in for a TPUv3-8; accelerators ignore it.
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    return env


def run(command, env, what):
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{what} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return result


def compile_only_plan(flags, out, what):
    """`run_clm_flax.py` with `flags` (a `--compile_only` run) into `out`: (its all_results.json, the train
    step's planned `train_step_*` figures of it, its log, its seconds); exits naming `what` if no plan came."""
    started = time.time()
    result = subprocess.run([sys.executable, "run_clm_flax.py", *flags, "--output_dir", out], cwd=ROOT,
                            capture_output=True, text=True)
    path = os.path.join(out, "all_results.json")
    if not os.path.exists(path):
        sys.exit(f"{what}: no plan (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    planned = {key: value for key, value in results.items() if key.startswith("train_step_")}
    return results, planned, result.stderr, time.time() - started


def script_tokens_per_second(metrics_path):
    """Steady-state tokens/s (and MFU) over the logged windows; the first window starts after step 1."""
    with open(metrics_path, encoding="utf-8") as f:
        rows = [row for row in map(json.loads, f) if row["split"] == "train" and "tokens_per_second" in row]
    steps = [row["step"] - previous for row, previous in zip(rows, [1] + [row["step"] for row in rows])]
    seconds = sum(n / row["tokens_per_second"] for n, row in zip(steps, rows))
    rate = sum(steps) / seconds  # tokens per step cancel: every step has the same batch shape
    mfu = [row["mfu"] for row in rows if "mfu" in row]
    return rate, (sum(mfu) / len(mfu) if mfu else None), sum(steps)


class Bench:
    def __init__(self, work, steps, logging_steps, repeats, extra):
        self.work, self.steps, self.logging_steps, self.repeats, self.extra = (work, steps, logging_steps, repeats,
                                                                                 extra)

    def args(self, task, size, name, *flags):
        out = os.path.join(self.work, f"{task}-{size}-{name}")
        return [os.path.join("configs", f"{task}_tiny.json"), *SIZES[size][task], *self.extra,
                "--output_dir", out, "--overwrite_output_dir", "--num_train_epochs", "1000", "--save_steps",
                "1000000", *flags], out

    def measure(self, task, script_args, datasets_cache, name):
        out = os.path.join(self.work, f"{name}.json")
        run([sys.executable, "benchmarks/measure.py", "--repeats", str(self.repeats), out, "--", SCRIPTS[task],
             *script_args], environment(datasets_cache), name)
        with open(out, encoding="utf-8") as f:
            return json.load(f)

    def throughput(self, task, size, cache):
        args, out = self.args(task, size, "train", "--do_train", "--do_eval", "--do_predict", "false",
                              "--max_steps", str(self.steps), "--logging_steps", str(self.logging_steps),
                              "--eval_steps", "1000000", "--compilation_cache_dir", cache)
        measured = self.measure(task, args, os.path.join(self.work, "datasets"), f"{task}-{size}-train")
        train = measured["steps"]["train_step"]
        limit = train["tokens_per_call"] / train["seconds_per_call"]
        script, mfu, timed_steps = script_tokens_per_second(os.path.join(out, "metrics.jsonl"))
        evaluation = measured["steps"]["eval_step"]
        return measured, {
            "limit_tokens_per_second": limit, "script_tokens_per_second": script, "script_vs_limit": script / limit,
            "script_mfu": mfu, "script_timed_steps": timed_steps,
            "train_step_compiled_at_calls": train["calls_that_compiled"],
            "eval_examples_per_second": evaluation["examples_per_call"] / evaluation["seconds_per_call"],
            "eval_step_compiled_at_calls": evaluation["calls_that_compiled"],
            "peak_host_memory_gib": measured["peak_host_memory"] / 2**30,
            "peak_device_memory_gib": (measured["peak_device_memory"] / 2**30
                                       if measured["peak_device_memory"] is not None else None),
        }

    def generate(self, task, size, cache, beams):
        args, _ = self.args(task, size, f"generate{beams}", "--do_train", "false", "--do_eval", "false",
                            "--do_predict", "--predict_with_generate", "--num_beams", str(beams),
                            "--compilation_cache_dir", cache)
        step = self.measure(task, args, os.path.join(self.work, "datasets"),
                            f"{task}-{size}-generate{beams}")["steps"]["generate_step"]
        return {f"generate_beams{beams}_examples_per_second": step["examples_per_call"] / step["seconds_per_call"],
                f"generate_beams{beams}_calls": step["calls"],
                f"generate_beams{beams}_compiled_at_calls": step["calls_that_compiled"]}

    def startup(self, task, size):
        """Seconds to the first finished step: cold, compile cache warm, compile + datasets caches warm."""
        cache, datasets = (os.path.join(self.work, f"{task}-{size}-{name}") for name in ("jax-cache", "ds-startup"))
        times = {}
        for name in ("cold", "compile_cache", "compile_and_datasets_cache"):
            if name != "compile_and_datasets_cache":
                shutil.rmtree(datasets, ignore_errors=True)
            args, _ = self.args(task, size, "startup", "--do_train", "--do_eval", "false", "--do_predict", "false",
                                "--max_steps", "1", "--logging_steps", "1", "--compilation_cache_dir", cache)
            result = run([sys.executable, SCRIPTS[task], *args], environment(datasets), f"{task} start-up ({name})")
            found = FIRST_STEP.search(result.stderr)
            if not found:
                sys.exit(f"{task}: no 'first step done' line in the log")
            times[f"startup_{name}_seconds"] = float(found.group(1))
        times["startup_warm_vs_cold"] = times["startup_compile_cache_seconds"] / times["startup_cold_seconds"]
        return times


def save_records(path, records, key):
    """Write `records` into the JSON list at `path`: each takes the place of the file's record of the same
    `key(record)`, or comes after them; the file's others stay (a run of some rows keeps the rows before)."""
    saved = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    places = {key(record): i for i, record in enumerate(saved)}
    for record in records:
        if key(record) in places:
            saved[places[key(record)]] = record
        else:
            places[key(record)] = len(saved)
            saved.append(record)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(saved, f, indent=2)
        f.write("\n")


def format_table(records, columns):
    """`records` as a plain-text table; `columns`: (header, record key, format); a missing figure is "-"."""
    rows = [[fmt.format(r[key]) if r.get(key) is not None else "-" for _, key, fmt in columns] for r in records]
    widths = [max(len(header), *(len(row[i]) for row in rows)) for i, (header, _, _) in enumerate(columns)]
    lines = [" | ".join(header.ljust(w) for (header, _, _), w in zip(columns, widths))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def table(records):
    return format_table(records, [
        ("task", "task", "{}"), ("size", "size", "{}"), ("limit tok/s", "limit_tokens_per_second", "{:,.0f}"),
        ("script tok/s", "script_tokens_per_second", "{:,.0f}"), ("script/limit", "script_vs_limit", "{:.1%}"),
        ("cold s", "startup_cold_seconds", "{:.1f}"), ("warm s", "startup_compile_cache_seconds", "{:.1f}"),
        ("warm/cold", "startup_warm_vs_cold", "{:.0%}"), ("eval ex/s", "eval_examples_per_second", "{:,.1f}"),
        ("greedy ex/s", "generate_beams1_examples_per_second", "{:,.1f}"),
        ("beam4 ex/s", "generate_beams4_examples_per_second", "{:,.1f}"),
        ("host GiB", "peak_host_memory_gib", "{:.2f}")])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--tasks", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--steps", type=int, default=25, help="Training steps of the timed script run.")
    parser.add_argument("--logging_steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=12, help="Tight-loop calls of each compiled step.")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--output", default="benchmark_results.json")
    args = parser.parse_args()
    if args.steps < 2 * args.logging_steps:
        parser.error("--steps must cover at least two logging windows (2 x --logging_steps)")

    records = []
    work = tempfile.mkdtemp(prefix="flaxtune-bench-")
    try:
        bench = Bench(work, args.steps, args.logging_steps, args.repeats, ["--dtype", args.dtype])
        for task in args.tasks:
            for size in args.sizes:
                print(f"{task} {size} ...", file=sys.stderr, flush=True)
                record = {"task": task, "size": size, "dtype": args.dtype}
                record.update(bench.startup(task, size))
                cache = os.path.join(work, f"{task}-{size}-jax-cache")
                measured, figures = bench.throughput(task, size, cache)
                record.update(figures, device_kind=measured["device_kind"], device_count=measured["device_count"])
                if task == "summarization":
                    for beams in (1, 4):
                        record.update(bench.generate(task, size, cache, beams))
                records.append(record)
                with open(args.output, "w", encoding="utf-8") as f:  # after each row: a long run keeps its rows
                    json.dump(records, f, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(records))
    print(f"written to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
