#!/usr/bin/env python
"""What each speed lever is worth on a TPU: run_clm_flax.py on benchmarks/tpu.py's LM rows, once per setting.

    python benchmarks/tpu_levers.py                      # every row and setting (~10 min on one v5e chip)
    python benchmarks/tpu_levers.py --runs gpt2_small:threefry gpt2_small:rbg

A run is ROW:SETTING. The settings: `threefry` / `rbg` (--dropout_rng: what draws the dropout masks),
`xla` / `splash` (--attention: the stock attention or Pallas' splash kernel; the model without dropout, as
Llama trains), `splash_checkpointing` (splash with --gradient_checkpointing), `dropout_kernel` (--attention
splash with the model's dropouts: its attention dropout drawn inside utils/dropout_attention's kernel, the
others by rbg), `chip_dropout` (that, and every other dropout's mask drawn inside utils/chip_dropout's
kernel: --dropout_rng chip). Each run trains from scratch in bf16 with an empty compilation cache, for
--steps steps; its steady-state tokens/s and MFU come from its metrics.jsonl (the first step left out), its
first step's seconds after start from its log. Refuses to run without TPU chips; writes --output after each
run and prints a table.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.run import FIRST_STEP, environment, format_table, script_tokens_per_second  # noqa: E402
from benchmarks.tpu import ROWS, config_dir, make_data, on_tpu, run  # noqa: E402

NO_DROPOUT = {"gpt2": ",resid_pdrop=0,embd_pdrop=0,attn_pdrop=0", "llama": ""}  # Llama's config has none
SETTINGS = {"threefry": (False, ["--dropout_rng", "threefry", "--attention", "xla"]),
            "rbg": (False, ["--dropout_rng", "rbg", "--attention", "xla"]),
            "xla": (True, ["--attention", "xla"]),
            "splash": (True, ["--attention", "splash"]),
            "splash_checkpointing": (True, ["--attention", "splash", "--gradient_checkpointing"]),
            "dropout_kernel": (False, ["--dropout_rng", "rbg", "--attention", "splash"]),
            "chip_dropout": (False, ["--dropout_rng", "chip", "--attention", "splash"])}
DEFAULT_RUNS = ["gpt2_small:threefry", "gpt2_small:rbg", "gpt2_small:xla", "gpt2_small:splash", "llama_0.6b:xla",
                "llama_0.6b:splash"]


def measure(run_name, work, data, steps, logs):
    row, setting = run_name.split(":")
    task, model_type, overrides, flags = ROWS[row]
    no_dropout, setting_flags = SETTINGS[setting]
    overrides += NO_DROPOUT[model_type] if no_dropout else ""
    config = config_dir(work, f"{row}-{setting}", model_type, overrides, data[task][1])
    out = os.path.join(work, f"out-{row}-{setting}")
    text = run([sys.executable, "run_clm_flax.py", "--config_name", config, *data[task], *flags, *setting_flags,
                "--dtype", "bfloat16", "--do_train", "--do_eval", "false", "--output_dir", out,
                "--overwrite_output_dir", "--num_train_epochs", "1000", "--save_steps", "1000000", "--seed", "42",
                "--max_steps", str(steps), "--logging_steps", str(max(steps // 5, 1)), "--compilation_cache_dir",
                "none"], environment(os.path.join(work, "datasets")), os.path.join(logs, f"{row}-{setting}.log"))
    rate, mfu, timed = script_tokens_per_second(os.path.join(out, "metrics.jsonl"))
    return {"run": run_name, "overrides": overrides, "flags": flags + setting_flags, "tokens_per_second": rate,
            "mfu": mfu, "timed_steps": timed, "first_step_cold_seconds": float(FIRST_STEP.search(text).group(1)),
            "date": time.strftime("%Y-%m-%d")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS,
                        help=f"ROW:SETTING, ROW of {list(ROWS)[:2]}, SETTING of {list(SETTINGS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--logs", help="Keep each run's log here.")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results_tpu_levers.json"))
    args = parser.parse_args()
    for name in args.runs:
        row, _, setting = name.partition(":")
        if row not in ROWS or ROWS[row][0] != "clm" or setting not in SETTINGS:
            sys.exit(f"error: --runs {name}: use ROW:SETTING with ROW an LM row of benchmarks/tpu.py "
                     f"({', '.join(r for r in ROWS if ROWS[r][0] == 'clm')}) and SETTING one of {', '.join(SETTINGS)}")
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
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(records, f, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(format_table(records, [("run", "run", "{}"), ("tok/s", "tokens_per_second", "{:,.0f}"),
                                 ("MFU", "mfu", "{:.3f}"), ("first step s", "first_step_cold_seconds", "{:.1f}")]))


if __name__ == "__main__":
    main()
