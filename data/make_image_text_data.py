"""Build the toy image-text data set and its BERT-style tokenizer (deterministic).

Each image is a small picture of two coloured shapes side by side (left / right) or stacked (top /
bottom), e.g. a red circle on the left and a blue square on the right. Its captions say what is
where, in several phrasings:

    "a red circle on the left and a blue square on the right"
    "a blue square to the right of a red circle"

Matching a caption needs both what is in the image and where: the mirrored picture (the blue square
on the left) has the same words in another order. Validation and test hold combinations never seen
in training: an unordered pair of shapes in one arrangement ({red circle, blue square},
side by side) appears there in both orders and never in train. Each image also has a class label,
the shape on the left or at the top ("red circle"), for zero-shot classification.

Writes next to this script, in `image_text/`:

    images/{train,validation,test}/<n>.png       the pictures (RGB, 32 x 32 by default)
    images/{split}/metadata.jsonl                 an ImageFolder with captions: file_name, captions, label
    {train,valid,test}_dataset.json               the classic layout: json lines {"image_path", "captions", "label"}
                                                  (paths relative to the file)
    {train,validation,test}.csv.gz                one row per caption: image_path, caption, label (gzip)
    tokenizer/                                    a lowercase WordPiece tokenizer trained on the train captions

    python data/make_image_text_data.py [--train_size 1600] [--seed 42]
"""

import argparse
import csv
import gzip
import io
import itertools
import json
import os
import random
import shutil
import sys

from PIL import Image, ImageDraw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere, the CLI lives in the repo root

from train_tokenizer import train_tokenizer  # noqa: E402

COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 235),
    "yellow": (235, 215, 40), "purple": (150, 60, 200), "white": (240, 240, 240),
}
SHAPES = ("circle", "square", "triangle", "cross")
OBJECTS = [f"{colour} {shape}" for colour in COLOURS for shape in SHAPES]
BACKGROUNDS = [(0, 0, 0), (25, 25, 25), (40, 30, 20), (20, 30, 45)]

# {a} is on the left (or at the top), {b} on the right (or at the bottom).
CAPTIONS = {
    "side by side": [
        "a {a} on the left and a {b} on the right",
        "a {b} on the right and a {a} on the left",
        "a {a} to the left of a {b}",
        "a {b} to the right of a {a}",
        "on the left a {a}, on the right a {b}",
    ],
    "stacked": [
        "a {a} at the top and a {b} at the bottom",
        "a {b} at the bottom and a {a} at the top",
        "a {a} above a {b}",
        "a {b} below a {a}",
        "at the top a {a}, at the bottom a {b}",
    ],
}
CAPTIONS_PER_IMAGE = 3
SPLIT_FILES = {"train": "train_dataset.json", "validation": "valid_dataset.json", "test": "test_dataset.json"}


def draw_object(draw, obj, box):
    """Draw `obj` ("red circle") filling the square `box` (x0, y0, x1, y1)."""
    colour_name, shape = obj.split()
    colour = COLOURS[colour_name]
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)
    else:  # a cross: two bars a third of the box wide
        third = (x1 - x0) / 3
        draw.rectangle((x0 + third, y0, x1 - third, y1), fill=colour)
        draw.rectangle((x0, y0 + third, x1, y1 - third), fill=colour)


def draw_image(rng, first, second, arrangement, size):
    """Two objects, each at a random size and place inside its half of the picture."""
    image = Image.new("RGB", (size, size), rng.choice(BACKGROUNDS))
    draw = ImageDraw.Draw(image)
    half = size // 2
    for obj, offset in ((first, 0), (second, half)):
        side = rng.randint(half * 9 // 16, half * 13 // 16)
        along = offset + rng.randint(0, half - side - 1)  # the axis the halves split
        across = rng.randint(0, size - side - 1)
        x, y = (along, across) if arrangement == "side by side" else (across, along)
        draw_object(draw, obj, (x, y, x + side, y + side))
    return image


def combinations(seed, held_out, test_share):
    """(first, second, arrangement) triples for each split; held-out pairs come in both orders."""
    pairs = [(pair, arrangement) for pair in itertools.combinations(OBJECTS, 2) for arrangement in CAPTIONS]
    random.Random(seed).shuffle(pairs)
    n_test = round(held_out * test_share)
    groups = {"test": pairs[:n_test], "validation": pairs[n_test:held_out], "train": pairs[held_out:]}
    return {
        split: [(a, b, arr) for (x, y), arr in group for a, b in ((x, y), (y, x))]
        for split, group in groups.items()
    }


def make_split(rng, combos, n_images, image_size, folder):
    """`n_images` pictures of `combos` (each once when there are as many, else drawn at random)."""
    os.makedirs(folder, exist_ok=True)
    chosen = combos if n_images == len(combos) else [rng.choice(combos) for _ in range(n_images)]
    rows = []
    for n, (first, second, arrangement) in enumerate(chosen):
        file_name = f"{n:05d}.png"
        draw_image(rng, first, second, arrangement, image_size).save(os.path.join(folder, file_name))
        captions = [t.format(a=first, b=second) for t in rng.sample(CAPTIONS[arrangement], CAPTIONS_PER_IMAGE)]
        rows.append({"file_name": file_name, "captions": captions, "label": first})
    return rows


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def write_split(out, split, rows):
    folder = f"images/{split}"
    write_jsonl(os.path.join(out, folder, "metadata.jsonl"), rows)
    classic = [{"image_path": f"{folder}/{r['file_name']}", "captions": r["captions"], "label": r["label"]}
               for r in rows]
    write_jsonl(os.path.join(out, SPLIT_FILES[split]), classic)
    # mtime 0: the same data gives the same bytes on every run.
    with gzip.GzipFile(os.path.join(out, f"{split}.csv.gz"), "wb", mtime=0) as raw:
        fh = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        writer = csv.writer(fh)
        writer.writerow(["image_path", "caption", "label"])
        writer.writerows((r["image_path"], caption, r["label"]) for r in classic for caption in r["captions"])
        fh.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=os.path.join(ROOT, "data", "image_text"))
    p.add_argument("--train_size", type=int, default=1600)
    p.add_argument("--held_out_pairs", type=int, default=150,
                   help="(pair, arrangement) combinations kept out of train; each gives two images")
    p.add_argument("--test_share", type=float, default=1 / 3, help="share of the held-out pairs for test")
    p.add_argument("--image_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vocab_size", type=int, default=200)
    args = p.parse_args(argv)

    if os.path.isdir(args.output_dir):
        shutil.rmtree(args.output_dir)
    combos = combinations(args.seed, args.held_out_pairs, args.test_share)
    sizes = {"train": args.train_size, "validation": len(combos["validation"]), "test": len(combos["test"])}
    splits = {}
    # One generator per split, so changing one split's size leaves the others unchanged.
    for offset, split in enumerate(["train", "validation", "test"]):
        rng = random.Random(args.seed * 1000 + offset)
        folder = os.path.join(args.output_dir, "images", split)
        splits[split] = make_split(rng, combos[split], sizes[split], args.image_size, folder)
        write_split(args.output_dir, split, splits[split])

    captions = [c for row in splits["train"] for c in row["captions"]]
    tokenizer = train_tokenizer("wordpiece", captions, args.vocab_size, lowercase=True, model_max_length=32)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    counts = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    print(f"wrote {counts} images and a wordpiece tokenizer (vocab {len(tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
