"""Tests for utils/scoring/metrics.py: offline sentence splitting, evaluate-identical ROUGE, reductions."""

import math

import jax.numpy as jnp
import nltk
import numpy as np
import pytest
from nltk.tokenize.punkt import PunktTokenizer
from rouge_score import rouge_scorer, scoring

from utils.scoring import metrics
from utils.scoring.metrics import (ROUGE_BOOTSTRAP_SEED, _punkt_params_from_package, perplexity, rouge, rouge_text,
                                   split_sentences, token_weighted_means)

TYPES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]

PAIRS = [
    ("The cat sat on the mat. It was happy.", "A cat sat on a mat. The cat was very happy."),
    ("Stocks rallied on Friday.", "Stocks rose sharply on Friday after the report."),
    (
        "Dr. Smith arrived at 5 p.m. He left early. Nobody noticed.",
        "Nobody noticed Dr. Smith. He arrived at 5 p.m. and left early.",
    ),
    ("Running runners ran.", "The runner runs."),
]


# --------------------------------------------------------------------------- sentence splitting


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "Dr. Smith arrived at 5 p.m. on Monday. He left.",
            ["Dr. Smith arrived at 5 p.m. on Monday.", "He left."],
        ),
        ("The U.S. economy grew. Prices fell.", ["The U.S. economy grew.", "Prices fell."]),
        (
            "Inflation was 3.5 percent. It fell to 2.75 later.",
            ["Inflation was 3.5 percent.", "It fell to 2.75 later."],
        ),
        ("Is it? Yes! Fine.", ["Is it?", "Yes!", "Fine."]),
        ("No final period", ["No final period"]),
        ("", []),
    ],
)
def test_split_sentences(text, expected):
    assert split_sentences(text) == expected


def test_punkt_tab_is_used_when_installed_and_agrees(tmp_path, monkeypatch):
    """Write the packaged parameters as a local punkt_tab model: that branch must split the same."""
    params = _punkt_params_from_package()
    model = tmp_path / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True)
    (model / "abbrev_types.txt").write_text("\n".join(sorted(params.abbrev_types)) + "\n")
    (model / "sent_starters.txt").write_text("\n".join(sorted(params.sent_starters)) + "\n")
    (model / "collocations.tab").write_text(
        "".join(f"{a}\t{b}\n" for a, b in sorted(params.collocations))
    )
    (model / "ortho_context.tab").write_text(
        "".join(f"{typ}\t{flag}\n" for typ, flag in sorted(params.ortho_context.items()))
    )
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    text = "Dr. Smith arrived at 5 p.m. on Monday. He left. The U.S. economy grew 3.5 percent."
    expected = split_sentences(text)
    metrics._sentence_tokenizer.cache_clear()
    try:
        assert isinstance(metrics._sentence_tokenizer(), PunktTokenizer)
        assert split_sentences(text) == expected
    finally:
        metrics._sentence_tokenizer.cache_clear()


def test_rouge_text_strips_and_puts_one_sentence_per_line():
    assert rouge_text(["  The U.S. grew. Prices fell.\n", "One."]) == [
        "The U.S. grew.\nPrices fell.",
        "One.",
    ]


# --------------------------------------------------------------------------- ROUGE


def _reference_rouge(predictions, references):
    """What evaluate's rouge computes, spelled out with rouge_score and the same seed."""
    scorer = rouge_scorer.RougeScorer(TYPES, use_stemmer=True)
    aggregator = scoring.BootstrapAggregator()
    for prediction, reference in zip(predictions, references):
        aggregator.add_scores(scorer.score(reference, prediction))
    np.random.seed(ROUGE_BOOTSTRAP_SEED)
    result = aggregator.aggregate()
    return {key: result[key].mid.fmeasure * 100 for key in TYPES}


def test_rouge_equals_direct_rouge_score():
    predictions, references = map(list, zip(*PAIRS))
    expected = _reference_rouge(rouge_text(predictions), rouge_text(references))
    assert rouge(predictions, references) == expected
    # The multi-sentence pair reorders sentences: rougeLsum must differ from rougeL there.
    single = rouge(predictions[2:3], references[2:3])
    assert single == _reference_rouge(rouge_text(predictions[2:3]), rouge_text(references[2:3]))
    assert single["rougeLsum"] > single["rougeL"]


def test_rouge_perfect_and_disjoint():
    text = "The model works. Scores are high."
    assert rouge([text, text], [text, text]) == {key: 100.0 for key in TYPES}
    assert rouge(["alpha beta gamma."], ["delta epsilon zeta."]) == {key: 0.0 for key in TYPES}


def test_rouge_is_deterministic_and_leaves_global_rng_alone():
    predictions, references = map(list, zip(*PAIRS))
    np.random.seed(123)
    state_before = np.random.get_state()
    first = rouge(predictions, references)
    state_after = np.random.get_state()
    assert state_after[0] == state_before[0]
    np.testing.assert_array_equal(state_after[1], state_before[1])
    assert state_after[2:] == state_before[2:]
    assert rouge(predictions, references) == first


@pytest.mark.parametrize("predictions, references", [([], []), (["a"], []), (["a", "b"], ["a"])])
def test_rouge_rejects_empty_or_mismatched_inputs(predictions, references):
    with pytest.raises(ValueError):
        rouge(predictions, references)


# --------------------------------------------------------------------------- losses


def test_perplexity():
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(20.0)) == pytest.approx(20.0)  # exp(log(x)) in float64: rel 1e-6 is ample
    assert perplexity(1000.0) == float("inf")


def test_token_weighted_means_matches_hand_computation():
    batches = [
        # Per-device sums as a jax array, as a pmap'd eval step returns them.
        {
            "loss": jnp.array([2.0, 4.0]),
            "accuracy": jnp.array([1.0, 2.0]),
            "tokens": jnp.array([3, 1]),
        },
        {"loss": np.float32(10.0), "accuracy": 5, "tokens": np.int32(16)},
    ]
    # loss: (2 + 4 + 10) / (3 + 1 + 16); accuracy: (1 + 2 + 5) / 20. Sums of small integers are exact;
    # only the division rounds (0.8 and 0.4 are not binary fractions): approx's default rel 1e-6.
    assert token_weighted_means(batches) == pytest.approx({"loss": 0.8, "accuracy": 0.4})
    assert token_weighted_means([{"loss": 6.0, "n": 4}], weight_key="n") == {"loss": 1.5}
    assert token_weighted_means(batches, keep_weight=True) == pytest.approx({"loss": 0.8, "accuracy": 0.4,
                                                                            "tokens": 20})


@pytest.mark.parametrize("batches", [[], [{"loss": 1.0, "tokens": 0}]])
def test_token_weighted_means_rejects_zero_weight(batches):
    with pytest.raises(ValueError):
        token_weighted_means(batches)
