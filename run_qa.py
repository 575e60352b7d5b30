#!/usr/bin/env python
"""Fine-tune a Flax encoder (BERT, RoBERTa, ELECTRA, BigBird, ...) for extractive question answering: SQuAD v1.1 / v2.0.

    python run_qa.py configs/qa_tiny.json
    python run_qa.py configs/qa_v2_tiny.json --null_score_diff_threshold 1.5   # flags override the file

Each example is a question, a context and the answer's text and character offset in it. Long
contexts are cut into windows of --max_seq_length tokens overlapping by --doc_stride; a window is
trained to point at the answer's first and last tokens, or at its CLS token when the answer is not
inside it (or, SQuAD v2.0, the question has none). At evaluation every window of an example is
scored and its best span over all of them is the answer (`utils/qa.py`), scored with the SQuAD
metrics, in percent as the official scripts do. One train / eval loop, each step defined once
for both layouts (`--sharding dp` / `fsdp`); everything mechanical lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.perf.seconds_since_start)

import ast
import inspect
import json
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

import jax.numpy as jnp
import numpy as np
from transformers import FlaxAutoModelForQuestionAnswering

from tasks import question_answering as qa
from tasks.question_answering import TASK
from utils import arrow_columns, dataset_loading, file_formats
from utils.args import BaseDataArguments, ModelArguments, TrainingArguments, parse_args
from utils.errors import UsageError, run_main
from utils.layout import make_layout
from utils.loop import InMemoryData
from utils.models import fit_config_to_tokenizer, fit_length, load_config, load_model, \
    load_tokenizer, max_positions
from utils.run import SPLIT_FLAGS, check_before_work, needed_splits, set_up, training_plan
from utils.steps import cross_entropy_sums
from utils.training import TrainingRun, make_steps

FILE_FORMATS = ("json", "csv")
PREFIXES = {"validation": "eval", "test": "predict"}

@dataclass
class DataTrainingArguments(BaseDataArguments):
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file (json, jsonl or csv), also compressed (.gz, .bz2, .xz); "
                                        "without answers it gets predictions only."})
    question_column_name: str = field(default="question", metadata={"help": "Column with the questions."})
    context_column_name: str = field(default="context", metadata={"help": "Column with the contexts."})
    answer_column_name: str = field(
        default="answers", metadata={"help": "Column with the answers: {text: [...], answer_start: [...]} (in csv "
                                             "files as JSON)."})
    max_seq_length: int = field(
        default=384, metadata={"help": "Tokens per window (question, context part and special tokens); at most the "
                                       "tokenizer's max length and the model's positions."})
    doc_stride: int = field(default=128, metadata={"help": "Tokens of context two consecutive windows share."})
    max_predict_samples: Optional[int] = field(
        default=None, metadata={"help": "Truncate the test set (examples: every window of each kept one)."})
    version_2_with_negative: bool = field(
        default=False, metadata={"help": "SQuAD v2.0: some questions have no answer (scored with the v2.0 metric). "
                                         "SQuAD scores are percentages, 0-100, as in the classic scripts."})
    null_score_diff_threshold: float = field(
        default=0.0, metadata={"help": "With --version_2_with_negative: answer nothing when the null score beats the "
                                       "best span's by more than this."})
    n_best_size: int = field(
        default=20, metadata={"help": "Best start and end tokens per window combined into spans, and spans kept per "
                                      "example (the n-best file)."})
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer, in tokens."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("max_seq_length", "n_best_size", "max_answer_length"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.doc_stride < self.max_seq_length:
            raise UsageError(f"--doc_stride {self.doc_stride} must be at least 0 and less than --max_seq_length "
                             f"{self.max_seq_length}: it is the overlap of two windows (e.g. 128 of 384)")

# ----------------------------------------------------------------------------------------------
# Data: SQuAD files, answers, windows
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
    for item in items:
        if "paragraphs" not in item:
            rows.append(item)
            continue
        for paragraph in item["paragraphs"]:
            for question in paragraph.get("qas", []):
                answers = question.get("answers", [])
                rows.append({"id": str(question.get("id", len(rows))), "title": item.get("title", ""),
                             "context": paragraph["context"], "question": question["question"],
                             "answers": {"text": [a["text"] for a in answers],
                                         "answer_start": [a["answer_start"] for a in answers]}})
    if not rows:
        raise UsageError(f"data file {path} holds no questions")
    return rows

def load_qa_splits(data_args, files, cache_dir):
    """{split: Dataset}: a hub dataset, or local files (SQuAD documents read here, the rest by `datasets`)."""
    import datasets

    if data_args.dataset_name:
        return dataset_loading.load_splits(data_args, files, cache_dir, allowed=FILE_FORMATS)
    documents = {split: path for split, path in files.items() if path and is_squad_document(path)}
    others = {split: path for split, path in files.items() if path and split not in documents}
    loaded = dict(dataset_loading.load_splits(data_args, others, cache_dir, allowed=FILE_FORMATS)) if others else {}
    for split, path in documents.items():
        loaded[split] = datasets.Dataset.from_list(read_squad_document(path))
    return loaded

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

def read_examples(dataset, split, data_args, tokenizer, has_answers):
    """The rows as id, question (left-stripped: some SQuAD questions start with spaces the window
    would waste), context, answer_texts, answer_starts, question_tokens; the first answer of each
    row checked against its context (the one trained on)."""
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
        out["question_tokens"] = [len(ids) for ids in tokenizer(out["question"], add_special_tokens=False)["input_ids"]]
        return out

    return dataset.map(read, batched=True, with_indices=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc=f"reading the {split} questions")

def check_windows(examples, split, seq_length, doc_stride, special_tokens):
    """Each window must hold the whole question and more context than the windows share."""
    lengths = np.asarray(examples["question_tokens"])
    room = seq_length - lengths - special_tokens
    worst = int(np.argmin(room))
    if room[worst] <= doc_stride:
        needed = lengths[worst] + special_tokens + doc_stride + 1
        raise UsageError(f"row {worst} of the {split} data: its question takes {lengths[worst]} tokens, leaving "
                         f"{room[worst]} of --max_seq_length {seq_length} for the context, not more than "
                         f"--doc_stride {doc_stride}: raise --max_seq_length to {needed} or more, or lower --doc_stride")

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
    example_index; offsets (the [tokens, 2] character offsets into the context, qa.NO_CONTEXT
    elsewhere, flattened) and null_index."""
    def tokenize(batch, indices):
        encoded, windows = qa.cut_windows(tokenizer, batch["question"], batch["context"], seq_length, doc_stride)
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

def load_qa_tokenizer(model_args):
    tokenizer = load_tokenizer(model_args)
    if not tokenizer.is_fast:
        raise UsageError(f"{type(tokenizer).__name__} is not a fast tokenizer: question answering maps tokens back "
                         "to the context by character offsets, which only fast tokenizers give; use a tokenizer "
                         "with a tokenizer.json (and drop --use_fast_tokenizer false)")
    return tokenizer

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
# Main
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    preflight = check_before_work(training_args, data_args, TASK, files, allowed=FILE_FORMATS, model_args=model_args)
    splits = needed_splits(training_args)
    logger, is_main = set_up(training_args)
    layout = make_layout(training_args.sharding, training_args.fsdp_size, training_args.compile_only)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data, windows
    # ------------------------------------------------------------------------------------------
    config = load_config(model_args, task="question-answering")
    config.num_labels = 2  # a start and an end logit per token
    tokenizer = load_qa_tokenizer(model_args)
    config = fit_config_to_tokenizer(config, tokenizer, model_args)
    raw = load_qa_splits(data_args, {s: files[s] for s in splits}, model_args.cache_dir)
    columns = {}
    for split in splits:
        if split not in raw:
            phase = SPLIT_FLAGS[split][0]
            raise UsageError(f"--{phase} needs a {split!r} split, but dataset {data_args.dataset_name!r} has only "
                             f"{', '.join(raw)}: drop --{phase}, or pass local files instead of --dataset_name")
        columns[split] = raw[split].column_names
    needed = (("question_column_name", data_args.question_column_name),
              ("context_column_name", data_args.context_column_name))
    file_formats.require_columns(columns, needed)
    answered = {"train", "validation"} & set(splits)  # a test set may come without answers
    file_formats.require_columns({split: columns[split] for split in answered},
                         (("answer_column_name", data_args.answer_column_name),))
    has_answers = {split: data_args.answer_column_name in columns[split] for split in splits}

    seq_length = data_args.max_seq_length
    if seq_length > tokenizer.model_max_length:
        logger.warning("--max_seq_length %d is more than the tokenizer's %d: using %d", seq_length,
                       tokenizer.model_max_length, tokenizer.model_max_length)
        seq_length = tokenizer.model_max_length
    seq_length = fit_length(seq_length, max_positions(config), "max_seq_length", logger)
    if data_args.doc_stride >= seq_length:
        raise UsageError(f"--doc_stride {data_args.doc_stride} must be less than the window of {seq_length} tokens "
                         "(--max_seq_length, lowered to the model's positions)")
    max_samples = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
                   "test": data_args.max_predict_samples}
    examples, arrays, sizes, windows, references = {}, {}, {}, {}, {}
    for split in splits:
        # Examples, not windows, are cut: every kept example is scored on all of its context.
        examples[split] = read_examples(dataset_loading.take(raw[split], max_samples[split]), split, data_args, tokenizer,
                                        has_answers[split])
        check_windows(examples[split], split, seq_length, data_args.doc_stride,
                      tokenizer.num_special_tokens_to_add(pair=True))
        if split != "train" and has_answers[split]:
            references[split] = dict(zip(examples[split]["id"], examples[split]["answer_texts"]))
            unanswered = [i for i, texts in enumerate(examples[split]["answer_texts"]) if not texts]
            if unanswered and not data_args.version_2_with_negative:
                raise UsageError(f"row {unanswered[0]} of the {split} data has no answer ({len(unanswered)} rows in "
                                 "all): pass --version_2_with_negative for SQuAD v2.0-style data")
        dataset = make_windows(examples[split], tokenizer, seq_length, data_args.doc_stride, data_args)
        model_inputs = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in dataset.features]
        arrays[split] = arrow_columns.to_arrays(dataset, model_inputs + ["start_positions", "end_positions"])
        sizes[split] = len(dataset)
        if split != "train":  # post-processed on the host, example by example
            windows[split] = {name: column[:] for name, column in
                              arrow_columns.to_arrays(dataset, ["example_index", "offsets", "null_index"]).items()}
            windows[split]["offsets"] = windows[split]["offsets"].reshape(sizes[split], seq_length, 2)
        logger.info("%s: %d examples in %d windows of %d tokens", split, len(examples[split]), sizes[split],
                    seq_length)
    # Before the model: too few examples for one batch fails now.
    plan = training_plan(training_args, sizes["train"] if training_args.do_train else None)
    train_data = InMemoryData(arrays["train"], sizes["train"]) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForQuestionAnswering, model_args, config,
                               training_args.seed, layout)
    # DistilBERT and others take no token_type_ids, which BERT-style tokenizers make.
    accepted = [name for name in model_inputs if name in inspect.signature(model.__call__).parameters]

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def logits_of(params, batch, dropout_rng=None, train=False):
        outputs = model(**{k: batch[k] for k in accepted}, params=params, dropout_rng=dropout_rng, train=train)
        return outputs.start_logits, outputs.end_logits

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        start_logits, end_logits = logits_of(params, batch, dropout_rng, train)
        return span_loss(start_logits, end_logits, batch["start_positions"], batch["end_positions"],
                         batch.get("example_weight"), label_smoothing)

    def predict_fn(params, batch):
        return jnp.stack(logits_of(params, batch), axis=-1).astype(jnp.float32)  # [rows, tokens, start / end]

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, predict_fn=predict_fn)

    def evaluate(params, split):
        """(loss over the windows and the SQuAD scores over every example, or None without answers;
        the answers, n-best lists and null odds per example id)."""
        metrics, rows = steps.evaluate(params, arrays[split], sizes[split])
        logits = np.stack(rows)
        found = qa.best_answers(list(zip(examples[split]["id"], examples[split]["context"])),
                                windows[split]["example_index"], logits[..., 0], logits[..., 1],
                                windows[split]["offsets"], windows[split]["null_index"], data_args.n_best_size,
                                data_args.max_answer_length, data_args.version_2_with_negative,
                                data_args.null_score_diff_threshold)
        if split not in references:
            return None, found
        answers = found[0]
        if data_args.version_2_with_negative:
            scores = qa.squad_v2(answers, references[split])
        else:
            scores = qa.squad_v1(answers, references[split])
        metrics["features"] = metrics.pop("tokens")
        return {**metrics, **scores, "samples": len(examples[split])}, found

    def report(split):
        metrics, (answers, nbest, null_odds) = evaluate(state.params, split)
        prefix = PREFIXES[split]
        if metrics is not None:
            run.report(prefix, metrics)
        run.write_json(f"{prefix}_predictions.json", answers)
        run.write_json(f"{prefix}_nbest_predictions.json", nbest)
        if data_args.version_2_with_negative:
            run.write_json(f"{prefix}_null_odds.json", null_odds)

    # --compile_only: the TPU plan of each step this run calls, on its first batch; the run ends there.
    evaluated = "validation" if "validation" in arrays else "test"
    steps.report_plan(training_args, state, eval_step=(arrays.get(evaluated), sizes.get(evaluated)))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(seq_length):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                report("validation")
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        report("validation")
    if training_args.do_predict:
        report("test")
    run.finish()

if __name__ == "__main__":
    sys.exit(run_main(main))
