#!/usr/bin/env python
"""CPU steps/s of LoRA vs full fine-tuning on the shipped configs, each trained by its own script.

    python benchmarks/lora_speed.py            # writes benchmarks/lora_cpu.json

Each config trains 60 steps as shipped (its global batch, one process, all the machine's CPU
devices), once in full and once with `--lora_rank 8`; steps/s is the median over the logged windows
after the first (the first holds the compile). Also recorded: each run's trained and total parameters
and the train step's per-device bytes (the compiler's figure) from its all_results.json.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"glue_tiny": "run_flax_glue.py", "chat_tiny": "run_clm_flax.py"}
STEPS, LOGGING = 60, 10


def run(script, config, extra):
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, os.path.join(ROOT, script), os.path.join("configs", f"{config}.json"),
                        "--output_dir", out, "--max_steps", str(STEPS), "--logging_steps", str(LOGGING),
                        "--do_eval", "false", "--do_predict", "false", "--compilation_cache_dir", "none", *extra],
                       cwd=ROOT, check=True, capture_output=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            train = [row for row in map(json.loads, f) if row["split"] == "train" and "tokens_per_second" in row]
        with open(os.path.join(out, "all_results.json"), encoding="utf-8") as f:
            results = json.load(f)
    with open(os.path.join(ROOT, "configs", f"{config}.json"), encoding="utf-8") as f:
        batch = json.load(f)["total_train_batch_size"]
    return {"steps_per_second": round(float(np.median([row["examples_per_second"] for row in train[1:]])) / batch, 2),
            "tokens_per_second": round(float(np.median([row["tokens_per_second"] for row in train[1:]])), 1),
            **{key: results[key] for key in ("trainable_parameters", "total_parameters", "train_step_device_bytes")}}


def main():
    rows = {}
    for config, script in CONFIGS.items():
        for name, extra in (("full", []), ("lora", ["--lora_rank", "8"])):
            rows[f"{config} {name}"] = run(script, config, extra)
            print(config, name, rows[f"{config} {name}"], flush=True)
        full, adapted = rows[f"{config} full"], rows[f"{config} lora"]
        rows[f"{config} lora/full steps per second"] = round(adapted["steps_per_second"] / full["steps_per_second"], 2)
    result = {"machine": f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end",
              "steps": STEPS, "rows": rows}
    with open(os.path.join(ROOT, "benchmarks", "lora_cpu.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
