"""Build a toy named-entity data set and its WordPiece tokenizer (deterministic).

Each example is one or two templated news sentences, pre-split into words, with IOB2 tags for
people (PER), places (LOC), organisations (ORG) and dates (DATE):

    Amara Okafor , a nurse from Lyon , joined Keller Foods on 12 March 2019 .
    B-PER I-PER  O O O     O    B-LOC O O      B-ORG  I-ORG O B-DATE I-DATE I-DATE O

A quarter of the first names, last names and places never occur in training: validation and test
use only those, so a tagger must read the context ("said", "from", "joined ... Foods"), not
remember the names. Organisations are built from names and places too ("Lyon University"), so
a place word is not always a LOC. Writes `ner/{train,validation,test}.jsonl` (fields `tokens` and
`ner_tags`, string tags) and `ner/tokenizer/` (cased WordPiece, trained on the training words, so
the held-out names split into sub-tokens) next to this script.

    python data/make_ner_data.py [--train_size 1500] [--seed 42]
"""

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere; the other generators are data.*

from train_tokenizer import train_tokenizer  # noqa: E402
from data.make_summarization_data import DAYS, FIRST_NAMES, JOBS, LAST_NAMES, PLACES  # noqa: E402

SPLITS = ("train", "validation", "test")
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ORG_SUFFIXES = ["Foods", "Bank", "Group", "Industries", "Media", "Motors", "Airlines", "Insurance"]
PLACE_SUFFIXES = ["Bay", "Valley", "Island", "Hills"]
ORG_PLACE_SUFFIXES = ["University", "Museum", "Hospital", "Orchestra", "Library"]

# Words that are both a name and a place (Sofia) would need context to tag even in training.
_AMBIGUOUS = set(FIRST_NAMES) & set(PLACES) | set(LAST_NAMES) & set(PLACES)


def _split_pool(words):
    """(training words, held-out words): every fourth distinct word, in sorted order, held out."""
    words = sorted(set(words) - _AMBIGUOUS)
    return [w for i, w in enumerate(words) if i % 4], words[::4]


POOLS = {name: _split_pool(words) for name, words in
         (("first", FIRST_NAMES), ("last", LAST_NAMES), ("place", PLACES))}

# Templates: words separated by spaces; {PER} {LOC} {ORG} {DATE} are entities, {job} {n} plain words.
TEMPLATES = [
    "{PER} , {job} from {LOC} , joined {ORG} on {DATE} .",
    "On {DATE} , {PER} travelled from {LOC} to {LOC} .",
    "{ORG} opened a new office in {LOC} on {DATE} .",
    "\" We are very proud , \" said {PER} of {ORG} .",
    "{PER} met {PER} in {LOC} last {DATE} .",
    "The mayor of {LOC} , {PER} , visited {ORG} on {DATE} .",
    "{PER} has worked for {ORG} since {DATE} .",
    "Shares in {ORG} rose on {DATE} after the company moved to {LOC} .",
    "{PER} was born in {LOC} in {DATE} .",
    "Speaking in {LOC} , {PER} said that {ORG} would hire {n} people .",
    "{PER} , {job} , lives in {LOC} with {n} cats .",
    "Police in {LOC} said {PER} was found safe on {DATE} .",
]


def _entity(words, kind):
    """(word, IOB2 tag) pairs of one entity."""
    return [(word, ("B-" if i == 0 else "I-") + kind) for i, word in enumerate(words)]


def _person(rng, pool, previous_word):
    first, last = rng.choice(pool["first"]), rng.choice(pool["last"])
    form = rng.random()
    if form < 0.6:
        return _entity([first, last], "PER")
    if form < 0.8:
        return _entity([first], "PER")
    return [(rng.choice(["Mr.", "Ms.", "Dr."]), "O")] + _entity([last], "PER")  # a title is no part of the name


def _place(rng, pool, previous_word):
    if rng.random() < 0.2:  # some two-word places, so the data has I-LOC too
        return _entity([rng.choice(pool["place"]), rng.choice(PLACE_SUFFIXES)], "LOC")
    return _entity([rng.choice(pool["place"])], "LOC")


def _organisation(rng, pool, previous_word):
    if rng.random() < 0.5:
        return _entity([rng.choice(pool["last"]), rng.choice(ORG_SUFFIXES)], "ORG")
    return _entity([rng.choice(pool["place"]), rng.choice(ORG_PLACE_SUFFIXES)], "ORG")


def _date(rng, pool, previous_word):
    """A date that reads right after the word before it: last Monday, in May 2003, on 3 June."""
    day, month, year = str(rng.randint(1, 28)), rng.choice(MONTHS), str(rng.randint(1950, 2024))
    if previous_word == "last":
        forms = [[rng.choice(DAYS)]]
    elif previous_word == "in":
        forms = [[month, year], [year]]
    else:
        forms = [[rng.choice(DAYS)], [day, month], [day, month, year]]
    return _entity(rng.choice(forms), "DATE")


FILLERS = {"{PER}": _person, "{LOC}": _place, "{ORG}": _organisation, "{DATE}": _date}


def sentence(rng, pool):
    """(words, IOB2 tags) of one filled template."""
    pairs = []
    for word in rng.choice(TEMPLATES).split():
        if word in FILLERS:
            pairs += FILLERS[word](rng, pool, pairs[-1][0] if pairs else "")
        else:
            pairs += [(w, "O") for w in word.format(job=rng.choice(JOBS), n=rng.randint(2, 900)).split()]
    words, tags = zip(*pairs)
    return list(words), list(tags)


def make_example(rng, pool):
    words, tags = sentence(rng, pool)
    if rng.random() < 0.3:  # a two-sentence story
        more_words, more_tags = sentence(rng, pool)
        words, tags = words + more_words, tags + more_tags
    return {"tokens": words, "ner_tags": tags}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=os.path.join(ROOT, "data", "ner"))
    p.add_argument("--train_size", type=int, default=1500)
    p.add_argument("--validation_size", type=int, default=300)
    p.add_argument("--test_size", type=int, default=300)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vocab_size", type=int, default=800)
    args = p.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    splits = {}
    for offset, split in enumerate(SPLITS):
        # Training names only in train; validation and test names only from the held-out pools.
        pool = {name: words[0 if split == "train" else 1] for name, words in POOLS.items()}
        # One generator per split, so changing one split's size leaves the others unchanged.
        rng = random.Random(args.seed * 1000 + offset)
        splits[split] = [make_example(rng, pool) for _ in range(getattr(args, f"{split}_size"))]
        with open(os.path.join(args.output_dir, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in splits[split])

    texts = [" ".join(row["tokens"]) for row in splits["train"]]
    tokenizer = train_tokenizer("wordpiece", texts, args.vocab_size, model_max_length=128)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    print(f"wrote {sizes} examples and a WordPiece tokenizer (vocab {len(tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
