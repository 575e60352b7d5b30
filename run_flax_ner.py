#!/usr/bin/env python
"""Fine-tune a Flax encoder (BERT, RoBERTa, ELECTRA, DistilBERT, ...) to tag words: NER, POS, chunking.

    python run_flax_ner.py configs/ner_tiny.json
    python run_flax_ner.py config.json --label_all_tokens   # flags override the file

The data is pre-split words and one tag per word (`tokens` / `ner_tags` in CoNLL-style datasets).
Each word's tag goes to its first sub-token; the loss is the mean over the labelled sub-tokens of
the whole global batch, and the scores (seqeval's, offline) are over words. One train / eval loop,
each step defined once for both layouts (`--sharding dp`, jax.pmap over the local devices, the
default; `--sharding fsdp`, the model split over all devices); everything mechanical (layouts,
schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.perf.seconds_since_start)

import json
import sys
from dataclasses import dataclass, field
from typing import Optional

import jax.numpy as jnp
import numpy as np
from transformers import FlaxAutoModelForTokenClassification, PretrainedConfig

from tasks.classification import (IGNORE_INDEX, align_word_labels, config_label_maps, entity_metrics,
                                  first_token_positions, inside_label_ids)
from tasks.token_classification import TASK
from utils import arrow_columns, dataset_loading, file_formats
from utils.args import BaseDataArguments, ModelArguments, TrainingArguments, parse_args
from utils.errors import UsageError, run_main
from utils.layout import make_layout
from utils.loop import InMemoryData
from utils.models import (fit_config_to_tokenizer, fit_length, load_config,
                          load_model, load_tokenizer, max_positions)
from utils.run import SPLIT_FLAGS, check_before_work, needed_splits, set_up, training_plan
from utils.steps import cross_entropy_sums
from utils.training import TrainingRun, make_steps

TASKS = ("ner", "pos", "chunk")

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
        if self.task_name not in TASKS:
            raise UsageError(f"unknown --task_name {self.task_name!r}: use one of {', '.join(TASKS)}")
        if self.max_seq_length is not None and self.max_seq_length < 2:
            raise UsageError(f"--max_seq_length must be at least 2 (special tokens and a word), got "
                             f"{self.max_seq_length}")

# ----------------------------------------------------------------------------------------------
# Data: columns, tags, tokenizing and aligning
# ----------------------------------------------------------------------------------------------
def resolve_columns(data_args, columns):
    """Word and tag columns: explicit, else `tokens` / `<task>_tags`, else the first two (the classic
    rules). `columns` maps each split to its column names; every split must have both."""
    split, names = next(iter(columns.items()))
    text = data_args.text_column_name or ("tokens" if "tokens" in names else names[0])
    default_label = f"{data_args.task_name}_tags"
    others = [name for name in names if name != text]
    label = data_args.label_column_name or (default_label if default_label in names else
                                            (others[0] if others else None))
    if label is None:
        raise UsageError(f"the {split} data has only the column {names[0]!r}: tagging needs a column of words and "
                         "one of tags (--text_column_name, --label_column_name)")
    file_formats.require_columns(columns, (("text_column_name", text), ("label_column_name", label)))
    return text, label

def as_sequence(value, what, split, row):
    """A row's words or tags as a list; a string is whitespace-separated (csv files hold them so)."""
    if isinstance(value, str):
        return value.split()
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"row {row} of the {split} data: the {what} are a {type(value).__name__}, not a list (or a "
                         "space-separated string)")
    return list(value)

def read_sentences(dataset, text_column, label_column, split, tokenizer, data_args):
    """The rows as `words`, `tags` (names: ClassLabel ids named, other tags as strings) and `length`
    (tokens, special ones included, untruncated); each row checked: string words, one tag per word."""
    inner = getattr(dataset.features[label_column], "feature", None)
    names = list(inner.names) if hasattr(inner, "names") else None  # a Sequence(ClassLabel) of tag ids

    def read(examples, indices):
        words, tags = [], []
        for row, row_words, row_tags in zip(indices, examples[text_column], examples[label_column]):
            row_words = as_sequence(row_words, "words", split, row)
            row_tags = as_sequence(row_tags, "tags", split, row)
            if len(row_words) != len(row_tags):
                raise UsageError(f"row {row} of the {split} data has {len(row_words)} words but {len(row_tags)} "
                                 f"tags (--text_column_name {text_column!r}, --label_column_name {label_column!r}): "
                                 "give every word one tag")
            if not all(isinstance(word, str) for word in row_words):
                raise UsageError(f"row {row} of the {split} data: the words must be strings")
            words.append(row_words)
            tags.append([names[t] if names else str(t) for t in row_tags])
        # verbose=False: sentences longer than the model are expected here, --max_seq_length cuts them.
        lengths = [len(ids) for ids in tokenizer(words, is_split_into_words=True, verbose=False)["input_ids"]]
        return {"words": words, "tags": tags, "length": lengths}

    return dataset.map(read, batched=True, with_indices=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc=f"reading the {split} sentences")

def has_label_map(config):
    """Whether `config` names its labels (a fine-tuned tagger), not transformers' LABEL_i defaults."""
    return config.label2id != PretrainedConfig(num_labels=config.num_labels).label2id

def choose_labels(config, data_tags, training, model_name, logger):
    """(label list, whether a pretrained head may be replaced): the checkpoint's own labels when it
    names them and they cover the data, else the data's tags sorted. Evaluating or predicting
    needs the checkpoint's labels to cover the data."""
    checkpoint_labels = [config.id2label[i] for i in range(config.num_labels)]
    if model_name and has_label_map(config):
        unknown = sorted(set(data_tags) - set(checkpoint_labels))
        if not unknown:
            return checkpoint_labels, False
        if not training:
            raise UsageError(f"the data has tags {', '.join(unknown[:5])} that {model_name!r} does not know (its "
                             f"labels: {', '.join(checkpoint_labels)}): evaluate on data with those tags, or "
                             "fine-tune it on yours (--do_train)")
        logger.warning("%s knows the tags %s, not the data's %s: it is fine-tuned on the data's tags (a head for "
                       "another number of labels is replaced by a fresh one)", model_name,
                       ", ".join(checkpoint_labels), ", ".join(unknown[:5]))
    labels = sorted(set(data_tags))
    if model_name and not training and len(labels) != config.num_labels:
        raise UsageError(f"the data has {len(labels)} tags but {model_name!r} predicts {config.num_labels} "
                         "unnamed labels: fine-tune it on the data (--do_train)")
    return labels, True

def tokenize_and_align(sentences, tokenizer, seq_length, label_ids, inside_ids, data_args):
    """Fixed-length rows: input_ids, attention_mask (token_type_ids where the tokenizer makes them),
    labels (a word's tag on its first sub-token, IGNORE_INDEX on the others, or their I- tag with
    --label_all_tokens) and word_starts (1 on each word's first sub-token: the host scores words)."""

    def tokenize(examples):
        encoded = tokenizer(examples["words"], is_split_into_words=True, max_length=seq_length, truncation=True,
                            padding="max_length")
        labels, starts = [], []
        for row, tags in enumerate(examples["tags"]):
            word_ids = encoded.word_ids(row)
            labels.append(align_word_labels(word_ids, [label_ids[tag] for tag in tags], data_args.label_all_tokens,
                                            inside_ids))
            row_starts = [0] * seq_length
            for position in first_token_positions(word_ids):
                row_starts[position] = 1
            starts.append(row_starts)
        return {**encoded, "labels": labels, "word_starts": starts}

    return sentences.map(tokenize, batched=True, num_proc=data_args.preprocessing_num_workers,
                         load_from_cache_file=not data_args.overwrite_cache, desc="tokenizing")

def load_tagging_tokenizer(model_args):
    """A fast tokenizer (word ids need one); byte-level BPE ones (RoBERTa, GPT-2 style) get
    add_prefix_space, so that each pre-split word is tokenized as the word it is inside a sentence."""
    tokenizer = load_tokenizer(model_args)
    if not tokenizer.is_fast:
        raise UsageError(f"{type(tokenizer).__name__} is not a fast tokenizer: tagging aligns words to sub-tokens "
                         "by word ids, which only fast tokenizers give; use a tokenizer with a tokenizer.json (and "
                         "drop --use_fast_tokenizer false)")
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    state = json.loads(pre_tokenizer.__getstate__()) if pre_tokenizer is not None else {}
    if state.get("type") == "ByteLevel" and not state.get("add_prefix_space"):
        tokenizer = load_tokenizer(model_args, add_prefix_space=True)
    return tokenizer

# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def tagging_loss(logits, labels, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) over the labelled sub-tokens; IGNORE_INDEX (special tokens,
    padding, later sub-tokens) counts nothing, and `example_weight` (eval: 0 for padded rows) scales
    a row's tokens."""
    weights = (labels != IGNORE_INDEX).astype(jnp.float32)
    if example_weight is not None:
        weights = weights * example_weight[:, None]
    loss, tokens = cross_entropy_sums(logits, jnp.where(labels == IGNORE_INDEX, 0, labels), weights,
                                      label_smoothing)
    return loss, {"loss": loss, "tokens": tokens}

def word_tags(predicted_ids, word_starts, label_list):
    """The tag predicted for each word of one example within --max_seq_length: its first sub-token's."""
    return [label_list[i] for i in predicted_ids[np.flatnonzero(word_starts)]]

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    preflight = check_before_work(training_args, data_args, TASK, files, allowed=("json", "csv"), model_args=model_args)
    splits = needed_splits(training_args)
    if not data_args.dataset_name and all(split in preflight.columns for split in splits):
        resolve_columns(data_args, {split: preflight.columns[split] for split in splits})  # a wrong column fails now
    logger, is_main = set_up(training_args)
    layout = make_layout(training_args.sharding, training_args.fsdp_size, training_args.compile_only)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data, labels
    # ------------------------------------------------------------------------------------------
    config = load_config(model_args, task="token-classification")
    tokenizer = load_tagging_tokenizer(model_args)
    config = fit_config_to_tokenizer(config, tokenizer, model_args)
    raw = dataset_loading.load_splits(data_args, {s: files[s] for s in splits}, model_args.cache_dir, allowed=("json", "csv"))
    for split in splits:
        if split not in raw:
            phase = SPLIT_FLAGS[split][0]
            raise UsageError(f"--{phase} needs a {split!r} split, but dataset {data_args.dataset_name!r} has only "
                             f"{', '.join(raw)}: drop --{phase}, or pass local files instead of --dataset_name")
    text_column, label_column = resolve_columns(data_args, {split: raw[split].column_names for split in splits})
    max_samples = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
                   "test": data_args.max_predict_samples}
    sentences = {split: read_sentences(dataset_loading.take(raw[split], max_samples[split]), text_column, label_column, split,
                                       tokenizer, data_args) for split in splits}
    all_tags = {tag for split in splits for tags in sentences[split]["tags"] for tag in tags}
    label_list, new_head = choose_labels(config, all_tags, training_args.do_train, model_args.model_name_or_path,
                                         logger)
    config.num_labels = len(label_list)
    config.label2id, config.id2label = config_label_maps(label_list)
    config.finetuning_task = data_args.task_name
    longest = max(max(sentences[split]["length"]) for split in splits)
    seq_length = fit_length(data_args.max_seq_length or min(longest, tokenizer.model_max_length),
                            max_positions(config), "max_seq_length", logger)

    inside_ids = inside_label_ids(label_list) if data_args.label_all_tokens else None
    arrays, sizes, word_starts, true_tags = {}, {}, {}, {}
    for split in splits:
        dataset = tokenize_and_align(sentences[split], tokenizer, seq_length, config.label2id, inside_ids, data_args)
        model_inputs = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in dataset.features]
        arrays[split], sizes[split] = arrow_columns.to_arrays(dataset, model_inputs + ["labels"]), len(dataset)
        if split != "train":  # scored on the host, word by word
            word_starts[split] = arrow_columns.to_arrays(dataset, ["word_starts"])["word_starts"][:]
            true_tags[split] = [tags[:n] for tags, n in zip(dataset["tags"], word_starts[split].sum(axis=1))]
            cut = sum(map(len, dataset["tags"])) - int(word_starts[split].sum())
            if cut:
                logger.warning("%s: %d words lie past --max_seq_length %d: they are not tagged or scored (raise "
                               "--max_seq_length)", split, cut, seq_length)
        logger.info("%s: %d sentences of %d tokens", split, sizes[split], seq_length)
    # Before the model: too few examples for one batch fails now.
    plan = training_plan(training_args, sizes["train"] if training_args.do_train else None)
    train_data = InMemoryData(arrays["train"], sizes["train"]) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForTokenClassification, model_args, config,
                               training_args.seed, layout,
                               new_head_if_mismatched=new_head and training_args.do_train)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def logits_of(params, batch, dropout_rng=None, train=False):
        return model(**{k: batch[k] for k in model_inputs}, params=params, dropout_rng=dropout_rng, train=train)[0]

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        return tagging_loss(logits_of(params, batch, dropout_rng, train), batch["labels"], batch.get("example_weight"),
                            label_smoothing)

    def predict_fn(params, batch):
        return jnp.argmax(logits_of(params, batch), axis=-1).astype(jnp.int32)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, predict_fn=predict_fn)

    def evaluate(params, split):
        """Token-weighted loss over the labelled sub-tokens, and seqeval's scores over every word
        within --max_seq_length of every example; the predicted tags per sentence."""
        metrics, rows = steps.evaluate(params, arrays[split], sizes[split])
        predicted = [word_tags(ids, starts, label_list) for ids, starts in zip(rows, word_starts[split])]
        scores = entity_metrics(true_tags[split], predicted, per_type=data_args.return_entity_level_metrics)
        return {**metrics, **scores, "samples": sizes[split]}, predicted

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
                run.report("eval", evaluate(state.params, "validation")[0])
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        run.report("eval", evaluate(state.params, "validation")[0])
    if training_args.do_predict:
        metrics, predicted = evaluate(state.params, "test")
        run.report("predict", metrics)
        lines = []
        for words, tags in zip(sentences["test"]["words"], predicted):
            lines.extend([""] if lines else [])  # a blank line between sentences
            lines.extend(f"{word} {tag}" for word, tag in zip(words, tags))
        run.write_text("predictions.txt", lines)
    run.finish()

if __name__ == "__main__":
    sys.exit(run_main(main))
