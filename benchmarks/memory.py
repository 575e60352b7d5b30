#!/usr/bin/env python
"""What fits where: the train step's per-device memory under `--sharding dp` and `--sharding fsdp`.

    python benchmarks/memory.py                                  # the TPU plan: sizes and largest
    python benchmarks/memory.py --plan cpu --parts sizes speed   # XLA's plan for 8 CPU devices
    python benchmarks/memory.py --parts largest --families llama --layouts fsdp --remat on

Nothing here runs a big model: each train step is compiled (the scripts' own step, through
`utils.layout.layouts`) for a state that has shapes but no values, and the compiler's memory analysis gives
the bytes per device (arguments + outputs + temporaries - what donated outputs reuse). Float32
master weights, bfloat16 compute, AdamW (T5 also with Adafactor), per-device batch 1 x 512 tokens
(T5: 512 source, 128 target).

- `--plan tpu` (default): compiled by the TPU compiler for a v3-8's 8 compile-only cores (libtpu,
  requirements-tpu.txt; `utils.layout.tpu_plan`), the plan the TPU runs; 16 GiB per core.
- `--plan cpu`: XLA's plan for 8 virtual CPU devices, what a CPU run needs. It keeps gathered
  weights and gradients whole, so it overstates what fsdp needs on a TPU.

- sizes: GPT-2 medium (355M), T5-large (738M) and a Llama-style 1.1B, dp vs fsdp (target on the TPU
  plan: fsdp <= 0.25 x dp), without and with gradient checkpointing.
- largest: the largest GPT-2-, Llama- and T5-style model (from a ladder of layers x width) whose step
  fits 16 GiB per device, bisected over the ladder, for each layout and gradient checkpointing
  setting asked for (target: fsdp + checkpointing >= 4B parameters for a decoder).
- speed: tokens/s of the tiny clm config trained by the real script under each layout (CPU only).

`--lora_rank R` measures LoRA instead of full fine-tuning (`utils.models.lora`: the default attention
targets, a bfloat16 frozen base, float32 adapters with AdamW, nothing kept for the base), into
benchmarks/memory_{plan}_lora.json; its Llama ladder goes on to 33B-, 52B- and 78B-class rungs.

Each compile takes minutes on 2 CPU cores (a whole 24-layer step on the TPU plan: over an hour on
a busy machine): run it under `nice`. `--depths 4 8` makes each row from compiles at those depths
(bytes are affine in the layer count for a fixed width: fixed + layers x per layer; a third depth
checks the fit) instead of one compile at the row's own depth. Prints a line per compile and writes
benchmarks/memory_{plan}.json after each (a stopped run keeps what it measured; `compiles` holds
every compile with its time and the machine's load average).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from transformers import (FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, FlaxT5ForConditionalGeneration,  # noqa: E402
                          GPT2Config, LlamaConfig, T5Config)

from utils.base.arguments import ModelArguments  # noqa: E402
from utils.layout import tpu_plan  # noqa: E402
from utils.layout.gradients import token_weighted_grads  # noqa: E402
from utils.layout.layouts import DataParallel, FullySharded  # noqa: E402
from utils.models import compat, lora  # noqa: E402
from utils.models.loading import cast_floats, enable_gradient_checkpointing  # noqa: E402
from utils.scoring.losses import cross_entropy_sums  # noqa: E402

GIB = 2**30
SEQUENCE, TARGET = 512, 128
TPU = "v3-8"
# Ladders of "largest that fits", smallest first. GPT-2 / GPT-3-like (layers, width); Llama-style
# (layers, width, MLP width: TinyLlama, open_llama 3B, Llama 7B, 13B, 30B-like); T5 v1.0 (layers,
# width; d_ff = 4 x width).
FAMILIES = {
    "gpt2": [(24, 1024), (36, 1280), (48, 1600), (32, 2560), (32, 3072), (40, 4096), (48, 5120), (64, 6144)],
    "llama": [(22, 2048, 5632), (26, 3200, 8640), (32, 4096, 11008), (40, 5120, 13824), (48, 6656, 17920)],
    "t5": [(12, 768), (24, 1024), (24, 1536), (24, 2048), (24, 3072), (32, 4096), (40, 5120)],
}
# LoRA's Llama ladder: the full fine-tuning one, then LLaMA-33B's shape, a 52B and a 78B (whose bfloat16
# base alone, 155 GB, exceeds a v3-8's 128 GiB).
LORA_FAMILIES = {**FAMILIES, "llama": FAMILIES["llama"] + [(60, 6656, 17920), (64, 8192, 22016), (80, 8192, 28672)]}
LORA_RANK = [0]  # --lora_rank: 0 measures full fine-tuning
SIZES = {"GPT-2 medium": ("gpt2", (24, 1024)), "T5-large": ("t5", (24, 1024)),
         "Llama-style 1.1B": ("llama", (22, 2048, 5632))}


def build(family, shape):
    if family == "gpt2":
        layers, width = shape
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1), n_positions=1024,
                            vocab_size=50257)
        return FlaxGPT2LMHeadModel(config, dtype=jnp.bfloat16, _do_init=False)
    if family == "llama":
        layers, width, mlp = shape
        config = LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=mlp,
                             num_attention_heads=width // 128, num_key_value_heads=width // 128, vocab_size=32000,
                             max_position_embeddings=2048)
        return FlaxLlamaForCausalLM(config, dtype=jnp.bfloat16, _do_init=False)
    layers, width = shape
    config = T5Config(num_layers=layers, d_model=width, d_ff=4 * width, num_heads=max(width // 64, 1), d_kv=64,
                      vocab_size=32128, decoder_start_token_id=0)
    return FlaxT5ForConditionalGeneration(config, dtype=jnp.bfloat16, _do_init=False)


def parameters(model):
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(model.params_shape_tree))


def make_layout(name, plan):
    return DataParallel(plan) if name == "dp" else FullySharded(jax.device_count(), plan)


def train_step_memory(model, layout, optimizer="adamw"):
    """(per-device bytes of the compiled train step of `model` under `layout`, None) (nothing
    allocated), or (None, why the TPU compiler refused to compile it: it does not fit)."""
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
        rng = layout.dropout_key(0, state.step)
        grads, sums = token_weighted_grads(loss_fn, state.params, batch, rng, 1, layout)
        return state.apply_gradients(grads=grads), sums

    tx = optax.adafactor(1e-3) if optimizer == "adafactor" else optax.adamw(1e-4)
    params = jax.eval_shape(lambda: cast_floats(model.init_weights(jax.random.PRNGKey(0), (1, 8)), jnp.float32))
    create = TrainState.create
    if LORA_RANK[0]:  # as utils.models.loading.load_model and utils.run.spine.make_steps make a LoRA run's state
        adapters = lora.plan(model, ModelArguments(lora_rank=LORA_RANK[0], lora_base_dtype="bfloat16"),
                             "FlaxAutoModelForSeq2SeqLM" if seq2seq else "FlaxAutoModelForCausalLM")
        lora.attach(model, adapters)
        base = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
        params = lora.join(lora.new_weights(adapters, 0, shapes_only=True), base)
        create = partial(lora.FrozenBaseState.create, trainable=lora.trainable_paths(params, adapters))

        def train_step(state, batch):
            rng = layout.dropout_key(0, state.step)
            trained, frozen = lora.trained_and_frozen(state)
            grads, sums = token_weighted_grads(lambda t, b, r: loss_fn(lora.join(t, frozen), b, r), trained, batch,
                                               rng, 1, layout, split_layers=False)
            return state.apply_gradients(grads=grads), sums
    shapes = jax.eval_shape(lambda p: create(apply_fn=model.__call__, params=p, tx=tx), params)
    rows = jax.device_count()
    batch = {"input_ids": np.ones((rows, SEQUENCE), np.int32),
             "labels": np.ones((rows, TARGET if seq2seq else SEQUENCE), np.int32)}
    layout.compile_train_step(train_step, layout.abstract_state(shapes), batch, 1)
    return layout.train_step_memory, layout.train_step_refused


def with_layers(shape, layers):
    return (layers,) + tuple(shape[1:])


def measure(family, shape, layout_name, remat, plan, optimizer="adamw"):
    """One compile: a result row, printed (with the compile's time and the machine's load)."""
    model = build(family, shape)
    if remat:
        enable_gradient_checkpointing(model)
    started = time.time()
    memory, refused = train_step_memory(model, make_layout(layout_name, plan), optimizer)
    if refused:
        row = {"family": family, "shape": list(shape), "parameters": parameters(model), "layout": layout_name,
               "gradient_checkpointing": remat, "optimizer": optimizer, "bytes": None, "refused": refused,
               "fits": False, "compile_seconds": round(time.time() - started, 1),
               "load_average": round(os.getloadavg()[0], 1)}
        print(f"{family:5} {'x'.join(map(str, shape)):14} {row['parameters'] / 1e9:6.2f}B {layout_name:4} "
              f"remat {'on ' if remat else 'off'} {optimizer:9}: refused by the TPU compiler ({refused})", flush=True)
        return row
    row = {"family": family, "shape": list(shape), "parameters": parameters(model), "layout": layout_name,
           "gradient_checkpointing": remat, "optimizer": optimizer, "bytes": memory["total"],
           "temporaries": memory["temporaries"], "arguments": memory["arguments"],
           "fits": memory["total"] <= DEVICE_BYTES[0], "compile_seconds": round(time.time() - started, 1),
           "load_average": round(os.getloadavg()[0], 1)}
    print(f"{family:5} {'x'.join(map(str, shape)):14} {row['parameters'] / 1e9:6.2f}B {layout_name:4} "
          f"remat {'on ' if remat else 'off'} {optimizer:9}: {memory['total'] / GIB:7.2f} GiB per device "
          f"(temporaries {memory['temporaries'] / GIB:.2f}) {'fits' if row['fits'] else 'does not fit'} "
          f"[{row['compile_seconds']:.0f} s, load {row['load_average']}]", flush=True)
    return row


def at_full_depth(family, shape, layout_name, remat, plan, optimizer, depths, compiles):
    """The step's bytes at `shape`'s own depth: compiled there when `depths` is empty, else the
    affine fit (bytes = fixed + layers x per layer, exact for a fixed width once the layers dominate:
    every layer holds the same state and activations) through compiles at the first two `depths`,
    checked against a compile at a third when given. `compiles` collects every compile's row."""
    if not depths:
        row = measure(family, shape, layout_name, remat, plan, optimizer)
        compiles.append(row)
        return {**row, "from": "compile"}
    rows = []
    for depth in depths:
        rows.append(measure(family, with_layers(shape, depth), layout_name, remat, plan, optimizer))
        if rows[-1]["bytes"] is None:  # refused at this depth: deeper, the step only grows
            compiles.extend(rows)
            return {"family": family, "shape": list(shape), "parameters": parameters(build(family, shape)),
                    "layout": layout_name, "gradient_checkpointing": remat, "optimizer": optimizer, "bytes": None,
                    "fits": False, "from": f"refused by the TPU compiler at {depth} layers: {rows[-1]['refused']}",
                    "compile_seconds": round(sum(r["compile_seconds"] for r in rows), 1)}
    compiles.extend(rows)
    (d1, b1), (d2, b2) = [(r["shape"][0], r["bytes"]) for r in rows[:2]]
    per_layer = (b2 - b1) / (d2 - d1)
    fixed = b1 - d1 * per_layer
    total = round(fixed + shape[0] * per_layer)
    result = {"family": family, "shape": list(shape), "parameters": parameters(build(family, shape)),
              "layout": layout_name, "gradient_checkpointing": remat, "optimizer": optimizer, "bytes": total,
              "fits": total <= DEVICE_BYTES[0], "from": f"fit of depths {d1}, {d2}",
              "bytes_per_layer": round(per_layer), "bytes_fixed": round(fixed),
              "compile_seconds": round(sum(r["compile_seconds"] for r in rows), 1)}
    # A layer's float32 parameters and AdamW moments alone, on one device: a fit whose layers cost
    # less did not see the layers dominate yet (too shallow depths: GPT-2 36 x 1280 under dp through
    # 2 and 4 layers gave 127 MiB a layer, below its 236 MiB of state).
    layer_parameters = (rows[1]["parameters"] - rows[0]["parameters"]) / (d2 - d1)
    state_per_layer = 12 * layer_parameters / (1 if layout_name == "dp" else jax.device_count())
    if optimizer == "adamw" and not LORA_RANK[0] and per_layer < state_per_layer:
        result["below_state"] = True
        print(f"  !! {per_layer / 2**20:.1f} MiB per layer is below the layer's own state "
              f"({state_per_layer / 2**20:.1f} MiB): compile deeper (--depths)", flush=True)
    if len(rows) > 2:
        d3, b3 = rows[2]["shape"][0], rows[2]["bytes"]
        result["check"] = {"layers": d3, "compiled": b3, "fit": round(fixed + d3 * per_layer),
                           "residual": round(b3 - (fixed + d3 * per_layer))}
    check = f"; residual at {d3} layers: {result['check']['residual'] / 2**20:.1f} MiB" if len(rows) > 2 else ""
    print(f"  -> {family} {'x'.join(map(str, shape))} {layout_name} remat {'on' if remat else 'off'}: "
          f"{total / GIB:.2f} GiB per device ({result['from']}; {per_layer / 2**20:.1f} MiB per layer{check})",
          flush=True)
    return result


DEVICE_BYTES = [16 * GIB]  # per device; the TPU plan takes the slice's own figure


def sizes(plan, args, save):
    rows, compiles = [], []
    for name in args.models:
        family, shape = SIZES[name]
        for remat in args.remat:
            pair = {}
            for layout_name in args.layouts:
                pair[layout_name] = at_full_depth(family, shape, layout_name, remat, plan, "adamw", args.depths,
                                                  compiles)
                rows.append({"model": name, **pair[layout_name]})
                save("sizes", rows)
                save("compiles", compiles)
            if len(pair) == 2:
                ratio = pair["fsdp"]["bytes"] / pair["dp"]["bytes"]
                print(f"{name}: fsdp/dp {ratio:.3f} (gradient checkpointing {'on' if remat else 'off'})", flush=True)
    return rows


def largest(plan, args, save):
    """Bisect each ladder: the largest rung that fits, with as few rungs as the ladder allows (each
    rung: a compile at its depth, or the fit through `--depths`)."""
    result, compiles = {}, []
    for family in args.families:
        optimizers = ["adamw", "adafactor"] if family == "t5" else ["adamw"]
        for optimizer in args.optimizers or optimizers:
            for layout_name in args.layouts:
                for remat in args.remat:
                    key = f"{family} {layout_name} remat {'on' if remat else 'off'} {optimizer}"
                    ladder = (LORA_FAMILIES if LORA_RANK[0] else FAMILIES)[family]
                    low, high, tried = -1, len(ladder), []
                    while high - low > 1:  # rungs <= low fit, rungs >= high do not
                        middle = args.start_rung if (args.start_rung is not None and not tried) else (low + high) // 2
                        row = at_full_depth(family, ladder[middle], layout_name, remat, plan, optimizer, args.depths,
                                            compiles)
                        tried.append(row)
                        low, high = (middle, high) if row["fits"] else (low, middle)
                        result[key] = {"largest": next((r for r in tried if r["shape"] == list(ladder[low])), None)
                                       if low >= 0 else None, "tried": tried}
                        save("largest", result)
                        save("compiles", compiles)
    return result


def speed(plan, args, save):
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
        save("speed", rows)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=["tpu", "cpu"], default="tpu")
    parser.add_argument("--parts", nargs="+", default=["sizes", "largest"], choices=["sizes", "largest", "speed"])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--layouts", nargs="+", default=["dp", "fsdp"], choices=["dp", "fsdp"])
    parser.add_argument("--remat", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--optimizers", nargs="+", default=None, choices=["adamw", "adafactor"],
                        help="largest: default AdamW, and Adafactor too for T5")
    parser.add_argument("--depths", nargs="*", type=int, default=[],
                        help="compile each row at these depths (layers; two, or three to check the fit) and fit "
                             "bytes = fixed + layers x per layer to its own depth, instead of compiling it whole")
    parser.add_argument("--start_rung", type=int, default=None, help="largest: the ladder's rung to try first")
    parser.add_argument("--lora_rank", type=int, default=0, help="measure LoRA of this rank instead of full "
                                                                  "fine-tuning (into memory_{plan}_lora.json)")
    parser.add_argument("--out", default=None, help="default: benchmarks/memory_{plan}.json (merged into)")
    args = parser.parse_args()
    LORA_RANK[0] = args.lora_rank
    args.remat = [value == "on" for value in args.remat]
    compat.apply()
    plan = tpu_plan.load(TPU) if args.plan == "tpu" else None
    if plan:
        DEVICE_BYTES[0] = plan.device_bytes
    out = args.out or os.path.join(ROOT, "benchmarks", f"memory_{args.plan}{'_lora' if args.lora_rank else ''}.json")
    results = {}
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            results = json.load(f)
    devices = plan.devices if plan else jax.devices()
    results.update(device_count=len(devices), device_kind=devices[0].device_kind, device_bytes=DEVICE_BYTES[0],
                   topology=TPU if plan else None)
    if args.lora_rank:
        results.update(lora_rank=args.lora_rank, lora_base_dtype="bfloat16")

    def save(part, value):
        previous = results.get(part)
        if isinstance(previous, dict) and isinstance(value, dict):
            value = {**previous, **value}
        elif isinstance(previous, list) and isinstance(value, list):
            kept = [row for row in previous if not any(_same(row, new) for new in value)]
            value = kept + value
        results[part] = value
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)

    for part in args.parts:
        {"sizes": sizes, "largest": largest, "speed": speed}[part](plan, args, save)


def _same(a, b):
    keys = ("model", "family", "shape", "layout", "gradient_checkpointing", "optimizer")
    return all(a.get(k) == b.get(k) for k in keys)


if __name__ == "__main__":
    main()
