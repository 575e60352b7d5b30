#!/usr/bin/env python
"""What `--chunked_loss` saves: the TPU compiler's plan of run_clm_flax.py's train step, with and without.

    python benchmarks/chunked_loss.py        # ~10 min on 2 CPU cores; needs libtpu (requirements-tpu.txt)

A Llama-3-style decoder (128,256-token vocabulary, 16 layers x 2048, 8 key-value heads; 1.67B
parameters with its own LM head), bfloat16 parameters, compute and AdamW state, gradient
checkpointing, 4 x 1024 tokens per device, planned by `--compile_only v5e-4` (no TPU, no weights):
the plan's bytes per device and whether it fits a 16 GiB chip. Writes
benchmarks/results_chunked_loss_plan.json.
"""

import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.run import compile_only_plan  # noqa: E402

MODEL = ("vocab_size=128256,hidden_size=2048,intermediate_size=8192,num_hidden_layers=16,num_attention_heads=32,"
         "num_key_value_heads=8,max_position_embeddings=1024")
FLAGS = ["--model_type", "llama", "--config_overrides", MODEL, "--tokenizer_name", "data/lm/tokenizer",
         "--train_file", "data/lm/train.txt", "--block_size", "1024", "--per_device_train_batch_size", "4",
         "--dtype", "bfloat16", "--param_dtype", "bfloat16", "--gradient_checkpointing", "--do_train",
         "--compile_only", "v5e-4"]
GIB = 2**30


def plan(chunked, work):
    results, planned, _, seconds = compile_only_plan(FLAGS + ["--chunked_loss", chunked], os.path.join(work, chunked),
                                                     f"--chunked_loss {chunked}")
    return {"chunked_loss": chunked, "fits": results["fits"], "compile_seconds": round(seconds), **planned}


def main():
    work = tempfile.mkdtemp(prefix="flaxtune-chunked-loss-")
    rows = [plan(chunked, work) for chunked in ("true", "false")]
    record = {"model": MODEL, "flags": FLAGS, "date": time.strftime("%Y-%m-%d"), "plans": rows}
    with open(os.path.join(ROOT, "benchmarks", "results_chunked_loss_plan.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    for row in rows:
        sizes = ", ".join(f"{key[len('train_step_'):]} {value / GIB:.2f} GiB" for key, value in row.items()
                          if key.startswith("train_step_") and isinstance(value, (int, float)) and value > GIB / 100)
        print(f"--chunked_loss {row['chunked_loss']}: {'fits' if row['fits'] else 'does not fit'}; "
              f"{sizes or row.get('train_step_refused')}")


if __name__ == "__main__":
    main()
