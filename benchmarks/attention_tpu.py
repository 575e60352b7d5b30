#!/usr/bin/env python
"""One GPT-2-small layer's causal attention, forward and backward, on a TPU: the stock attention, JAX's
splash kernel and utils/kernels/flash_attention's flash kernel at each tile size, with and without dropout.

    python benchmarks/attention_tpu.py      # ~1 min on one v5e chip

Shapes of the GPT-2-small row of benchmarks/tpu.py: 16 sequences of 1024 tokens, 12 heads of 64, bf16.
Each variant starts from what GPT-2's c_attn writes ([batch, length, 3 x 768]: queries, keys, values side by
side) and returns [batch, length, 768] for c_proj, its own transposes included; its gradient of
sum(out * d_out) with respect to that input is compiled once, then timed over 20 calls (the median).
Refuses to run without TPU chips; writes benchmarks/results_attention_tpu.json.
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


def heads_first(qkv):
    """(q scaled, k, v) as [batch, heads, length, head_dim], the layout the stock attention and splash take."""
    import jax.numpy as jnp

    q, k, v = (x.reshape(BATCH, LENGTH, HEADS, HEAD_DIM).transpose(0, 2, 1, 3) for x in jnp.split(qkv, 3, axis=-1))
    return q * jnp.asarray(HEAD_DIM ** -0.5, q.dtype), k, v


def heads_merged(out):
    return out.transpose(0, 2, 1, 3).reshape(BATCH, LENGTH, HEADS * HEAD_DIM)


def stock(qkv, rng, rate):
    """transformers' Flax attention: the whole score matrix, its softmax and its dropout mask in HBM."""
    import jax
    import jax.numpy as jnp

    q, k, v = heads_first(qkv)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), -1)
    if rate:
        keep = jax.random.bernoulli(rng, 1 - rate, weights.shape)
        weights = jnp.where(keep, weights / (1 - rate), 0.0)
    return heads_merged(jnp.einsum("bhqk,bhkd->bhqd", weights.astype(q.dtype), v))


def variants():
    """(name, attention(qkv, rng), the flash kernel's tile or None)."""
    import jax
    import jax.numpy as jnp

    from utils.kernels import flash_attention, model_attention

    segments = jnp.ones((BATCH, LENGTH), jnp.int32)

    def flash(rate):
        def run(qkv, rng):
            return flash_attention.packed_dropout_attention(qkv, segments, flash_attention.seed_of(rng), rate,
                                                              HEADS)
        return run

    splash = model_attention._kernel(HEADS, LENGTH, False)
    yield "stock", lambda qkv, rng: stock(qkv, rng, 0.0), None
    yield f"stock, dropout {RATE}", lambda qkv, rng: stock(qkv, rng, RATE), None
    yield "splash (512)", lambda qkv, rng: heads_merged(jax.vmap(splash)(*heads_first(qkv))), None
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

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    qkv = jax.random.normal(keys[0], (BATCH, LENGTH, 3 * HEADS * HEAD_DIM), jnp.bfloat16)
    d_out = jax.random.normal(keys[1], (BATCH, LENGTH, HEADS * HEAD_DIM), jnp.bfloat16)
    from utils.kernels import flash_attention

    default_tile = flash_attention.block_size
    rows = []
    for name, attend, tile in variants():
        step = jax.jit(jax.grad(lambda qkv, rng: jnp.sum((attend(qkv, rng) * d_out).astype(jnp.float32))))
        # The tile is fixed when the forward and backward kernels are traced: in the first call.
        flash_attention.block_size = default_tile if tile is None else (lambda length, tile=tile: tile)
        try:
            jax.block_until_ready(step(qkv, keys[2]))
        finally:
            flash_attention.block_size = default_tile
        times = []
        for _ in range(20):
            started = time.perf_counter()
            jax.block_until_ready(step(qkv, keys[2]))
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
