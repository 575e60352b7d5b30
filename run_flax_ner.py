#!/usr/bin/env python
"""Fine-tune a Flax encoder (BERT, RoBERTa, ELECTRA, DistilBERT, ...) to tag words: NER, POS, chunking.

    python run_flax_ner.py configs/ner_tiny.json
    python run_flax_ner.py config.json --label_all_tokens   # flags override the file

The data is pre-split words and one tag per word (`tokens` / `ner_tags` in CoNLL-style datasets).
Each word's tag goes to its first sub-token; the loss is the mean over the labelled sub-tokens of
the whole global batch, and the scores (seqeval's, offline) are over words. One train / eval loop,
each step defined once for both layouts (`--sharding dp`, jax.pmap over the local devices, the
default; `--sharding fsdp`, the model split over all devices); everything mechanical (layouts,
schedules, checkpoints, metrics, logging) lives in `utils/`, the task's data preparation, loss,
metrics and prediction file in `tasks/token_classification.py`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForTokenClassification

from tasks import classification, token_classification as tagging
from tasks.token_classification import TASK
from utils.base.arguments import BaseDataArguments, ModelArguments, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.data import loaders
from utils.models.loading import fit_config_to_tokenizer, fit_length, load_config, load_model, max_positions
from utils.run.loop import InMemoryData
from utils.run.preflight import check_before_work, needed_splits, phase_datasets
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class DataTrainingArguments(BaseDataArguments):
    task_name: str = field(default="ner", metadata={"help": "ner, pos or chunk: picks the label column "
                                                            "<task>_tags when --label_column_name is not given."})
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file (json, jsonl or csv), also compressed (.gz, .bz2, .xz)."})
    text_column_name: Optional[str] = field(
        default=None, metadata={"help": "Column with the words (default: 'tokens' if present, else the first column)."})
    label_column_name: Optional[str] = field(
        default=None, metadata={"help": "Column with one tag per word (default: '<task>_tags' if present, else the "
                                        "second column)."})
    max_seq_length: Optional[int] = field(
        default=None, metadata={"help": "Tokens per example, special tokens included (default: the longest example "
                                        "of the data; at most the tokenizer's max length and the model's positions). "
                                        "Words past it are not tagged or scored."})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the test set."})
    label_all_tokens: bool = field(
        default=False, metadata={"help": "Train on every sub-token of a word, not only the first: later sub-tokens "
                                         "of a B-X word get I-X. Scores stay per word."})
    return_entity_level_metrics: bool = field(
        default=False, metadata={"help": "Also report precision, recall, f1 and number for each entity type."})

    def __post_init__(self):
        super().__post_init__()
        self.task_name = self.task_name.lower()
        if self.task_name not in tagging.TAGGINGS:
            raise UsageError(f"unknown --task_name {self.task_name!r}: use one of {', '.join(tagging.TAGGINGS)}")
        if self.max_seq_length is not None and self.max_seq_length < 2:
            raise UsageError(f"--max_seq_length must be at least 2 (special tokens and a word), got "
                             f"{self.max_seq_length}")


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    logger, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data, labels
    # ------------------------------------------------------------------------------------------
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    phase_of = {split: split for split in needed_splits(training_args)}  # a split per phase, named for it
    config = load_config(model_args, task="token-classification")
    tokenizer = tagging.load_tagging_tokenizer(model_args)
    config = fit_config_to_tokenizer(config, tokenizer, model_args)
    raw = loaders.load_splits(data_args, {s: files[s] for s in phase_of}, model_args.cache_dir,
                                      allowed=("json", "csv"))
    raw = phase_datasets(raw, phase_of, data_args)
    text_column, label_column = tagging.resolve_columns(data_args, {split: raw[split].column_names for split in raw})
    sentences = {split: tagging.read_sentences(raw[split], text_column, label_column, split, tokenizer, data_args)
                 for split in raw}
    label_list, new_head = tagging.choose_labels(config, sentences, training_args.do_train,
                                                 model_args.model_name_or_path, logger)
    classification.set_config_labels(config, label_list, data_args.task_name)
    seq_length = fit_length(data_args.max_seq_length or min(tagging.longest_sentence(sentences),
                                                            tokenizer.model_max_length),
                            max_positions(config), "max_seq_length", logger)
    tagged = {split: tagging.tag_split(sentences[split], split, tokenizer, seq_length, label_list, data_args, logger)
              for split in sentences}
    # Before the model: too few examples for one batch fails now.
    plan = training_plan(training_args, tagged["train"].size if training_args.do_train else None)
    train_data = InMemoryData(tagged["train"].arrays, tagged["train"].size) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForTokenClassification, model_args, config, training_args.seed, layout,
                               new_head_if_mismatched=new_head and training_args.do_train)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------
    loss_fn, predict_fn = tagging.step_fns(model, classification.model_inputs(tokenizer, model))
    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, predict_fn=predict_fn)

    def evaluate(params, split):
        """Token-weighted loss over the labelled sub-tokens, and seqeval's scores over every word
        within --max_seq_length of every example; the predicted tags per sentence."""
        means, rows = steps.evaluate(params, tagged[split].arrays, tagged[split].size)
        return tagging.eval_results(means, rows, tagged[split], label_list, data_args.return_entity_level_metrics)

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    evaluated = tagged.get("validation") or tagged.get("test")
    other_steps = dict(eval_step=(evaluated.arrays, evaluated.size) if evaluated else None)

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
                run.report("eval", evaluate(state.params, "validation")[0])
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        run.report("eval", evaluate(state.params, "validation")[0])
    if training_args.do_predict:
        results, predicted = evaluate(state.params, "test")
        run.report("predict", results)
        run.write_text("predictions.txt", tagging.prediction_lines(sentences["test"]["words"], predicted))
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
