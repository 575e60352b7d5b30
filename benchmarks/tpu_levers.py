#!/usr/bin/env python
"""What each speed lever is worth on a TPU: benchmarks/tpu.py's rows, once per setting.

    python benchmarks/tpu_levers.py                      # every row and setting (~10 min on one v5e chip)
    python benchmarks/tpu_levers.py --runs gpt2_small:threefry gpt2_small:rbg

A run is ROW:SETTING. The settings: `threefry` / `rbg` (--dropout_rng: what draws the dropout masks),
`xla` / `splash` (--attention: the stock attention or Pallas' splash kernel; the model without dropout, as
Llama trains), `splash_checkpointing` (splash with --gradient_checkpointing), `splash_checkpointing_kernels` (and
--gradient_checkpointing_policy kernels: each layer keeps its kernels' outputs), `dropout_kernel` (--attention
splash with the model's dropouts: its attention dropout drawn inside utils/kernels/flash_attention's kernel, the
others by rbg), `chip_dropout` (that, and every other dropout's mask drawn inside utils/kernels/chip_dropout's
kernel: --dropout_rng chip), `rbg_masks` / `chip_masks` (--dropout_rng rbg / chip beside the row's default
--attention: for the rows whose attention the kernels do not take, t5's), `fsdp_splash` / `fsdp_xla` (--sharding
fsdp with the kernels, run on each device's rows, or the stock attention; the row's dropouts). Each run trains from scratch in bf16
with an empty compilation cache, for --steps steps; its steady-state tokens/s and MFU come from its
metrics.jsonl (the first step left out), its first step's seconds after start and its train step's planned
memory from its log. Refuses to run without TPU chips; writes each run into --output as it ends (replacing
that run's earlier record) and prints a table.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.run import (FIRST_STEP, environment, format_table, save_records,  # noqa: E402
                            script_tokens_per_second)
from benchmarks.tpu import ROWS, SCRIPTS, config_dir, make_data, on_tpu, planned_gib, run  # noqa: E402

NO_DROPOUT = {"gpt2": ",resid_pdrop=0,embd_pdrop=0,attn_pdrop=0", "llama": ""}  # Llama's config has none
SETTINGS = {"threefry": (False, ["--dropout_rng", "threefry", "--attention", "xla"]),
            "rbg": (False, ["--dropout_rng", "rbg", "--attention", "xla"]),
            "xla": (True, ["--attention", "xla"]),
            "splash": (True, ["--attention", "splash"]),
            "splash_checkpointing": (True, ["--attention", "splash", "--gradient_checkpointing"]),
            "splash_checkpointing_kernels": (True, ["--attention", "splash", "--gradient_checkpointing",
                                                    "--gradient_checkpointing_policy", "kernels"]),
            "dropout_kernel": (False, ["--dropout_rng", "rbg", "--attention", "splash"]),
            "chip_dropout": (False, ["--dropout_rng", "chip", "--attention", "splash"]),
            "rbg_masks": (False, ["--dropout_rng", "rbg"]),
            "chip_masks": (False, ["--dropout_rng", "chip"]),
            "fsdp_splash": (False, ["--sharding", "fsdp", "--attention", "splash"]),
            "fsdp_xla": (False, ["--sharding", "fsdp", "--attention", "xla"])}
DEFAULT_RUNS = ["gpt2_small:threefry", "gpt2_small:rbg", "gpt2_small:xla", "gpt2_small:splash", "llama_0.6b:xla",
                "llama_0.6b:splash"]


def measure(run_name, work, data, steps, logs):
    row, setting = run_name.split(":")
    task, model_type, overrides, flags = ROWS[row]
    no_dropout, setting_flags = SETTINGS[setting]
    overrides += NO_DROPOUT[model_type] if no_dropout else ""
    config = config_dir(work, f"{row}-{setting}", model_type, overrides, data[task][1])
    out = os.path.join(work, f"out-{row}-{setting}")
    text = run([sys.executable, SCRIPTS[task], "--config_name", config, *data[task], *flags, *setting_flags,
                "--dtype", "bfloat16", "--do_train", "--do_eval", "false", "--output_dir", out,
                "--overwrite_output_dir", "--num_train_epochs", "1000", "--save_steps", "1000000", "--seed", "42",
                "--max_steps", str(steps), "--logging_steps", str(max(steps // 5, 1)), "--compilation_cache_dir",
                "none"], environment(os.path.join(work, "datasets")), os.path.join(logs, f"{row}-{setting}.log"))
    rate, mfu, timed = script_tokens_per_second(os.path.join(out, "metrics.jsonl"))
    return {"run": run_name, "overrides": overrides, "flags": flags + setting_flags, "tokens_per_second": rate,
            "mfu": mfu, "timed_steps": timed, "first_step_cold_seconds": float(FIRST_STEP.search(text).group(1)),
            "planned_device_memory_gib": planned_gib(text),
            "date": time.strftime("%Y-%m-%d")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS,
                        help=f"ROW:SETTING, ROW of {list(ROWS)}, SETTING of {list(SETTINGS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--logs", help="Keep each run's log here.")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results_tpu_levers.json"))
    args = parser.parse_args()
    for name in args.runs:
        row, _, setting = name.partition(":")
        if row not in ROWS or setting not in SETTINGS or (SETTINGS[setting][0] and ROWS[row][1] not in NO_DROPOUT):
            sys.exit(f"error: --runs {name}: use ROW:SETTING with ROW a row of benchmarks/tpu.py ({', '.join(ROWS)}) "
                     f"and SETTING one of {', '.join(SETTINGS)} (xla and the splash ones for "
                     f"{', '.join(r for r in ROWS if ROWS[r][1] in NO_DROPOUT)} only)")
    if not on_tpu():
        sys.exit("error: benchmarks/tpu_levers.py measures a TPU, and this machine has no TPU chips: run it on a TPU VM")
    work = tempfile.mkdtemp(prefix="flaxtune-levers-")
    logs = args.logs or work
    os.makedirs(logs, exist_ok=True)
    records = []
    try:
        data = make_data(work, 40000)
        for name in args.runs:
            print(f"{name} ...", file=sys.stderr, flush=True)
            records.append(measure(name, work, data, args.steps, logs))
            save_records(args.output, records, key=lambda record: record["run"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(format_table(records, [("run", "run", "{}"), ("tok/s", "tokens_per_second", "{:,.0f}"),
                                 ("MFU", "mfu", "{:.3f}"), ("first step s", "first_step_cold_seconds", "{:.1f}")]))


if __name__ == "__main__":
    main()
