"""The shipped toy classification data (data/glue, data/ner): reproducible, balanced, learnable."""

import collections
import csv
import importlib.util
import json
import os

import pytest
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE, NER = os.path.join(ROOT, "data", "glue"), os.path.join(ROOT, "data", "ner")
GLUE_TASKS = ("sst2", "cola", "mrpc", "stsb")
SPLITS = ("train", "validation", "test")


def _load_generator(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "data", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("generator, committed, files", [
    ("make_glue_data", GLUE,
     [f"{task}/{split}.{ext}" for task in GLUE_TASKS for split in SPLITS for ext in ("csv", "jsonl")]),
    ("make_ner_data", NER, [f"{split}.jsonl" for split in SPLITS]),
])
def test_generators_reproduce_the_committed_files(tmp_path, generator, committed, files):
    _load_generator(generator).main(["--output_dir", str(tmp_path)])
    for name in files:
        assert (tmp_path / name).read_bytes() == open(os.path.join(committed, name), "rb").read(), name
    # `tokenizers`' WordPiece training is not deterministic (huggingface/tokenizers#1794: the ids
    # of its "##" pieces follow hash-map order and break ties between equally frequent merges), so
    # a fresh tokenizer is the same kind, not the same vocabulary: the shipped one is what runs use.
    fresh, saved = (AutoTokenizer.from_pretrained(path)
                    for path in (tmp_path / "tokenizer", os.path.join(committed, "tokenizer")))
    assert len(fresh) == len(saved)
    assert fresh.all_special_tokens == saved.all_special_tokens and fresh.all_special_ids == saved.all_special_ids
    texts = (tmp_path / files[-1]).read_text(encoding="utf-8").splitlines()
    counts = [sum(len(ids) for ids in tok(texts)["input_ids"]) for tok in (fresh, saved)]
    assert abs(counts[0] - counts[1]) < 0.05 * counts[1]  # as fine a split; ties change a few pieces


@pytest.mark.parametrize("task", GLUE_TASKS)
def test_glue_files_agree_and_test_splits_have_no_labels(task):
    for split in SPLITS:
        rows = _jsonl(os.path.join(GLUE, task, f"{split}.jsonl"))
        with open(os.path.join(GLUE, task, f"{split}.csv"), encoding="utf-8", newline="") as f:
            csv_rows = list(csv.DictReader(f))
        assert [{k: str(v) for k, v in row.items()} for row in rows] == csv_rows
        columns = ["sentence"] if task in ("sst2", "cola") else ["sentence1", "sentence2"]
        assert list(rows[0]) == (columns if split == "test" else columns + ["label"])
        assert len(rows) == (600 if split == "train" else 200)


def test_glue_labels_are_balanced_and_of_the_right_kind():
    for task in GLUE_TASKS:
        for split in ("train", "validation"):
            labels = [row["label"] for row in _jsonl(os.path.join(GLUE, task, f"{split}.jsonl"))]
            if task == "stsb":
                assert all(isinstance(x, float) and 0.0 <= x <= 5.0 for x in labels)
                # Every level of similarity occurs, none dominates.
                assert all(0.1 < sum(round(x) == level for x in labels) / len(labels) < 0.25 for level in range(1, 5))
                continue
            counts = collections.Counter(labels)
            expected = {"equivalent", "not_equivalent"} if task == "mrpc" else {0, 1}
            assert set(counts) == expected, task
            assert min(counts.values()) / len(labels) > 0.4, (task, split, counts)


def test_glue_labels_follow_from_the_sentences():
    """Spot checks of the rules a model has to learn, written independently of the generator."""
    homes = {"cow": "barn", "bee": "hive", "owl": "tree"}
    checked = 0
    for row in _jsonl(os.path.join(GLUE, "sst2", "train.jsonl")):
        words = row["sentence"].rstrip(".").split()  # "The [adjective] cow lives in the barn"
        if words[0] == "The" and words[-4:-1] == ["lives", "in", "the"] and words[-5] in homes:
            assert row["label"] == int(words[-1] == homes[words[-5]]), row
            checked += 1
    same_details = 0
    for row in _jsonl(os.path.join(GLUE, "mrpc", "train.jsonl")):
        # The same words in another order are the same five details: a paraphrase.
        words1, words2 = (sorted(row[k].replace(",", "").split()) for k in ("sentence1", "sentence2"))
        same_words = words1 == words2
        if same_words:
            assert row["label"] == "equivalent", row
            same_details += 1
        if row["label"] == "not_equivalent":  # one detail changed: never the same words
            assert not same_words, row
    assert checked > 20 and same_details > 50


def test_ner_data_holds_names_and_places_out_of_training():
    splits = {split: _jsonl(os.path.join(NER, f"{split}.jsonl")) for split in SPLITS}
    assert [len(rows) for rows in splits.values()] == [1500, 300, 300]

    def entity_words(rows, kinds):
        return {w for row in rows for w, t in zip(row["tokens"], row["ner_tags"]) if t[2:] in kinds}

    for split in ("validation", "test"):
        held_out = entity_words(splits[split], {"PER", "LOC"}) - {"Mr.", "Ms.", "Dr."}
        held_out -= {"Bay", "Valley", "Island", "Hills"}  # the suffixes of two-word places are shared
        assert held_out and not held_out & {w for row in splits["train"] for w in row["tokens"]}, split
    for rows in splits.values():
        for row in rows:
            assert len(row["tokens"]) == len(row["ner_tags"])
            for previous, tag in zip(["O"] + row["ner_tags"], row["ner_tags"]):
                assert tag == "O" or tag[:2] in ("B-", "I-")
                assert not tag.startswith("I-") or previous[2:] == tag[2:]  # IOB2: I- only inside
    counts = collections.Counter(t for row in splits["train"] for t in row["ner_tags"])
    assert set(counts) == {"O"} | {f"{b}-{k}" for b in "BI" for k in ("PER", "LOC", "ORG", "DATE")}
    assert min(counts[f"B-{k}"] for k in ("PER", "LOC", "ORG", "DATE")) > 500


@pytest.mark.parametrize("directory, text_of", [
    (GLUE, lambda: [r["sentence1"] for r in _jsonl(os.path.join(GLUE, "mrpc", "validation.jsonl"))]),
    (NER, lambda: [" ".join(r["tokens"]) for r in _jsonl(os.path.join(NER, "validation.jsonl"))]),
])
def test_wordpiece_tokenizers_split_words_but_know_every_character(directory, text_of):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(directory, "tokenizer"))
    assert len(tokenizer) <= 800 and tokenizer.is_fast
    assert (tokenizer.pad_token_id, tokenizer.cls_token, tokenizer.sep_token) == (0, "[CLS]", "[SEP]")
    texts = text_of()
    ids = tokenizer(texts)["input_ids"]
    assert all(tokenizer.unk_token_id not in row for row in ids)
    words = sum(len(t.split()) for t in texts)
    pieces = sum(len(row) - 2 for row in ids)
    assert pieces > 1.2 * words  # many words split into sub-tokens
    # The pieces join back into the words (BERT's clean-up moves the spaces around punctuation).
    assert tokenizer.decode(ids[0], skip_special_tokens=True).replace(" ", "") == texts[0].replace(" ", "")
