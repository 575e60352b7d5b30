#!/usr/bin/env python
"""Images/s of the image pipeline (decode + transform, `tasks/image_classification.py`) vs what a train step consumes.

    python benchmarks/image_pipeline.py                          # ~2 min on 2 CPU cores
    python benchmarks/image_pipeline.py --workers 1 2 4 --steps 20

pipeline  `ImageData.host_batches` alone (no devices): global batches of `--batch` random-resized
          crops, flipped and normalised, with 1, 2, ... decoding threads, for
          - digits: the 8x8 grey PNGs of data/images/train cropped to 16 (configs/image_tiny.json);
          - photos: `--photos` synthetic 500x375 RGB JPEGs (imagenette's typical size, written to a
            temporary folder, noise over gradients so they do not compress to nothing) cropped to 224,
            the input of vit-base-patch16-224.
step      run_image_classification.py on configs/image_tiny.json for `--train_steps` steps (no eval),
          one CPU device: the images/s it logs (`examples_per_second`, the median of its windows after
          the first), the whole loop, data included. The pipeline keeps up when its images/s on the
          same images are well above it.
Prints a table; the machine's load average before and after. No figure is asserted anywhere.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from tasks import images  # noqa: E402


def photo_folder(root, count):
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, 500)[None, :, None] + np.linspace(0, 50, 375)[:, None, None]
    for i in range(count):
        pixels = np.clip(ramp + rng.normal(0, 25, (375, 500, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, f"{i}.jpg"), quality=90)
    return sorted(os.path.join(root, name) for name in os.listdir(root))


def pipeline_rate(paths, size, batch, steps, workers):
    """Images/s of `steps` training batches of `batch` images (the first batch, the pool's start, apart)."""
    transforms = images.Transforms(size, images.Normalisation(images.eval_processor(size, (0.5,) * 3, (0.5,) * 3)))
    data = images.ImageData(paths, np.zeros(len(paths), np.int32), transforms, workers)
    batches = data.host_batches(batch, 0, len(paths) // batch, 0, steps + 1)
    next(batches)
    start = time.perf_counter()
    for _ in batches:
        pass
    return steps * batch / (time.perf_counter() - start)


def step_rate(train_steps):
    """The median images/s run_image_classification.py logs on configs/image_tiny.json, one CPU device."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run([sys.executable, os.path.join(ROOT, "run_image_classification.py"), "configs/image_tiny.json",
                        "--do_eval", "false", "--do_predict", "false", "--max_steps", str(train_steps),
                        "--logging_steps", "10", "--save_steps", "100000", "--output_dir", out,
                        "--compilation_cache_dir", "none"], cwd=ROOT, env=env, check=True, capture_output=True)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [row for row in map(json.loads, f) if row["split"] == "train" and "examples_per_second" in row]
    return statistics.median(row["examples_per_second"] for row in rows[1:] or rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--photos", type=int, default=256)
    parser.add_argument("--train_steps", type=int, default=100)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    digits, _, _ = images.scan_folder(os.path.join(ROOT, "data", "images", "train"), "train_dir")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        photos = photo_folder(tmp, args.photos)
        for name, paths, size in (("digits 8x8 -> 16", digits, 16), ("photos 500x375 -> 224", photos, 224)):
            for workers in args.workers:
                steps = args.steps if size == 16 else max(2, args.steps // 4)
                rows.append((f"pipeline, {name}, {workers} thread(s)",
                             pipeline_rate(paths, size, args.batch, steps, workers)))
    rows.append((f"train step, configs/image_tiny.json (16), 1 device, {args.train_steps} steps",
                 step_rate(args.train_steps)))
    width = max(len(name) for name, _ in rows)
    for name, rate in rows:
        print(f"{name:<{width}}  {rate:10,.0f} images/s")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
