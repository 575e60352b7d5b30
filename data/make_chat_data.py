"""Build the toy chat data and its tokenizer (deterministic).

Conversations whose answers follow rules a tiny decoder learns within a few hundred steps: add two
digits, name the colour of the thing a person was said to have, reverse three animals, and where
an animal lives (facts learnt by heart); some start with a system turn, some hold two exchanges.
The held-out rows draw new combinations (three animals in another order, another person with
another thing), so their exact match measures the rules learnt, not rows recalled.

Writes next to this script: `chat/{train,validation,test}.jsonl` (`messages` rows),
`chat/instructions_{train,validation}.jsonl` (the same questions as `prompt` / `completion` rows),
and `chat/tokenizer/`: byte-level BPE with role tokens and a chat template whose answers sit in
`{% generation %}` blocks (so transformers can tell their tokens too).

    python data/make_chat_data.py [--train_rows 4000] [--seed 7]
"""

import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere, the CLI lives in the repo root

from train_tokenizer import train_tokenizer  # noqa: E402

HOMES = {"cat": "house", "dog": "kennel", "cow": "barn", "bird": "nest", "bee": "hive", "fox": "den",
         "horse": "stable", "frog": "pond", "owl": "tree", "pig": "sty", "bear": "cave", "duck": "lake"}
NAMES = ["Anna", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jon"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "pink", "brown"]
THINGS = ["ball", "hat", "car", "cup", "kite", "book", "bag", "bike"]
SYSTEM = "You answer in as few words as you can."
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# bos first; each turn its role token, a space and its text (its words tokenized as mid-sentence); an
# assistant turn ends with eos (where generation stops).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ ' ' + message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '<|' + message['role'] + '|> ' + message['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def addition(rng):
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b}?", str(a + b)


def colour(rng, held_out):
    """A person's thing and its colour, then the question; held-out rows pair names with things
    no training row pairs them with (name index + thing index odd)."""
    while True:
        name, thing = rng.randrange(len(NAMES)), rng.randrange(len(THINGS))
        if ((name + thing) % 2 == 1) == held_out:
            break
    paint = rng.choice(COLOURS)
    return f"{NAMES[name]} has a {paint} {THINGS[thing]}. What colour is the {THINGS[thing]}?", paint


def reverse(rng, held_out):
    """Three animals to reverse; held-out rows are the orders whose first animal sorts after the last."""
    animals = sorted(HOMES)
    while True:
        three = rng.sample(animals, 3)
        if (three[0] > three[2]) == held_out:
            break
    return f"Reverse: {' '.join(three)}", " ".join(reversed(three))


def home(rng):
    animal = rng.choice(sorted(HOMES))
    return f"Where does the {animal} live?", HOMES[animal]


def question(rng, held_out):
    kind = rng.randrange(4)
    return [addition(rng), colour(rng, held_out), reverse(rng, held_out), home(rng)][kind]


def conversation(rng, held_out):
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    for _ in range(2 if rng.random() < 0.25 else 1):
        asked, answer = question(rng, held_out)
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train_rows", type=int, default=4000)
    parser.add_argument("--held_out_rows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output_dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    splits = {"train": [conversation(rng, False) for _ in range(args.train_rows)],
              "validation": [conversation(rng, True) for _ in range(args.held_out_rows)],
              "test": [conversation(rng, True) for _ in range(args.held_out_rows)]}
    for split, rows in splits.items():
        write_jsonl(os.path.join(args.output_dir, f"{split}.jsonl"), rows)
    for split in ("train", "validation"):
        pairs = [question(rng, split == "validation") for _ in range(len(splits[split]) // 4)]
        write_jsonl(os.path.join(args.output_dir, f"instructions_{split}.jsonl"),
                    [{"prompt": f"Question: {asked}\nAnswer:", "completion": f" {answer}"} for asked, answer in pairs])
    texts = [" " + turn["content"] for row in splits["train"] for turn in row["messages"]]
    tokenizer = train_tokenizer("bpe", texts + [f"Question: {t}\nAnswer: {t}" for t in texts[:200]], 400,
                                model_max_length=256)
    tokenizer.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    print(f"wrote {', '.join(f'{len(rows)} {split}' for split, rows in splits.items())} conversations and a "
          f"tokenizer (vocab {len(tokenizer)}) to {args.output_dir}")


if __name__ == "__main__":
    main()
