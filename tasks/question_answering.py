"""Extractive question answering: SQuAD data, context windows, the span loss, from start / end logits to answers,
the SQuAD scores and the prediction files.

What run_qa.py does with a split, in order: `load_splits` reads it (SQuAD documents here, other
files and hub datasets through `utils.data.loaders`), `check_columns` checks its columns,
`prepare_split` reads its examples (`read_examples`, answers checked against their contexts) and cuts each context into
overlapping windows (features, `cut_windows`: what the model trains and predicts on, and what the
demo feeds it), labelled with the answer's first and last tokens (`span_loss` trains on them).
`predicted_answers` gathers the best spans of every window of an example and picks its answer
(`best_answers`), as the classic `utils_qa.py` of Hugging Face's examples does, without its failure
modes (no index past the candidates, no "empty" placeholder text); `eval_metrics` scores them with
the official SQuAD v1.1 and v2.0 evaluation scripts' definitions, offline and in their scale
(percentages, 0 to 100); `write_predictions` writes the answers, n-best lists and null odds.
"""

import ast
import collections
import inspect
import json
import logging
import re
import string
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task
from tasks.demo import (Answer, BadInput, Predictor, bucket_for, buckets, escape_markdown, require_text,
                        show_answer)
from utils.base.errors import UsageError
from utils.data import arrow_columns, file_formats, loaders
from utils.models import loading
from utils.scoring.losses import cross_entropy_sums

FILE_FORMATS = ("json", "csv")
TASK = Task("question-answering", "question-answering",
            outputs=("*_predictions.json", "*_nbest_predictions.json", "*_null_odds.json"), file_formats=FILE_FORMATS)
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # those a tokenizer makes and a model may take
PREFIXES = {"validation": "eval", "test": "predict"}  # of a split's result keys and prediction files
NO_CONTEXT = -1  # the offsets of a token outside the context (question, special tokens, padding)


# ----------------------------------------------------------------------------------------------
# Data: SQuAD files, columns, answers, examples
# ----------------------------------------------------------------------------------------------
def is_squad_document(path):
    """Whether a local .json file is one SQuAD document, {"version": ..., "data": [...]} (or the
    classic scripts' {"data": [rows]}), rather than JSON lines."""
    if file_formats.EXTENSIONS.get(file_formats._extensions(path)[0]) != "json":
        return False
    with file_formats.open_content(path) as f:
        head = f.read(4096).decode("utf-8", errors="ignore").lstrip("\ufeff")
    return re.match(r'\s*\{\s*"(version|data)"\s*:', head) is not None


def read_squad_document(path):
    """The rows of a SQuAD document: the official layout's articles / paragraphs / qas flattened
    (id, title, context, question, answers {text, answer_start}), or the classic scripts' rows."""
    with file_formats.open_content(path) as f:
        try:
            document = json.load(f)
        except json.JSONDecodeError as e:
            raise UsageError(f"data file {path} is not valid JSON: {e.msg} at line {e.lineno} column "
                             f"{e.colno}") from None
    items = document.get("data")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise UsageError(f"data file {path}: its \"data\" must be a list of SQuAD articles or rows")
    rows = []
    for number, item in enumerate(items):
        if "paragraphs" not in item:
            rows.append(item)
            continue
        try:
            for paragraph in item["paragraphs"]:
                for question in paragraph.get("qas", []):
                    answers = question.get("answers", [])
                    rows.append({"id": str(question.get("id", len(rows))), "title": item.get("title", ""),
                                 "context": paragraph["context"], "question": question["question"],
                                 "answers": {"text": [a["text"] for a in answers],
                                             "answer_start": [a["answer_start"] for a in answers]}})
        except (KeyError, TypeError, AttributeError) as e:
            missing = f"has no {e}" if isinstance(e, KeyError) else f"is malformed ({e})"
            raise UsageError(f"data file {path}: article {number} (question {len(rows)} of the file) {missing}: "
                             "a SQuAD article holds paragraphs, each a context and qas, each a question and "
                             "answers of text and answer_start") from None
    if not rows:
        raise UsageError(f"data file {path} holds no questions")
    return rows


def load_splits(data_args, files, cache_dir):
    """{split: Dataset}: a hub dataset, or local files (SQuAD documents read here, the rest by `datasets`)."""
    import datasets

    if data_args.dataset_name:
        return loaders.load_splits(data_args, files, cache_dir, allowed=FILE_FORMATS)
    documents = {split: path for split, path in files.items() if path and is_squad_document(path)}
    others = {split: path for split, path in files.items() if path and split not in documents}
    loaded = dict(loaders.load_splits(data_args, others, cache_dir, allowed=FILE_FORMATS)) if others else {}
    for split, path in documents.items():
        loaded[split] = datasets.Dataset.from_list(read_squad_document(path))
    return loaded


def check_columns(splits, data_args):
    """{split: whether it has answers} of `splits` ({split: Dataset}), once every split has the
    question and context columns, and the training and validation splits the answer column (a test
    set may come without answers)."""
    columns = {split: dataset.column_names for split, dataset in splits.items()}
    file_formats.require_columns(columns, (("question_column_name", data_args.question_column_name),
                                           ("context_column_name", data_args.context_column_name)))
    file_formats.require_columns({split: names for split, names in columns.items() if split in ("train", "validation")},
                                 (("answer_column_name", data_args.answer_column_name),))
    return {split: data_args.answer_column_name in names for split, names in columns.items()}


def parse_answers(value, split, row):
    """(texts, starts) of a row's answers: {text: [...], answer_start: [...]}, a list of {text,
    answer_start}, or either written as JSON / a Python literal (csv); empty or missing: none."""
    if isinstance(value, str):
        if not value.strip():
            return [], []
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                raise UsageError(f"row {row} of the {split} data: the answers {value[:60]!r} are not JSON such as "
                                 '{"text": ["..."], "answer_start": [0]}') from None
    if value is None:
        return [], []
    if isinstance(value, list):
        value = {"text": [a.get("text") for a in value], "answer_start": [a.get("answer_start") for a in value]}
    if not isinstance(value, dict) or "text" not in value or "answer_start" not in value:
        raise UsageError(f"row {row} of the {split} data: the answers must have 'text' and 'answer_start' "
                         '(e.g. {"text": ["Lyon"], "answer_start": [12]})')
    texts, starts = list(value["text"] or []), list(value["answer_start"] or [])
    if len(texts) != len(starts):
        raise UsageError(f"row {row} of the {split} data has {len(texts)} answer texts but {len(starts)} "
                         "answer_start values: give each answer its start")
    return texts, starts


def cut_questions(questions, tokenizer, max_tokens):
    """(questions, their tokens, whether each was cut): a question of more than `max_tokens` tokens
    cut after its `max_tokens`-th, as BERT's SQuAD code cuts at max_query_length, so that one long
    question leaves its windows room for the context (`max_tokens` None: none cut)."""
    encoded = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)
    questions, lengths = list(questions), [len(ids) for ids in encoded["input_ids"]]
    cut = [max_tokens is not None and length > max_tokens for length in lengths]
    for i in np.flatnonzero(cut):
        questions[i] = questions[i][:encoded["offset_mapping"][i][max_tokens - 1][1]]
        lengths[i] = len(tokenizer(questions[i], add_special_tokens=False)["input_ids"])
    return questions, lengths, cut


def check_unique_ids(ids, split):
    """The answers, n-best lists and references of a split are keyed by id: two rows with one id would
    leave one question unanswered in the files and its score counted twice."""
    first = {}
    for row, example_id in enumerate(ids):
        if example_id in first:
            raise UsageError(f"rows {first[example_id]} and {row} of the {split} data have the same id "
                             f"{example_id!r}: each question needs an id of its own (its answer is written under "
                             "it); fix or drop one of them")
        first[example_id] = row


def read_examples(dataset, split, data_args, tokenizer, has_answers):
    """The rows as id, question (left-stripped: some SQuAD questions start with spaces the window
    would waste; cut to --max_question_length tokens, `cut_questions`), context, answer_texts,
    answer_starts, question_tokens, question_cut; the first answer of each row checked against its
    context (the one trained on)."""
    question_col, context_col, answer_col = (data_args.question_column_name, data_args.context_column_name,
                                             data_args.answer_column_name)

    def read(examples, indices):
        out = {"id": [], "question": [], "context": [], "answer_texts": [], "answer_starts": []}
        for i, row in enumerate(indices):
            question, context = examples[question_col][i], examples[context_col][i]
            if not isinstance(question, str) or not isinstance(context, str):
                raise UsageError(f"row {row} of the {split} data: the question and the context must be text")
            texts, starts = parse_answers(examples[answer_col][i], split, row) if has_answers else ([], [])
            if texts:
                start, text = starts[0], texts[0]
                if not isinstance(start, int) or not 0 <= start < len(context):
                    raise UsageError(f"row {row} of the {split} data: answer_start {start} is outside its context "
                                     f"of {len(context)} characters: it must be the answer's character offset")
                if context[start:start + len(text)] != text:
                    raise UsageError(f"row {row} of the {split} data: the answer {text!r} is not at answer_start "
                                     f"{start} of the context (which reads {context[start:start + len(text)]!r} "
                                     "there): fix the offset or the text")
            ids = examples["id"][i] if "id" in examples else row
            out["id"].append(str(ids))
            out["question"].append(question.lstrip())
            out["context"].append(context)
            out["answer_texts"].append([str(t) for t in texts])
            out["answer_starts"].append([int(s) for s in starts])
        out["question"], out["question_tokens"], out["question_cut"] = cut_questions(
            out["question"], tokenizer, data_args.max_question_length)
        return out

    return dataset.map(read, batched=True, with_indices=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc=f"reading the {split} questions")


def load_tokenizer(model_args):
    """The tokenizer of the run, which must be a fast one (it gives the character offsets)."""
    tokenizer = loading.load_tokenizer(model_args)
    if not tokenizer.is_fast:
        raise UsageError(f"{type(tokenizer).__name__} is not a fast tokenizer: question answering maps tokens back "
                         "to the context by character offsets, which only fast tokenizers give; use a tokenizer "
                         "with a tokenizer.json (and drop --use_fast_tokenizer false)")
    return tokenizer


def window_length(max_seq_length, doc_stride, tokenizer, config, logger):
    """Tokens per window: `max_seq_length`, lowered (with a warning) to the tokenizer's max length
    and the model's positions; more than `doc_stride`, the tokens two windows share."""
    if max_seq_length > tokenizer.model_max_length:
        logger.warning("--max_seq_length %d is more than the tokenizer's %d: using %d", max_seq_length,
                       tokenizer.model_max_length, tokenizer.model_max_length)
        max_seq_length = tokenizer.model_max_length
    seq_length = loading.fit_length(max_seq_length, loading.max_positions(config), "max_seq_length", logger)
    if doc_stride >= seq_length:
        raise UsageError(f"--doc_stride {doc_stride} must be less than the window of {seq_length} tokens "
                         "(--max_seq_length, lowered to the model's positions)")
    return seq_length


# ----------------------------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------------------------
class Window(NamedTuple):
    """One window of a (question, context) pair: `pair` its index among the pairs, `context_mask`
    [tokens] where the context's tokens are, `offsets` [tokens, 2] their character offsets into the
    context (NO_CONTEXT elsewhere), `null` the token that stands for "no answer"."""
    pair: int
    context_mask: np.ndarray
    offsets: np.ndarray
    null: int


def null_index(input_ids, attention_mask, cls_token_id):
    """The token that stands for "no answer": the CLS token, else the first real token (a tokenizer without CLS)."""
    if cls_token_id is not None:
        hits = np.flatnonzero(np.asarray(input_ids) == cls_token_id)
        if len(hits):
            return int(hits[0])
    return int(np.flatnonzero(np.asarray(attention_mask))[0])


def cut_windows(tokenizer, questions, contexts, seq_length, doc_stride):
    """(model inputs, windows) of (question, context) pairs: each window holds the whole question
    and a part of the context, consecutive parts sharing `doc_stride` tokens, padded to
    `seq_length`. The inputs are the tokenizer's columns (input_ids, attention_mask, ...: one row
    per window), `windows` a `Window` per row. A fast tokenizer (offsets) is needed."""
    pad_on_right = tokenizer.padding_side == "right"
    first, second = (questions, contexts) if pad_on_right else (contexts, questions)
    encoded = tokenizer(first, second, truncation="only_second" if pad_on_right else "only_first",
                        max_length=seq_length, stride=doc_stride, return_overflowing_tokens=True,
                        return_offsets_mapping=True, padding="max_length")
    pairs = encoded.pop("overflow_to_sample_mapping")
    offset_mapping = encoded.pop("offset_mapping")
    context_id = 1 if pad_on_right else 0
    windows = []
    for row, pair in enumerate(pairs):
        context_mask = np.array([s == context_id for s in encoded.sequence_ids(row)])
        offsets = np.array(offset_mapping[row], np.int64)
        offsets[~context_mask] = NO_CONTEXT
        null = null_index(encoded["input_ids"][row], encoded["attention_mask"][row], tokenizer.cls_token_id)
        windows.append(Window(pair, context_mask, offsets, null))
    return encoded, windows


def check_windows(examples, split, seq_length, doc_stride, special_tokens):
    """Each window must hold the whole (possibly cut) question and more context than the windows share."""
    lengths = np.asarray(examples["question_tokens"])
    room = seq_length - lengths - special_tokens
    worst = int(np.argmin(room))
    if room[worst] <= doc_stride:
        needed = lengths[worst] + special_tokens + doc_stride + 1
        raise UsageError(f"row {worst} of the {split} data: its question takes {lengths[worst]} tokens, leaving "
                         f"{max(room[worst], 0)} of --max_seq_length {seq_length} for the context, not more than "
                         f"--doc_stride {doc_stride}: raise --max_seq_length to {needed} or more, or lower "
                         "--doc_stride or --max_question_length")


def report_cut_questions(examples, split, max_tokens):
    """Warn once per split about the questions `cut_questions` cut: how many, and the first."""
    cut = np.flatnonzero(examples["question_cut"])
    if len(cut):
        logging.getLogger(__name__).warning(
            "%s: %d question%s longer than --max_question_length %d tokens cut to it (the first: row %d)", split,
            len(cut), "s" if len(cut) > 1 else "", max_tokens, cut[0])


def answer_tokens(offsets, context_mask, start_char, end_char):
    """(first token, last token) of the span [start_char, end_char) inside a window, or None when
    the window's context does not hold all of it."""
    context = np.flatnonzero(context_mask)
    if offsets[context[0]][0] > start_char or offsets[context[-1]][1] < end_char:
        return None
    first = context[np.flatnonzero(offsets[context, 0] <= start_char)[-1]]
    last = context[np.flatnonzero(offsets[context, 1] >= end_char)[0]]
    return int(first), int(last)


def make_windows(examples, tokenizer, seq_length, doc_stride, data_args):
    """Fixed-length windows: the model inputs; start_positions / end_positions (the answer's first
    and last tokens, or null_index where the window lacks the first answer or there is none);
    example_index; offsets (the [tokens, 2] character offsets into the context, NO_CONTEXT
    elsewhere, flattened) and null_index."""
    def tokenize(batch, indices):
        encoded, windows = cut_windows(tokenizer, batch["question"], batch["context"], seq_length, doc_stride)
        out = {"start_positions": [], "end_positions": [], "example_index": [], "offsets": [], "null_index": []}
        for window in windows:
            texts, starts = batch["answer_texts"][window.pair], batch["answer_starts"][window.pair]
            span = answer_tokens(window.offsets, window.context_mask, starts[0], starts[0] + len(texts[0])) \
                if texts else None
            start, end = span or (window.null, window.null)
            out["start_positions"].append(start)
            out["end_positions"].append(end)
            out["example_index"].append(indices[window.pair])
            out["offsets"].append(window.offsets.reshape(-1).tolist())  # flat: a fixed-length column
            out["null_index"].append(window.null)
        return {**encoded, **out}

    return examples.map(tokenize, batched=True, with_indices=True, num_proc=data_args.preprocessing_num_workers,
                        remove_columns=examples.column_names, load_from_cache_file=not data_args.overwrite_cache,
                        desc="cutting windows")


class Features(NamedTuple):
    """A split ready for the steps: `examples` as `read_examples` gives them; `arrays` the windows'
    model inputs and start / end positions (`utils.data.arrow_columns.to_arrays`), `size` windows; for evaluation
    and prediction `windows`, what post-processing reads of them on the host (example_index, offsets
    [windows, tokens, 2], null_index), and `references` ({id: answer texts}, None without answers)."""
    examples: object
    arrays: dict
    size: int
    windows: Optional[dict] = None
    references: Optional[dict] = None


def prepare_split(dataset, split, data_args, tokenizer, seq_length, has_answers):
    """The `Features` of a split: its examples read and checked, each cut into windows of
    `seq_length` tokens. Examples, not windows, were cut to --max_*_samples: every kept example is
    scored on all of its context. A validation set without answers (unless SQuAD v2.0) fails."""
    examples = read_examples(dataset, split, data_args, tokenizer, has_answers)
    if split != "train":  # predictions and references are keyed by id
        check_unique_ids(examples["id"], split)
    report_cut_questions(examples, split, data_args.max_question_length)
    special_tokens = tokenizer.num_special_tokens_to_add(pair=True)
    check_windows(examples, split, seq_length, data_args.doc_stride, special_tokens)
    references = None
    if split != "train" and has_answers:
        references = dict(zip(examples["id"], examples["answer_texts"]))
        unanswered = [i for i, texts in enumerate(examples["answer_texts"]) if not texts]
        if unanswered and not data_args.version_2_with_negative:
            raise UsageError(f"row {unanswered[0]} of the {split} data has no answer ({len(unanswered)} rows in "
                             "all): pass --version_2_with_negative for SQuAD v2.0-style data")
    dataset = make_windows(examples, tokenizer, seq_length, data_args.doc_stride, data_args)
    inputs = [name for name in MODEL_INPUTS if name in dataset.features]
    arrays = arrow_columns.to_arrays(dataset, inputs + ["start_positions", "end_positions"])
    if split == "train":
        return Features(examples, arrays, len(dataset))
    windows = {name: column[:] for name, column in
               arrow_columns.to_arrays(dataset, ["example_index", "offsets", "null_index"]).items()}
    windows["offsets"] = windows["offsets"].reshape(len(dataset), seq_length, 2)
    return Features(examples, arrays, len(dataset), windows, references)


def model_inputs(model, arrays):
    """The inputs among `arrays` that `model` takes (DistilBERT and others take no token_type_ids,
    which BERT-style tokenizers make)."""
    taken = inspect.signature(model.__call__).parameters
    return [name for name in MODEL_INPUTS if name in arrays and name in taken]


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def span_loss(start_logits, end_logits, start_positions, end_positions, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}): per window the mean of its start and end cross entropies,
    summed; "tokens" counts the windows (`example_weight`: 0 for eval padding rows)."""
    weights = jnp.ones(start_positions.shape, jnp.float32) if example_weight is None else example_weight
    start, windows = cross_entropy_sums(start_logits, start_positions, weights, label_smoothing)
    end, _ = cross_entropy_sums(end_logits, end_positions, weights, label_smoothing)
    loss = (start + end) / 2
    return loss, {"loss": loss, "tokens": windows}


# ----------------------------------------------------------------------------------------------
# Post-processing
# ----------------------------------------------------------------------------------------------
def window_spans(start_logits, end_logits, offsets, n_best_size, max_answer_length):
    """The candidate spans of one window: [(score, start logit, end logit, start char, end char)],
    of the `n_best_size` best start and end tokens; both tokens in the context (offsets not
    NO_CONTEXT), end not before start, at most `max_answer_length` tokens."""
    starts = np.argsort(start_logits, kind="stable")[::-1][:n_best_size]
    ends = np.argsort(end_logits, kind="stable")[::-1][:n_best_size]
    in_context = offsets[:, 0] != NO_CONTEXT
    s, e = np.meshgrid(starts, ends, indexing="ij")
    valid = in_context[s] & in_context[e] & (e >= s) & (e - s + 1 <= max_answer_length)
    s, e = s[valid], e[valid]
    return [(float(start_logits[i] + end_logits[j]), float(start_logits[i]), float(end_logits[j]),
             int(offsets[i, 0]), int(offsets[j, 1])) for i, j in zip(s, e)]


def best_answers(examples, feature_examples, start_logits, end_logits, offsets, null_indices, n_best_size=20,
                 max_answer_length=30, with_negative=False, null_score_diff_threshold=0.0):
    """(answers, n-best lists, null odds) per example id, from the logits of all its windows.

    `examples` is a list of (id, context); `feature_examples[f]` the example index of window f,
    `start_logits` / `end_logits` `[windows, tokens]`, `offsets` `[windows, tokens, 2]` character
    offsets into the context (NO_CONTEXT outside it), `null_indices[f]` the token that stands for
    "no answer" in window f (its CLS token). An example's candidates are the spans of all its
    windows, its `n_best_size` best kept (score = start + end logit), with softmax probabilities
    over them; its answer is the best one's text. With `with_negative` (SQuAD v2.0), its null
    score is the lowest of its windows' (start + end logit at the null token); the answer is ""
    when the null score beats the best non-empty span's by more than `null_score_diff_threshold`,
    or when there is no non-empty span. Null odds (v2.0 only) are null score minus best span score
    (None without a span); an example without candidates (v1.1) answers "".
    """
    windows = collections.defaultdict(list)
    for feature, example in enumerate(feature_examples):
        windows[int(example)].append(feature)
    answers, nbest, null_odds = {}, {}, {}
    for index, (example_id, context) in enumerate(examples):
        candidates, null = [], None
        for f in windows[index]:
            candidates += window_spans(start_logits[f], end_logits[f], offsets[f], n_best_size, max_answer_length)
            k = int(null_indices[f])
            score = float(start_logits[f, k] + end_logits[f, k])
            if null is None or score < null[0]:
                null = (score, float(start_logits[f, k]), float(end_logits[f, k]), 0, 0)
        candidates.sort(key=lambda c: c[0], reverse=True)
        kept = candidates[:n_best_size]
        if with_negative and null is not None:
            kept = sorted(kept + [null], key=lambda c: c[0], reverse=True)
        entries = []
        if kept:
            scores = np.array([c[0] for c in kept])
            probabilities = np.exp(scores - scores.max())
            probabilities /= probabilities.sum()
            for (score, start, end, first, last), probability in zip(kept, probabilities):
                entries.append({"text": context[first:last], "score": score, "probability": float(probability),
                                "start_logit": start, "end_logit": end, "offsets": [first, last]})
        nbest[example_id] = entries
        spans = [entry for entry in entries if entry["text"]]
        if not with_negative:
            answers[example_id] = spans[0]["text"] if spans else ""
            continue
        if not spans or null is None:
            answers[example_id], null_odds[example_id] = "", None
            continue
        difference = null[0] - spans[0]["start_logit"] - spans[0]["end_logit"]
        null_odds[example_id] = difference
        answers[example_id] = "" if difference > null_score_diff_threshold else spans[0]["text"]
    return answers, nbest, null_odds


def predicted_answers(features, logits, data_args):
    """(answers, n-best lists, null odds) per example id of a split's `Features`, from the logits
    [windows, tokens, start / end] of its windows, with the run's n-best size, answer length and
    SQuAD v2.0 settings (`best_answers`)."""
    return best_answers(list(zip(features.examples["id"], features.examples["context"])),
                        features.windows["example_index"], logits[..., 0], logits[..., 1],
                        features.windows["offsets"], features.windows["null_index"], data_args.n_best_size,
                        data_args.max_answer_length, data_args.version_2_with_negative,
                        data_args.null_score_diff_threshold)


# ----------------------------------------------------------------------------------------------
# SQuAD metrics (the official evaluation scripts' definitions)
# ----------------------------------------------------------------------------------------------
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text):
    """Lower case, punctuation removed, articles (a, an, the) removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction, truth):
    return float(normalize_answer(prediction) == normalize_answer(truth))


def token_f1(prediction, truth):
    """F1 of the normalised tokens in common. Two empty answers agree (v2.0's rule: v1.1 has no empty truth)."""
    predicted, true = normalize_answer(prediction).split(), normalize_answer(truth).split()
    if not predicted or not true:
        return float(predicted == true)
    common = sum((collections.Counter(predicted) & collections.Counter(true)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(true)
    return 2 * precision * recall / (precision + recall)


def squad_v1(predictions, references):
    """{"exact_match", "f1"} in percent: per question the best over its answers, averaged over
    `references` ({id: [answer texts]}, each with one at least); `predictions` {id: text}."""
    exact = f1 = 0.0
    for example_id, truths in references.items():
        prediction = predictions[example_id]
        exact += max(exact_match(prediction, truth) for truth in truths)
        # v1.1's F1 has no tokens in common when either side normalises to nothing ("The"), even both.
        f1 += max(token_f1(prediction, truth) if normalize_answer(prediction) and normalize_answer(truth) else 0.0
                  for truth in truths)
    return {"exact_match": 100.0 * exact / len(references), "f1": 100.0 * f1 / len(references)}


def squad_v2(predictions, references, no_answer_probabilities=None, no_answer_threshold=1.0):
    """The SQuAD v2.0 scores in percent: exact, f1, total; HasAns_* and NoAns_* over the questions
    with and without an answer (where there are any); best_exact / best_f1 and their thresholds.

    `references` {id: [answer texts]} ([] or only empty texts: no answer). A prediction counts as
    "no answer" where its `no_answer_probabilities` entry exceeds `no_answer_threshold`; without
    them every probability is 0, as the classic Hugging Face scripts pass, so the best_* entries
    are the best score of predicting "no answer" for the first questions in the references'
    order and the prediction for the rest.
    """
    probabilities = no_answer_probabilities or {example_id: 0.0 for example_id in references}
    exact, f1, has_answer = {}, {}, {}
    for example_id, truths in references.items():
        truths = [truth for truth in truths if normalize_answer(truth)] or [""]
        has_answer[example_id] = truths != [""]
        prediction = predictions[example_id]
        exact[example_id] = max(exact_match(prediction, truth) for truth in truths)
        f1[example_id] = max(token_f1(prediction, truth) for truth in truths)

    def thresholded(scores):
        return {example_id: float(not has_answer[example_id]) if probabilities[example_id] > no_answer_threshold
                else score for example_id, score in scores.items()}

    def mean(scores, ids):
        return 100.0 * sum(scores[i] for i in ids) / len(ids)

    exact, f1 = thresholded(exact), thresholded(f1)
    ids = list(references)
    results = {"exact": mean(exact, ids), "f1": mean(f1, ids), "total": len(ids)}
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        subset = [i for i in ids if has_answer[i] == wanted]
        if subset:
            results.update({f"{name}_exact": mean(exact, subset), f"{name}_f1": mean(f1, subset),
                            f"{name}_total": len(subset)})
    for name, scores in (("exact", exact), ("f1", f1)):
        results[f"best_{name}"], results[f"best_{name}_thresh"] = _best_threshold(
            predictions, scores, probabilities, has_answer)
    return results


def _best_threshold(predictions, scores, probabilities, has_answer):
    """(best score in percent, its threshold) of "no answer where the probability exceeds the
    threshold", over the thresholds the probabilities give, the official script's way: start from
    "no answer" everywhere and take the questions back one by one in order of probability."""
    current = best = sum(not has for has in has_answer.values())
    threshold = 0.0
    for example_id in sorted(scores, key=lambda i: probabilities[i]):
        if has_answer[example_id]:
            current += scores[example_id]
        elif predictions[example_id]:
            current -= 1
        if current > best:
            best, threshold = current, probabilities[example_id]
    return 100.0 * best / len(scores), threshold


def eval_metrics(means, features, answers, with_negative):
    """A split's results: the eval step's mean loss over the windows ("features": how many), the
    SQuAD v1.1 (or, `with_negative`, v2.0) scores of `answers` against the split's references, and
    "samples", the examples scored."""
    scores = squad_v2(answers, features.references) if with_negative else squad_v1(answers, features.references)
    loss = {name: value for name, value in means.items() if name != "tokens"}
    return {**loss, "features": means["tokens"], **scores, "samples": len(features.examples)}


# ----------------------------------------------------------------------------------------------
# Prediction files
# ----------------------------------------------------------------------------------------------
def write_predictions(run, prefix, answers, nbest, null_odds, with_negative):
    """`{prefix}_predictions.json` (the answer per example id), `{prefix}_nbest_predictions.json` and,
    SQuAD v2.0 (`with_negative`), `{prefix}_null_odds.json`, through the run's directory."""
    run.write_json(f"{prefix}_predictions.json", answers)
    run.write_json(f"{prefix}_nbest_predictions.json", nbest)
    if with_negative:
        run.write_json(f"{prefix}_null_odds.json", null_odds)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class QuestionAnswerer(Predictor):
    """run_qa.py's predict path for one question and its context: the same windows (`window_length`,
    `cut_windows`) and post-processing (`best_answers`) with the run's n-best size, answer length and
    SQuAD v2.0 settings. `details` is the n-best list (text, probability, score, character offsets
    into the context); the answer is "" when the model says the context does not answer the question
    (v2.0)."""

    auto_class = "FlaxAutoModelForQuestionAnswering"
    MAX_WINDOWS = 8  # windows read per request (a longer context is cut, and the page says so)

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.doc_stride = run_args["doc_stride"]
        self.seq_length = window_length(run_args["max_seq_length"], self.doc_stride, self.tokenizer, self.config,
                                        logging.getLogger(__name__))
        self.settings = dict(n_best_size=run_args["n_best_size"], max_answer_length=run_args["max_answer_length"],
                             with_negative=run_args["version_2_with_negative"],
                             null_score_diff_threshold=run_args["null_score_diff_threshold"])
        self.window_buckets = buckets(self.MAX_WINDOWS, smallest=1)
        accepted = inspect.signature(self.model.__call__).parameters
        self.inputs = [name for name in MODEL_INPUTS if name in accepted]
        self._outputs = jax.jit(self.window_outputs)

    def window_outputs(self, params, inputs):
        """The model's outputs for a batch of windows, one array (compiled once per window bucket):
        here [windows, tokens, start / end logits]."""
        outputs = self.model(**inputs, params=params)
        return jnp.stack([outputs.start_logits, outputs.end_logits], axis=-1).astype(jnp.float32)

    def read_windows(self, question, context, answer):
        """(windows, outputs): `question` and `context` cut into windows as run_qa.py cuts them (at
        most MAX_WINDOWS), and `window_outputs` of each; what was cut goes to `answer`'s notes."""
        require_text(question, "question")
        require_text(context, "context")
        # As `read_examples` reads them: left-stripped, cut to the run's --max_question_length (runs before it: whole).
        limit = self.run_args.get("max_question_length")
        (question,), (question_tokens,), (cut,) = cut_questions([question.lstrip()], self.tokenizer, limit)
        if cut:
            answer.notes.append(f"the question was cut to its first {limit} tokens, as the model was trained")
        room = self.seq_length - question_tokens - self.tokenizer.num_special_tokens_to_add(pair=True)
        if room <= self.doc_stride:
            raise BadInput(f"the question takes {question_tokens} tokens, leaving {max(room, 0)} of the model's "
                           f"{self.seq_length} for the context: ask a shorter question")
        encoded, windows = cut_windows(self.tokenizer, [question], [context], self.seq_length, self.doc_stride)
        if len(windows) > self.MAX_WINDOWS:
            read = int(windows[self.MAX_WINDOWS - 1].offsets.max())
            answer.notes.append(f"the context needs {len(windows)} windows of {self.seq_length} tokens; the model "
                                f"reads the first {self.MAX_WINDOWS}, its first {read} characters")
            windows = windows[:self.MAX_WINDOWS]
        size = bucket_for(len(windows), self.window_buckets)
        inputs = {}
        for name in self.inputs:
            rows = np.zeros((size, self.seq_length), np.int32)
            rows[:len(windows)] = np.asarray(encoded[name][:len(windows)])
            inputs[name] = rows
        return windows, np.asarray(self._outputs(self.params, inputs))[:len(windows)]

    def predict(self, question, context):
        answer = Answer()
        windows, logits = self.read_windows(question, context, answer)
        answers, nbest, _ = best_answers(
            [("request", context)], [0] * len(windows), logits[..., 0], logits[..., 1],
            np.stack([w.offsets for w in windows]), [w.null for w in windows], **self.settings)
        answer.text, answer.details = answers["request"], nbest["request"]
        return answer

    def warm_up(self):
        for size in self.window_buckets:
            ids = np.zeros((size, self.seq_length), np.int32)
            jax.block_until_ready(self._outputs(self.params, {name: ids for name in self.inputs}))


PREDICTOR = QuestionAnswerer


def highlighted(context, first, last):
    """`context` as markdown with characters [first, last) (the answer) highlighted."""
    return (escape_markdown(context[:first]) + f":orange-background[{escape_markdown(context[first:last])}]"
            + escape_markdown(context[last:]))


def demo_form(st, predictor):
    with st.form("request"):
        question = st.text_input("Question", key="text")
        context = st.text_area("Context", height=150, key="context")
        submitted = st.form_submit_button("Answer")
    if submitted:
        def show():
            answer = predictor(question, context)
            show_answer(st, answer)
            with st.container(key="context_shown"):
                if answer.text:  # the best span with text (tasks.question_answering.best_answers)
                    st.markdown(highlighted(context, *next(e["offsets"] for e in answer.details if e["text"])))
                else:
                    st.markdown("The model finds no answer to this question in the context.")
            st.table({"answer": [escape_markdown(entry["text"]) or "(no answer)" for entry in answer.details],
                      "probability": [f"{entry['probability']:.3f}" for entry in answer.details],
                      "score": [f"{entry['score']:.3f}" for entry in answer.details]})
        return show
