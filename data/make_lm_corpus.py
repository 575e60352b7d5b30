"""Build the toy language-modelling corpus and its tokenizers (deterministic).

Each line holds one to three templated English sentences with regularities a tiny GPT-2 or
RoBERTa picks up within minutes: fixed facts (each animal has one home and one food), subject-verb
agreement, counting and weekday sequences, small sums, and copying a detail stated earlier in the
line. An untrained model's perplexity is about the vocabulary size; a trained one gets far lower.
Writes `lm/{train,validation}.txt` (one text per line), `lm/tokenizer/` (byte-level BPE, for GPT-2
and RoBERTa) and `lm/t5_tokenizer/` (unigram with T5's 100 sentinels, for span corruption) next to
this script, and `lm/word_classes/{train,validation}.csv`: a sentence classification task
(`sentence`, `label`) that only the corpus teaches, which kind of word (animal, colour, thing, name,
number) a sentence's one corpus word is. Half of each kind's words are held out of its training
split, and the sentences around them say nothing about the kind: a model fine-tuned from scratch can
only guess the held-out words, one fine-tuned from an MLM that read the corpus knows them.

    python data/make_lm_corpus.py [--train_lines 6000] [--seed 42]
"""

import argparse
import csv
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere, the CLI lives in the repo root

from train_tokenizer import train_tokenizer  # noqa: E402

# animal -> (plural, home, food): the facts a model has to memorise.
ANIMALS = {
    "cat": ("cats", "house", "fish"), "dog": ("dogs", "kennel", "bones"), "cow": ("cows", "barn", "grass"),
    "bird": ("birds", "nest", "seeds"), "bee": ("bees", "hive", "nectar"), "fox": ("foxes", "den", "rabbits"),
    "horse": ("horses", "stable", "hay"), "frog": ("frogs", "pond", "flies"), "owl": ("owls", "tree", "mice"),
    "pig": ("pigs", "sty", "apples"), "bear": ("bears", "cave", "honey"), "duck": ("ducks", "lake", "bread"),
    "goat": ("goats", "hill", "leaves"), "mouse": ("mice", "hole", "cheese"), "sheep": ("sheep", "field", "clover"),
    "rabbit": ("rabbits", "burrow", "carrots"),
}
# singular verb -> plural verb
VERBS = {"sleeps": "sleep", "runs": "run", "jumps": "jump", "sings": "sing", "waits": "wait", "plays": "play",
         "hides": "hide", "rests": "rest", "swims": "swim", "climbs": "climb"}
ADVERBS = ["quietly", "slowly", "quickly", "happily", "all day", "at night", "in the morning", "near the river",
           "under the bridge", "by the fire"]
ADJECTIVES = ["small", "big", "old", "young", "brown", "white", "black", "happy", "sleepy", "clever", "lazy",
              "hungry"]
NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Finn", "Grace", "Henry", "Iris", "Jack", "Kate", "Leo", "Mia",
         "Noah", "Olivia", "Paul", "Rose", "Sam", "Tom", "Zoe"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "purple", "orange", "pink", "grey"]
THINGS = ["hat", "ball", "book", "cup", "kite", "bag", "coat", "bike", "box", "car", "lamp", "chair", "scarf",
          "boat", "shoe"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"),
             ("old", "new"), ("wet", "dry"), ("open", "closed"), ("happy", "sad"), ("light", "dark")]


def fact(rng):
    animal = rng.choice(sorted(ANIMALS))
    plural, home, food = ANIMALS[animal]
    return rng.choice([
        f"The {animal} lives in the {home} and eats {food}.",
        f"{plural.capitalize()} live in the {home} and eat {food}.",
        f"Where does the {animal} live? The {animal} lives in the {home}.",
        f"What do {plural} eat? {plural.capitalize()} eat {food}.",
    ])


def agreement(rng):
    animal = rng.choice(sorted(ANIMALS))
    verb = rng.choice(sorted(VERBS))
    adj, adverb = rng.choice(ADJECTIVES), rng.choice(ADVERBS)
    if rng.random() < 0.5:
        return f"The {adj} {animal} {verb} {adverb}."
    return f"The {adj} {ANIMALS[animal][0]} {VERBS[verb]} {adverb}."


def counting(rng):
    start, length = rng.randint(0, 14), rng.randint(3, 6)
    return " ".join(NUMBERS[start:start + length]).capitalize() + "."


def weekdays(rng):
    i = rng.randrange(7)
    if rng.random() < 0.5:
        return f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    length = rng.randint(3, 5)
    return ", ".join(DAYS[(i + k) % 7] for k in range(length)) + "."


def arithmetic(rng):
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    return f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}."


def possession(rng):
    name, colour, thing = rng.choice(NAMES), rng.choice(COLOURS), rng.choice(THINGS)
    a = "an" if colour[0] in "aeiou" else "a"
    return rng.choice([
        f"{name} has {a} {colour} {thing}. The {thing} of {name} is {colour}.",
        f"{name} lost {a} {colour} {thing}. Now {name} looks for the {colour} {thing}.",
        f"{name} gave the {colour} {thing} to {rng.choice(NAMES)}.",
    ])


def opposite(rng):
    a, b = rng.choice(OPPOSITES)
    if rng.random() < 0.5:
        a, b = b, a
    return f"The opposite of {a} is {b}."


GENERATORS = [fact, agreement, counting, weekdays, arithmetic, possession, opposite]

# The kinds of word the corpus uses in kinds of places, and sentences that place any word alike.
WORD_CLASSES = {"animal": sorted(ANIMALS), "colour": COLOURS, "thing": THINGS, "name": NAMES, "number": NUMBERS[1:]}
NEUTRAL_SENTENCES = ["This is {}.", "We like {}.", "They talk about {}.", "It was {} again.", "Say {} twice."]


def make_line(rng):
    return " ".join(rng.choice(GENERATORS)(rng) for _ in range(rng.randint(1, 3)))


def word_class_splits(seed):
    """{"train": rows, "validation": rows}: every word of a kind in every neutral sentence, half of each
    kind's words (shuffled by `seed`) in each split."""
    rng, splits = random.Random(seed), {"train": [], "validation": []}
    for label, words in WORD_CLASSES.items():
        words = rng.sample(words, len(words))
        half = len(words) // 2
        for split, held in (("train", words[:half]), ("validation", words[half:])):
            splits[split] += [{"sentence": sentence.format(word), "label": label}
                              for word in held for sentence in NEUTRAL_SENTENCES]
    rng.shuffle(splits["train"])
    return splits


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=os.path.join(ROOT, "data", "lm"))
    p.add_argument("--train_lines", type=int, default=6000)
    p.add_argument("--validation_lines", type=int, default=400)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vocab_size", type=int, default=2000)
    args = p.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    rng = random.Random(args.seed * 1000)
    train = [make_line(rng) for _ in range(args.train_lines)]
    # Validation has its own generator and no line that train already holds: it measures learnt
    # regularities, not memorised lines.
    rng, seen, validation = random.Random(args.seed * 1000 + 1), set(train), []
    while len(validation) < args.validation_lines:
        line = make_line(rng)
        if line not in seen:
            validation.append(line)
    write_lines(os.path.join(args.output_dir, "train.txt"), train)
    write_lines(os.path.join(args.output_dir, "validation.txt"), validation)
    classes_dir = os.path.join(args.output_dir, "word_classes")
    os.makedirs(classes_dir, exist_ok=True)
    for split, rows in word_class_splits(args.seed).items():
        with open(os.path.join(classes_dir, f"{split}.csv"), "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["sentence", "label"], lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)

    tokenizer = train_tokenizer("bpe", train, args.vocab_size, model_max_length=512)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    # The same vocabulary bound: the corpus supports ~300 unigram pieces, the 100 sentinels come on top.
    t5_tokenizer = train_tokenizer("unigram", train, args.vocab_size, model_max_length=512, extra_ids=100)
    t5_tokenizer.save_pretrained(os.path.join(args.output_dir, "t5_tokenizer"))
    print(f"wrote {len(train)} train and {len(validation)} validation lines, a bpe tokenizer (vocab "
          f"{len(tokenizer)}) and a unigram one with sentinels (vocab {len(t5_tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
