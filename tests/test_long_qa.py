"""Long-document question answering (`tasks/long_qa.py`, `run_qa.py --answer_categories`): rows and the
simplified Natural Questions layout, windows labelled from the answer's real position, the category
head's weights saved and reloaded, the example-level decision and its metrics against plain
computations, BigBird's block-sparse attention against full attention, bad inputs.

Negative controls (each was broken on purpose and seen failing):
- the research project's labelling (every window after the first that lacks the answer labelled null,
  `start_token` overwritten in its loop): `test_every_window_is_labelled_from_the_answers_own_position`;
- the head left out of the reloaded parameters (`saved_head` returning None):
  `test_the_category_head_survives_the_export`;
- the category taken from the first window instead of the most confident one:
  `test_an_example_takes_the_category_of_its_most_confident_window`.
"""

import json
import os
import random
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoTokenizer, BigBirdConfig, FlaxBigBirdForQuestionAnswering

from script_runner import ROOT, directory_state
from tasks import long_qa
from tasks import question_answering as qa
from utils.base.errors import UsageError
from utils.models import compat

LONG_QA_TOKENIZER = os.path.join(ROOT, "data", "long_qa", "tokenizer")
TINY_BIG_BIRD = ("hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,"
                 "max_position_embeddings=128,block_size=8,num_random_blocks=1")
FILLER = "The market was busy that week ."
FACT = "Amara moved to Lyon in 1998 ."


def long_document(fillers_before, fillers_after=2):
    """A document of fillers with one fact; (document, the fact's offset, the offset of 'Lyon')."""
    before = " ".join([FILLER] * fillers_before)
    document = f"{before} {FACT} " + " ".join([FILLER] * fillers_after)
    return document, len(before) + 1, len(before) + 1 + FACT.index("Lyon")


def long_qa_row(i, category="short", start=None):
    document, _, lyon = long_document(3)
    return {"id": f"q{i}", "question": "Where did Amara move to?", "context": document,
            "answers": [{"category": category, "text": "Lyon", "answer_start": lyon if start is None else start}]}


def data_args(**kwargs):
    defaults = dict(question_column_name="question", context_column_name="context", answer_column_name="answers",
                    max_question_length=64, doc_stride=8, preprocessing_num_workers=None, overwrite_cache=True,
                    n_best_size=20, max_answer_length=30, max_long_answer_length=1024)
    return types.SimpleNamespace(**{**defaults, **kwargs})


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(LONG_QA_TOKENIZER)


def windows_of(tokenizer, rows, seq_length=48, doc_stride=16):
    import datasets

    features = long_qa.prepare_split(datasets.Dataset.from_list(rows), "validation", data_args(doc_stride=doc_stride),
                                     tokenizer, seq_length, has_answers=True)
    return features, np.asarray(features.arrays["input_ids"][:])


# ----------------------------------------------------------------------------------------------
# Windows and their labels
# ----------------------------------------------------------------------------------------------
def test_every_window_is_labelled_from_the_answers_own_position(tokenizer):
    """An answer at the end of a long document (in its last window): the windows holding it point at
    it (its tokens decode to it) with its category; every other window is null at its CLS."""
    document, fact, lyon = long_document(fillers_before=12)
    rows = [{"id": "late", "question": "Where did Amara move to?", "context": document,
             "answers": [{"category": "short", "text": "Lyon", "answer_start": lyon}]},
            {"id": "fact", "question": "What about Amara?", "context": document,
             "answers": [{"category": "long", "text": FACT, "answer_start": fact}]}]
    features, ids = windows_of(tokenizer, rows)
    arrays = {name: np.asarray(features.arrays[name][:]) for name in ("start_positions", "end_positions", "category")}
    examples = features.windows["example_index"]
    for index, (category, text) in enumerate([("short", "Lyon"), ("long", FACT)]):
        rows_of_example = np.flatnonzero(examples == index)
        assert len(rows_of_example) >= 4  # a long document: many windows
        holding = [w for w in rows_of_example if text.replace(" .", ".") in
                   tokenizer.decode(ids[w][features.windows["offsets"][w][:, 0] >= 0])]
        assert holding[-1] == rows_of_example[-1] and holding[0] != rows_of_example[0], "the answer is in the last window"
        for w in rows_of_example:
            start, end = arrays["start_positions"][w], arrays["end_positions"][w]
            if w in holding:
                assert long_qa.CATEGORIES[arrays["category"][w]] == category
                assert tokenizer.decode(ids[w][start:end + 1]).replace(" .", ".") == text.replace(" .", ".")
            else:
                assert arrays["category"][w] == long_qa.CATEGORIES.index("null")
                assert start == end == features.windows["null_index"][w]


def test_yes_no_answers_label_the_windows_of_their_evidence(tokenizer):
    document, fact, _ = long_document(fillers_before=12)
    with_evidence = {"id": "e", "question": "Did Amara move to Lyon?", "context": document,
                     "answers": [{"category": "yes", "text": FACT, "answer_start": fact}]}
    without = {"id": "n", "question": "Did Amara move to Oslo?", "context": document,
               "answers": [{"category": "no", "text": "", "answer_start": -1}]}
    features, ids = windows_of(tokenizer, [with_evidence, without])
    categories = np.asarray(features.arrays["category"][:])
    examples = features.windows["example_index"]
    evidence = [FACT.replace(" .", ".") in tokenizer.decode(ids[w][features.windows["offsets"][w][:, 0] >= 0])
                for w in range(len(ids))]
    first = examples == 0
    assert set(categories[first & np.array(evidence)]) == {long_qa.CATEGORIES.index("yes")}
    assert set(categories[first & ~np.array(evidence)]) == {long_qa.CATEGORIES.index("null")}
    assert set(categories[examples == 1]) == {long_qa.CATEGORIES.index("no")}  # no evidence: every window
    assert (np.asarray(features.arrays["start_positions"][:]) == features.windows["null_index"]).all()


def test_the_shipped_data_labels_each_answer_in_the_windows_that_hold_it(tokenizer):
    """Over the shipped validation documents (thousands of tokens): each span answer is labelled
    in exactly the windows that hold it whole, wherever it is."""
    import datasets

    rows = datasets.load_dataset("json", data_files=os.path.join(ROOT, "data", "long_qa", "validation.jsonl.gz"),
                                 split="train").select(range(12))
    features = long_qa.prepare_split(rows, "validation", data_args(doc_stride=64), tokenizer, 256, has_answers=True)
    categories = np.asarray(features.arrays["category"][:])
    offsets = features.windows["offsets"]
    for index, example in enumerate(features.examples):
        windows = np.flatnonzero(features.windows["example_index"] == index)
        assert len(windows) > 3
        if not example["answer_categories"] or example["answer_categories"][0] not in long_qa.SPAN_CATEGORIES:
            continue
        start = example["answer_starts"][0]
        end = start + len(example["answer_texts"][0])
        for w in windows:
            covered = offsets[w][offsets[w][:, 0] >= 0]
            holds = covered[0, 0] <= start and covered[-1, 1] >= end
            assert (long_qa.CATEGORIES[categories[w]] != "null") == holds


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------
def test_the_generator_reproduces_the_shipped_data(tmp_path, tokenizer):
    """data/make_long_qa_data.py writes the committed rows byte for byte (its tokenizer is trained
    anew, not reproducibly: tests/test_classification_data.py); validation documents run to thousands
    of tokens, and every category is asked."""
    import gzip

    from test_classification_data import _load_generator

    _load_generator("make_long_qa_data").main(["--output_dir", str(tmp_path)])
    for split in ("train", "validation", "test"):
        name = f"{split}.jsonl.gz"
        assert (tmp_path / name).read_bytes() == open(os.path.join(ROOT, "data", "long_qa", name), "rb").read(), name
    with gzip.open(tmp_path / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert {row["answers"][0]["category"] if row["answers"] else "null" for row in rows} == set(long_qa.CATEGORIES)
    lengths = [len(tokenizer(context)["input_ids"]) for context in {row["context"] for row in rows}]
    assert min(lengths) > 1000 and max(lengths) > 2500


def test_simplified_natural_questions_rows_lose_their_tags_and_keep_their_answers():
    tokens = "<H1> Lyon </H1> <P> Amara moved to Lyon in 1998 . </P> <P> She liked it . </P>".split(" ")
    row = {"example_id": 7, "question_text": "where did amara move", "document_text": " ".join(tokens),
           "annotations": [{"yes_no_answer": "NONE", "long_answer": {"start_token": 3, "end_token": 12},
                            "short_answers": [{"start_token": 7, "end_token": 8}]},
                           {"yes_no_answer": "NONE", "long_answer": {"start_token": 3, "end_token": 12},
                            "short_answers": []},
                           {"yes_no_answer": "YES", "long_answer": {"start_token": 12, "end_token": 18},
                            "short_answers": []},
                           {"yes_no_answer": "NONE", "long_answer": {"start_token": -1, "end_token": -1},
                            "short_answers": []}]}
    converted = long_qa.simplified_nq_row(row)
    context = converted["context"]
    assert context == "Lyon Amara moved to Lyon in 1998 . She liked it ."
    assert converted["id"] == "7" and converted["question"] == "where did amara move"
    expected = [("short", "Lyon"), ("long", "Amara moved to Lyon in 1998 ."), ("yes", "She liked it .")]
    assert [(a["category"], a["text"]) for a in converted["answers"]] == expected
    for answer in converted["answers"]:
        assert context[answer["answer_start"]:answer["answer_start"] + len(answer["text"])] == answer["text"]
    assert converted["answers"][0]["answer_start"] == context.index("to Lyon") + 3  # the short answer's own Lyon


@pytest.mark.parametrize("answers, pattern", [
    ([{"category": "maybe", "text": "x", "answer_start": 0}], "unknown answer category 'maybe'"),
    ([{"category": "short", "text": "", "answer_start": 0}], "its short answer has no text"),
    ([{"category": "long", "text": "Lyon", "answer_start": 2}], "the long answer 'Lyon' is not at answer_start 2"),
    ([{"category": "yes", "text": "Lyon", "answer_start": 500}], "answer_start 500 is outside its document"),
    ('{"category": short', "are not JSON"),
    # SQuAD-style answers given to --answer_categories
    ([{"text": "Lyon", "answer_start": 2}], r"an answer has no category: --answer_categories reads answers as "
                                            r"\{category, text, answer_start\}"),
    ([{"category": "short", "text": "Lyon", "answer_start": 2.5}], "answer_start 2.5 is not a character offset"),
])
def test_bad_answers_are_one_error_naming_the_row(answers, pattern):
    with pytest.raises(UsageError, match=pattern):
        for category, text, start in long_qa.parse_answers(answers, "train", 3):
            long_qa.check_answer(category, text, start, long_qa_row(0)["context"], "train", 3)


def test_a_whole_float_offset_is_the_offset():
    """One float among a file's offsets makes pandas or datasets read them all as floats: 12.0 is 12."""
    row = long_qa_row(0)
    start = row["answers"][0]["answer_start"]
    answers = long_qa.parse_answers([{**row["answers"][0], "answer_start": float(start)}], "train", 0)
    assert answers == [("short", "Lyon", start)] and isinstance(answers[0][2], int)
    long_qa.check_answer(*answers[0], row["context"], "train", 0)


@pytest.mark.parametrize("context, question, pattern", [
    ("", "Where did Amara move to?", "row 0 of the train data has an empty document"),
    (" Amara moved to Lyon .", " ", "row 0 of the train data has an empty question"),
])
def test_an_empty_document_or_question_is_named(tokenizer, context, question, pattern):
    import datasets

    rows = datasets.Dataset.from_list([{"id": "q0", "question": question, "context": context, "answers": []}])
    with pytest.raises(UsageError, match=pattern):
        long_qa.read_examples(rows, "train", data_args(), tokenizer, has_answers=True)


# ----------------------------------------------------------------------------------------------
# The example's answer and the metrics
# ----------------------------------------------------------------------------------------------
def one_hot_logits(size, index, high=5.0):
    logits = np.zeros(size)
    logits[index] = high
    return logits


def test_an_example_takes_the_category_of_its_most_confident_window():
    """Three windows of one example: the first leans to "long", the last is surer of "short" and
    holds the span; a second example's windows all say null."""
    context = "aaaa bbbb cccc dddd"
    tokens = 6
    offsets = np.full((4, tokens, 2), qa.NO_CONTEXT)
    offsets[2, 1:5] = [[0, 4], [5, 9], [10, 14], [15, 19]]
    offsets[0, 1:3] = [[0, 4], [5, 9]]
    start = np.stack([one_hot_logits(tokens, 1), np.zeros(tokens), one_hot_logits(tokens, 2), np.zeros(tokens)])
    end = np.stack([one_hot_logits(tokens, 2), np.zeros(tokens), one_hot_logits(tokens, 3), np.zeros(tokens)])
    categories = np.array([[1.0, 0.0, 2.0, 0.0, 0.0], [3.0, 0, 0, 0, 0], [0.0, 4.0, 0, 0, 0], [2.0, 1.0, 0, 0, 0]])
    answers = long_qa.best_answers([("a", context), ("b", context)], [0, 0, 0, 1], start, end, categories, offsets)
    assert answers["a"]["category"] == "short" and answers["a"]["answer"] == "bbbb cccc"
    probabilities = np.exp(categories[2]) / np.exp(categories[2]).sum()
    assert answers["a"]["score"] == pytest.approx(np.log(probabilities[1] / probabilities[0]))
    assert answers["b"] == {"category": "null", "answer": "", "score": pytest.approx(-1.0)}
    # Short answers of at most max_answer_length tokens: one word here.
    assert long_qa.best_answers([("a", context)], [0, 0, 0], start[:3], end[:3], categories[:3], offsets[:3],
                                max_answer_length=1)["a"]["answer"] in ("bbbb", "cccc")


def test_category_metrics_against_a_plain_count():
    rng = random.Random(0)
    words = ["Lyon", "the Lyon", "lyon", "Oslo", "red car"]

    def plain(text):  # what SQuAD's normalisation does to these words
        return text.lower().removeprefix("the ")

    references, predictions = {}, {}
    for i in range(400):
        references[str(i)] = rng.choice([[], [("short", rng.choice(words))], [("yes", "")], [("no", "x")],
                                         [("long", rng.choice(words)), ("short", "Oslo")]])
        category = rng.choice(long_qa.CATEGORIES)
        predictions[str(i)] = {"category": category,
                               "answer": rng.choice(words) if category in ("short", "long") else category}
    match = answered_match = category_right = answered = 0
    for i, gold in references.items():
        category, answer = predictions[i]["category"], predictions[i]["answer"]
        gold_categories = [c for c, _ in gold] or ["null"]
        if category in ("short", "long"):
            ok = any(c in ("short", "long") and plain(t) == plain(answer) for c, t in gold)
        else:
            ok = category in gold_categories
        match += ok
        category_right += category in gold_categories
        if gold:
            answered += 1
            answered_match += ok
    scores = long_qa.category_metrics(predictions, references)
    assert scores["exact_match"] == pytest.approx(100 * match / 400)
    assert scores["has_answer_exact_match"] == pytest.approx(100 * answered_match / answered)
    assert scores["category_accuracy"] == pytest.approx(100 * category_right / 400)
    assert scores["has_answer_total"] == answered


# ----------------------------------------------------------------------------------------------
# The category head's weights; BigBird's attention
# ----------------------------------------------------------------------------------------------
def tiny_big_bird(**overrides):
    compat.apply()
    values = dict(vocab_size=800, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=256, block_size=8, num_random_blocks=1, attention_type="block_sparse",
                  sep_token_id=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BigBirdConfig(**{**values, **overrides})


def test_the_category_head_survives_the_export(tmp_path):
    """Saved with the model's weights, the head is read back whole by `saved_head`; the stock class
    loads the same file without it."""
    config = tiny_big_bird()
    model = FlaxBigBirdForQuestionAnswering(config, seed=0)
    head = long_qa.category_head(config, jnp.float32).init(jax.random.PRNGKey(1), jnp.zeros((1, 32)))["params"]
    model.save_pretrained(tmp_path, params={**model.params, long_qa.HEAD: head})
    saved = long_qa.saved_head(str(tmp_path))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, saved, jax.device_get(head)))
    stock = FlaxBigBirdForQuestionAnswering.from_pretrained(tmp_path)
    assert long_qa.HEAD not in stock.params and set(stock.params) == set(model.params)
    assert long_qa.saved_head(None) is None


def test_block_sparse_attention_agrees_with_full_attention_on_its_global_blocks():
    """BigBird's first and last blocks attend to every token: after one layer their states equal full
    attention's (the stock `original_full`), while the middle blocks, which see a band, differ."""
    sparse = FlaxBigBirdForQuestionAnswering(tiny_big_bird(), seed=0)
    full = FlaxBigBirdForQuestionAnswering(tiny_big_bird(attention_type="original_full"), _do_init=False)
    block, blocks = 8, 12
    ids = np.random.RandomState(0).randint(5, 800, (2, block * blocks))
    ids[:, 0], ids[:, 6] = 2, 3
    a = np.asarray(sparse(ids, params=sparse.params, output_hidden_states=True).hidden_states[-1])
    b = np.asarray(full(ids, params=sparse.params, output_hidden_states=True).hidden_states[-1])
    difference = np.abs(a - b).max(axis=(0, 2)).reshape(blocks, block).max(axis=1)
    np.testing.assert_allclose(difference[[0, -1]], 0, atol=1e-5)
    assert (difference[1:-1] > 1e-3).all()


def test_block_settings_are_checked():
    config = tiny_big_bird(block_size=16, num_random_blocks=2)
    long_qa.check_blocks(config, 160)  # 10 blocks: more than 2 x 2 + 5
    with pytest.raises(UsageError, match=r"--block_size 16 does not divide the window of 100 tokens .* use "
                                         r"--max_seq_length 112 or 96"):
        long_qa.check_blocks(config, 100)
    with pytest.raises(UsageError, match=r"9 blocks of 16, too few for block-sparse attention with 2 random"):
        long_qa.check_blocks(config, 144)
    long_qa.check_blocks(tiny_big_bird(attention_type="original_full", block_size=16), 100)
    with pytest.raises(UsageError, match="--block_size is a BigBird setting, but the model is bert"):
        long_qa.set_attention(types.SimpleNamespace(model_type="bert"), None, 16, None)
    assert long_qa.set_attention(tiny_big_bird(), "original_full", None, None).attention_type == "original_full"


def test_a_block_size_that_does_not_divide_the_window_is_one_error(monkeypatch, capsys, tmp_path):
    import run_qa
    from test_errors_cli import check_failure, run_in_process, write_jsonl

    monkeypatch.setattr(run_qa, "load_model", lambda *a, **k: pytest.fail("the model was built"))
    train = write_jsonl(tmp_path / "t.jsonl", [long_qa_row(i) for i in range(4)])
    out = tmp_path / "out"
    out.mkdir()
    (out / "all_results.json").write_text("{}")
    before = directory_state(out)
    code = run_in_process(run_qa, ["--model_type", "big_bird", "--config_overrides", TINY_BIG_BIRD,
                                   "--tokenizer_name", LONG_QA_TOKENIZER, "--answer_categories", "--block_size", 24,
                                   "--max_seq_length", 128, "--doc_stride", 16, "--do_train", "--train_file", train,
                                   "--output_dir", out, "--overwrite_output_dir"], tmp_path)
    check_failure(2, code, capsys.readouterr().err,
                  r"--block_size 24 does not divide the window of 128 tokens .* use --max_seq_length 144 or 120")
    assert directory_state(out) == before


def test_thinning_keeps_every_answer_window_and_a_fraction_of_the_null_ones():
    import datasets

    categories = np.random.default_rng(3).choice([0, 0, 0, 1, 3], size=4000)
    windows = datasets.Dataset.from_dict({"category": categories, "row": np.arange(4000)})
    kept = long_qa.thinned(windows, 0.25, seed=7)
    rows = np.asarray(kept["row"])
    null = categories == 0
    assert set(np.flatnonzero(~null)) <= set(rows)
    assert abs(np.isin(np.flatnonzero(null), rows).mean() - 0.25) < 0.03
    assert np.array_equal(rows, np.asarray(long_qa.thinned(windows, 0.25, seed=7)["row"]))  # a pure function of the seed
    assert long_qa.thinned(windows, 1.0, seed=7) is windows
    # A kept null window stands for 1 / 0.25 of them in the loss: the null share of the weights is the data's.
    weights = np.asarray(kept["window_weight"])
    assert np.array_equal(weights, np.where(null[rows], 4.0, 1.0))
    assert abs(weights[null[rows]].sum() / weights.sum() - null.mean()) < 0.03


def test_the_loss_weighs_each_window_by_its_window_weight():
    """The loss with window weights is the weighted mean of the windows' own losses (each computed
    alone), the weights summed as its count."""
    rng = np.random.default_rng(0)
    start, end, categories = rng.normal(size=(3, 8)), rng.normal(size=(3, 8)), rng.normal(size=(3, 5))
    batch = {"start_positions": np.array([1, 0, 4]), "end_positions": np.array([2, 0, 6]),
             "category": np.array([1, 0, 0]), "window_weight": np.array([1.0, 4.0, 4.0], np.float32)}

    def alone(i):
        one = {k: v[i:i + 1] for k, v in batch.items() if k != "window_weight"}
        return float(long_qa.loss(start[i:i + 1], end[i:i + 1], categories[i:i + 1], one)[0])

    total, sums = long_qa.loss(start, end, categories, batch)
    assert float(sums["tokens"]) == 9.0
    assert float(total) == pytest.approx(sum(w * alone(i) for i, w in enumerate(batch["window_weight"])), rel=1e-5)


def test_only_big_bird_takes_the_tokenizers_separator_for_the_questions_end(tokenizer):
    from transformers import BertConfig

    assert long_qa.fit_question_end(tiny_big_bird(sep_token_id=66), tokenizer).sep_token_id == tokenizer.sep_token_id
    assert long_qa.fit_question_end(BertConfig(), tokenizer).sep_token_id is None
