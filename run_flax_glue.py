#!/usr/bin/env python
"""Fine-tune a Flax encoder (BERT, RoBERTa, DistilBERT, ELECTRA, ALBERT, ...) to classify sentences or
sentence pairs (GLUE, or your own CSV / JSON), or to score them (regression: STS-B, float labels).

    python run_flax_glue.py configs/glue_tiny.json
    python run_flax_glue.py --model_name_or_path bert-base-cased --task_name mrpc --do_train --do_eval \\
        --output_dir runs/mrpc            # GLUE from the hub

Labels become a sorted label list, saved in the model's config as `label2id` / `id2label`; float
labels (and stsb) make a regression with one output and a squared-error loss. One train / eval loop,
each step defined once for both layouts (`--sharding dp`, jax.pmap over the local devices, the
default; `--sharding fsdp`, the model split over all devices); everything mechanical (layouts,
schedules, checkpoints, metrics, logging) lives in `utils/`, the task's data preparation, loss,
metrics and prediction file in `tasks/text_classification.py`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForSequenceClassification

from tasks import classification, text_classification
from tasks.text_classification import TASK
from utils.base.arguments import BaseDataArguments, ModelArguments, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.data import loaders
from utils.models.loading import (fit_config_to_tokenizer, fit_length, load_config, load_model, load_tokenizer,
                                  max_positions)
from utils.run.loop import InMemoryData
from utils.run.preflight import check_before_work, phase_datasets
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class GlueModelArguments(ModelArguments):
    use_slow_tokenizer: bool = field(
        default=False, metadata={"help": "Use the slow (Python) tokenizer (same as --use_fast_tokenizer false)."})

    def __post_init__(self):
        super().__post_init__()
        if self.use_slow_tokenizer:
            self.use_fast_tokenizer = False


@dataclass
class DataTrainingArguments(BaseDataArguments):
    task_name: Optional[str] = field(
        default=None, metadata={"help": "GLUE task (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli): its columns "
                                        "and metrics; its data from the hub's glue dataset unless local files are "
                                        "given."})
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file (json, jsonl or csv), also compressed; labels not needed."})
    text_column_name: Optional[str] = field(
        default=None, metadata={"help": "Text column, or two comma-separated for sentence pairs (default: the task's; "
                                        "else sentence1,sentence2 if present, else the first two non-label columns, "
                                        "or the one)."})
    label_column_name: Optional[str] = field(default=None, metadata={"help": "Label column (default: 'label')."})
    max_seq_length: Optional[int] = field(
        default=None, metadata={"help": "Tokens per example, pairs together; longer are truncated, shorter padded "
                                        "(default: min(512, the tokenizer's max length); at most the model's "
                                        "positions)."})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the test set."})

    def __post_init__(self):
        super().__post_init__()
        if self.task_name is not None:
            self.task_name = self.task_name.lower()
            classification.glue_task(self.task_name)  # an unknown name fails here
        if self.max_seq_length is not None and self.max_seq_length <= 0:
            raise UsageError(f"--max_seq_length must be positive, got {self.max_seq_length}")


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (GlueModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    logger, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data, labels
    # ------------------------------------------------------------------------------------------
    task = text_classification.glue_task_of(data_args)
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    source = text_classification.data_source(data_args)  # a --task_name alone reads GLUE from the hub
    phase_of = text_classification.phase_splits(task, training_args, local=any(files.values()))
    tokenizer = load_tokenizer(model_args)
    pretrained = bool(model_args.model_name_or_path)
    config = fit_config_to_tokenizer(load_config(model_args, task="sequence-classification"), tokenizer, model_args)
    seq_length = fit_length(data_args.max_seq_length or min(512, tokenizer.model_max_length), max_positions(config),
                            "max_seq_length", logger)
    raw = loaders.load_splits(source, {s: files[s] for s in phase_of if s in files}, model_args.cache_dir,
                                      allowed=("json", "csv"))
    raw = phase_datasets(raw, phase_of, source)
    columns = text_classification.resolve_columns(data_args, task, {split: raw[split].column_names for split in raw})
    names = text_classification.choose_labels(task, raw, columns.label, config, pretrained)
    is_regression = names is None
    text_classification.set_config_labels(config, names, data_args.task_name, training_args.label_smoothing_factor)
    plan = training_plan(training_args, len(raw["train"]) if training_args.do_train else None)

    # ------------------------------------------------------------------------------------------
    # Model, preprocessing
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForSequenceClassification, model_args, config, training_args.seed,
                               layout, new_head_if_mismatched=True)
    model_inputs = classification.model_inputs(tokenizer, model)
    arrays, sizes = {}, {}
    for split in raw:
        arrays[split] = text_classification.split_arrays(raw[split], split, tokenizer, data_args, columns, seq_length,
                                                         model_inputs, names)
        sizes[split] = len(raw[split])
        logger.info("%s: %d examples", split, sizes[split])
    train_data = InMemoryData(arrays["train"], sizes["train"]) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------
    loss_fn, predict_fn = text_classification.step_fns(model, model_inputs, is_regression)
    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, predict_fn=predict_fn)
    p_predict_step = layout.compile_step("predict_step", predict_fn)
    metric_names = classification.metric_names(data_args.task_name, is_regression)
    evaluated = [split for split, phase in phase_of.items() if phase == "validation"]
    predicted = [split for split, phase in phase_of.items() if phase == "test"]

    def evaluate(params, split):
        """Mean loss and the task's metrics over every example of `split` (padded rows left out)."""
        means, predictions = steps.evaluate(params, arrays[split], sizes[split])
        return text_classification.eval_results(means, predictions, arrays[split]["labels"], metric_names)

    def predict(params, split):
        predictions = []
        for batch, valid in steps.eval_batches({k: arrays[split][k] for k in model_inputs}, sizes[split]):
            predictions.extend(layout.rows_to_host(p_predict_step(params, batch))[:valid])
        return text_classification.prediction_lines(predictions, names)

    def evaluate_all(params):
        for split in evaluated:
            run.report(text_classification.metric_prefix(task, split), evaluate(params, split))

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    other_steps = dict(eval_step=(arrays[evaluated[0]], sizes[evaluated[0]]) if evaluated else None,
                       predict_step=({k: arrays[predicted[0]][k] for k in model_inputs}, sizes[predicted[0]])
                       if predicted else None)

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(seq_length):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                evaluate_all(state.params)
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        evaluate_all(state.params)
    if training_args.do_predict:
        for split in predicted:
            name = text_classification.prediction_file(data_args.task_name, split)
            run.write_text(name, predict(state.params, split), collapse_whitespace=False)
        run.dir.add_results(predict_samples=sum(sizes[split] for split in predicted))
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
