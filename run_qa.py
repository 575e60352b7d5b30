#!/usr/bin/env python
"""Fine-tune a Flax encoder (BERT, RoBERTa, ELECTRA, BigBird, ...) for extractive question answering: SQuAD v1.1 / v2.0,
or long documents with answer categories (Natural Questions style).

    python run_qa.py configs/qa_tiny.json
    python run_qa.py configs/qa_v2_tiny.json --null_score_diff_threshold 1.5   # flags override the file
    python run_qa.py configs/long_qa_tiny.json   # BigBird, block-sparse attention, answer categories

Each example is a question, a context and the answer's text and character offset in it. Long
contexts are cut into windows of --max_seq_length tokens overlapping by --doc_stride; a window is
trained to point at the answer's first and last tokens, or at its CLS token when the answer is not
inside it (or, SQuAD v2.0, the question has none). At evaluation every window of an example is
scored and its best span over all of them is the answer, scored with the SQuAD metrics, in percent
as the official scripts do: the task's knowledge (SQuAD files, windows, loss, post-processing,
scores, prediction files) lives in `tasks/question_answering.py`. With --answer_categories each
answer also has a category (null / short / long / yes / no: Natural Questions), a small head on the
model predicts each window's, and an example's category and answer come from its windows
(`tasks/long_qa.py`); BigBird reads long windows with block-sparse attention (--attention_type).
One train / eval loop, each step defined once for both layouts (`--sharding dp` / `fsdp`);
everything mechanical lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

import jax.numpy as jnp
import numpy as np
from transformers import FlaxAutoModelForQuestionAnswering

from tasks import long_qa
from tasks import question_answering as qa
from utils.base.arguments import BaseDataArguments, ModelArguments, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import fit_config_to_tokenizer, load_config, load_model
from utils.run.loop import InMemoryData
from utils.run.preflight import check_before_work, needed_splits, phase_datasets
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


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
    max_question_length: int = field(
        default=64, metadata={"help": "Tokens a question keeps: longer ones are cut (counted in a warning), as BERT's "
                                      "max_query_length does."})
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
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer, in tokens (with "
                                                                     "--answer_categories: short answers)."})
    answer_categories: bool = field(
        default=False, metadata={"help": "Natural Questions-style answers of category null / short / long / yes / no "
                                         "(answers [{category, text, answer_start}], or the simplified NQ jsonl), "
                                         "with a head predicting each window's category (saved with the model); "
                                         "scored by exact match and category accuracy."})
    keep_null_windows: float = field(
        default=1.0, metadata={"help": "With --answer_categories: the fraction of the training windows without an "
                                       "answer kept (drawn with --seed; the BigBird research project keeps 0.4): "
                                       "shorter epochs. Each kept one weighs 1 / this in the loss, so the model "
                                       "still learns how rare an answer is."})
    max_long_answer_length: int = field(
        default=1024, metadata={"help": "With --answer_categories: longest long answer, in tokens."})
    attention_type: Optional[str] = field(
        default=None, metadata={"help": "BigBird: block_sparse or original_full (default: the model config's).",
                                "choices": ["block_sparse", "original_full"]})
    block_size: Optional[int] = field(
        default=None, metadata={"help": "BigBird: tokens per attention block; must divide --max_seq_length "
                                        "(default: the model config's)."})
    num_random_blocks: Optional[int] = field(
        default=None, metadata={"help": "BigBird: random blocks each block attends to (default: the model "
                                        "config's)."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("max_seq_length", "max_question_length", "n_best_size", "max_answer_length",
                     "max_long_answer_length"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.keep_null_windows <= 1:
            raise UsageError(f"--keep_null_windows {self.keep_null_windows} must be more than 0 and at most 1 (a "
                             "fraction of the training windows without an answer)")
        for name in ("block_size", "num_random_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < (1 if name == "block_size" else 0):
                raise UsageError(f"--{name} must be {'positive' if name == 'block_size' else 'at least 0'}, got "
                                 f"{getattr(self, name)}")
        if not 0 <= self.doc_stride < self.max_seq_length:
            raise UsageError(f"--doc_stride {self.doc_stride} must be at least 0 and less than --max_seq_length "
                             f"{self.max_seq_length}: it is the overlap of two windows (e.g. 128 of 384)")

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    # Its own task with --answer_categories: the demo serves its export with the category head.
    declared = (long_qa if data_args.answer_categories else qa).TASK
    preflight = check_before_work(declared, model_args, data_args, training_args)
    logger, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data, windows
    # ------------------------------------------------------------------------------------------
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    splits = needed_splits(training_args)
    config = load_config(model_args, task="question-answering")
    config.num_labels = 2  # a start and an end logit per token
    config = long_qa.set_attention(config, data_args.attention_type, data_args.block_size,
                                   data_args.num_random_blocks)
    tokenizer = qa.load_tokenizer(model_args)
    config = fit_config_to_tokenizer(config, tokenizer, model_args)
    if not model_args.model_name_or_path:
        config = long_qa.fit_question_end(config, tokenizer)
    # --max_*_samples keep whole examples: every kept one is scored on all of its context's windows.
    task = long_qa if data_args.answer_categories else qa  # how rows are read
    raw = phase_datasets(task.load_splits(data_args, {s: files[s] for s in splits}, model_args.cache_dir),
                         {split: split for split in splits}, data_args)
    has_answers = qa.check_columns(raw, data_args)
    seq_length = qa.window_length(data_args.max_seq_length, data_args.doc_stride, tokenizer, config, logger)
    long_qa.check_blocks(config, seq_length)
    features = {}
    for split in splits:
        if data_args.answer_categories:
            features[split] = long_qa.prepare_split(raw[split], split, data_args, tokenizer, seq_length,
                                                    has_answers[split], data_args.keep_null_windows, training_args.seed)
        else:
            features[split] = qa.prepare_split(raw[split], split, data_args, tokenizer, seq_length, has_answers[split])
        logger.info("%s: %d examples in %d windows of %d tokens", split, len(features[split].examples),
                    features[split].size, seq_length)
    # Before the model: too few examples for one batch fails now.
    plan = training_plan(training_args, features["train"].size if training_args.do_train else None)
    train_data = InMemoryData(features["train"].arrays, features["train"].size) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    # With LoRA, the category head (outside the stock model) trains in full beside the adapters
    model, params = load_model(FlaxAutoModelForQuestionAnswering, model_args, config, training_args.seed, layout,
                               added_groups=(long_qa.HEAD,) if data_args.answer_categories else ())
    if data_args.answer_categories:  # the category head's weights beside the model's (saved ones reloaded)
        params = long_qa.add_category_head(params, model, model_args, config, training_args.seed, layout)
        head = long_qa.category_head(config, model.dtype)
        long_qa.export_note(model)
    inputs = qa.model_inputs(model, features[splits[0]].arrays)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def logits_of(params, batch, dropout_rng=None, train=False):
        """(start logits, end logits) per token; with --answer_categories also the category logits per window."""
        model_inputs = {k: batch[k] for k in inputs}
        if data_args.answer_categories:
            return long_qa.answer_logits(model, head, params, model_inputs, dropout_rng, train)
        outputs = model(**model_inputs, params=params, dropout_rng=dropout_rng, train=train,
                        **long_qa.random_blocks_key(model, dropout_rng if train else None))
        return outputs.start_logits, outputs.end_logits

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        logits = logits_of(params, batch, dropout_rng, train)
        if data_args.answer_categories:
            return long_qa.loss(*logits, batch, label_smoothing)
        return qa.span_loss(*logits, batch["start_positions"], batch["end_positions"], batch.get("example_weight"),
                            label_smoothing)

    def predict_fn(params, batch):
        if data_args.answer_categories:
            return long_qa.window_outputs(*logits_of(params, batch))  # [rows, start, end and category logits]
        return jnp.stack(logits_of(params, batch), axis=-1).astype(jnp.float32)  # [rows, tokens, start / end]

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, predict_fn=predict_fn)

    def report(split):
        """The answers of every example of `split` and their files; with the split's answers, the
        loss over its windows and the SQuAD scores."""
        means, logits = steps.evaluate(state.params, features[split].arrays, features[split].size)
        prefix = qa.PREFIXES[split]
        if data_args.answer_categories:
            answers = long_qa.predicted_answers(features[split], np.stack(logits), data_args, seq_length)
            if features[split].references is not None:
                run.report(prefix, long_qa.eval_metrics(means, features[split], answers))
            long_qa.write_predictions(run, prefix, answers)
            return
        answers, nbest, null_odds = qa.predicted_answers(features[split], np.stack(logits), data_args)
        if features[split].references is not None:
            run.report(prefix, qa.eval_metrics(means, features[split], answers, data_args.version_2_with_negative))
        qa.write_predictions(run, prefix, answers, nbest, null_odds, data_args.version_2_with_negative)

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    evaluated = features.get("validation") or features.get("test")
    other_steps = dict(eval_step=evaluated and (evaluated.arrays, evaluated.size))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), declared, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer, other_steps)

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
