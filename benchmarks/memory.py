#!/usr/bin/env python
"""What fits where: the train step's per-device memory under `--sharding dp` and `--sharding fsdp`.

    python benchmarks/memory.py                      # all three parts, ~15 min on 2 CPU cores
    python benchmarks/memory.py --parts sizes        # one part: sizes, largest, speed

Nothing here runs a big model: each train step is compiled (the scripts' own step, through
`utils.layout`) for a state that has shapes but no values, and XLA's memory analysis gives the
bytes per device (arguments + outputs + temporaries - what donated outputs reuse), on 8 virtual CPU
devices standing in for a TPUv3-8's 8 cores. Float32 master weights, bfloat16 compute, AdamW,
per-device batch 1 x 512 tokens (T5: 512 source, 128 target).

- sizes: GPT-2 medium (350M) and T5-large (770M), dp vs fsdp (target: fsdp <= 0.25 x dp).
- largest: the largest GPT-2-style and T5-style model (from a list of layers x width) whose step
  fits 16 GiB per device (a TPUv3 core) under each layout (target: >= 6x the parameters with fsdp).
- speed: tokens/s of the tiny clm config trained by the real script under each layout.

Prints tables and writes benchmarks/memory_cpu.json. The figures are XLA's plan for CPU devices;
a TPU's compiler schedules its own buffers, so they are estimates there, not measurements.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from transformers import FlaxGPT2LMHeadModel, FlaxT5ForConditionalGeneration, GPT2Config, T5Config  # noqa: E402

from utils import compat  # noqa: E402
from utils.layout import DataParallel, FullySharded  # noqa: E402
from utils.models import cast_floats  # noqa: E402
from utils.state import TrainState  # noqa: E402
from utils.steps import cross_entropy_sums, token_weighted_grads  # noqa: E402

GIB = 2**30
DEVICE_BYTES = 16 * GIB  # a TPUv3 core
SEQUENCE, TARGET = 512, 128
GPT2_MEDIUM = dict(n_layer=24, n_embd=1024, n_head=16)
T5_LARGE = dict(num_layers=24, d_model=1024, d_ff=4096, num_heads=16, d_kv=64)
# Candidates for "largest that fits", smallest first: (layers, width) of GPT-2 / GPT-3-like models,
# and T5 (v1.0 widths: d_ff = 4 x d_model).
GPT2_LADDER = [(24, 1024), (36, 1280), (48, 1600), (32, 2560), (32, 3072), (40, 4096), (48, 5120), (64, 6144)]
T5_LADDER = [(12, 768), (24, 1024), (24, 1536), (24, 2048), (24, 3072), (32, 4096), (40, 5120)]


def gpt2(layers, width):
    return FlaxGPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1), n_positions=1024,
                                          vocab_size=50257), dtype=jnp.bfloat16, _do_init=False)


def t5(layers, width):
    return FlaxT5ForConditionalGeneration(T5Config(num_layers=layers, d_model=width, d_ff=4 * width,
                                                   num_heads=max(width // 64, 1), d_kv=64, vocab_size=32128,
                                                   decoder_start_token_id=0), dtype=jnp.bfloat16, _do_init=False)


def parameters(model):
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(model.params_shape_tree))


def train_step_bytes(model, layout):
    """Per-device bytes of the compiled train step of `model` under `layout` (nothing allocated)."""
    seq2seq = isinstance(model, FlaxT5ForConditionalGeneration)

    def loss_fn(params, batch, rng):
        if seq2seq:
            logits = model(batch["input_ids"], decoder_input_ids=batch["labels"], params=params, dropout_rng=rng,
                           train=True).logits
        else:
            logits = model(batch["input_ids"], params=params, dropout_rng=rng, train=True).logits
        loss, tokens = cross_entropy_sums(logits, batch["labels"], jnp.ones(batch["labels"].shape))
        return loss, {"loss": loss, "tokens": tokens}

    def train_step(state, batch):
        rng, state = state.next_dropout_rng()
        grads, sums = token_weighted_grads(loss_fn, state.params, batch, rng, 1, layout)
        return state.apply_gradients(grads=grads), sums

    params = jax.eval_shape(lambda: cast_floats(model.init_weights(jax.random.PRNGKey(0), (1, 8)), jnp.float32))
    shapes = jax.eval_shape(lambda p: TrainState.create(apply_fn=model.__call__, params=p, tx=optax.adamw(1e-4),
                                                        dropout_rng=jax.random.PRNGKey(0)), params)
    rows = jax.device_count()
    batch = {"input_ids": np.ones((rows, SEQUENCE), np.int32),
             "labels": np.ones((rows, TARGET if seq2seq else SEQUENCE), np.int32)}
    layout.compile_train_step(train_step, layout.abstract_state(shapes), batch, 1)
    return layout.train_step_memory["total"]


def sizes():
    rows = []
    for name, model in (("GPT-2 medium", gpt2(GPT2_MEDIUM["n_layer"], GPT2_MEDIUM["n_embd"])),
                        ("T5-large", t5(T5_LARGE["num_layers"], T5_LARGE["d_model"]))):
        dp, fsdp = train_step_bytes(model, DataParallel()), train_step_bytes(model, FullySharded(jax.device_count()))
        rows.append({"model": name, "parameters": parameters(model), "dp_bytes": dp, "fsdp_bytes": fsdp,
                     "fsdp_over_dp": fsdp / dp})
        print(f"{name:13} {parameters(model) / 1e6:7.0f}M params  dp {dp / GIB:6.2f} GiB  fsdp {fsdp / GIB:6.2f} GiB  "
              f"fsdp/dp {fsdp / dp:.3f}", flush=True)
    return rows


def largest():
    result = {}
    for family, ladder, build in (("GPT-2", GPT2_LADDER, gpt2), ("T5", T5_LADDER, t5)):
        for name, layout in (("dp", DataParallel), ("fsdp", lambda: FullySharded(jax.device_count()))):
            fits = None
            for layers, width in ladder:
                model = build(layers, width)
                needed = train_step_bytes(model, layout())
                fit = needed <= DEVICE_BYTES
                print(f"{family:5} {name:4} {layers:2} x {width:4} {parameters(model) / 1e9:6.2f}B params: "
                      f"{needed / GIB:7.2f} GiB per device {'fits' if fit else 'does not fit'}", flush=True)
                if not fit:
                    break
                fits = {"layers": layers, "width": width, "parameters": parameters(model), "bytes": needed}
            result[f"{family} {name}"] = fits
        dp, fsdp = result[f"{family} dp"], result[f"{family} fsdp"]
        if dp and fsdp:
            print(f"{family}: fsdp fits {fsdp['parameters'] / dp['parameters']:.1f}x the parameters of dp", flush=True)
    return result


def speed():
    """tokens/s of the tiny clm config under each layout (the script itself, 60 steps)."""
    rows = {}
    for name in ("dp", "fsdp"):
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, os.path.join(ROOT, "run_clm_flax.py"), "configs/clm_tiny.json",
                            "--output_dir", out, "--sharding", name, "--max_steps", "60", "--logging_steps", "10",
                            "--do_eval", "false", "--total_train_batch_size", "128", "--compilation_cache_dir", "none"],
                           cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1",
                                                                                HF_DATASETS_OFFLINE="1"))
            with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
                train = [row for row in map(json.loads, f) if row["split"] == "train" and "tokens_per_second" in row]
            rows[name] = float(np.median([row["tokens_per_second"] for row in train[1:]]))
        print(f"clm tiny {name:4}: {rows[name]:,.0f} tokens/s", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["sizes", "largest", "speed"],
                        choices=["sizes", "largest", "speed"])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "memory_cpu.json"))
    args = parser.parse_args()
    compat.apply()
    results = {"device_count": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
               "device_bytes": DEVICE_BYTES}
    for part in args.parts:
        results[part] = {"sizes": sizes, "largest": largest, "speed": speed}[part]()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
