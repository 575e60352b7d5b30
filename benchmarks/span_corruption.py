#!/usr/bin/env python
"""Host time of T5 span corruption (tasks/span_corruption.py) per batch (numpy on the host).

    python benchmarks/span_corruption.py [--rows 64] [--repeats 50]

For each setting (max_seq_length, noise density, mean span length) it corrupts a batch of `--rows`
random raw blocks of the raw length that setting needs (512, 0.15, 3: 64 x 568 tokens) through the
transform run_t5_mlm_flax.py uses (one seeded generator per row, drawing the row's random numbers),
and prints one JSON line: the shapes and the milliseconds per batch (median and min over --repeats).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tasks import span_corruption as sc  # noqa: E402

SETTINGS = [(512, 0.15, 3), (512, 0.3, 8), (512, 0.15, 1), (1024, 0.15, 3)]
VOCAB, SENTINELS = 32100, 100


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    for max_seq_length, density, mean_span in SETTINGS:
        lengths = sc.span_corruption_lengths(max_seq_length, density, mean_span)
        plan = sc.SpanCorruption(lengths, np.arange(VOCAB - 1, VOCAB - 1 - SENTINELS, -1), eos_id=1)
        transform = sc.span_corruption(plan, decoder_start_token_id=0, seed=0, stream=0)
        blocks = np.random.default_rng(0).integers(2, VOCAB - SENTINELS, (args.rows, lengths.raw_length), np.int32)
        seconds = []
        row_ids = np.arange(args.rows)
        for step in range(args.repeats):
            start = time.perf_counter()
            batch = transform({"input_ids": blocks}, step, row_ids)
            seconds.append(time.perf_counter() - start)
        print(json.dumps({
            "max_seq_length": max_seq_length, "noise_density": density, "mean_noise_span_length": mean_span,
            "raw_block": list(blocks.shape), "labels": list(batch["labels"].shape),
            "ms_per_batch_median": round(1000 * statistics.median(seconds), 3),
            "ms_per_batch_min": round(1000 * min(seconds), 3),
        }))


if __name__ == "__main__":
    main()
