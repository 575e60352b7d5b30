"""Build the toy summarization data set and its T5-style tokenizer (deterministic).

Each document is a short templated news story: one key event sentence ("who did what where, on
which day") placed at a random position among distractor sentences (weather, quotes, background,
numbers, and other people's past events). The summary restates the key event in one fixed form:

    "Maria Lopez opened a bakery in Lisbon on Monday."

Only the key sentence carries a weekday, so a small model can learn to find it, but it must look
past the first sentence and rephrase, not copy. Writes `summarization/{train,validation,test}.jsonl`
(fields `document`, `summary`) and `summarization/tokenizer/` next to this script.

    python data/make_summarization_data.py [--train_size 2000] [--seed 42]
"""

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere, the CLI lives in the repo root

from train_tokenizer import train_tokenizer  # noqa: E402

FIRST_NAMES = """Maria James Aisha Kenji Sofia Lucas Amara Diego Elena Omar Priya Noah Chloe Mateo Fatima
Liam Ingrid Ravi Hannah Yusuf Clara Tomas Leila Victor Nadia Samuel Zara Felix Irene Hugo Mei Pablo
Greta Arjun Lucia Emil Rosa Daniel Ayumi Marco Olga Kwame Alice Ibrahim Nora Stefan Lina Andre Julia
Pedro Keiko Oscar Amelia Tariq Vera Leon Sara Jonas Eva Rafael""".split()

LAST_NAMES = """Lopez Smith Okafor Tanaka Rossi Martin Mensah Garcia Petrova Haddad Sharma Wilson Dubois
Fernandez Khan Murphy Larsen Patel Becker Demir Moreau Novak Rahman Silva Kowalski Adeyemi Ali Weber
Costa Nakamura Santos Berg Jensen Kumar Romano Fischer Ortiz Lindqvist Baker Hughes Ivanova Mendes
Owusu Keller Varga Suzuki Morales Walsh Nilsson Reyes""".split()

PLACES = """Lisbon Madrid Porto Seville Valencia Bilbao Lyon Marseille Nantes Bordeaux Toulouse Geneva
Zurich Basel Milan Turin Naples Florence Bologna Verona Vienna Graz Munich Hamburg Cologne Leipzig
Dresden Berlin Prague Brno Krakow Gdansk Warsaw Budapest Zagreb Ljubljana Athens Sofia Bucharest
Istanbul Dublin Cork Galway Belfast Glasgow Edinburgh Leeds Bristol Oxford Cambridge Oslo Bergen
Stockholm Uppsala Helsinki Tampere Copenhagen Aarhus Riga Vilnius Tallinn Amsterdam Utrecht Rotterdam
Antwerp Ghent Brussels Luxembourg Nairobi Accra Lagos Dakar Tunis Cairo Mumbai Delhi Osaka Kyoto
Seoul Busan Manila Jakarta Sydney Perth Auckland Toronto Montreal Boston Denver Seattle Chicago
Houston Lima Bogota Quito Santiago""".split()

# Past-tense verb -> objects it takes. Summaries reuse these strings verbatim.
EVENTS = {
    "opened": ["a bakery", "a bookshop", "a small cafe", "a dance school", "a bicycle shop", "a toy museum",
               "a vegan restaurant", "an art gallery", "a flower shop", "a repair cafe"],
    "sold": ["a vintage car", "a rare painting", "an old farmhouse", "a racehorse", "a sailing boat",
             "a collection of stamps", "a family hotel", "a signed guitar"],
    "won": ["a chess tournament", "a cooking contest", "a city marathon", "a poetry prize",
            "a baking competition", "a photography award", "a rowing race", "a spelling bee"],
    "launched": ["a podcast", "a local newspaper", "a charity", "a radio station", "a food delivery app",
                 "a reading club", "a recycling project", "a startup"],
    "found": ["a lost dog", "a rare coin", "an ancient map", "a stolen bicycle", "a meteorite",
              "a buried chest", "a missing wedding ring", "a fossil"],
    "built": ["a wooden bridge", "a greenhouse", "a treehouse", "a small robot", "a rowing boat",
              "a solar oven", "a telescope", "a stone wall"],
    "painted": ["a huge mural", "a portrait of the mayor", "a city map", "a bus shelter",
                "a school wall", "a fishing boat"],
    "repaired": ["a church clock", "an old piano", "a historic tram", "a windmill", "a village fountain",
                 "a broken bell"],
    "donated": ["a grand piano", "a fire truck", "a thousand books", "a football pitch", "an ambulance",
                "a set of laptops"],
    "rescued": ["a stranded whale", "two lost hikers", "a trapped kitten", "a family of ducks",
                "an injured eagle", "a drifting canoe"],
    "organised": ["a street festival", "a charity concert", "a night market", "a film festival",
                  "a beach cleanup", "a jazz evening"],
    "discovered": ["a hidden cave", "a new species of frog", "a Roman coin", "an old shipwreck",
                   "a forgotten tunnel", "a secret garden"],
}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
JOBS = ["a teacher", "an engineer", "a nurse", "a baker", "a farmer", "a student", "a retired pilot",
        "a musician", "a chef", "a librarian", "a carpenter", "a firefighter", "an architect", "a fisherman",
        "a postman", "a doctor", "a painter", "a shop owner", "a taxi driver", "a scientist"]

KEY_TEMPLATES = [
    "{name} {verb} {obj} in {place} on {day}.",
    "On {day}, {name} {verb} {obj} in {place}.",
    "In {place} on {day}, {name}, {job} aged {age}, {verb} {obj}.",
    "{name}, {job}, {verb} {obj} in {place} on {day}, officials confirmed.",
    "Witnesses said that {name} {verb} {obj} in {place} on {day}.",
    "It was on {day} that {name} {verb} {obj} in {place}.",
    "After months of planning, {name} {verb} {obj} in {place} on {day}.",
    "Residents of {place} were surprised on {day} when {name} {verb} {obj}.",
]
SUMMARY_TEMPLATE = "{name} {verb} {obj} in {place} on {day}."

WEATHER = ["sunny", "cloudy", "rainy", "windy", "foggy", "cold", "unusually warm", "stormy"]
QUOTES = [
    "It was a wonderful day for everyone",
    "Nobody expected this to happen here",
    "We are very proud of our community",
    "I have never seen anything like it",
    "This is good news for the whole town",
    "It took a lot of hard work",
    "People are still talking about it",
    "We hope it will happen again next year",
    "It made the children very happy",
    "The whole street came out to watch",
]
TOWN_FEATURES = ["its old harbour", "its narrow streets", "its spring market", "its football club",
                 "its cathedral", "its cheese", "its river festival", "its university", "its bridges"]
FILLERS = [
    "Police said no one was hurt.",
    "The story was reported by local radio.",
    "Photos of the event spread quickly online.",
    "The mayor has not yet commented.",
    "More details are expected later this week.",
    "Neighbours gathered to watch.",
]

DISTRACTORS = [
    "The weather in {place} was {weather}, with temperatures around {n} degrees.",
    "Rain is expected in {place2} later this week.",
    "\"{quote},\" said {other}, {job2} from {place2}.",
    "Reporters from {place2} arrived later in the day.",
    "{last} has lived in {place2} for {n} years.",
    "{last} first moved to {place} as {job2} {n} years ago.",
    "About {big} people followed the news, and {n} of them sent messages.",
    "The project cost about {big} euros, according to {other}.",
    "{place} is known for {feature}.",
    "Last year, {other} {verb2} {obj2} in {place2}.",
    "Years ago, {other} {verb2} {obj2} in {place}.",
    "{filler}",
]


def _event(rng):
    verb = rng.choice(sorted(EVENTS))
    return verb, rng.choice(EVENTS[verb])


def _fields(rng):
    """Everything one story may mention; key-event fields plus distinct distractor ones."""
    verb, obj = _event(rng)
    verb2, obj2 = _event(rng)
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    other = f"{rng.choice(FIRST_NAMES)} {rng.choice([n for n in LAST_NAMES if n != last])}"
    place, place2 = rng.sample(PLACES, 2)
    return dict(
        name=f"{first} {last}", last=last, verb=verb, obj=obj, place=place, day=rng.choice(DAYS),
        age=rng.randint(19, 84), job=rng.choice(JOBS), other=other, place2=place2, verb2=verb2, obj2=obj2,
        job2=rng.choice(JOBS), weather=rng.choice(WEATHER), quote=rng.choice(QUOTES), n=rng.randint(2, 40),
        big=rng.choice([120, 300, 450, 800, 1500, 2000, 5000, 12000]), feature=rng.choice(TOWN_FEATURES),
        filler=rng.choice(FILLERS),
    )


def make_example(rng, min_words=40, max_words=120):
    while True:
        f = _fields(rng)
        n_distractors = rng.randint(2, 5)
        sentences = [t.format(**f) for t in rng.sample(DISTRACTORS, n_distractors)]
        sentences.insert(rng.randint(0, n_distractors), rng.choice(KEY_TEMPLATES).format(**f))
        document = " ".join(sentences)
        if min_words <= len(document.split()) <= max_words:
            return {"document": document, "summary": SUMMARY_TEMPLATE.format(**f)}


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default=os.path.join(ROOT, "data", "summarization"))
    p.add_argument("--train_size", type=int, default=2000)
    p.add_argument("--validation_size", type=int, default=200)
    p.add_argument("--test_size", type=int, default=200)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--vocab_size", type=int, default=2000)
    args = p.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    splits = {}
    # One generator per split, so changing one split's size leaves the others unchanged.
    for offset, split in enumerate(["train", "validation", "test"]):
        rng = random.Random(args.seed * 1000 + offset)
        splits[split] = [make_example(rng) for _ in range(getattr(args, f"{split}_size"))]
        write_jsonl(os.path.join(args.output_dir, f"{split}.jsonl"), splits[split])

    texts = [t for row in splits["train"] for t in (row["document"], row["summary"])]
    tokenizer = train_tokenizer("unigram", texts, args.vocab_size, model_max_length=512)
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
    print(f"wrote {sizes} examples and a unigram tokenizer (vocab {len(tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
