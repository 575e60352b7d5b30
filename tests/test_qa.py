"""tasks/question_answering.py: the SQuAD metrics against hand-worked examples and a second
implementation written here from the official definitions; post-processing of window logits into
answers; training labels of the windows of a real tokenizer.

Negative controls (each was broken on purpose and seen failing):
- end logits used for the start (`best_answers` fed end for start):
  `test_spans_outside_the_context_reversed_or_too_long_are_rejected` (asymmetric start / end logits);
- the offsets of the wrong window (an example's first window's offsets used for all of them):
  `test_the_best_window_wins`, `test_an_answer_past_the_first_window_is_found`;
- the CLS label for answerable questions (`answer_tokens` returning None):
  `test_windows_label_the_answer_or_cls`.
"""

import collections
import os
import random
import re
import string

import numpy as np
import pytest

from tasks import question_answering as qa
from tasks.question_answering import NO_CONTEXT, best_answers, normalize_answer, squad_v1, squad_v2, token_f1
from utils.base.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "qa", "tokenizer")


# ----------------------------------------------------------------------------------------------
# Metrics: hand-worked examples of the official definitions
# ----------------------------------------------------------------------------------------------
def test_normalisation_lowers_strips_punctuation_articles_and_whitespace():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("An apple\tand a pear.") == "apple and pear"
    assert normalize_answer("theatre anthem") == "theatre anthem"  # articles are whole words only
    assert normalize_answer("  Lyon's (old) town ") == "lyons old town"
    assert normalize_answer("the") == ""


def test_token_f1_counts_common_tokens():
    # [cat sat on mat] vs [cat on mat]: 3 in common, precision 3/4, recall 1.
    assert token_f1("the cat sat on the mat", "a cat on a mat") == pytest.approx(2 * 0.75 / 1.75)
    assert token_f1("cat cat", "cat") == pytest.approx(2 * 0.5 / 1.5)  # a repeated token counts once per match
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("", "cat") == 0.0 and token_f1("", "") == 1.0  # v2.0: two empty answers agree


def test_squad_v1_takes_the_best_gold_answer_in_percent():
    predictions = {"1": "Lyon", "2": "in Paris"}
    references = {"1": ["lyon", "Lyon city"], "2": ["Paris France", "Paris"]}
    # 2: exact with neither; F1 max(1/2 with "Paris France", 2/3 with "Paris").
    assert squad_v1(predictions, references) == pytest.approx({"exact_match": 50.0, "f1": 100 * (1 + 2 / 3) / 2})
    # v1.1: an answer that normalises to nothing shares no token, even with an empty prediction.
    assert squad_v1({"1": ""}, {"1": ["the"]}) == {"exact_match": 100.0, "f1": 0.0}


def test_squad_v2_splits_answerable_and_not_and_finds_the_best_threshold():
    references = {"a": ["Lyon"], "b": [], "c": ["x y"]}
    predictions = {"a": "Lyon", "b": "", "c": "x"}
    # exact a 1, b 1 (both empty), c 0; F1 a 1, b 1, c 2/3 (precision 1, recall 1/2).
    assert squad_v2(predictions, references) == pytest.approx({
        "exact": 200 / 3, "f1": 100 * (2 + 2 / 3) / 3, "total": 3,
        "HasAns_exact": 50.0, "HasAns_f1": 100 * (1 + 2 / 3) / 2, "HasAns_total": 2,
        "NoAns_exact": 100.0, "NoAns_f1": 100.0, "NoAns_total": 1,
        # No probabilities (the classic scripts'): all 0. "No answer" everywhere scores 1 (b); taking a
        # back gives 2, b changes nothing, c adds its 0 (exact) or 2/3 (F1).
        "best_exact": 200 / 3, "best_exact_thresh": 0.0, "best_f1": 100 * (2 + 2 / 3) / 3, "best_f1_thresh": 0.0})

    # With probabilities, taken back in their order a (0.1), c (0.8), b (0.9): exact peaks after a
    # (2 of 3 at 0.1), F1 after c (1 + 2/3 + 1 at 0.8); b's wrong answer costs 1 when taken back.
    predictions["b"] = "Rome"
    probabilities = {"a": 0.1, "b": 0.9, "c": 0.8}
    scores = squad_v2(predictions, references, probabilities)
    assert scores["exact"] == pytest.approx(100 / 3) and scores["NoAns_exact"] == 0.0
    assert (scores["best_exact"], scores["best_exact_thresh"]) == (pytest.approx(200 / 3), 0.1)
    assert (scores["best_f1"], scores["best_f1_thresh"]) == (pytest.approx(100 * (2 + 2 / 3) / 3), 0.8)
    # Above the threshold a question counts as answered "nothing": b is then right.
    thresholded = squad_v2(predictions, references, probabilities, no_answer_threshold=0.85)
    assert thresholded["exact"] == pytest.approx(200 / 3) and thresholded["NoAns_exact"] == 100.0


def test_squad_v2_leaves_out_a_split_without_questions():
    scores = squad_v2({"a": "Lyon"}, {"a": ["Lyon"]})
    assert "HasAns_total" in scores and not [key for key in scores if key.startswith("NoAns")]


# ----------------------------------------------------------------------------------------------
# Metrics: random predictions against a second implementation of the official definitions
# ----------------------------------------------------------------------------------------------
def reference_normalise(text):
    text = text.lower()
    text = text.translate(str.maketrans("", "", string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def reference_f1(prediction, truth):
    p, t = reference_normalise(prediction).split(), reference_normalise(truth).split()
    if len(p) == 0 or len(t) == 0:
        return int(p == t)
    same = sum((collections.Counter(p) & collections.Counter(t)).values())
    return 0 if same == 0 else 2 * same / (len(p) + len(t))  # = 2PR / (P + R)


def reference_v2(predictions, references, probabilities, threshold):
    raw_exact, raw_f1, answerable = {}, {}, {}
    for qid, golds in references.items():
        golds = [g for g in golds if reference_normalise(g)] or [""]
        answerable[qid] = golds != [""]
        raw_exact[qid] = max(int(reference_normalise(predictions[qid]) == reference_normalise(g)) for g in golds)
        raw_f1[qid] = max(reference_f1(predictions[qid], g) for g in golds)
    exact = {q: (not answerable[q]) * 1.0 if probabilities[q] > threshold else s for q, s in raw_exact.items()}
    f1 = {q: (not answerable[q]) * 1.0 if probabilities[q] > threshold else s for q, s in raw_f1.items()}
    out = {"exact": 100 * np.mean(list(exact.values())), "f1": 100 * np.mean(list(f1.values())),
           "total": len(references)}
    for name, flag in (("HasAns", True), ("NoAns", False)):
        ids = [q for q in references if answerable[q] == flag]
        if ids:
            out[f"{name}_exact"] = 100 * np.mean([exact[q] for q in ids])
            out[f"{name}_f1"] = 100 * np.mean([f1[q] for q in ids])
            out[f"{name}_total"] = len(ids)
    # The best threshold by brute force: every candidate threshold (0 and each probability), the
    # score of "no answer" for the questions above it and the raw score for the others.
    for name, raw in (("exact", raw_exact), ("f1", raw_f1)):
        best, best_threshold = None, None
        for t in sorted({0.0, *probabilities.values()}):
            total = sum(raw[q] if probabilities[q] <= t else float(not answerable[q]) for q in references)
            if best is None or total > best + 1e-12:
                best, best_threshold = total, t
        start = sum(not a for a in answerable.values())  # every question above the threshold
        if start > best:  # never better than "no answer" everywhere: the official script's starting point
            best, best_threshold = start, 0.0
        out[f"best_{name}"], out[f"best_{name}_thresh"] = 100 * best / len(references), best_threshold
    return out


WORDS = ["The", "the", "a", "An", "cat", "Cat,", "sat", "on", "mat.", "Lyon", "lyon!", "in", "1998", "(old)", "town"]


def random_answer(rng, empty=0.0):
    if rng.random() < empty:
        return ""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))


@pytest.mark.parametrize("seed", range(3))
def test_random_predictions_score_as_the_reference_implementation_does(seed):
    rng = random.Random(seed)
    ids = [f"q{i}" for i in range(200)]
    answered = {q: [random_answer(rng) for _ in range(rng.randint(1, 3))] for q in ids}
    predictions = {q: random_answer(rng, empty=0.1) for q in ids}
    # v1.1: every question has an answer; gold answers are taken as they are (none dropped as empty).
    ours = squad_v1(predictions, answered)
    v1_exact = 100 * np.mean([max(reference_normalise(predictions[q]) == reference_normalise(g) for g in answered[q])
                              for q in ids])
    assert ours["exact_match"] == pytest.approx(v1_exact)  # means of 200 floats summed in another order
    v1_f1 = 100 * np.mean([max(reference_f1(predictions[q], g) if reference_normalise(predictions[q])
                               and reference_normalise(g) else 0 for g in answered[q]) for q in ids])
    assert ours["f1"] == pytest.approx(v1_f1)
    # v2.0: a third without an answer; distinct probabilities (ties would make the threshold order-dependent).
    references = {q: ([] if rng.random() < 0.33 else golds) for q, golds in answered.items()}
    probabilities = dict(zip(ids, rng.sample(range(1000), len(ids))))
    probabilities = {q: p / 1000 for q, p in probabilities.items()}
    for threshold in (1.0, 0.5):
        assert squad_v2(predictions, references, probabilities, threshold) == pytest.approx(
            reference_v2(predictions, references, probabilities, threshold))


# ----------------------------------------------------------------------------------------------
# Post-processing
# ----------------------------------------------------------------------------------------------
CONTEXT = "Ann moved to Lyon in 1998 ."
# Character offsets of the context's words; a window is [CLS] question [SEP] context part [SEP].
WORD_OFFSETS = [(0, 3), (4, 9), (10, 12), (13, 17), (18, 20), (21, 25), (26, 27)]


def window(words, tokens=10, question=2):
    """offsets [tokens, 2] of a window holding context words `words` after [CLS] + `question` + [SEP]."""
    offsets = np.full((tokens, 2), NO_CONTEXT)
    for position, word in enumerate(words, start=question + 2):
        offsets[position] = WORD_OFFSETS[word]
    return offsets


def logits(tokens=10, **peaks):
    """Start or end logits: -5 everywhere, `peaks` {"t<position>": value}."""
    values = np.full(tokens, -5.0)
    for name, value in peaks.items():
        values[int(name[1:])] = value
    return values


def answers_of(starts, ends, offsets, examples=(("q", CONTEXT),), feature_examples=None, **kwargs):
    feature_examples = [0] * len(starts) if feature_examples is None else feature_examples
    return best_answers(list(examples), feature_examples, np.array(starts), np.array(ends), np.array(offsets),
                        [0] * len(starts), **kwargs)


def test_the_best_window_wins():
    """Two windows of one example (words 0-4 and 2-6): window 1's span "1998" outscores window 0's
    "Lyon"; each span's text comes from its own window's offsets."""
    first, second = window([0, 1, 2, 3, 4]), window([2, 3, 4, 5, 6])
    starts = [logits(t7=3.0, t8=1.0), logits(t7=4.0, t5=1.0)]  # window 0: "Lyon" at 7; window 1: "1998" at 7
    ends = [logits(t7=2.0), logits(t7=3.5, t5=0.0)]
    answers, nbest, _ = answers_of(starts, ends, [first, second])
    assert answers == {"q": "1998"}
    texts = [entry["text"] for entry in nbest["q"]]
    assert texts[:2] == ["1998", "Lyon"]
    assert nbest["q"][0]["offsets"] == [21, 25] and nbest["q"][0]["score"] == pytest.approx(7.5)
    assert sum(entry["probability"] for entry in nbest["q"]) == pytest.approx(1.0)
    # The probabilities are a softmax over the kept scores.
    scores = np.array([entry["score"] for entry in nbest["q"]])
    assert [entry["probability"] for entry in nbest["q"]] == pytest.approx(list(np.exp(scores) / np.exp(scores).sum()))


def test_spans_outside_the_context_reversed_or_too_long_are_rejected():
    offsets = window([0, 1, 2, 3, 4, 5])  # context at tokens 4-9
    # Best pairs: start at a question token (2), end before start (8 -> 5), 6 tokens long (4 -> 9);
    # the best valid one is "in 1998" (8 -> 9, 15), then "Ann moved" (4 -> 5, 14.5).
    starts = [logits(t2=9.0, t8=8.0, t4=6.5, t6=1.0)]
    ends = [logits(t2=9.0, t5=8.0, t9=7.0, t6=1.0)]
    answers, nbest, _ = answers_of(starts, ends, [offsets], max_answer_length=5)
    spans = {(entry["offsets"][0], entry["offsets"][1]) for entry in nbest["q"]}
    assert (WORD_OFFSETS[4][0], WORD_OFFSETS[1][1]) not in spans  # reversed
    assert (WORD_OFFSETS[0][0], WORD_OFFSETS[5][1]) not in spans  # 6 tokens > 5
    assert all(start >= 0 for start, _ in spans)  # no question token
    assert answers["q"] == "in 1998" and nbest["q"][1]["text"] == "Ann moved"
    assert nbest["q"][0]["text"] == CONTEXT[slice(*nbest["q"][0]["offsets"])]


def test_n_best_size_limits_the_candidates():
    offsets = window([0, 1, 2, 3, 4, 5])
    rng = np.random.default_rng(0)
    starts, ends = [rng.normal(size=10)], [rng.normal(size=10)]
    _, nbest, _ = answers_of(starts, ends, [offsets], n_best_size=3, max_answer_length=30)
    assert 0 < len(nbest["q"]) <= 3
    assert [e["score"] for e in nbest["q"]] == sorted((e["score"] for e in nbest["q"]), reverse=True)


@pytest.mark.parametrize("threshold, expected", [(1.9, ""), (2.1, "Lyon")])
def test_v2_answers_nothing_when_the_null_score_wins_by_more_than_the_threshold(threshold, expected):
    """Null score 6 (start + end at CLS) against the best span's 4: a difference of 2."""
    offsets = window([0, 1, 2, 3])
    starts, ends = [logits(t0=3.0, t7=2.5)], [logits(t0=3.0, t7=1.5)]
    answers, nbest, null_odds = answers_of(starts, ends, [offsets], with_negative=True,
                                           null_score_diff_threshold=threshold)
    assert answers == {"q": expected}
    assert null_odds["q"] == pytest.approx(2.0)
    assert "" in [entry["text"] for entry in nbest["q"]]  # the null answer is a candidate


def test_v2_null_score_is_the_lowest_over_the_windows():
    """Window 0 is sure there is no answer (null 10), window 1 holds the answer (null 0): the
    example's null score is 0, and the span of window 1 (score 3) wins."""
    offsets = [window([0, 1, 2, 3]), window([2, 3, 4, 5])]
    starts = [logits(t0=5.0), logits(t0=0.0, t5=1.5)]
    ends = [logits(t0=5.0), logits(t0=0.0, t5=1.5)]
    answers, _, null_odds = answers_of(starts, ends, offsets, with_negative=True)
    assert answers == {"q": "Lyon"} and null_odds["q"] == pytest.approx(-3.0)


def test_every_candidate_empty_answers_nothing_without_indexing_past_the_list():
    """No valid span at all (the top tokens are outside the context, n_best_size 1): v1.1 answers ""
    with an empty n-best list; v2.0 answers "" with the null answer alone."""
    offsets = window([0, 1])
    starts, ends = [logits(t1=5.0)], [logits(t1=5.0)]
    answers, nbest, _ = answers_of(starts, ends, [offsets], n_best_size=1)
    assert answers == {"q": ""} and nbest == {"q": []}
    answers, nbest, null_odds = answers_of(starts, ends, [offsets], n_best_size=1, with_negative=True)
    assert answers == {"q": ""} and [entry["text"] for entry in nbest["q"]] == [""] and null_odds == {"q": None}
    # Spans whose text is empty (a zero-width token) are no answer either.
    zero_width = window([0, 1])
    zero_width[4] = (3, 3)
    answers, _, _ = answers_of([logits(t4=5.0)], [logits(t4=5.0)], [zero_width], n_best_size=1, with_negative=True)
    assert answers == {"q": ""}


def test_each_example_gets_only_its_own_windows():
    examples = [("a", CONTEXT), ("b", "Bob moved to Rome .")]
    offsets = [window([0, 1, 2, 3]), window([])]
    offsets[1][4], offsets[1][7] = (0, 3), (13, 17)  # "Bob", "Rome"
    starts, ends = [logits(t7=1.0), logits(t7=3.0)], [logits(t7=1.0), logits(t7=3.0)]
    answers, _, _ = answers_of(starts, ends, offsets, examples=examples, feature_examples=[0, 1])
    assert answers == {"a": "Lyon", "b": "Rome"}


# ----------------------------------------------------------------------------------------------
# Windows and training labels on the shipped tokenizer
# ----------------------------------------------------------------------------------------------
def make_windows(rows, seq_length, doc_stride):
    import datasets
    from transformers import AutoTokenizer

    import run_qa

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    args = run_qa.DataTrainingArguments(max_seq_length=seq_length, doc_stride=doc_stride)
    examples = qa.read_examples(datasets.Dataset.from_list(rows), "train", args, tokenizer, True)
    return tokenizer, examples, qa.make_windows(examples, tokenizer, seq_length, doc_stride, args)


STORY = ("The market was busy that week . Elena Garcia works as a teacher in Oslo . On Monday , Alice Silva "
         "bought a red car . Vera Varga met Marco Hughes at a concert in Florence . Hannah Costa works as a "
         "plumber in Graz .")


def squad_row(question, answer, occurrence=0):
    start = [m.start() for m in re.finditer(re.escape(answer), STORY)][occurrence]
    return {"id": question, "question": question, "context": STORY,
            "answers": {"text": [answer], "answer_start": [start]}}


def test_windows_label_the_answer_or_cls():
    """Windows of 24 tokens sharing 8: every window whose context holds the whole answer labels its
    tokens, the others (and a question without answer) label the CLS token at 0."""
    rows = [squad_row("Where does Hannah Costa work?", "Graz"), squad_row("Who did Vera Varga meet?", "Marco Hughes"),
            {"id": "none", "question": "What did Omar buy?", "context": STORY,
             "answers": {"text": [], "answer_start": []}}]
    tokenizer, examples, windows = make_windows(rows, 24, 8)
    by_example = collections.defaultdict(list)
    for w in windows:
        by_example[w["example_index"]].append(w)
    assert min(len(ws) for ws in by_example.values()) >= 3  # the story needs several windows
    for index, row in enumerate(rows):
        labelled = 0
        for w in by_example[index]:
            offsets = np.array(w["offsets"]).reshape(-1, 2)
            start, end = w["start_positions"], w["end_positions"]
            context_tokens = offsets[offsets[:, 0] != NO_CONTEXT]
            answer = row["answers"]["text"][:1]
            inside = bool(answer) and context_tokens[0, 0] <= row["answers"]["answer_start"][0] and \
                context_tokens[-1, 1] >= row["answers"]["answer_start"][0] + len(answer[0])
            if inside:
                labelled += 1
                assert STORY[offsets[start, 0]:offsets[end, 1]] == answer[0]
                assert tokenizer.decode(w["input_ids"][start:end + 1]).replace(" ", "") == answer[0].replace(" ", "")
            else:
                assert (start, end) == (0, 0) and w["input_ids"][0] == tokenizer.cls_token_id
        assert labelled >= 1 if row["answers"]["text"] else labelled == 0


def test_an_answer_past_the_first_window_is_found():
    """"Graz" lies only in the last windows: labelled there, and logits pointing at it there are answered."""
    rows = [squad_row("Where does Hannah Costa work?", "Graz")]
    _, examples, windows = make_windows(rows, 24, 8)
    starts = np.full((len(windows), 24), -5.0)
    ends = np.full((len(windows), 24), -5.0)
    labelled = [i for i, w in enumerate(windows) if w["start_positions"] != 0]
    assert labelled and labelled[0] > 0
    for i in labelled:
        starts[i, windows[i]["start_positions"]] = 4.0
        ends[i, windows[i]["end_positions"]] = 2.0
    offsets = np.array(windows["offsets"]).reshape(len(windows), 24, 2)
    answers, _, _ = best_answers(list(zip(examples["id"], examples["context"])), windows["example_index"], starts,
                                 ends, offsets, windows["null_index"])
    assert answers == {rows[0]["id"]: "Graz"}
    assert qa.squad_v1(answers, {rows[0]["id"]: ["Graz"]}) == {"exact_match": 100.0, "f1": 100.0}


def test_squad_documents_json_lines_and_csv_read_alike(tmp_path):
    """The official nested layout, the classic scripts' {"data": [rows]}, JSON lines (here gzipped)
    and csv (answers written as JSON, or as the Python literal `datasets` writes) give the same rows."""
    import gzip
    import json

    import run_qa

    answer = {"text": ["Lyon"], "answer_start": [13]}
    row = {"id": "q1", "question": "  Where did Ann go?", "context": "Ann moved to Lyon .", "answers": answer}
    official = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": row["context"], "qas": [
        {"id": "q1", "question": row["question"], "answers": [{"text": "Lyon", "answer_start": 13}]}]}]}]}
    (tmp_path / "official.json").write_text(json.dumps(official))
    (tmp_path / "classic.json").write_text(json.dumps({"data": [row]}))
    with gzip.open(tmp_path / "rows.jsonl.gz", "wt") as f:
        f.write(json.dumps(row) + "\n")
    (tmp_path / "json.csv").write_text('id,question,context,answers\nq1,"  Where did Ann go?",Ann moved to Lyon .,'
                                       '"{""text"": [""Lyon""], ""answer_start"": [13]}"\n')
    (tmp_path / "literal.csv").write_text("id,question,context,answers\nq1,  Where did Ann go?,Ann moved to Lyon .,"
                                          "\"{'text': ['Lyon'], 'answer_start': [13]}\"\n")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    args = run_qa.DataTrainingArguments()
    for name in ("official.json", "classic.json", "rows.jsonl.gz", "json.csv", "literal.csv"):
        assert qa.is_squad_document(str(tmp_path / name)) == name.endswith(".json")
        split = qa.load_splits(args, {"train": str(tmp_path / name)}, str(tmp_path / "cache"))["train"]
        read = qa.read_examples(split, "train", args, tokenizer, True)[0]
        assert (read["id"], read["question"], read["context"], read["answer_texts"], read["answer_starts"]) == (
            "q1", "Where did Ann go?", "Ann moved to Lyon .", ["Lyon"], [13]), name


def test_a_split_is_prepared_with_its_windows_and_references():
    """`prepare_split` of a validation split: the windows' host columns (offsets [windows, tokens, 2])
    are those `make_windows` cuts, the references every example's answer texts; a question without
    answer is SQuAD v2.0 data only."""
    import datasets

    import run_qa

    rows = [squad_row("Where does Hannah Costa work?", "Graz"), squad_row("Who did Vera Varga meet?", "Marco Hughes")]
    tokenizer, _, windows = make_windows(rows, 24, 8)
    args = run_qa.DataTrainingArguments(max_seq_length=24, doc_stride=8)
    features = qa.prepare_split(datasets.Dataset.from_list(rows), "validation", args, tokenizer, 24, True)
    assert features.size == len(windows) and features.references == {
        rows[0]["id"]: ["Graz"], rows[1]["id"]: ["Marco Hughes"]}
    np.testing.assert_array_equal(features.windows["offsets"], np.array(windows["offsets"]).reshape(-1, 24, 2))
    np.testing.assert_array_equal(features.windows["example_index"], windows["example_index"])
    np.testing.assert_array_equal(features.arrays["start_positions"][:], windows["start_positions"])
    train = qa.prepare_split(datasets.Dataset.from_list(rows), "train", args, tokenizer, 24, True)
    assert train.windows is None and train.references is None
    unanswered = rows + [{"id": "none", "question": "What did Omar buy?", "context": STORY,
                          "answers": {"text": [], "answer_start": []}}]
    with pytest.raises(UsageError, match=r"row 2 of the validation data has no answer \(1 rows in all\): pass "
                                         r"--version_2_with_negative"):
        qa.prepare_split(datasets.Dataset.from_list(unanswered), "validation", args, tokenizer, 24, True)
    v2 = run_qa.DataTrainingArguments(max_seq_length=24, doc_stride=8, version_2_with_negative=True)
    assert qa.prepare_split(datasets.Dataset.from_list(unanswered), "validation", v2, tokenizer, 24,
                            True).references["none"] == []


def test_columns_a_test_set_may_lack_the_answers():
    import datasets

    import run_qa

    args = run_qa.DataTrainingArguments()
    answered = datasets.Dataset.from_list([squad_row("Where does Hannah Costa work?", "Graz")])
    questions = answered.remove_columns("answers")
    assert qa.answered_splits({"train": answered, "test": questions}, args) == {"train": True, "test": False}
    with pytest.raises(UsageError, match="--answer_column_name 'answers' is not a column of the validation data"):
        qa.answered_splits({"train": answered, "validation": questions}, args)


def test_window_length_is_cut_to_the_tokenizer_and_the_model(caplog):
    import logging
    from types import SimpleNamespace

    from transformers import BertConfig

    logger = logging.getLogger("test_qa")
    tokenizer, config = SimpleNamespace(model_max_length=48), BertConfig(max_position_embeddings=40)
    assert qa.window_length(64, 16, tokenizer, config, logger) == 40
    assert "more than the tokenizer's 48" in caplog.text and "more than the model's 40 positions" in caplog.text
    assert qa.window_length(64, 16, SimpleNamespace(model_max_length=36), config, logger) == 36
    assert qa.window_length(32, 16, tokenizer, config, logger) == 32
    with pytest.raises(UsageError, match=r"--doc_stride 40 must be less than the window of 40 tokens"):
        qa.window_length(64, 40, tokenizer, config, logger)


def test_span_loss_is_the_mean_of_start_and_end_cross_entropy_over_real_windows():
    """Against plain NumPy: per window (start CE + end CE) / 2, summed over the windows of weight 1;
    padded windows (weight 0) add neither loss nor count."""
    rng = np.random.default_rng(0)
    starts, ends = rng.normal(size=(2, 6, 16)).astype(np.float32)
    start_positions, end_positions = rng.integers(0, 16, (2, 6)).astype(np.int32)
    weights = np.array([1, 1, 1, 1, 0, 0], np.float32)

    def cross_entropy(logits, labels):
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return -log_probs[np.arange(len(labels)), labels]

    expected = ((cross_entropy(starts, start_positions) + cross_entropy(ends, end_positions)) / 2 * weights).sum()
    loss, sums = qa.span_loss(starts, ends, start_positions, end_positions, weights)
    assert float(loss) == float(sums["loss"]) == pytest.approx(expected, rel=1e-5)
    assert float(sums["tokens"]) == 4
