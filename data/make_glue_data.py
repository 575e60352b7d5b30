"""Build four toy GLUE-like tasks for sequence classification and regression (deterministic).

Each is small and learnable by a tiny encoder within minutes, with the column names of its GLUE
counterpart:

- `sst2` (`sentence`, `label` 0/1): true or false statements about the animals of the language
  modelling corpus ("The cow lives in the barn." 1, "The cow eats honey." 0): facts the corpus states
  again and again (whether an MLM trained on it fine-tunes better: benchmarks/README.md, "Transfer
  from the MLM export").
- `cola` (`sentence`, `label` 0/1): subject-verb agreement, kept (1) or broken (0), sometimes with
  an attractor noun of the other number in between ("The dog near the cats sleep quietly." 0).
- `mrpc` (`sentence1`, `sentence2`, `label` "equivalent" / "not_equivalent", strings as user data
  often has): a news sentence and a rephrasing of it, with one detail changed when not equivalent.
- `stsb` (`sentence1`, `sentence2`, `label` a float 0-5): the same pairs with zero to five of their
  five details changed; the score is the number of details kept, jittered by up to 0.2.

Writes `glue/<task>/{train,validation,test}.{csv,jsonl}` next to this script; the test files have
no label column, as GLUE's test sets publish none, and `glue/tokenizer/`, a small cased WordPiece
(BERT-style) tokenizer trained on the training sentences, so that rarer words split into sub-tokens.

    python data/make_glue_data.py [--train_size 600] [--seed 42]
"""

import argparse
import csv
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere; the other generators are data.*

from train_tokenizer import train_tokenizer  # noqa: E402
from data.make_lm_corpus import ADJECTIVES, ADVERBS, ANIMALS, VERBS  # noqa: E402
from data.make_summarization_data import DAYS, EVENTS, FIRST_NAMES, LAST_NAMES, PLACES  # noqa: E402

TASKS = ("sst2", "cola", "mrpc", "stsb")
SPLITS = ("train", "validation", "test")
TIMES = ["in the morning", "at noon", "in the afternoon", "in the evening", "at night"]


def sst2_example(rng):
    animal = rng.choice(sorted(ANIMALS))
    plural, home, food = ANIMALS[animal]
    true = rng.random() < 0.5
    adjective = rng.choice(["", *[a + " " for a in ADJECTIVES]])  # varies the wording, not the fact
    if rng.random() < 0.5:
        place = home if true else rng.choice(sorted({h for _, h, _ in ANIMALS.values()} - {home}))
        sentence = rng.choice([f"The {adjective}{animal} lives in the {place}.",
                               f"{(adjective + plural).capitalize()} live in the {place}."])
    else:
        meal = food if true else rng.choice(sorted({f for _, _, f in ANIMALS.values()} - {food}))
        sentence = rng.choice([f"The {adjective}{animal} eats {meal}.",
                               f"{(adjective + plural).capitalize()} eat {meal}."])
    return {"sentence": sentence, "label": int(true)}


def cola_example(rng):
    animal, other = rng.sample(sorted(ANIMALS), 2)
    plural_subject = rng.random() < 0.5
    agrees = rng.random() < 0.5
    verb = rng.choice(sorted(VERBS))
    subject = ANIMALS[animal][0] if plural_subject else animal
    # The verb agrees with the subject, or is deliberately the other number.
    verb_is_plural = plural_subject == agrees
    words = ["The", rng.choice(ADJECTIVES), subject]
    if rng.random() < 0.4:  # an attractor of the other number, so the nearest noun is no guide
        words += ["near", "the", other if plural_subject else ANIMALS[other][0]]
    words += [VERBS[verb] if verb_is_plural else verb, rng.choice(ADVERBS)]
    return {"sentence": " ".join(words) + ".", "label": int(agrees)}


def _event(rng):
    verb = rng.choice(sorted(EVENTS))
    return {"name": f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}", "event": (verb, rng.choice(EVENTS[verb])),
            "place": rng.choice(PLACES), "day": rng.choice(DAYS), "time": rng.choice(TIMES)}


def _changed(rng, event, field):
    """`event` with `field` replaced by a different value of the same kind."""
    while True:
        value = _event(rng)[field]
        if value != event[field]:
            return {**event, field: value}


def _say(rng, event):
    """One of several phrasings of the same five details."""
    name, (verb, obj), place, day, time = (event[k] for k in ("name", "event", "place", "day", "time"))
    return rng.choice([
        f"{name} {verb} {obj} in {place} on {day} {time}.",
        f"On {day} {time}, {name} {verb} {obj} in {place}.",
        f"In {place}, {name} {verb} {obj} on {day} {time}.",
        f"It was {name} who {verb} {obj} in {place} on {day} {time}.",
    ])


def pair_example(rng, n_changed):
    first = _event(rng)
    second = first
    for field in rng.sample(["name", "event", "place", "day", "time"], n_changed):
        second = _changed(rng, second, field)
    return _say(rng, first), _say(rng, second)


def mrpc_example(rng):
    equivalent = rng.random() < 0.5
    sentence1, sentence2 = pair_example(rng, 0 if equivalent else 1)
    return {"sentence1": sentence1, "sentence2": sentence2, "label": "equivalent" if equivalent else "not_equivalent"}


def stsb_example(rng):
    n_changed = rng.randint(0, 5)
    sentence1, sentence2 = pair_example(rng, n_changed)
    score = min(5.0, max(0.0, 5 - n_changed + rng.uniform(-0.2, 0.2)))
    return {"sentence1": sentence1, "sentence2": sentence2, "label": round(score, 2)}


MAKERS = {"sst2": sst2_example, "cola": cola_example, "mrpc": mrpc_example, "stsb": stsb_example}


def write_split(directory, split, rows):
    if split == "test":
        rows = [{k: v for k, v in row.items() if k != "label"} for row in rows]
    with open(os.path.join(directory, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    with open(os.path.join(directory, f"{split}.csv"), "w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def make_task(task, sizes, seed):
    """{split: rows}; one generator per (task, split), so one size leaves the other splits unchanged."""
    return {split: [MAKERS[task](random.Random(f"{seed}-{task}-{split}-{i}")) for i in range(sizes[split])]
            for split in SPLITS}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=os.path.join(ROOT, "data", "glue"))
    p.add_argument("--train_size", type=int, default=600)
    p.add_argument("--validation_size", type=int, default=200)
    p.add_argument("--test_size", type=int, default=200)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vocab_size", type=int, default=800)
    args = p.parse_args(argv)

    sizes = {split: getattr(args, f"{split}_size") for split in SPLITS}
    train_texts = []
    for task in TASKS:
        directory = os.path.join(args.output_dir, task)
        os.makedirs(directory, exist_ok=True)
        rows_by_split = make_task(task, sizes, args.seed)
        for split, rows in rows_by_split.items():
            write_split(directory, split, rows)
        train_texts += [row[k] for row in rows_by_split["train"] for k in row if k != "label"]
    tokenizer = train_tokenizer("wordpiece", train_texts, args.vocab_size, model_max_length=128)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    print(f"wrote {', '.join(TASKS)} ({', '.join(f'{s} {n}' for s, n in sizes.items())}) and a WordPiece "
          f"tokenizer (vocab {len(tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
