"""Build a toy extractive question-answering data set (SQuAD v1.1 and v2.0 layouts) and its tokenizer.

Each context is a short story of facts about four to six people, in random order between filler
sentences, so the tiny config's 64-token window needs two or three windows to cover it:

    The market was busy that week . Amara moved to Lyon in 1998 . On Friday , Diego bought a
    bicycle . ...

Questions ask who / where / when / what about one fact; the other facts are distractors of the same
shape ("Where did Amara move to?" while Diego moved elsewhere), so a model must match the person
and the verb, not the sentence pattern. The v2.0 variant adds unanswerable questions:
about people who are not in the story, or about a fact the story does not give for someone who is.

Writes next to this script, in `qa/`: `train.json.gz` / `validation.json` (SQuAD v1.1: every
question answerable), `train_v2.json.gz` / `validation_v2.json` (SQuAD v2.0: the same stories and
questions plus unanswerable ones, `is_impossible`), `test.jsonl` (flat rows `id`, `question`, `context`, no
answers) and `tokenizer/` (cased WordPiece trained on the training stories and questions).

    python data/make_qa_data.py [--train_stories 300] [--seed 42]
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
from data.make_summarization_data import DAYS, FIRST_NAMES, PLACES  # noqa: E402

OBJECTS = ["bicycle", "piano", "red car", "small boat", "violin", "old clock", "camera", "painting", "tent",
           "telescope", "sofa", "guitar", "laptop", "kite", "wooden chair", "lamp"]
JOBS = ["teacher", "builder", "nurse", "baker", "farmer", "pilot", "doctor", "painter", "lawyer", "chef",
        "plumber", "writer"]
FILLERS = ["The market was busy that week .", "It rained for most of the spring .", "Nobody expected the news .",
           "The town council met twice that month .", "Prices rose again in the autumn .",
           "Many visitors came for the festival .", "The river flooded the lower streets ."]

# A fact: (sentence template, [(question template, the slot that answers it)]). Slots: P (person),
# Q (another person), L (place), Y (year), D (day), O (object), J (job).
FACTS = {
    "move": ("{P} moved to {L} in {Y} .",
             [("Where did {P} move to?", "L"), ("When did {P} move to {L}?", "Y"), ("Who moved to {L}?", "P")]),
    "buy": ("On {D} , {P} bought a {O} .",
            [("What did {P} buy?", "O"), ("Who bought a {O}?", "P"), ("On which day did {P} buy a {O}?", "D")]),
    "work": ("{P} works as a {J} in {L} .",
             [("What is the job of {P}?", "J"), ("Where does {P} work?", "L")]),
    "meet": ("{P} met {Q} at a concert in {L} .",
             [("Who did {P} meet at the concert?", "Q"), ("Where did {P} meet {Q}?", "L")]),
}
# The questions of each kind of fact that name its person: asked about someone without that fact
# (v2.0), they have no answer in the story.
ABOUT_PERSON = {kind: [question for question, _ in questions if "{P}" in question]
                for kind, (_, questions) in FACTS.items()}


def person(rng, taken):
    """A first name no one else in the story has (one token to match: a tiny model learns that in minutes)."""
    name = rng.choice([name for name in FIRST_NAMES if name not in taken])
    taken.add(name)
    return name


def story(rng):
    """(context, facts): each fact is (kind, {slot: value}, {slot: character offset in the context})."""
    taken, places, objects = set(), set(), set()
    people = [person(rng, taken) for _ in range(rng.randint(4, 6))]
    facts, sentences = [], []
    for who in people:
        # Each person has one fact; places and objects are unique in the story so who-questions have one answer.
        kind = rng.choice(list(FACTS))
        values = {"P": who, "Y": str(rng.randint(1950, 2024)), "D": rng.choice(DAYS), "J": rng.choice(JOBS)}
        values["L"] = rng.choice([p for p in PLACES if p not in places])
        values["O"] = rng.choice([o for o in OBJECTS if o not in objects])
        values["Q"] = person(rng, taken)
        places.add(values["L"])
        objects.add(values["O"])
        facts.append((kind, values))
        sentences.append(len(facts) - 1)
    sentences += rng.sample(FILLERS, rng.randint(2, 3))
    rng.shuffle(sentences)
    context, located = "", []
    for item in sentences:
        if context:
            context += " "
        if isinstance(item, str):
            context += item
            continue
        kind, values = facts[item]
        template, offsets = FACTS[kind][0], {}
        for part in template.split(" "):
            if part.startswith("{"):
                slot = part[1]
                offsets[slot] = len(context)
                context += values[slot] + part[3:]
            else:
                context += part
            context += " "
        context = context[:-1]
        located.append((kind, values, offsets))
    return context, located, taken


def questions(rng, story_id, context, facts, taken, with_impossible):
    """SQuAD `qas` of one story: one or two questions per fact; with_impossible adds two unanswerable."""
    qas = []
    for kind, values, offsets in facts:
        for template, slot in rng.sample(FACTS[kind][1], rng.randint(1, 2)):
            answer = values[slot]
            assert context[offsets[slot]:offsets[slot] + len(answer)] == answer
            qas.append({"id": f"{story_id}-{len(qas)}", "question": template.format(**values),
                        "answers": [{"text": answer, "answer_start": offsets[slot]}]})
    if with_impossible:
        used = {value for _, values, _ in facts for value in values.values()}
        for _ in range(2):
            kind, values, _ = rng.choice(facts)
            fresh = {"L": rng.choice([p for p in PLACES if p not in used]),
                     "O": rng.choice([o for o in OBJECTS if o not in used])}
            if rng.random() < 0.5:  # about a person the story never mentions
                template = rng.choice(ABOUT_PERSON[kind])
                values = {**values, "P": person(rng, set(taken))}
            else:  # about someone in the story, and a fact of another kind than theirs
                template = rng.choice([t for k in FACTS if k != kind for t in ABOUT_PERSON[k]])
                values = {**values, **fresh}
            qas.append({"id": f"{story_id}-{len(qas)}", "question": template.format(**values), "answers": [],
                        "is_impossible": True})
    return qas


def squad(stories, version):
    return {"version": version, "data": [{"title": story_id, "paragraphs": [{"context": context, "qas": qas}]}
                                          for story_id, context, qas in stories]}


def write_json(path, document):
    """Compact JSON; gzip-compressed (reproducibly: no time stamp) when the name ends in .gz."""
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n"
    if path.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(text.encode("utf-8"))
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=os.path.join(ROOT, "data", "qa"))
    p.add_argument("--train_stories", type=int, default=300)
    p.add_argument("--validation_stories", type=int, default=40)
    p.add_argument("--test_stories", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vocab_size", type=int, default=1200)
    args = p.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    counts = {}
    for offset, split in enumerate(("train", "validation", "test")):
        rng = random.Random(args.seed * 1000 + offset)  # one generator per split: sizes change nothing else
        v1, v2 = [], []
        for i in range(getattr(args, f"{split}_stories")):
            story_id = f"{split[0]}{i:04d}"
            context, facts, taken = story(rng)
            qas = questions(rng, story_id, context, facts, taken, with_impossible=True)
            v2.append((story_id, context, qas))
            v1.append((story_id, context, [qa for qa in qas if qa["answers"]]))
        if split == "test":
            with open(os.path.join(args.output_dir, "test.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"id": qa["id"], "question": qa["question"], "context": context}) + "\n"
                             for _, context, qas in v1 for qa in qas)
            counts[split] = sum(len(qas) for _, _, qas in v1)
            continue
        ending = ".json.gz" if split == "train" else ".json"  # the training stories compressed: 8 times smaller
        write_json(os.path.join(args.output_dir, f"{split}{ending}"), squad(v1, "1.1"))
        write_json(os.path.join(args.output_dir, f"{split}_v2{ending}"), squad(v2, "v2.0"))
        counts[split] = f"{sum(len(q) for _, _, q in v1)} (v2: {sum(len(q) for _, _, q in v2)})"
        if split == "train":
            texts = [context for _, context, _ in v2] + [qa["question"] for _, _, qas in v2 for qa in qas]

    tokenizer = train_tokenizer("wordpiece", texts, args.vocab_size, model_max_length=512)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    print(f"wrote questions: {', '.join(f'{k} {v}' for k, v in counts.items())} and a WordPiece tokenizer "
          f"(vocab {len(tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
