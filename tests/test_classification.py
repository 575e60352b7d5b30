"""tasks/classification.py against the libraries the classic scripts' metrics come from.

scikit-learn, scipy and seqeval (test-only requirements) are the references; every comparison runs
on many random inputs, edge cases included. Tolerance 1e-9 everywhere: both sides compute the same
float64 ratios, only in another order, so they differ by a few ulps at most.
"""

import json
import os
import random
import warnings

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics
from seqeval.metrics import accuracy_score as seqeval_accuracy
from seqeval.metrics import classification_report as seqeval_report
from transformers import AutoTokenizer

from tasks import classification as cls
from utils.base.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NER = os.path.join(ROOT, "data", "ner")
TOL = 1e-9  # see the module docstring


# ---------------------------------------------------------------------------------------------
# GLUE tasks and labels
# ---------------------------------------------------------------------------------------------


def test_glue_tasks_have_the_classic_columns_metrics_and_splits():
    # The classic scripts' task_to_keys, written out again as the reference.
    task_to_keys = {
        "cola": ("sentence", None), "mnli": ("premise", "hypothesis"), "mrpc": ("sentence1", "sentence2"),
        "qnli": ("question", "sentence"), "qqp": ("question1", "question2"), "rte": ("sentence1", "sentence2"),
        "sst2": ("sentence", None), "stsb": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2"),
    }
    assert {name: task.text_columns for name, task in cls.GLUE_TASKS.items()} == task_to_keys
    assert [name for name, task in cls.GLUE_TASKS.items() if task.is_regression] == ["stsb"]
    assert cls.metric_names("cola", False) == ("matthews_correlation",)
    assert cls.metric_names("stsb", True) == ("pearson", "spearmanr")
    assert set(cls.metric_names("mrpc", False)) == set(cls.metric_names("qqp", False)) == {"accuracy", "f1"}
    for name in ("sst2", "mnli", "qnli", "rte", "wnli"):
        assert cls.metric_names(name, False) == ("accuracy",)
    assert cls.GLUE_TASKS["mnli"].eval_splits == (("validation_matched", "eval"),
                                                  ("validation_mismatched", "eval_mismatched"))
    assert cls.GLUE_TASKS["mnli"].test_splits == ("test_matched", "test_mismatched")
    assert all(task.eval_splits == (("validation", "eval"),) for name, task in cls.GLUE_TASKS.items() if name != "mnli")
    assert cls.metric_names(None, False) == ("accuracy",) and cls.metric_names(None, True) == ("pearson", "spearmanr")
    with pytest.raises(UsageError, match="unknown --task_name 'mnli_matched'.*cola"):
        cls.glue_task("mnli_matched")


def test_label_list_sorts_classes_and_detects_regression():
    assert cls.label_list(["not_equivalent", "equivalent", "equivalent"]) == ["equivalent", "not_equivalent"]
    assert cls.label_list([10, 2, 2, 0]) == [0, 2, 10]  # numeric order, not "10" < "2"
    assert cls.label_list(np.array([1, 0, 1])) == [0, 1]
    assert cls.label_list([True, False]) == [False, True]
    assert cls.label_list([0.5, 3.25, 1.0]) is None
    assert cls.label_list([1, 2, 0.0]) is None  # one float makes the column a regression
    assert cls.label_list(np.array([0.0, 1.0], dtype=np.float32)) is None
    for bad, message in [([], "empty"), (["a", None], "missing"), ([1.0, float("nan")], "missing"),
                         (["a", 1], "mixes number and string"), ([[1]], "list")]:
        with pytest.raises(UsageError, match=message):
            cls.label_list(bad)


def test_config_label_maps_name_every_label():
    label2id, id2label = cls.config_label_maps(["equivalent", "not_equivalent"])
    assert label2id == {"equivalent": 0, "not_equivalent": 1} and id2label == {0: "equivalent", 1: "not_equivalent"}
    assert cls.config_label_maps([0, 2, 10]) == ({"0": 0, "2": 1, "10": 2}, {0: "0", 1: "2", 2: "10"})
    with pytest.raises(UsageError, match="clashing"):
        cls.config_label_maps([1, "1"])


# ---------------------------------------------------------------------------------------------
# Sequence-classification metrics
# ---------------------------------------------------------------------------------------------


def _random_class_pairs(seed, trials=300):
    """(predictions, labels) of 1..40 rows and 1..4 classes; a fifth are one class on a side."""
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        n, classes = int(rng.integers(1, 41)), int(rng.integers(1, 5))
        labels = rng.integers(0, classes, n)
        predictions = rng.integers(0, classes, n)
        if trial % 5 == 0:
            predictions[:] = predictions[0]  # constant predictions
        if trial % 7 == 0:
            labels[:] = labels[0]
        yield predictions, labels


def test_classification_metrics_equal_sklearn():
    """Catches: F1 of the wrong class, a micro/macro F1, MCC with a wrong term or sign."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn warns on the degenerate cases it scores 0.0
        for predictions, labels in _random_class_pairs(0):
            assert abs(cls.accuracy(predictions, labels) - sklearn.metrics.accuracy_score(labels, predictions)) < TOL
            assert abs(cls.matthews_correlation(predictions, labels)
                       - sklearn.metrics.matthews_corrcoef(labels, predictions)) < TOL
            binary_predictions, binary_labels = predictions % 2, labels % 2
            expected_f1 = sklearn.metrics.f1_score(binary_labels, binary_predictions, labels=[0, 1])
            assert abs(cls.binary_f1(binary_predictions, binary_labels) - expected_f1) < TOL


def test_classification_metrics_edge_cases():
    assert cls.binary_f1([0, 0], [0, 0]) == 0.0  # no positive anywhere: sklearn's 0.0
    assert cls.binary_f1([1], [1]) == 1.0 and cls.accuracy([3], [3]) == 1.0
    assert cls.matthews_correlation([1, 1, 1], [0, 1, 1]) == 0.0  # constant predictions
    assert cls.matthews_correlation([0, 1], [1, 0]) == -1.0
    with pytest.raises(ValueError, match="no examples"):
        cls.accuracy([], [])
    with pytest.raises(ValueError, match="equal-length"):
        cls.accuracy([1, 0], [1])
    with pytest.raises(ValueError, match="unknown metrics"):
        cls.sequence_metrics(["f1_macro"], [1], [1])


def test_correlations_equal_scipy_ties_included():
    """Catches: Spearman with ordinal (first-come) ranks for ties, Pearson without centring."""
    rng = np.random.default_rng(1)
    for trial in range(300):
        n = int(rng.integers(2, 40))
        # Every third trial draws from 4 values, so most entries are tied.
        labels = rng.integers(0, 4, n).astype(float) if trial % 3 == 0 else rng.uniform(0, 5, n)
        predictions = rng.integers(0, 4, n) * 1.25 if trial % 3 == 1 else labels + rng.normal(0, 1.5, n)
        if np.ptp(labels) == 0 or np.ptp(predictions) == 0:
            continue  # the constant case is pinned below
        assert abs(cls.pearson(predictions, labels) - scipy.stats.pearsonr(predictions, labels)[0]) < TOL
        assert abs(cls.spearman(predictions, labels) - scipy.stats.spearmanr(predictions, labels)[0]) < TOL
        assert np.allclose(cls.average_ranks(predictions), scipy.stats.rankdata(predictions), rtol=0, atol=TOL)


def test_correlations_of_constant_inputs_are_zero_where_scipy_says_nan():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scipy.stats.ConstantInputWarning)
        assert np.isnan(scipy.stats.pearsonr([2.5, 2.5, 2.5], [1.0, 2.0, 3.0])[0])
    for predictions, labels in [([2.5, 2.5, 2.5], [1.0, 2.0, 3.0]), ([1.0, 2.0], [4.0, 4.0]), ([3.0], [1.0])]:
        assert cls.pearson(predictions, labels) == cls.spearman(predictions, labels) == 0.0
    metrics = cls.sequence_metrics(("pearson", "spearmanr"), [0.1, 0.4, 0.2], [0.0, 3.0, 1.0])
    assert metrics == pytest.approx({"pearson": scipy.stats.pearsonr([0.1, 0.4, 0.2], [0.0, 3.0, 1.0])[0],
                                     "spearmanr": 1.0}, abs=TOL)
    json.dumps(metrics, allow_nan=False)  # results files stay valid JSON


# ---------------------------------------------------------------------------------------------
# Entity metrics against seqeval
# ---------------------------------------------------------------------------------------------


def _seqeval_reference(true_tags, predicted_tags):
    """Our keys, computed as `evaluate`'s seqeval metric (and the classic script after it) does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # undefined ratios and non-NE tags are warned about
        report = seqeval_report(true_tags, predicted_tags, output_dict=True)
        accuracy = seqeval_accuracy(true_tags, predicted_tags)
    overall = report.pop("micro avg")
    report.pop("macro avg"), report.pop("weighted avg")
    expected = {"precision": overall["precision"], "recall": overall["recall"], "f1": overall["f1-score"],
                "accuracy": accuracy}
    for entity_type, scores in report.items():
        expected.update({f"{entity_type}_precision": scores["precision"], f"{entity_type}_recall": scores["recall"],
                         f"{entity_type}_f1": scores["f1-score"], f"{entity_type}_number": scores["support"]})
    return expected


def _assert_same_scores(true_tags, predicted_tags):
    ours = cls.entity_metrics(true_tags, predicted_tags, per_type=True)
    expected = _seqeval_reference(true_tags, predicted_tags)
    assert ours.keys() == expected.keys(), (true_tags, predicted_tags)
    for key, value in expected.items():
        assert abs(ours[key] - value) < TOL, (key, true_tags, predicted_tags)


TYPES = ["PER", "LOC", "ORG", "DATE", "MISC"]
IOB_TAGS = ["O"] + [f"{b}-{t}" for b in "BI" for t in TYPES]
ALL_SCHEME_TAGS = IOB_TAGS + [f"{b}-{t}" for b in "ES" for t in TYPES]
# Tags outside the entity schemes, as POS and chunk data have them (seqeval warns and still chunks).
ODD_TAGS = ["NN", "VBD", ",", ".", "B", "I", "E", "S", "B-NP", "I-NP", "B-I-X", "X-PER"]


def _random_sentences(rng, vocabulary, n_sentences, max_length=12):
    return [[rng.choice(vocabulary) for _ in range(rng.randint(0, max_length))] for _ in range(n_sentences)]


@pytest.mark.parametrize("vocabulary", [IOB_TAGS, ALL_SCHEME_TAGS, ALL_SCHEME_TAGS + ODD_TAGS],
                         ids=["iob", "iob-e-s", "with-odd-tags"])
def test_entity_metrics_equal_seqeval_on_random_tags(vocabulary):
    """Random tags are mostly malformed: I- without B-, B- after I- of another type, lone E-/S-.

    Catches: chunks running across sentences, strict (IOB2-only) chunking, type changes not
    closing an entity, `_number` counting predicted entities, accuracy over sub-tokens.
    """
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 5)
        true_tags = _random_sentences(rng, vocabulary, n)
        if not any(true_tags):
            true_tags[0].append("O")
        predicted_tags = [[rng.choice(vocabulary) if rng.random() < 0.4 else tag for tag in s] for s in true_tags]
        _assert_same_scores(true_tags, predicted_tags)


def test_entity_metrics_equal_seqeval_on_hand_picked_cases():
    cases = [
        ([["O", "O"]], [["O", "O"]]),  # no entity on either side: all 0.0, accuracy 1
        ([["B-PER", "I-PER", "O"]], [["O", "O", "O"]]),  # nothing predicted
        ([["O"]], [["B-LOC"]]),  # nothing to find
        ([["B-PER", "I-PER"]], [["B-PER", "B-PER"]]),  # a second B- splits the entity
        ([["I-PER", "I-PER", "B-LOC"]], [["B-PER", "I-PER", "I-LOC"]]),  # lenient starts
        ([["B-PER", "I-LOC", "I-LOC"]], [["B-PER", "B-LOC", "I-LOC"]]),  # type change opens an entity
        ([["S-PER", "B-ORG", "E-ORG", "E-ORG"]], [["B-PER", "B-ORG", "I-ORG", "E-ORG"]]),  # IOBES-ish
        ([["B-PER"], ["I-PER"]], [["B-PER"], ["I-PER"]]),  # no entity across sentences
        ([["S-ER", "PER", "B-Y"], ["X"]], [["S-ER", "O", "B-Y"], ["X"]]),  # odd tags, kept as seqeval has them
        ([[], ["B-DATE"]], [[], ["B-DATE"]]),  # an empty sentence
    ]
    for true_tags, predicted_tags in cases:
        _assert_same_scores(true_tags, predicted_tags)
    ours = cls.entity_metrics([["B-PER", "I-PER"]], [["B-PER", "B-PER"]])
    assert ours == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 0.5}


def test_entities_and_bad_input():
    assert cls.entities(["B-PER", "I-PER", "O", "I-LOC", "B-LOC"]) == [("PER", 0, 1), ("LOC", 3, 3), ("LOC", 4, 4)]
    with pytest.raises(ValueError, match="2 true tags but 1 predicted"):
        cls.entity_metrics([["O", "O"]], [["O"]])
    with pytest.raises(ValueError, match="1 true sentences but 2"):
        cls.entity_metrics([["O"]], [["O"], ["O"]])
    with pytest.raises(ValueError, match="not a non-empty string"):
        cls.entity_metrics([["O", ""]], [["O", "O"]])
    with pytest.raises(ValueError, match="no words"):
        cls.entity_metrics([[]], [[]])


# ---------------------------------------------------------------------------------------------
# Word labels onto sub-tokens, on the shipped WordPiece tokenizer
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ner_examples():
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(NER, "tokenizer"))
    with open(os.path.join(NER, "validation.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:60]
    return tokenizer, rows


def _pieces_per_word(tokenizer, words):
    """Sub-tokens of each word, tokenizing it alone: a reference that never looks at word_ids."""
    return [len(tokenizer(word, add_special_tokens=False)["input_ids"]) for word in words]


def test_align_word_labels_on_a_wordpiece_tokenizer(ner_examples):
    """Labels on the first sub-token of each word, -100 on the rest and on [CLS]/[SEP].

    Catches: labels shifted by one word (or by the [CLS] token), later sub-tokens labelled, special
    tokens labelled, `label_all_tokens` copying B- onto later sub-tokens (a second B-), or its I-
    landing on a word's first sub-token.
    """
    tokenizer, rows = ner_examples
    labels = sorted({tag for row in rows for tag in row["ner_tags"]})
    label_ids = {label: i for i, label in enumerate(labels)}
    inside_ids = cls.inside_label_ids(labels)
    split_words = split_entity_words = 0
    for row in rows:
        encoding = tokenizer(row["tokens"], is_split_into_words=True)
        word_label_ids = [label_ids[tag] for tag in row["ner_tags"]]
        pieces = _pieces_per_word(tokenizer, row["tokens"])
        assert len(encoding["input_ids"]) == sum(pieces) + 2  # the reference sees the same sub-tokens
        first_only, all_tokens = [-100], [-100]
        for tag, n in zip(row["ner_tags"], pieces):
            first_only += [label_ids[tag]] + [-100] * (n - 1)
            all_tokens += [label_ids[tag]] + [label_ids[tag.replace("B-", "I-", 1)]] * (n - 1)
            split_words += n > 1
            split_entity_words += n > 1 and tag.startswith("B-")
        first_only.append(-100)
        all_tokens.append(-100)
        word_ids = encoding.word_ids()
        assert cls.align_word_labels(word_ids, word_label_ids) == first_only
        assert cls.align_word_labels(word_ids, word_label_ids, True, inside_ids) == all_tokens
        # Per-word predictions read back from the first sub-tokens are the word labels again.
        positions = cls.first_token_positions(word_ids)
        assert [first_only[p] for p in positions] == word_label_ids
    assert split_words > 100 and split_entity_words > 20  # the data really exercises sub-word splits


def test_label_all_tokens_never_doubles_an_entity(ner_examples):
    tokenizer, rows = ner_examples
    labels = ["B-PER", "I-PER", "B-LOC", "O"]  # no I-LOC: later LOC sub-tokens are ignored instead
    assert cls.inside_label_ids(labels) == [1, 1, -100, 3]
    words = ["Clara", "Berg", "in", "Tunis"]
    encoding = tokenizer(words, is_split_into_words=True)
    aligned = cls.align_word_labels(encoding.word_ids(), [0, 1, 3, 2], True, cls.inside_label_ids(labels))
    tags = [labels[i] for i in aligned if i != -100]
    # Scored on sub-tokens, the label_all_tokens labels still hold one PER and one LOC.
    assert [entity_type for entity_type, _, _ in cls.entities(tags)] == ["PER", "LOC"]
    with pytest.raises(ValueError, match="inside_ids"):
        cls.align_word_labels(encoding.word_ids(), [0, 1, 3, 2], True)


def test_first_token_positions_skip_special_and_truncated_words():
    assert cls.first_token_positions([None, 0, 0, 1, 2, 2, 2, None]) == [1, 3, 4]
    assert cls.first_token_positions([None, None]) == []
