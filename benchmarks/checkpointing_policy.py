#!/usr/bin/env python
"""What `--gradient_checkpointing_policy` keeps: the TPU plan's bytes of run_clm_flax.py's train step per policy.

    python benchmarks/checkpointing_policy.py     # ~10 min on 2 CPU cores; needs libtpu (requirements-tpu.txt)

benchmarks/tpu.py's two decoder rows, GPT-2 small (with its dropouts, 16 x 1024 tokens a device) and the
0.46B Llama-style decoder (8 x 1024), bf16 compute, planned by `--compile_only v5e-4` (no TPU, no weights;
the attention kernels on, as on a chip) without gradient checkpointing, then with it under each policy:
`nothing` (every activation recomputed) and `kernels` (each layer keeps its Pallas kernels' outputs).
Writes benchmarks/results_checkpointing_policy_plan.json; how fast each runs is a chip's to say
(`benchmarks/tpu_levers.py`, `splash_checkpointing` and `splash_checkpointing_kernels`).
"""

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.run import compile_only_plan  # noqa: E402
from benchmarks.scan_layers import MODEL as GPT2_SMALL  # noqa: E402
from benchmarks.tpu import ROWS  # noqa: E402

MODELS = {"gpt2_small": ("gpt2", GPT2_SMALL, 16),
          "llama_0.6b": ("llama", ROWS["llama_0.6b"][2], 8)}
POLICIES = (None, "nothing", "kernels")  # None: no gradient checkpointing
GIB = 2**30


def flags(model, policy):
    model_type, overrides, rows = MODELS[model]
    checkpointing = ["--gradient_checkpointing", "--gradient_checkpointing_policy", policy] if policy else []
    return ["--model_type", model_type, "--config_overrides", overrides, "--tokenizer_name", "data/lm/tokenizer",
            "--train_file", "data/lm/train.txt", "--block_size", "1024", "--per_device_train_batch_size", str(rows),
            "--dtype", "bfloat16", "--do_train", "--compile_only", "v5e-4", "--compilation_cache_dir", "none",
            *checkpointing]


def main():
    work = tempfile.mkdtemp(prefix="flaxtune-checkpointing-policy-")
    rows = []
    for model in MODELS:
        for policy in POLICIES:
            results, planned, _, seconds = compile_only_plan(flags(model, policy), os.path.join(work, f"{model}-{policy}"),
                                                             f"{model} with policy {policy}")
            rows.append({"model": model, "policy": policy, "fits": results["fits"], "plan_seconds": round(seconds),
                         **planned})
            need = planned.get("train_step_device_bytes")
            print(f"{model}, {'no gradient checkpointing' if policy is None else f'policy {policy}'}: "
                  f"{f'{need / GIB:.2f} GiB per device' if need else results.get('train_step_refused')}", flush=True)
    record = {"models": {name: {"model_type": m[0], "overrides": m[1], "rows_per_device": m[2]}
                         for name, m in MODELS.items()},
              "date": time.strftime("%Y-%m-%d"), "plans": rows}
    with open(os.path.join(ROOT, "benchmarks", "results_checkpointing_policy_plan.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
