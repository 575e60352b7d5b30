#!/usr/bin/env python
"""One GPT-2-small layer's causal attention, forward and backward, on a TPU: the stock attention, JAX's
splash kernel and utils/dropout_attention's flash kernel at each tile size, with and without dropout.

    python benchmarks/attention_tpu.py      # ~1 min on one v5e chip

Shapes of the GPT-2-small row of benchmarks/tpu.py: 16 sequences of 1024 tokens, 12 heads of 64, bf16.
Each variant's gradient of sum(out * d_out) with respect to q, k and v is compiled once, then timed over
20 calls (the median). Refuses to run without TPU chips; writes benchmarks/results_attention_tpu.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH, HEADS, LENGTH, HEAD_DIM, RATE = 16, 12, 1024, 64, 0.1


def stock(q, k, v, rng, rate):
    """transformers' Flax attention: the whole score matrix, its softmax and its dropout mask in HBM."""
    import jax
    import jax.numpy as jnp

    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), -1)
    if rate:
        keep = jax.random.bernoulli(rng, 1 - rate, weights.shape)
        weights = jnp.where(keep, weights / (1 - rate), 0.0)
    return jnp.einsum("bhqk,bhkd->bhqd", weights.astype(q.dtype), v)


def variants():
    """(name, attention(q, k, v, rng), the flash kernel's tile or None)."""
    import jax
    import jax.numpy as jnp

    from utils import attention, dropout_attention

    segments = jnp.ones((BATCH, LENGTH), jnp.int32)

    def flash(rate):
        def run(q, k, v, rng):
            return dropout_attention.dropout_attention(q, k, v, segments, dropout_attention.seed_of(rng), rate)
        return run

    splash = attention._kernel(HEADS, LENGTH, False)
    yield "stock", lambda q, k, v, rng: stock(q, k, v, rng, 0.0), None
    yield f"stock, dropout {RATE}", lambda q, k, v, rng: stock(q, k, v, rng, RATE), None
    yield "splash (512)", lambda q, k, v, rng: jax.vmap(splash)(q, k, v), None
    for block in (512, 256, 128):
        for rate in (0.0, RATE):
            yield f"flash {block}" + (f", dropout {rate}" if rate else ""), flash(rate), block


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results_attention_tpu.json"))
    args = parser.parse_args()
    from benchmarks.tpu import on_tpu

    if not on_tpu():
        sys.exit("error: benchmarks/attention_tpu.py measures a TPU, and this machine has no TPU chips: run it on a TPU VM")
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v, d_out = (jax.random.normal(key, (BATCH, HEADS, LENGTH, HEAD_DIM), jnp.bfloat16) for key in keys[:4])
    q = q * HEAD_DIM ** -0.5
    from utils import dropout_attention

    default_tile = dropout_attention.block_size
    rows = []
    for name, attend, tile in variants():
        step = jax.jit(jax.grad(lambda q, k, v, rng: jnp.sum((attend(q, k, v, rng) * d_out).astype(jnp.float32)),
                                argnums=(0, 1, 2)))
        # The tile is fixed when the forward and backward kernels are traced: in the first call.
        dropout_attention.block_size = default_tile if tile is None else (lambda length, tile=tile: tile)
        try:
            jax.block_until_ready(step(q, k, v, keys[4]))
        finally:
            dropout_attention.block_size = default_tile
        times = []
        for _ in range(20):
            started = time.perf_counter()
            jax.block_until_ready(step(q, k, v, keys[4]))
            times.append(time.perf_counter() - started)
        rows.append({"attention": name, "forward_and_backward_ms": round(1000 * statistics.median(times), 3)})
        print(f"{name:24s} {rows[-1]['forward_and_backward_ms']:8.3f} ms", flush=True)
    record = {"shape": {"batch": BATCH, "heads": HEADS, "length": LENGTH, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
              "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
