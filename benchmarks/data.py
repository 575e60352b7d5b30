#!/usr/bin/env python
"""Host-side data figures: the in-memory path from 10^4 to 10^7 blocks, the streaming pipeline, resume start-up.

    python benchmarks/data.py                       # everything: ~10 min on 2 CPU cores, ~5 GB under /tmp and 6 GB RAM
    python benchmarks/data.py --parts memory --sizes 10000 1000000
    python benchmarks/data.py --parts stream resume --stream_megabytes 10 --resume_steps 10 200

memory   per size, in a fresh process: a synthetic token cache (`--block` tokens per block, written
         as a `datasets` Arrow cache file, one record batch per 1000 rows, as `datasets.map` writes
         it) read through `arrow_columns.to_arrays`, then the host side of `loop.train_batches`
         (`loop.host_train_batches`: order + gather, no devices) for `--steps` steps of a global
         batch of `--batch`: seconds per step (median; the first step, which computes the epoch's
         order, apart) and the minor page faults per step (the kernel mapping a page of the file on
         its first touch), the same steps again (their pages mapped), and the same gathers from a
         copy of the column in RAM (a separate process: 5 GB at 10^7); the process's anonymous
         memory (RssAnon: heap, not the page cache of the mapped file) before, after opening and at
         its peak; the old loop (the epoch's permutation recomputed every step) for contrast.
         Target: per-step time within 2x from 10^4 to 10^7, memory growing only by the order's
         indices (8 bytes per block).
stream   tokens/s of `utils.data.stream` alone: data/lm/train.txt repeated to `--stream_megabytes`,
         read, tokenized (data/lm's tokenizer), grouped into 256-token blocks, shuffled (10,000-block
         pool) into host batches of 32 (the medium clm benchmark's), with 1 (the default) and 2
         tokenizer threads; against the 4,479 tokens/s the medium clm step consumes here (README).
         Target: >= 3x.
resume   seconds from making a resumed stream (shuffled, the file twice as long) to its first batch,
         for states saved at each of `--resume_steps`, from the txt file and the same file gzipped;
         and for contrast the seconds the uninterrupted stream took to get there.
Prints a table per part and writes every figure to --output (JSON). The cache files are deleted.
"""

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CLM_MEDIUM_TOKENS_PER_SECOND = 4479  # README, Performance: what the medium clm step consumes on 2 CPU cores
STREAM_BLOCK, STREAM_BATCH, STREAM_POOL = 256, 32, 10000


def memory_status():
    """{"anon", "rss", "peak_rss"} of this process in bytes, from /proc/self/status."""
    fields = {"RssAnon": "anon", "VmRSS": "rss", "VmHWM": "peak_rss"}
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            name = line.split(":")[0]
            if name in fields:
                found[fields[name]] = int(line.split()[1]) * 1024
    return found


def write_token_cache(path, blocks, block):
    """A `datasets` Arrow cache of `blocks` rows of `block` int32 tokens, 1000 rows per record batch."""
    import numpy as np
    import pyarrow as pa

    schema = pa.schema({"input_ids": pa.list_(pa.int32())})
    offsets = np.arange(0, 1001 * block, block, dtype=np.int32)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, blocks, 1000):
            rows = min(1000, blocks - start)
            values = (np.arange(start * block, (start + rows) * block, dtype=np.int64) % 50000).astype(np.int32)
            column = pa.ListArray.from_arrays(offsets[: rows + 1], values)
            writer.write_batch(pa.record_batch([column], schema=schema))


def run_child(*args):
    output = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *map(str, args)], check=True,
                            capture_output=True, text=True)
    return json.loads(output.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# In-memory path
# ----------------------------------------------------------------------------------------------
def timed_steps(arrays, blocks, batch, steps):
    """(median seconds per step, minor page faults per step, peak anonymous bytes) of steps 1..steps - 1
    of `loop.host_train_batches` (step 0, which computes the epoch's order, is timed by the caller)."""
    from utils.run import loop

    batches = loop.host_train_batches(arrays, blocks, batch, 0, blocks // batch, 0, steps)
    next(batches)
    times, faults, peak = [], 0, memory_status()["anon"]
    for _ in range(steps - 1):
        before, clock = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        next(batches)
        times.append(time.perf_counter() - clock)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        peak = max(peak, memory_status()["anon"])
    return statistics.median(times), faults / (steps - 1), peak


def memory_child(path, blocks, batch, steps, old_steps, mode):
    import datasets
    import numpy as np

    from utils.data import arrow_columns, batch_order
    from utils.run import loop

    start = memory_status()
    dataset = datasets.Dataset.from_file(path)
    clock = time.perf_counter()
    arrays = arrow_columns.to_arrays(dataset, ["input_ids"])
    open_s = time.perf_counter() - clock
    if mode == "ram":  # the floor: the same gathers from a copy in memory (what to_arrays did before)
        column = arrays["input_ids"]
        copy = np.empty(column.shape, np.int32)
        for first in range(0, len(column), 1 << 20):
            copy[first: first + (1 << 20)] = column[first: first + (1 << 20)]
        step_s, _, _ = timed_steps({"input_ids": copy}, blocks, batch, steps)
        return {"ram_copy_step_s": step_s}
    opened = memory_status()
    clock = time.perf_counter()
    next(loop.host_train_batches(arrays, blocks, batch, 0, blocks // batch, 0, 1))
    first = time.perf_counter() - clock
    step_s, faults, peak = timed_steps(arrays, blocks, batch, steps)
    replay_s, _, _ = timed_steps(arrays, blocks, batch, steps)  # the same rows: their pages are mapped now
    old = []
    per_epoch = blocks // batch
    for step in range(old_steps):  # the loop before TrainOrder: the permutation in every step
        clock = time.perf_counter()
        batch_order.gather(arrays, batch_order.train_batch_indices(blocks, batch, 0, *divmod(step, per_epoch)))
        old.append(time.perf_counter() - clock)
    end = memory_status()
    return {"blocks": blocks, "open_s": open_s, "step_s": step_s, "page_faults_per_step": faults,
            "mapped_step_s": replay_s, "first_step_s": first, "old_step_s": statistics.median(old),
            "anon_start": start["anon"], "anon_opened": opened["anon"], "anon_peak": peak,
            "order_bytes": blocks * 8, "peak_rss_with_page_cache": end["peak_rss"]}


def memory_part(args, workdir):
    rows = []
    for blocks in args.sizes:
        path = os.path.join(workdir, f"tokens_{blocks}.arrow")
        clock = time.time()
        write_token_cache(path, blocks, args.block)
        written = time.time() - clock
        row = run_child("memory", path, blocks, args.batch, args.steps, args.old_steps, "mapped")
        row.update(run_child("memory", path, blocks, args.batch, args.steps, args.old_steps, "ram"))
        row.update(file_bytes=os.path.getsize(path), write_s=written)
        os.remove(path)
        rows.append(row)
        print(f"  {blocks:>10,} blocks: {row['step_s'] * 1e6:.0f} us/step", flush=True)
    return rows


def print_memory(rows, batch, block):
    print(f"\nIn-memory path: host work per step (order + gather of {batch} blocks of {block} tokens), "
          "anonymous memory")
    print("| blocks | cache file | to_arrays | per step | page faults / step | per step, pages mapped | "
          "same gathers from a copy in RAM | first step (epoch order) | old per step | anon after open | "
          "anon peak - start | order indices | peak RSS incl. page cache |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for row in rows:
        print(f"| {row['blocks']:,} | {row['file_bytes'] / (1 << 30):.2f} GiB | {row['open_s'] * 1e3:.0f} ms | "
              f"{row['step_s'] * 1e6:.0f} us | {row['page_faults_per_step']:.1f} | "
              f"{row['mapped_step_s'] * 1e6:.0f} us | "
              f"{row['ram_copy_step_s'] * 1e6:.0f} us | {row['first_step_s'] * 1e3:.1f} ms | "
              f"{row['old_step_s'] * 1e3:.1f} ms | {(row['anon_opened'] - row['anon_start']) / mib:+.1f} MiB | "
              f"{(row['anon_peak'] - row['anon_start']) / mib:+.1f} MiB | {row['order_bytes'] / mib:.1f} MiB | "
              f"{row['peak_rss_with_page_cache'] / mib:,.0f} MiB |")
    if len(rows) > 1:
        ratio = lambda key: rows[-1][key] / rows[0][key]  # noqa: E731
        print(f"per step, largest / smallest: {ratio('step_s'):.2f}x (target <= 2x); with the pages mapped "
              f"{ratio('mapped_step_s'):.2f}x; from a copy in RAM {ratio('ram_copy_step_s'):.2f}x")


# ----------------------------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------------------------
def text_file(path, megabytes):
    with open(os.path.join(ROOT, "data", "lm", "train.txt"), "rb") as f:
        corpus = f.read()
    with open(path, "wb") as f:
        for _ in range(max(1, round(megabytes * 1e6 / len(corpus)))):
            f.write(corpus)
    return path


def make_stream(path, workers=1, state=None):
    from transformers import AutoTokenizer

    from tasks import lm
    from utils.data import stream, text_sources

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "lm", "tokenizer"))
    return stream.Stream(text_sources.FileSource(path), lm.Blocks(tokenizer, STREAM_BLOCK), STREAM_BATCH,
                         shuffle_buffer_size=STREAM_POOL, seed=0, workers=workers, state=state)


def stream_child(path, workers):
    import transformers  # noqa: F401  (imported before the first reading: their memory is not the stream's)

    from tasks import lm  # noqa: F401
    from utils.data import stream, text_sources  # noqa: F401

    start = memory_status()["anon"]
    clock = time.perf_counter()
    tokens, first, peak = 0, None, start
    with make_stream(path, int(workers)) as batches:
        for batch in batches:
            if first is None:
                first = time.perf_counter() - clock
            tokens += batch["input_ids"].size
            peak = max(peak, memory_status()["anon"])
    total = time.perf_counter() - clock
    first_tokens = STREAM_BATCH * STREAM_BLOCK
    return {"workers": int(workers), "tokens": tokens, "seconds": total, "first_batch_s": first,
            "tokens_per_second": tokens / total,
            "steady_tokens_per_second": (tokens - first_tokens) / (total - first),
            "anon_growth": peak - start, "file_bytes": os.path.getsize(path)}


def stream_part(args, workdir):
    path = text_file(os.path.join(workdir, "stream.txt"), args.stream_megabytes)
    rows = [run_child("stream", path, workers) for workers in (1, 2)]
    os.remove(path)
    return rows


def print_stream(rows):
    print(f"\nStreaming pipeline alone: read + tokenize + group ({STREAM_BLOCK}) + shuffle ({STREAM_POOL:,} blocks) "
          f"into host batches of {STREAM_BATCH}, {rows[0]['file_bytes'] / 1e6:.0f} MB of text")
    print("| tokenizer threads | tokens/s (whole run) | tokens/s after the first batch | first batch (pool filled) | "
          "x the medium clm step's need | anon memory growth |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['workers']} | {row['tokens_per_second']:,.0f} | {row['steady_tokens_per_second']:,.0f} | "
              f"{row['first_batch_s']:.1f} s | {row['tokens_per_second'] / CLM_MEDIUM_TOKENS_PER_SECOND:.0f}x | "
              f"{row['anon_growth'] / (1 << 20):+.0f} MiB |")


def resume_child(path, steps):
    steps = sorted(int(step) for step in steps.split(","))
    states, reached, saves = {}, {}, {}
    clock = time.perf_counter()
    with make_stream(path) as batches:
        for taken, _ in enumerate(batches, start=1):
            if taken in steps:
                reached[taken] = time.perf_counter() - clock
                save = time.perf_counter()
                states[taken] = batches.state_after(taken)
                saves[taken] = time.perf_counter() - save
                if taken == steps[-1]:
                    break
    if len(states) < len(steps):
        raise SystemExit(f"the stream ended before step {steps[-1]}: raise --stream_megabytes")
    rows = []
    for step in steps:
        first = []
        for _ in range(3):
            clock = time.perf_counter()
            with make_stream(path, state=states[step]) as resumed:
                next(resumed)
            first.append(time.perf_counter() - clock)
        rows.append({"step": step, "first_batch_s": statistics.median(first), "reached_s": reached[step],
                     "save_s": saves[step], "offset": states[step]["meta"]["source"]["offset"]})
    return {"file": os.path.basename(path), "rows": rows}


def resume_part(args, workdir):
    path = text_file(os.path.join(workdir, "resume.txt"), 2 * args.stream_megabytes)
    packed = path + ".gz"
    with open(path, "rb") as plain, gzip.open(packed, "wb", compresslevel=6) as f:
        shutil.copyfileobj(plain, f)
    steps = ",".join(map(str, args.resume_steps))
    results = [run_child("resume", path, steps), run_child("resume", packed, steps)]
    os.remove(path), os.remove(packed)
    return results


def print_resume(results):
    print(f"\nResume start-up: a resumed stream (shuffled, {STREAM_POOL:,}-block pool) to its first batch")
    print("| file | resumed at step | byte offset | state save | resumed stream to its first batch | "
          "the uninterrupted stream to that step |")
    print("|---|---|---|---|---|---|")
    for result in results:
        for row in result["rows"]:
            print(f"| {result['file']} | {row['step']:,} | {row['offset'] / 1e6:.1f} MB | "
                  f"{row['save_s'] * 1e3:.0f} ms | {row['first_batch_s']:.2f} s | {row['reached_s']:.1f} s |")


# ----------------------------------------------------------------------------------------------
def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        if kind == "memory":
            path, blocks, batch, steps, old_steps, mode = rest
            result = memory_child(path, int(blocks), int(batch), int(steps), int(old_steps), mode)
        elif kind == "stream":
            result = stream_child(*rest)
        else:
            result = resume_child(*rest)
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["memory", "stream", "resume"],
                        choices=["memory", "stream", "resume"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[10**4, 10**5, 10**6, 10**7])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--old_steps", type=int, default=20)
    parser.add_argument("--stream_megabytes", type=float, default=50)
    parser.add_argument("--resume_steps", nargs="+", type=int, default=[10, 2000])
    parser.add_argument("--workdir", default=None, help="where the cache files go (default: a new folder in /tmp)")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results_data_cpu.json"))
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="flaxtune-data-", dir=args.workdir)
    results = {"settings": {key: value for key, value in vars(args).items() if key not in ("workdir", "output")},
               "cpus": os.cpu_count()}
    try:
        if "memory" in args.parts:
            results["memory"] = memory_part(args, workdir)
            print_memory(results["memory"], args.batch, args.block)
        if "stream" in args.parts:
            results["stream"] = stream_part(args, workdir)
            print_stream(results["stream"])
        if "resume" in args.parts:
            results["resume"] = resume_part(args, workdir)
            print_resume(results["resume"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
