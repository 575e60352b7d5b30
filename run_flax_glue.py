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
schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.perf.seconds_since_start)

import inspect
import sys
from dataclasses import dataclass, field
from typing import Optional

import jax.numpy as jnp
import numpy as np
from transformers import FlaxAutoModelForSequenceClassification

from tasks import classification
from tasks.text_classification import TASK
from utils import arrow_columns, dataset_loading, file_formats
from utils.args import BaseDataArguments, ModelArguments, TrainingArguments, parse_args
from utils.errors import UsageError, run_main
from utils.layout import make_layout
from utils.loop import InMemoryData
from utils.models import fit_config_to_tokenizer, fit_length, load_config, load_model, load_tokenizer, max_positions
from utils.run import SPLIT_FLAGS, check_before_work, set_up, training_plan
from utils.steps import cross_entropy_sums
from utils.training import TrainingRun, make_steps

GLUE_DATASET = "nyu-mll/glue"

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

# ----------------------------------------------------------------------------------------------
# Data: splits, columns, labels
# ----------------------------------------------------------------------------------------------
def phase_splits(task, local):
    """{"train": ["train"], "validation": [(split, metric prefix), ...], "test": [split, ...]}: the
    splits each phase reads. Hub mnli is evaluated and predicted on its matched and mismatched sets."""
    if task is None or local:
        return {"train": ["train"], "validation": [("validation", "eval")], "test": ["test"]}
    return {"train": ["train"], "validation": list(task.eval_splits), "test": list(task.test_splits)}

def resolve_columns(data_args, task, columns):
    """(first text column, second text column or None, label column), checked against `columns`
    ({split: column names}; test splits need no label column)."""
    label = data_args.label_column_name or "label"
    if data_args.text_column_name:
        texts = [name.strip() for name in data_args.text_column_name.split(",")]
        if len(texts) > 2 or not all(texts):
            raise UsageError(f"--text_column_name {data_args.text_column_name!r} must be one column or two "
                             "comma-separated (e.g. 'question,answer')")
    elif task is not None:
        texts = [name for name in task.text_columns if name]
    else:
        split, names = next(iter(columns.items()))
        candidates = [name for name in names if name != label]
        texts = ["sentence1", "sentence2"] if {"sentence1", "sentence2"} <= set(candidates) else candidates[:2]
        if not texts:
            raise UsageError(f"the {split} data has no column besides the label column {label!r}: it needs a text "
                             "column (--text_column_name)")
    file_formats.require_columns(columns, [("text_column_name", name) for name in texts])
    file_formats.require_columns({split: names for split, names in columns.items() if not split.startswith("test")},
                         [("label_column_name", label)])
    return texts[0], (texts[1] if len(texts) > 1 else None), label

def split_label_names(dataset, label_column):
    """A split's labels as names: hub ClassLabel ids become their names, other labels their str()."""
    feature = dataset.features[label_column]
    values = list(dataset[label_column])
    return [feature.int2str(v) for v in values] if hasattr(feature, "int2str") else [str(v) for v in values]

def label_list_of(dataset, label_column):
    """A split's label names by id, or None when its labels are floats (a regression): a hub
    ClassLabel's names in the dataset's own order, other labels sorted (`classification.label_list`)."""
    feature = dataset.features[label_column]
    if hasattr(feature, "names"):
        return list(feature.names)
    labels = classification.label_list(dataset[label_column])
    return None if labels is None else [str(label) for label in labels]

def choose_labels(task, raw, label_column, config, pretrained, label_source):
    """The label names, by id, or None for a regression.

    From the task (stsb is a regression), the `label_source` split's labels (the training data when
    training), and a pretrained config's label map: when that names its labels, the data's must be
    among them (case aside, as transformers' GLUE models spell them) and keep its ids, so its head
    still means what it learned.
    """
    regression = task.is_regression if task else (pretrained and config.problem_type == "regression")
    names = None
    if not regression and label_source is not None:
        names = label_list_of(raw[label_source], label_column)
        regression = names is None
    if regression:
        return None
    saved = classification.saved_label_names(config) if pretrained else None
    if saved is None:
        if names is None:
            raise UsageError("prediction alone needs the label names: use a model fine-tuned by this script (its "
                             "config names them), or add --do_eval with labelled validation data")
        return names
    known = {name.lower() for name in saved}
    unknown = [name for name in names or [] if name.lower() not in known]
    if unknown:
        raise UsageError(f"labels not in the checkpoint's label map: {', '.join(map(repr, unknown))} (the checkpoint "
                         f"knows {', '.join(map(repr, saved))}): fine-tune from a checkpoint without a label map "
                         "(its base model), or relabel the data")
    return saved

def label_ids(split, label_values, names):
    """Label ids of a split's label names; a label the list lacks is a UsageError."""
    index = {name.lower(): i for i, name in enumerate(names)}
    unknown = sorted({value for value in label_values if value.lower() not in index})
    if unknown:
        raise UsageError(f"the {split} data has labels the model does not know: {', '.join(map(repr, unknown[:5]))} "
                         f"(its labels: {', '.join(map(repr, names))})")
    return np.array([index[value.lower()] for value in label_values], np.int32)

def tokenize(dataset, tokenizer, data_args, text_columns, seq_length, input_names):
    """Every example (or pair) tokenized to exactly `seq_length` tokens."""
    first, second = text_columns

    def encode(examples):
        texts = [[text or "" for text in examples[first]]]  # an empty CSV cell reads as None
        if second:
            texts.append([text or "" for text in examples[second]])
        encoded = tokenizer(*texts, max_length=seq_length, padding="max_length", truncation=True, return_tensors="np")
        return {name: encoded[name] for name in input_names}

    return dataset.map(encode, batched=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc="tokenizing")

# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def classification_loss(logits, labels, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}): cross-entropy summed over the examples, "tokens" counting them.
    `example_weight` (eval: 0 for padded rows) scales each example."""
    weights = jnp.ones(labels.shape, jnp.float32) if example_weight is None else example_weight
    loss, examples = cross_entropy_sums(logits, labels, weights, label_smoothing)
    return loss, {"loss": loss, "tokens": examples}

def regression_loss(logits, labels, example_weight=None):
    """(loss sum, {"loss", "tokens"}): squared error of the one output, summed over the examples (the
    mean is the MSE)."""
    weights = jnp.ones(labels.shape, jnp.float32) if example_weight is None else example_weight
    errors = (logits[:, 0].astype(jnp.float32) - labels.astype(jnp.float32)) ** 2
    loss = (errors * weights).sum()
    return loss, {"loss": loss, "tokens": weights.sum()}

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (GlueModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    task = classification.glue_task(data_args.task_name) if data_args.task_name else None
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    local = any(files.values())
    if task is not None and not local and not data_args.dataset_name:
        data_args.dataset_name, data_args.dataset_config_name = GLUE_DATASET, data_args.task_name
    preflight = check_before_work(training_args, data_args, TASK, files, allowed=("json", "csv"), model_args=model_args)
    phases = phase_splits(task, local)
    needed = {phase: phases[phase] for phase in ("train", "validation", "test")
              if getattr(training_args, SPLIT_FLAGS[phase][0])}
    phase_of = {split if isinstance(split, str) else split[0]: phase
                for phase, group in needed.items() for split in group}
    splits = list(phase_of)
    if local and all(split in preflight.columns for split in splits):
        resolve_columns(data_args, task, {split: preflight.columns[split] for split in splits})  # fails now
    logger, is_main = set_up(training_args)
    layout = make_layout(training_args.sharding, training_args.fsdp_size, training_args.compile_only)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data, labels
    # ------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(model_args)
    pretrained = bool(model_args.model_name_or_path)
    config = fit_config_to_tokenizer(load_config(model_args, task="sequence-classification"), tokenizer, model_args)
    seq_length = fit_length(data_args.max_seq_length or min(512, tokenizer.model_max_length), max_positions(config),
                            "max_seq_length", logger)
    raw = dataset_loading.load_splits(data_args, {s: files[s] for s in splits if s in files}, model_args.cache_dir,
                           allowed=("json", "csv"))
    for split in splits:
        if split not in raw:
            raise UsageError(f"--{SPLIT_FLAGS[phase_of[split]][0]} needs a {split!r} split, but dataset "
                             f"{data_args.dataset_name!r} has only {', '.join(raw)}: pass local files instead")
    columns = resolve_columns(data_args, task, {split: raw[split].column_names for split in splits})
    label_column = columns[2]
    max_samples = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
                   "test": data_args.max_predict_samples}
    raw = {split: dataset_loading.take(raw[split], max_samples[phase_of[split]]) for split in splits}
    label_source = "train" if training_args.do_train else (needed["validation"][0][0] if "validation" in needed
                                                           else None)
    names = choose_labels(task, raw, label_column, config, pretrained, label_source)
    is_regression = names is None
    config.num_labels = 1 if is_regression else len(names)
    if not is_regression:
        config.label2id, config.id2label = classification.config_label_maps(names)
    config.problem_type = "regression" if is_regression else "single_label_classification"
    config.finetuning_task = data_args.task_name
    if is_regression and training_args.label_smoothing_factor:
        raise UsageError("--label_smoothing_factor applies to classification, not to a regression: drop it")
    plan = training_plan(training_args, len(raw["train"]) if training_args.do_train else None)

    # ------------------------------------------------------------------------------------------
    # Model, preprocessing
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForSequenceClassification, model_args, config,
                               training_args.seed, layout,
                               new_head_if_mismatched=True)
    # What the tokenizer gives and the family takes (DistilBERT has no token types, a BERT tokenizer makes them).
    model_inputs = [name for name in ("input_ids", "attention_mask", "token_type_ids")
                    if name in tokenizer.model_input_names and name in inspect.signature(model.__call__).parameters]
    arrays, sizes, labels = {}, {}, {}
    for split in splits:
        dataset = tokenize(raw[split], tokenizer, data_args, columns[:2], seq_length, model_inputs)
        arrays[split], sizes[split] = arrow_columns.to_arrays(dataset, model_inputs), len(dataset)
        if not split.startswith("test"):
            if is_regression:
                labels[split] = np.asarray(raw[split][label_column], np.float32)
            else:
                labels[split] = label_ids(split, split_label_names(raw[split], label_column), names)
            arrays[split]["labels"] = labels[split]
        logger.info("%s: %d examples", split, len(dataset))
    train_data = InMemoryData(arrays["train"], sizes["train"]) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def logits_of(params, batch, dropout_rng=None, train=False):
        return model(**{k: batch[k] for k in model_inputs}, params=params, dropout_rng=dropout_rng, train=train)[0]

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        logits = logits_of(params, batch, dropout_rng, train)
        if is_regression:
            return regression_loss(logits, batch["labels"], batch.get("example_weight"))
        return classification_loss(logits, batch["labels"], batch.get("example_weight"),
                                   label_smoothing)

    def predict_fn(params, batch):
        """Each row's prediction: its score (regression) or its class id."""
        logits = logits_of(params, batch)
        return logits[:, 0].astype(jnp.float32) if is_regression else logits.argmax(-1)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, predict_fn=predict_fn)
    p_predict_step = layout.compile_step("predict_step", predict_fn)
    metric_names = classification.metric_names(data_args.task_name, is_regression)

    def evaluate(params, split):
        """Mean loss and the task's metrics over every example of `split` (padded rows left out)."""
        means, predictions = steps.evaluate(params, arrays[split], sizes[split])
        scores = classification.sequence_metrics(metric_names, np.asarray(predictions), labels[split])
        return {"loss": means["loss"], **scores, "samples": means["tokens"]}

    def predict(params, split):
        predictions = []
        for batch, valid in steps.eval_batches({k: arrays[split][k] for k in model_inputs}, sizes[split]):
            predictions.extend(layout.rows_to_host(p_predict_step(params, batch))[:valid])
        if is_regression:
            return [f"{i}\t{score:3.3f}" for i, score in enumerate(predictions)]
        return [f"{i}\t{names[class_id]}" for i, class_id in enumerate(predictions)]

    def evaluate_all(params):
        for split, prefix in needed["validation"]:
            run.report(prefix, evaluate(params, split))

    # --compile_only: the TPU plan of each step this run calls, on its first batch; the run ends there.
    evaluated = needed["validation"][0][0] if "validation" in needed else None
    predicted = needed["test"][0] if "test" in needed else None
    steps.report_plan(training_args, state, eval_step=(arrays.get(evaluated), sizes.get(evaluated)),
                      predict_step=({k: arrays[predicted][k] for k in model_inputs}, sizes[predicted]) if predicted
                      else None)

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
                evaluate_all(state.params)
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        evaluate_all(state.params)
    if training_args.do_predict:
        for i, split in enumerate(needed["test"]):
            task_part = data_args.task_name and data_args.task_name + ("-mm" if i else "")
            name = f"predict_results_{task_part}.txt" if task_part else "predict_results.txt"
            run.write_text(name, ["index\tprediction", *predict(state.params, split)], collapse_whitespace=False)
        run.dir.add_results(predict_samples=sum(sizes[split] for split in needed["test"]))
    run.finish()

if __name__ == "__main__":
    sys.exit(run_main(main))
