#!/usr/bin/env python
"""What `--scan_layers` saves: the time to plan run_clm_flax.py's train step for a TPU, and the plan's bytes.

    python benchmarks/scan_layers.py        # ~4 min on 2 CPU cores; needs libtpu (requirements-tpu.txt)

GPT-2 small (12 layers x 768, 50,257-token vocabulary) at 1024 tokens, 16 sequences per device, bf16
compute with its dropouts, planned by `--compile_only v5e-4` (no TPU, no weights) with `--scan_layers auto`
(on when planning for a TPU: the log says so) and `no`, each with and without `--gradient_checkpointing`:
the planning run's seconds (the TPU compiler on this CPU, most of it; the attention kernels are on as on a
chip), the train step's trace and compile alone (from the log's timestamps), and the plan's bytes per
device. Writes benchmarks/results_scan_layers_plan.json.
"""

import json
import os
import sys
import tempfile
import time
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.run import compile_only_plan  # noqa: E402

MODEL = "vocab_size=50257,n_embd=768,n_layer=12,n_head=12,n_positions=1024"
FLAGS = ["--model_type", "gpt2", "--config_overrides", MODEL, "--tokenizer_name", "data/lm/tokenizer",
         "--train_file", "data/lm/train.txt", "--block_size", "1024", "--per_device_train_batch_size", "16",
         "--dtype", "bfloat16", "--do_train", "--compile_only", "v5e-4", "--compilation_cache_dir", "none"]
SCANNED = "run under jax.lax.scan"  # the spine's log line when the layers are scanned
GIB = 2**30


def logged_at(log, text):
    """The time of the log's line holding `text`."""
    line = next(line for line in log.splitlines() if text in line)
    return datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S")


def plan(scan, checkpointing, work):
    flags = FLAGS + ["--gradient_checkpointing"] * checkpointing + ["--scan_layers", scan]
    results, planned, log, seconds = compile_only_plan(flags, os.path.join(work, f"{scan}-{checkpointing}"),
                                                       f"--scan_layers {scan}")
    # From the last line before the step is traced (make_steps' attention line) to the plan's.
    step = logged_at(log, "train step (dp) on") - logged_at(log, "attention: ")
    return {"scan_layers": scan, "gradient_checkpointing": checkpointing, "scanned": SCANNED in log,
            "fits": results["fits"], "compile_seconds": round(seconds), "train_step_seconds": round(step.total_seconds()),
            **planned}


def main():
    work = tempfile.mkdtemp(prefix="flaxtune-scan-layers-")
    rows = [plan(scan, checkpointing, work) for checkpointing in (False, True) for scan in ("auto", "no")]
    record = {"model": MODEL, "flags": FLAGS, "date": time.strftime("%Y-%m-%d"), "plans": rows}
    with open(os.path.join(ROOT, "benchmarks", "results_scan_layers_plan.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    for row in rows:
        need = row.get("train_step_device_bytes")
        print(f"--scan_layers {row['scan_layers']}{' --gradient_checkpointing' * row['gradient_checkpointing']}: "
              f"{'scanned' if row['scanned'] else 'the loop'}, {row['compile_seconds']} s to plan "
              f"({row['train_step_seconds']} s the train step), "
              f"{f'{need / GIB:.2f} GiB per device' if need else row.get('train_step_refused')}")


if __name__ == "__main__":
    main()
