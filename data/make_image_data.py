"""Write scikit-learn's handwritten digits as a small ImageFolder (deterministic).

The 1,797 real 8x8 grey images of `sklearn.datasets.load_digits` (bundled with scikit-learn: no
download), 10 classes, written as 8-bit grey PNGs into

    images/{train,validation}/<digit>/<n>.png

next to this script, `n` being the image's index in the digits set. Every fifth image (by index)
goes to validation (360), the rest to train (1,437). Only this generator needs scikit-learn; the
training script reads the PNGs.

    python data/make_image_data.py [--out data/images]
"""

import argparse
import os
import shutil

import numpy as np
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
VALIDATION_EVERY = 5


def write_digits(out):
    from sklearn.datasets import load_digits

    digits = load_digits()
    if os.path.isdir(out):
        shutil.rmtree(out)
    counts = {"train": 0, "validation": 0}
    for n, (image, label) in enumerate(zip(digits.images, digits.target)):
        split = "validation" if n % VALIDATION_EVERY == 0 else "train"
        folder = os.path.join(out, split, str(label))
        os.makedirs(folder, exist_ok=True)
        # Values are 0..16 (ink counts): scaled to the full 8-bit range.
        pixels = np.round(image * (255 / 16)).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(os.path.join(folder, f"{n}.png"), optimize=False)
        counts[split] += 1
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "images"))
    args = parser.parse_args()
    counts = write_digits(args.out)
    print(f"wrote {counts['train']} train and {counts['validation']} validation images to {args.out}")


if __name__ == "__main__":
    main()
