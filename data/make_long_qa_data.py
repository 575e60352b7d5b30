"""Build a toy long-document question-answering data set (Natural Questions-style answer categories) and its tokenizer.

Each document is a long chronicle of a town: hundreds of filler sentences with two or three facts
about people scattered anywhere in it (hundreds to thousands of tokens, so a question's answer sits
in one window of many), built from `make_qa_data.py`'s facts, each of another kind (a move, a
purchase, a job, a meeting): a question's verb finds its sentence, which a tiny model from scratch
learns in minutes, where matching a name across thousands of tokens it does not. Each question has
one answer category:

- short: a span of the fact ("Where did Amara move to?" -> "Lyon");
- long: the whole fact sentence ("What does the chronicle say about where Amara moved?");
- yes / no: a fact checked ("Did Amara move to Lyon?"), the fact sentence its evidence;
- null: about a kind of fact the document does not hold, of someone in it or not.

Rows are JSON lines `id`, `question`, `context`, `answers`: a list of {category, text, answer_start}
(empty: null; yes / no: the evidence sentence and its offset). Writes next to this script, in
`long_qa/`: `train.jsonl.gz`, `validation.jsonl.gz`, `test.jsonl.gz` (no answers) and `tokenizer/`
(cased WordPiece trained on the training documents and questions).

    python data/make_long_qa_data.py [--train_documents 300] [--seed 42]
"""

import argparse
import gzip
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere; the other generators are data.*

from train_tokenizer import train_tokenizer  # noqa: E402
from data.make_qa_data import FACTS, FILLERS, JOBS, OBJECTS, person  # noqa: E402
from data.make_summarization_data import DAYS, FIRST_NAMES, PLACES  # noqa: E402

MORE_FILLERS = ["The bakery opened a second shop .", "A storm closed the harbour for a day .",
                "The school held its yearly fair .", "Roads were repaired before the winter .",
                "The library bought new books .", "A new bridge was planned but never built .",
                "The mayor gave a long speech .", "Trains ran late for a week ."]
# A yes / no question per kind of fact, about its person and one more slot.
CHECKS = {"move": ("Did {P} move to {L}?", "L"), "buy": ("Did {P} buy a {O}?", "O"),
          "work": ("Does {P} work as a {J}?", "J"), "meet": ("Did {P} meet {Q}?", "Q")}
LONG_QUESTIONS = {"move": "What does the chronicle say about where {P} moved?",
                  "buy": "What does the chronicle say about what {P} bought?",
                  "work": "What does the chronicle say about the work of {P}?",
                  "meet": "What does the chronicle say about whom {P} met?"}
POOLS = {"L": PLACES, "O": OBJECTS, "J": JOBS}


def document(rng, sentences):
    """(context, facts, taken): `sentences` sentences, 2 or 3 of them facts about people (each of
    another kind), the rest fillers; each fact is (kind, {slot: value}, {slot: character offset},
    (sentence start, sentence end)); `taken` the names the document uses."""
    taken = set()
    kinds = rng.sample(list(FACTS), rng.randint(2, 3))
    slots = dict(zip(sorted(rng.sample(range(sentences), len(kinds))), kinds))
    context, facts = "", []
    for position in range(sentences):
        if context:
            context += " "
        if position not in slots:
            context += rng.choice(FILLERS + MORE_FILLERS)
            continue
        kind = slots[position]
        values = {"P": person(rng, taken), "L": rng.choice(PLACES), "O": rng.choice(OBJECTS),
                  "J": rng.choice(JOBS), "Y": str(rng.randint(1950, 2024)), "D": rng.choice(DAYS)}
        values["Q"] = person(rng, taken)
        start, offsets = len(context), {}
        for part in FACTS[kind][0].split(" "):
            if part.startswith("{"):
                offsets[part[1]] = len(context)
                context += values[part[1]] + part[3:]
            else:
                context += part
            context += " "
        context = context[:-1]
        facts.append((kind, values, offsets, (start, len(context))))
    return context, facts, taken


def questions(rng, doc_id, context, facts, taken):
    """The questions of one document: per fact a short one and one of short / long / yes / no, and
    one null question, about a kind of fact the document does not hold."""
    rows = []

    def add(question, category, text="", start=-1):
        answers = [] if category == "null" else [{"category": category, "text": text, "answer_start": start}]
        rows.append({"id": f"{doc_id}-{len(rows)}", "question": question, "context": context, "answers": answers})

    for kind, values, offsets, (first, last) in facts:
        sentence = context[first:last]
        shorts = iter(rng.sample(FACTS[kind][1], 2))  # two short questions of one fact ask different things
        for category in ("short", rng.choice(["short", "long", "yes", "no"])):
            if category == "short":
                template, slot = next(shorts)
                add(template.format(**values), "short", values[slot], offsets[slot])
            elif category == "long":
                add(LONG_QUESTIONS[kind].format(**values), "long", sentence, first)
            else:
                template, slot = CHECKS[kind]
                asked = dict(values)
                if category == "no":  # another value of the slot than the document's
                    pool = POOLS.get(slot) or [name for name in FIRST_NAMES if name not in taken]
                    asked[slot] = rng.choice([value for value in pool if value != values[slot]])
                add(template.format(**asked), category, sentence, first)
    _, values, _, _ = rng.choice(facts)
    missing = rng.choice([kind for kind in FACTS if kind not in {fact[0] for fact in facts}])
    if rng.random() < 0.5:  # someone the document never mentions, else someone in it
        values = {**values, "P": rng.choice([name for name in FIRST_NAMES if name not in taken])}
    template, _ = rng.choice([q for q in FACTS[missing][1] if "{P}" in q[0]])
    add(template.format(**values), "null")
    return rows


def write_jsonl(path, rows):
    """JSON lines; gzip-compressed (reproducibly: no time stamp) when the name ends in .gz."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    if path.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(text)
    else:
        with open(path, "wb") as f:
            f.write(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=os.path.join(ROOT, "data", "long_qa"))
    p.add_argument("--train_documents", type=int, default=300)
    p.add_argument("--validation_documents", type=int, default=12)
    p.add_argument("--test_documents", type=int, default=3)
    p.add_argument("--train_sentences", default="20,80", help="sentences of the shortest and longest "
                   "training documents (shorter than the others: the tiny config trains in two minutes)")
    p.add_argument("--sentences", default="150,450", help="sentences of the shortest and longest validation and "
                   "test documents")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vocab_size", type=int, default=1000)
    args = p.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    counts = {}
    for offset, split in enumerate(("train", "validation", "test")):
        rng = random.Random(args.seed * 1000 + offset)  # one generator per split: sizes change nothing else
        rows = []
        fewest, most = map(int, (args.train_sentences if split == "train" else args.sentences).split(","))
        for i in range(getattr(args, f"{split}_documents")):
            context, facts, taken = document(rng, rng.randint(fewest, most))
            rows += questions(rng, f"{split[0]}{i:03d}", context, facts, taken)
        if split == "test":
            rows = [{key: row[key] for key in ("id", "question", "context")} for row in rows]
        write_jsonl(os.path.join(args.output_dir, f"{split}.jsonl.gz"), rows)  # a document per question: compressed
        counts[split] = len(rows)
        if split == "train":
            texts = sorted({row["context"] for row in rows}) + [row["question"] for row in rows]
    tokenizer = train_tokenizer("wordpiece", texts, args.vocab_size, model_max_length=4096)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    print(f"wrote questions: {', '.join(f'{k} {v}' for k, v in counts.items())} and a WordPiece tokenizer "
          f"(vocab {len(tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
