"""Labels and metrics for classifying sequences (GLUE-style) and tagging tokens (NER / POS / chunk).

Pure numpy and Python, offline. The metric keys and values are those the classic scripts get from
`evaluate.load("glue", task)` / `evaluate.load("seqeval")` (scikit-learn, scipy and seqeval under
the hood); `tests/test_classification.py` holds them to those libraries on random inputs.
Every metric is exact over the arrays it is given: the caller passes only real rows (no padding).

Sequence classification
- `GLUE_TASKS`: each GLUE task's text columns (the classic `task_to_keys`), the metrics it reports,
  whether it is a regression (stsb), and its evaluation and test splits. mnli is scored on both
  `validation_matched` (keys `eval_*`) and `validation_mismatched` (keys `eval_mismatched_*`), and
  predicted on `test_matched` and `test_mismatched`.
- `label_list`: the sorted distinct labels of a column, or None when its labels are floats
  (regression); `config_label_maps` names them for a model config (no more `LABEL_0`).
- `sequence_metrics`: accuracy, binary F1, Matthews correlation, Pearson, Spearman.

Token classification
- `first_token_positions` / `align_word_labels`: word-level tags onto sub-tokens by `word_ids`.
- `entity_metrics`: seqeval's default (conlleval-compatible, non-strict) chunking and scores.

Both (`tasks/text_classification.py`, `tasks/token_classification.py`)
- `set_config_labels`, `model_inputs`, `logits_fn`.
"""

import dataclasses
import inspect
import math
from collections import defaultdict

import numpy as np

from utils.base.errors import UsageError

# Label id that the loss and the metrics skip (the value transformers' losses ignore too).
IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------
# GLUE tasks
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GlueTask:
    text_columns: tuple  # (first, second) sentence column; second is None for single sentences
    metrics: tuple  # keys `sequence_metrics` returns for this task
    is_regression: bool = False
    # Split -> prefix of its metric keys. Only mnli has two evaluation (and two test) sets.
    eval_splits: tuple = (("validation", "eval"),)
    test_splits: tuple = ("test",)


GLUE_TASKS = {
    "cola": GlueTask(("sentence", None), ("matthews_correlation",)),
    "sst2": GlueTask(("sentence", None), ("accuracy",)),
    "mrpc": GlueTask(("sentence1", "sentence2"), ("accuracy", "f1")),
    "stsb": GlueTask(("sentence1", "sentence2"), ("pearson", "spearmanr"), is_regression=True),
    "qqp": GlueTask(("question1", "question2"), ("accuracy", "f1")),
    "mnli": GlueTask(
        ("premise", "hypothesis"), ("accuracy",),
        eval_splits=(("validation_matched", "eval"), ("validation_mismatched", "eval_mismatched")),
        test_splits=("test_matched", "test_mismatched"),
    ),
    "qnli": GlueTask(("question", "sentence"), ("accuracy",)),
    "rte": GlueTask(("sentence1", "sentence2"), ("accuracy",)),
    "wnli": GlueTask(("sentence1", "sentence2"), ("accuracy",)),
}


def glue_task(name):
    """The GLUE task called `name`, or a UsageError listing the known ones."""
    if name not in GLUE_TASKS:
        raise UsageError(f"unknown --task_name {name!r}; expected one of {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[name]


def metric_names(task_name, is_regression):
    """The metrics a task reports; for the user's own data (task None), by its kind of label.

    Own regression data gets stsb's correlations: its MSE is already the evaluation loss.
    """
    if task_name is not None:
        return glue_task(task_name).metrics
    return ("pearson", "spearmanr") if is_regression else ("accuracy",)


# ---------------------------------------------------------------------------------------------
# Labels of a sequence-classification column
# ---------------------------------------------------------------------------------------------


def label_list(values, split="train"):
    """Sorted distinct labels of a label column of the `split` data, or None if it holds floats (a
    regression).

    Strings and integers (bools too) are classes, sorted as Python sorts them, so integer labels
    keep their numeric order (2 before 10). Any float makes the column a regression, as a float
    column does in the classic scripts. Missing, non-finite (a regression trains on them until its
    loss is) or mixed-type labels are a UsageError naming the first such row.
    """
    values = list(values)
    if not values:
        raise UsageError(f"the label column of the {split} data is empty")
    kinds = set()
    for row, value in enumerate(values):
        if value is None or (isinstance(value, (float, np.floating)) and math.isnan(value)):
            raise UsageError(f"row {row} of the {split} data has no label (the label column has missing values): "
                             "every example needs a label; fill it in or drop the row")
        if isinstance(value, (float, np.floating)) and math.isinf(value):
            raise UsageError(f"row {row} of the {split} data has the label {value}: a score must be a finite "
                             "number; fix it or drop the row")
        if isinstance(value, str):
            kinds.add("string")
        elif isinstance(value, (bool, np.bool_)):
            kinds.add("bool")
        elif isinstance(value, (int, np.integer)):
            kinds.add("number")
        elif isinstance(value, (float, np.floating)):
            kinds.add("number")
            kinds.add("float")
        else:
            raise UsageError(f"row {row} of the {split} data: label {value!r} is a {type(value).__name__}; labels "
                             "must be strings or numbers")
    if "float" in kinds:
        return None
    if len(kinds) > 1:
        raise UsageError(f"the label column of the {split} data mixes {' and '.join(sorted(kinds))} labels; use one "
                         "kind")
    return sorted(set(values))


def config_label_maps(labels):
    """`(label2id, id2label)` for a model config: label names as strings, ids in `labels` order."""
    names = [str(label) for label in labels]
    if len(set(names)) != len(names):
        raise UsageError(f"labels {labels} have clashing names as strings")
    return {name: i for i, name in enumerate(names)}, dict(enumerate(names))


def saved_label_names(config):
    """The label names of a pretrained config, by id; None when they are transformers' LABEL_<i> placeholders."""
    names = [config.id2label[i] for i in range(config.num_labels)]
    return None if names == [f"LABEL_{i}" for i in range(config.num_labels)] else names


# ---------------------------------------------------------------------------------------------
# What sequence classification and token classification share
# ---------------------------------------------------------------------------------------------


def set_config_labels(config, names, finetuning_task):
    """The model config's labels: as many outputs as `names`, named by them (`config_label_maps`)."""
    config.num_labels = len(names)
    config.label2id, config.id2label = config_label_maps(names)
    config.finetuning_task = finetuning_task


def model_inputs(tokenizer, model):
    """The inputs the tokenizer makes and the model takes (DistilBERT takes no token types, which a
    BERT tokenizer makes)."""
    taken = inspect.signature(model.__call__).parameters
    return [name for name in ("input_ids", "attention_mask", "token_type_ids")
            if name in tokenizer.model_input_names and name in taken]


def logits_fn(model, input_names):
    """`logits_of(params, batch, dropout_rng=None, train=False)`: the model's logits for the
    `input_names` of a batch."""
    def logits_of(params, batch, dropout_rng=None, train=False):
        return model(**{k: batch[k] for k in input_names}, params=params, dropout_rng=dropout_rng, train=train)[0]

    return logits_of


# ---------------------------------------------------------------------------------------------
# Sequence-classification metrics
# ---------------------------------------------------------------------------------------------


def _checked_pair(predictions, labels):
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.ndim != 1 or predictions.shape != labels.shape:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} must be equal-length vectors")
    if predictions.size == 0:
        raise ValueError("no examples to score")
    return predictions, labels


def accuracy(predictions, labels):
    predictions, labels = _checked_pair(predictions, labels)
    return float(np.mean(predictions == labels))


def binary_f1(predictions, labels):
    """F1 of class 1. Without any 1 among labels and predictions it is undefined: 0.0, as sklearn."""
    predictions, labels = _checked_pair(predictions, labels)
    true_pos = np.sum((predictions == 1) & (labels == 1))
    wrong = np.sum(predictions != labels)
    denominator = 2 * true_pos + wrong
    return float(2 * true_pos / denominator) if denominator else 0.0


def matthews_correlation(predictions, labels):
    """Matthews correlation for any number of classes (the R_K statistic, which sklearn computes).

    When either side has a single class the correlation is undefined: 0.0, as sklearn returns.
    """
    predictions, labels = _checked_pair(predictions, labels)
    classes, codes = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    true_codes, pred_codes = codes[: labels.size], codes[labels.size:]
    confusion = np.zeros((classes.size, classes.size), dtype=np.float64)
    np.add.at(confusion, (true_codes, pred_codes), 1)
    n = float(labels.size)
    true_counts, pred_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    covariance = np.trace(confusion) * n - true_counts @ pred_counts
    true_variance = n * n - true_counts @ true_counts
    pred_variance = n * n - pred_counts @ pred_counts
    if true_variance * pred_variance == 0:
        return 0.0
    return float(covariance / math.sqrt(true_variance * pred_variance))


def pearson(predictions, labels):
    """Pearson correlation. 0.0 when either side is constant (or a single example).

    scipy returns nan there (with a warning, or an error for one example); 0.0 says "no measurable
    correlation", as `matthews_correlation` does, and keeps the results files valid JSON.
    """
    predictions, labels = _checked_pair(predictions, labels)
    x = predictions.astype(np.float64) - predictions.mean(dtype=np.float64)
    y = labels.astype(np.float64) - labels.mean(dtype=np.float64)
    # Exact zero only for truly constant inputs: a constant float column's mean is the value itself.
    norm = math.sqrt(x @ x) * math.sqrt(y @ y)
    if norm == 0:
        return 0.0
    return float(np.clip((x @ y) / norm, -1.0, 1.0))


def average_ranks(values):
    """Ranks 1..n, tied values sharing the mean of their ranks (scipy's `rankdata` default)."""
    values = np.asarray(values)
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    # Start index of each run of equal values in sorted order.
    run_starts = np.flatnonzero(np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]]))
    run_ends = np.concatenate([run_starts[1:], [values.size]])
    run_ranks = (run_starts + 1 + run_ends) / 2.0  # mean of ranks start+1 .. end
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.repeat(run_ranks, run_ends - run_starts)
    return ranks


def spearman(predictions, labels):
    """Spearman correlation: Pearson of the average ranks. 0.0 where `pearson` would be."""
    predictions, labels = _checked_pair(predictions, labels)
    return pearson(average_ranks(predictions), average_ranks(labels))


_SEQUENCE_METRICS = {
    "accuracy": accuracy,
    "f1": binary_f1,
    "matthews_correlation": matthews_correlation,
    "pearson": pearson,
    "spearmanr": spearman,
}


def sequence_metrics(names, predictions, labels):
    """`{name: value}` for the metric `names` (see `metric_names`), over every row given."""
    unknown = [name for name in names if name not in _SEQUENCE_METRICS]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; known: {', '.join(_SEQUENCE_METRICS)}")
    return {name: _SEQUENCE_METRICS[name](predictions, labels) for name in names}


# ---------------------------------------------------------------------------------------------
# Token classification: word tags onto sub-tokens
# ---------------------------------------------------------------------------------------------


def first_token_positions(word_ids):
    """Token index of each word's first sub-token, in word order (`word_ids` from a fast tokenizer).

    Words cut off by truncation have no position; special tokens (word id None) are skipped.
    """
    positions, previous = [], None
    for position, word_id in enumerate(word_ids):
        if word_id is not None and word_id != previous:
            positions.append(position)
        previous = word_id
    return positions


def inside_label_ids(labels):
    """For each label id, the id its word's later sub-tokens get under `label_all_tokens`.

    `B-X` -> `I-X` (a second `B-` would count the word as two entities); `IGNORE_INDEX` if the label
    list has no `I-X`. Every other tag (I-, O, POS tags, ...) is its own.
    """
    index = {label: i for i, label in enumerate(labels)}
    inside = []
    for i, label in enumerate(labels):
        if isinstance(label, str) and label.startswith("B-"):
            inside.append(index.get("I-" + label[2:], IGNORE_INDEX))
        else:
            inside.append(i)
    return inside


def align_word_labels(word_ids, word_label_ids, label_all_tokens=False, inside_ids=None):
    """Per-token label ids for one tokenized sentence.

    The first sub-token of word w gets `word_label_ids[w]`; later sub-tokens get `IGNORE_INDEX`, or
    with `label_all_tokens` `inside_ids[word_label_ids[w]]` (see `inside_label_ids`); special
    tokens get `IGNORE_INDEX`.
    """
    if label_all_tokens and inside_ids is None:
        raise ValueError("label_all_tokens needs inside_ids (from inside_label_ids)")
    aligned, previous = [], None
    for word_id in word_ids:
        if word_id is None:
            aligned.append(IGNORE_INDEX)
        elif word_id != previous:
            aligned.append(word_label_ids[word_id])
        elif label_all_tokens:
            aligned.append(inside_ids[word_label_ids[word_id]])
        else:
            aligned.append(IGNORE_INDEX)
        previous = word_id
    return aligned


# ---------------------------------------------------------------------------------------------
# Token classification: entities and their scores (seqeval's default mode)
# ---------------------------------------------------------------------------------------------

# The conlleval rules, as seqeval's default mode applies them. A tag is read as its first
# character (the boundary: B, I, E, S, O, or anything else) and its type (what follows the first
# "-", else the rest; "_" if empty). "O" and "." are outside any entity.
_OUTSIDE = ("O", ".")
_ENDS_AFTER = {"E", "S"}  # an entity always ends after these
_ENDS_BEFORE = {("B", "B"), ("B", "S"), ("B", "O"), ("I", "B"), ("I", "S"), ("I", "O")}
_STARTS_AT = {"B", "S"}
_STARTS_AFTER = {("E", "E"), ("E", "I"), ("S", "E"), ("S", "I"), ("O", "E"), ("O", "I")}


def _boundary_and_type(tag):
    kind = tag[0]
    entity_type = tag[1:].split("-", 1)[-1]
    return kind, entity_type or "_"


def entities(tags):
    """`(type, first, last)` spans of the entities in a tag sequence, chunked like seqeval.

    Lenient, as conlleval: an `I-X` after `O` or after another type opens an entity, a type change
    closes one. Tags outside the B/I/E/S/O schemes (POS tags) are chunked by the same rules.
    """
    spans = []
    previous_kind, previous_type, start = "O", "", 0
    for position, tag in enumerate(list(tags) + ["O"]):  # a closing "O" ends the last entity
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag {tag!r} at position {position} is not a non-empty string")
        kind, entity_type = _boundary_and_type(tag)
        type_changed = previous_type != entity_type
        if (previous_kind in _ENDS_AFTER or (previous_kind, kind) in _ENDS_BEFORE
                or (previous_kind not in _OUTSIDE and type_changed)):
            spans.append((previous_type, start, position - 1))
        if (kind in _STARTS_AT or (previous_kind, kind) in _STARTS_AFTER
                or (kind not in _OUTSIDE and type_changed)):
            start = position
        previous_kind, previous_type = kind, entity_type
    return spans


def _ratio(numerator, denominator):
    return numerator / denominator if denominator else 0.0  # seqeval's zero_division default


def _scores(correct, predicted, true):
    precision, recall = _ratio(correct, predicted), _ratio(correct, true)
    f1 = _ratio(2 * precision * recall, precision + recall)
    return precision, recall, f1


def entity_metrics(true_tags, predicted_tags, per_type=False):
    """seqeval's scores for word-level tag sequences (lists of sentences of string tags).

    Returns `precision`, `recall`, `f1` (micro over all entities), `accuracy` (over words); with
    `per_type`, also `<TYPE>_precision`, `_recall`, `_f1` and `_number` (entities of that type in
    `true_tags`) for every type in either side, as the classic `--return_entity_level_metrics`.
    An undefined ratio (nothing predicted, nothing to find) is 0.0, as seqeval's default.
    """
    true_tags, predicted_tags = list(true_tags), list(predicted_tags)
    if len(true_tags) != len(predicted_tags):
        raise ValueError(f"{len(true_tags)} true sentences but {len(predicted_tags)} predicted")
    words = correct_words = 0
    for sentence, (truth, prediction) in enumerate(zip(true_tags, predicted_tags)):
        if len(truth) != len(prediction):
            raise ValueError(f"sentence {sentence}: {len(truth)} true tags but {len(prediction)} predicted")
        words += len(truth)
        correct_words += sum(t == p for t, p in zip(truth, prediction))
    if words == 0:
        raise ValueError("no words to score")
    # Chunked as one stream with an "O" after each sentence, as seqeval does: that "O" closes every
    # entity of B/I/E/S tags, and odd (non-B/I/E/S/O) tags see the same neighbours as in seqeval.
    true_spans, predicted_spans = defaultdict(set), defaultdict(set)
    for spans, sentences in ((true_spans, true_tags), (predicted_spans, predicted_tags)):
        stream = [tag for sentence in sentences for tag in [*sentence, "O"]]
        for entity_type, first, last in entities(stream):
            spans[entity_type].add((first, last))

    types = sorted(set(true_spans) | set(predicted_spans))
    counts = {t: (len(true_spans[t] & predicted_spans[t]), len(predicted_spans[t]), len(true_spans[t]))
              for t in types}
    totals = [sum(c[i] for c in counts.values()) for i in range(3)]
    precision, recall, f1 = _scores(*totals)
    results = {"precision": precision, "recall": recall, "f1": f1, "accuracy": correct_words / words}
    if per_type:
        for entity_type in types:
            type_precision, type_recall, type_f1 = _scores(*counts[entity_type])
            results[f"{entity_type}_precision"] = type_precision
            results[f"{entity_type}_recall"] = type_recall
            results[f"{entity_type}_f1"] = type_f1
            results[f"{entity_type}_number"] = counts[entity_type][2]
    return results
