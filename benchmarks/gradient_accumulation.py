#!/usr/bin/env python
"""Gradient accumulation: `lax.scan` over micro-batches (utils/layout/gradients.py) vs `optax.MultiSteps`.

    python benchmarks/gradient_accumulation.py scan|multisteps|big   # one variant per process

The tiny T5 of configs/summarization_tiny.json (2+2 layers, d_model 128, vocab 512) on one device;
4 micro-batches of 8 rows x (96 source + 16 target tokens) per optimizer step. `scan`: one pmap call
per optimizer step; `multisteps`: one call per micro-batch, MultiSteps applies AdamW every 4th;
`big`: the same 32 rows in one batch, no accumulation. Prints one JSON line: the optimizer step time
(median and min over --steps) and the compiled step's memory (XLA's memory analysis): the train state
it carries between steps and the temporaries of one call; peak = state + temporaries.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from transformers import AutoConfig, FlaxAutoModelForSeq2SeqLM  # noqa: E402

from utils.layout.gradients import token_weighted_grads  # noqa: E402
from utils.layout.layouts import AXIS, DataParallel  # noqa: E402
from utils.models import compat  # noqa: E402
from utils.scoring.losses import cross_entropy_sums  # noqa: E402

ACCUMULATION, MICRO_ROWS, SOURCE, TARGET, VOCAB = 4, 8, 96, 16, 512


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=("scan", "multisteps", "big"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    compat.apply()
    config = AutoConfig.for_model("t5", vocab_size=VOCAB, d_model=128, d_ff=512, num_layers=2, num_decoder_layers=2,
                                  num_heads=4, d_kv=32, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = FlaxAutoModelForSeq2SeqLM.from_config(config, seed=0)
    tx = optax.adamw(1e-3)
    if args.variant == "multisteps":
        tx = optax.MultiSteps(tx, every_k_schedule=ACCUMULATION)
    layout = DataParallel()
    state = layout.create_state(model.__call__, model.params, tx)

    def loss_fn(params, batch, rng):
        logits = model(batch["input_ids"], batch["attention_mask"], batch["decoder_input_ids"], params=params,
                       dropout_rng=rng, train=True)[0]
        loss, tokens = cross_entropy_sums(logits, batch["labels"], batch["decoder_attention_mask"])
        return loss, {"loss": loss, "tokens": tokens}

    accumulation = ACCUMULATION if args.variant == "scan" else 1

    def train_step(state, batch):
        rng = layout.dropout_key(0, state.step)
        grads, sums = token_weighted_grads(loss_fn, state.params, batch, rng, accumulation, layout)
        return state.apply_gradients(grads=grads), sums

    p_train_step = jax.pmap(train_step, AXIS, donate_argnums=(0,))
    rows = MICRO_ROWS if args.variant == "multisteps" else MICRO_ROWS * ACCUMULATION
    calls = ACCUMULATION if args.variant == "multisteps" else 1
    rng = np.random.default_rng(0)
    source = rng.integers(1, VOCAB, (rows, SOURCE)).astype(np.int32)
    target = rng.integers(1, VOCAB, (rows, TARGET)).astype(np.int32)
    batch = layout.place_batch({"input_ids": source, "attention_mask": np.ones_like(source), "decoder_input_ids": target,
                                "labels": target, "decoder_attention_mask": np.ones_like(target)})
    memory = p_train_step.lower(state, batch).compile().memory_analysis()
    state, sums = p_train_step(state, batch)  # compiles
    jax.block_until_ready(sums)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for _ in range(calls):
            state, sums = p_train_step(state, batch)
        jax.block_until_ready(sums)
        times.append(time.perf_counter() - start)
    mib = 2 ** 20
    print(json.dumps({
        "variant": args.variant,
        "step_ms_median": round(1000 * float(np.median(times)), 1),
        "step_ms_min": round(1000 * min(times), 1),
        "state_MiB": round(memory.argument_size_in_bytes / mib, 1),
        "temporaries_MiB": round(memory.temp_size_in_bytes / mib, 1),
        "peak_MiB": round((memory.argument_size_in_bytes + memory.temp_size_in_bytes) / mib, 1),
    }))


if __name__ == "__main__":
    main()
