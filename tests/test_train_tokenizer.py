"""train_tokenizer.py (library and CLI) and the committed toy data sets and tokenizers."""

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
import sentencepiece
from packaging.version import Version
from transformers import AutoTokenizer

from train_tokenizer import KINDS, train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "train_tokenizer.py")
SUMMARIZATION = os.path.join(ROOT, "data", "summarization")
LM = os.path.join(ROOT, "data", "lm")

# Per kind: special token ids, the pad id, what one text is wrapped in, specials added for a pair.
EXPECTED = {
    "bpe": dict(specials={"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": 4}, pad=1,
                prefix=[0], suffix=[2], pair_specials=4),
    "wordpiece": dict(specials={"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}, pad=0,
                      prefix=[2], suffix=[3], pair_specials=3),
    "unigram": dict(specials={"<pad>": 0, "</s>": 1, "<unk>": 2}, pad=0, prefix=[], suffix=[1], pair_specials=2),
}
SAMPLE = "Maria Lopez opened a bakery in Lisbon on Monday, and the weather was warm."


def make_texts(n=300, seed=0):
    rng = random.Random(seed)
    names = ["Maria Lopez", "Kenji Tanaka", "Aisha Okafor", "Lucas Martin", "Elena Petrova"]
    actions = ["opened a bakery", "sold a painting", "won a prize", "found a coin", "built a boat"]
    places = ["Lisbon", "Osaka", "Lagos", "Lyon", "Oslo", "Quito"]
    days = ["Monday", "Tuesday", "Friday", "Sunday"]
    weather = ["warm", "cold", "rainy", "windy"]
    return [
        f"{rng.choice(names)} {rng.choice(actions)} in {rng.choice(places)} on {rng.choice(days)}, "
        f"and the weather was {rng.choice(weather)}." for _ in range(n)
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each kind trained once on the same texts, saved, and reloaded through AutoTokenizer."""
    loaded = {}
    for kind in KINDS:
        path = tmp_path_factory.mktemp(kind)
        train_tokenizer(kind, make_texts(), vocab_size=500, lowercase=kind == "wordpiece").save_pretrained(path)
        loaded[kind] = AutoTokenizer.from_pretrained(path)
    return loaded


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_specials_padding_and_decode(saved, kind):
    tok, exp = saved[kind], EXPECTED[kind]
    assert {t: tok.convert_tokens_to_ids(t) for t in exp["specials"]} == exp["specials"]
    assert tok.pad_token_id == exp["pad"] and tok.model_max_length == 512

    ids = tok(SAMPLE)["input_ids"]
    inner = ids[len(exp["prefix"]):len(ids) - len(exp["suffix"])]
    assert ids[:len(exp["prefix"])] == exp["prefix"] and ids[-len(exp["suffix"]):] == exp["suffix"]
    assert not set(inner) & set(exp["specials"].values())
    assert tok.num_special_tokens_to_add(pair=True) == exp["pair_specials"]

    batch = tok(["Oslo", SAMPLE], padding=True)
    short = batch["input_ids"][0]
    assert len(short) == len(ids) and short[-1] == exp["pad"] and batch["attention_mask"][0][-1] == 0

    expected_text = SAMPLE.lower() if kind == "wordpiece" else SAMPLE
    assert tok.decode(ids, skip_special_tokens=True) == expected_text


def test_bpe_mask_token_takes_the_space_before_it(saved):
    tok = saved["bpe"]
    assert tok.mask_token == "<mask>" and tok.added_tokens_decoder[4].lstrip
    # "Oslo <mask> was" == "Oslo" + <mask> + " was": no separate token for the space before <mask>.
    expected = tok("Oslo")["input_ids"][:-1] + [4] + tok(" was")["input_ids"][1:]
    assert tok("Oslo <mask> was")["input_ids"] == expected


def test_wordpiece_keeps_case_unless_lowercase():
    tok = train_tokenizer("wordpiece", make_texts(), vocab_size=500)
    assert tok.decode(tok(SAMPLE)["input_ids"], skip_special_tokens=True) == SAMPLE
    assert "token_type_ids" in tok("x")  # BERT-style models take segment ids


def test_unigram_keeps_frequent_words_whole(saved):
    # Suffix-array seeding alone would split words always followed by a space ("was" -> "▁wa" "s").
    assert saved["unigram"].tokenize("the weather was warm") == ["▁the", "▁weather", "▁was", "▁warm"]


def test_extra_ids_are_t5_sentinels_on_top_of_the_vocabulary(tmp_path):
    plain = train_tokenizer("unigram", make_texts(), vocab_size=500)
    train_tokenizer("unigram", make_texts(), vocab_size=500, extra_ids=5).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    sentinels = [f"<extra_id_{i}>" for i in range(5)]
    assert len(tok) == len(plain) + 5
    # T5's convention: counting down from the top of the vocabulary, the learnt pieces unchanged.
    assert tok.convert_tokens_to_ids(sentinels) == list(range(len(tok) - 1, len(tok) - 6, -1))
    assert {t: i for t, i in tok.get_vocab().items() if t not in sentinels} == plain.get_vocab()
    assert tok.additional_special_tokens == sentinels
    ids = tok("Oslo <extra_id_3> was warm")["input_ids"]
    assert tok.convert_tokens_to_ids("<extra_id_3>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "Oslo was warm"


def test_empty_input_and_unknown_kind_are_value_errors():
    with pytest.raises(ValueError, match="no non-empty texts"):
        train_tokenizer("bpe", ["", "   "], vocab_size=100)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        train_tokenizer("wordlevel", ["a b"], vocab_size=100)


# ----------------------------------------------------------------------------- command line


def run_cli(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture
def input_files(tmp_path):
    """A txt, a jsonl (column "text") and a csv (no "text" column: the first string one is used)."""
    texts = make_texts(60)
    txt, jsonl, csv = tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.csv"
    txt.write_text("\n\n".join(f"{t} aardvark" for t in texts[:20]) + "\n")
    jsonl.write_text("".join(json.dumps({"id": i, "text": f"{t} quokka"}) + "\n" for i, t in enumerate(texts[20:40])))
    csv.write_text("id,body\n" + "".join(f'{i},"{t} narwhal"\n' for i, t in enumerate(texts[40:])))
    return tmp_path, [str(txt), str(jsonl), str(csv)]


def test_cli_trains_on_txt_jsonl_and_csv(input_files):
    tmp_path, files = input_files
    out = tmp_path / "tok"
    result = run_cli("--kind", "wordpiece", "--train_files", *files, "--vocab_size", "400", "--lowercase",
                     "--extra_ids", "3", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout and "vocab size" in result.stdout
    tok = AutoTokenizer.from_pretrained(out)
    assert {"aardvark", "quokka", "narwhal"} <= set(tok.get_vocab())  # one word only in each file
    assert tok.convert_ids_to_tokens(tok("Quokka")["input_ids"]) == ["[CLS]", "quokka", "[SEP]"]
    assert tok.convert_ids_to_tokens([len(tok) - 1, len(tok) - 3]) == ["<extra_id_0>", "<extra_id_2>"]


@pytest.mark.parametrize(
    "case, message",
    [("missing", "no such file"), ("column", "has no column 'body'"), ("extension", "unsupported extension"),
     ("extra_ids", "--extra_ids must be 0 or more")],
)
def test_cli_errors_are_one_line_and_exit_2(input_files, case, message):
    tmp_path, files = input_files
    args = {
        "missing": ["--train_files", str(tmp_path / "nope.txt")],
        "column": ["--train_files", files[1], "--text_column", "body"],
        "extension": ["--train_files", str(tmp_path / "a.parquet")],
        "extra_ids": ["--train_files", files[0], "--extra_ids", "-1"],
    }[case]
    result = run_cli("--kind", "bpe", *args, "--vocab_size", "300", "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- committed data


def test_committed_summarization_data_and_tokenizer():
    import datasets

    files = {split: os.path.join(SUMMARIZATION, f"{split}.jsonl") for split in ("train", "validation", "test")}
    ds = datasets.load_dataset("json", data_files=files)
    assert {split: ds[split].num_rows for split in files} == {"train": 2000, "validation": 200, "test": 200}
    assert ds["train"].column_names == ["document", "summary"]
    for row in ds["validation"]:
        assert 40 <= len(row["document"].split()) <= 120
        name = " ".join(row["summary"].split()[:2])
        assert name in row["document"] and row["summary"] != row["document"]

    tok = AutoTokenizer.from_pretrained(os.path.join(SUMMARIZATION, "tokenizer"))
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2) and len(tok) <= 2000
    document = ds["test"][0]["document"]
    ids = tok(document)["input_ids"]
    assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == document


def test_committed_lm_corpus_and_tokenizer():
    lines = {split: open(os.path.join(LM, f"{split}.txt"), encoding="utf-8").read().splitlines()
             for split in ("train", "validation")}
    assert (len(lines["train"]), len(lines["validation"])) == (6000, 400)
    assert all(lines["validation"]) and not set(lines["validation"]) & set(lines["train"])

    tok = AutoTokenizer.from_pretrained(os.path.join(LM, "tokenizer"))
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 1, 2, 4)
    ids = tok(lines["validation"][0])["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and len(tok) <= 2000
    assert tok.decode(ids, skip_special_tokens=True) == lines["validation"][0]

    # The T5 one (span corruption): T5's special ids, and 100 sentinels counting down from the top.
    t5 = AutoTokenizer.from_pretrained(os.path.join(LM, "t5_tokenizer"))
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2) and len(t5) <= 2100
    assert t5.convert_tokens_to_ids([f"<extra_id_{i}>" for i in (0, 99)]) == [len(t5) - 1, len(t5) - 100]
    ids = t5(lines["validation"][0])["input_ids"]
    assert ids[-1] == t5.eos_token_id and t5.unk_token_id not in ids
    assert t5.decode(ids, skip_special_tokens=True) == lines["validation"][0]


def _load_generator(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "data", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The committed unigram tokenizers were trained by this sentencepiece; older ones (the requirements' floor, 0.2.0,
# through 0.2.2) choose some other pieces from the same data.
TRAINED_BY = Version("0.2.3")


@pytest.mark.parametrize(
    "generator, committed, files, tokenizers",
    [("make_summarization_data", SUMMARIZATION, ["train.jsonl", "validation.jsonl", "test.jsonl"], ["tokenizer"]),
     ("make_lm_corpus", LM, ["train.txt", "validation.txt", "word_classes/train.csv", "word_classes/validation.csv"],
      ["tokenizer", "t5_tokenizer"])],
)
def test_generators_reproduce_the_committed_files(tmp_path, generator, committed, files, tokenizers):
    _load_generator(generator).main(["--output_dir", str(tmp_path)])
    for name in files:
        assert (tmp_path / name).read_bytes() == open(os.path.join(committed, name), "rb").read(), name
    if Version(sentencepiece.__version__) < TRAINED_BY:
        pytest.skip(f"the data files match; the committed tokenizers were trained by sentencepiece {TRAINED_BY}")
    for name in tokenizers:
        fresh, saved = (AutoTokenizer.from_pretrained(path) for path in (tmp_path / name, os.path.join(committed, name)))
        assert fresh.get_vocab() == saved.get_vocab(), name
        # And the same pieces chosen (a unigram model's scores decide them).
        assert fresh(SAMPLE)["input_ids"] == saved(SAMPLE)["input_ids"], name
