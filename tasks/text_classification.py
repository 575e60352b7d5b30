"""Sentence and sentence-pair classification and regression (`run_flax_glue.py`): the data a run
reads (a GLUE task's hub dataset, splits and columns), its labels, tokenizing, the losses, the
metrics and the prediction files; the demo's predictor. The labels and metrics themselves are
`tasks.classification`'s, shared with tagging and images."""

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task
from tasks import classification
from tasks.demo import Answer, Predictor, require_text, show_answer, truncation_note
from utils.base.errors import UsageError
from utils.data import arrow_columns, file_formats
from utils.run.preflight import phase_columns
from utils.scoring.losses import cross_entropy_sums

GLUE_DATASET = "nyu-mll/glue"


# ----------------------------------------------------------------------------------------------
# Data: where from, splits, columns, labels
# ----------------------------------------------------------------------------------------------
def implied_dataset(args):
    """The hub dataset that arguments `args` (run_args.json, or the data arguments as a dict) read
    without naming it: {"dataset_name": GLUE's, "dataset_config_name": the task} for a --task_name
    without --dataset_name or local files, else {}."""
    files = (args.get(name) for name in ("train_file", "validation_file", "test_file"))
    if args.get("task_name") and not args.get("dataset_name") and not any(files):
        return {"dataset_name": GLUE_DATASET, "dataset_config_name": args["task_name"]}
    return {}


def data_source(data_args):
    """The data arguments to load with: `data_args` as given, or a copy naming the GLUE dataset its
    --task_name implies (`implied_dataset`); run_args.json records `data_args` as given."""
    implied = implied_dataset(vars(data_args))
    return replace(data_args, **implied) if implied else data_args


def phase_splits(task, training_args, local):
    """{split: phase} of every split this run reads, in phase order (train, validation, test). Hub
    mnli is evaluated and predicted on its matched and mismatched sets; local files are one split
    per phase."""
    hub_glue = task is not None and not local
    splits = {"train": ["train"],
              "validation": [split for split, _ in task.eval_splits] if hub_glue else ["validation"],
              "test": list(task.test_splits) if hub_glue else ["test"]}
    flags = {"train": training_args.do_train, "validation": training_args.do_eval, "test": training_args.do_predict}
    return {split: phase for phase, names in splits.items() if flags[phase] for split in names}


def metric_prefix(task, split):
    """The prefix of an evaluated split's metric keys: "eval" ("eval_mismatched" for hub mnli's
    mismatched validation set)."""
    return dict(task.eval_splits).get(split, "eval") if task else "eval"


def is_labelled(split):
    """Whether a split's examples carry labels: test splits need none."""
    return not split.startswith("test")


class Columns(NamedTuple):
    first: str  # text column
    second: str  # the second text column of a sentence pair, else None
    label: str


def resolve_columns(data_args, task, columns):
    """The `Columns`, checked against `columns` ({split: column names}; test splits need no label
    column)."""
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
    file_formats.require_columns({split: names for split, names in columns.items() if is_labelled(split)},
                                 [("label_column_name", label)])
    return Columns(texts[0], texts[1] if len(texts) > 1 else None, label)



def glue_task_of(data_args):
    """The `classification.GlueTask` --task_name names; None without one (an unknown name is refused)."""
    return classification.glue_task(data_args.task_name) if data_args.task_name else None


def check_task_name(model_args, data_args, training_args):
    glue_task_of(data_args)


def check_columns(columns, model_args, data_args, training_args):
    """A wrong column of the local files the phases read fails before any work (a hub dataset's once loaded)."""
    known = phase_columns(columns, training_args, data_source(data_args).dataset_name)
    if known:
        resolve_columns(data_args, glue_task_of(data_args), known)


# A --task_name alone reads GLUE from the hub (`implied_dataset`).
TASK = Task("text-classification", "text-classification", outputs=("predict_results*.txt",), widget="text",
            implied_dataset=implied_dataset, check_arguments=check_task_name, check_data=check_columns)


def split_label_names(dataset, label_column):
    """A split's labels as names: hub ClassLabel ids become their names, other labels their str()."""
    feature = dataset.features[label_column]
    values = list(dataset[label_column])
    return [feature.int2str(v) for v in values] if hasattr(feature, "int2str") else [str(v) for v in values]


def label_list_of(dataset, label_column, split):
    """A split's label names by id, or None when its labels are floats (a regression): a hub
    ClassLabel's names in the dataset's own order, other labels sorted (`classification.label_list`)."""
    feature = dataset.features[label_column]
    if hasattr(feature, "names"):
        return list(feature.names)
    labels = classification.label_list(dataset[label_column], split)
    return None if labels is None else [str(label) for label in labels]


def check_classes(dataset, label_column):
    """Training data must hold two classes or more: with one, the classifier learns a constant (its
    loss 0 from the start)."""
    present = sorted(set(split_label_names(dataset, label_column)))
    if len(present) < 2:
        raise UsageError(f"the train data has one class only in its label column {label_column!r} "
                         f"({', '.join(map(repr, present))}): classification needs examples of two classes or more; "
                         "add them (or name another column with --label_column_name), or, to predict a score, make "
                         "the labels floats (a regression)")


def choose_labels(task, raw, label_column, config, pretrained):
    """The label names, by id, or None for a regression.

    From the task (stsb is a regression; every labelled split's scores must be finite), the first
    labelled split's labels (the training data when training; `raw` holds the run's splits in phase
    order; its classes two or more), and a pretrained config's label map: when
    that names its labels, the data's must be among them (case aside, as transformers' GLUE models
    spell them) and keep its ids, so its head still means what it learned.
    """
    regression = task.is_regression if task else (pretrained and config.problem_type == "regression")
    label_source = next((split for split in raw if is_labelled(split)), None)
    names = None
    if not regression and label_source is not None:
        names = label_list_of(raw[label_source], label_column, label_source)
        regression = names is None
    if regression:
        for split in filter(is_labelled, raw):  # a missing or non-finite score fails here, in any split
            classification.label_list(raw[split][label_column], split)
        return None
    if "train" in raw:
        check_classes(raw["train"], label_column)
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


def set_config_labels(config, names, task_name, label_smoothing):
    """The model config's head: a class per name, or one output for a regression (`names` None),
    which label smoothing cannot apply to."""
    if names is None:
        if label_smoothing:
            raise UsageError("--label_smoothing_factor applies to classification, not to a regression: drop it")
        config.num_labels = 1
        config.finetuning_task = task_name
    else:
        classification.set_config_labels(config, names, task_name)
    config.problem_type = "regression" if names is None else "single_label_classification"


def label_ids(split, label_values, names):
    """Label ids of a split's label names; a label the list lacks is a UsageError."""
    index = {name.lower(): i for i, name in enumerate(names)}
    unknown = sorted({value for value in label_values if value.lower() not in index})
    if unknown:
        raise UsageError(f"the {split} data has labels the model does not know: {', '.join(map(repr, unknown[:5]))} "
                         f"(its labels: {', '.join(map(repr, names))})")
    return np.array([index[value.lower()] for value in label_values], np.int32)


def tokenize(dataset, tokenizer, data_args, columns, seq_length, input_names):
    """Every example (or pair) tokenized to exactly `seq_length` tokens."""

    def encode(examples):
        texts = [[text or "" for text in examples[columns.first]]]  # an empty CSV cell reads as None
        if columns.second:
            texts.append([text or "" for text in examples[columns.second]])
        encoded = tokenizer(*texts, max_length=seq_length, padding="max_length", truncation=True, return_tensors="np")
        return {name: encoded[name] for name in input_names}

    return dataset.map(encode, batched=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc="tokenizing")


def split_arrays(dataset, split, tokenizer, data_args, columns, seq_length, input_names, names):
    """{name: rows} of a split: the model's `input_names` (`tokenize`) and, where the split is
    labelled, "labels": ids of the label `names`, or the float scores of a regression (`names` None)."""
    tokenized = tokenize(dataset, tokenizer, data_args, columns, seq_length, input_names)
    arrays = arrow_columns.to_arrays(tokenized, input_names)
    if is_labelled(split):
        if names is None:
            arrays["labels"] = np.asarray(dataset[columns.label], np.float32)
        else:
            arrays["labels"] = label_ids(split, split_label_names(dataset, columns.label), names)
    return arrays


# ----------------------------------------------------------------------------------------------
# Loss and prediction
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


def step_fns(model, input_names, is_regression):
    """(`loss_fn(params, batch, dropout_rng, train, label_smoothing)` for `utils.run.spine.make_steps`,
    `predict_fn(params, batch)`: each row's score (regression) or class id)."""
    logits_of = classification.logits_fn(model, input_names)

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        logits = logits_of(params, batch, dropout_rng, train)
        if is_regression:
            return regression_loss(logits, batch["labels"], batch.get("example_weight"))
        return classification_loss(logits, batch["labels"], batch.get("example_weight"), label_smoothing)

    def predict_fn(params, batch):
        logits = logits_of(params, batch)
        return logits[:, 0].astype(jnp.float32) if is_regression else logits.argmax(-1)

    return loss_fn, predict_fn


# ----------------------------------------------------------------------------------------------
# Metrics and prediction files
# ----------------------------------------------------------------------------------------------
def eval_results(means, predictions, labels, metric_names):
    """A split's results: its mean loss (`means`, `Steps.evaluate`'s), the task's metrics of the
    `predictions` against `labels`, and its number of examples."""
    scores = classification.sequence_metrics(metric_names, np.asarray(predictions), labels)
    return {"loss": means["loss"], **scores, "samples": means["tokens"]}


def prediction_file(task_name, split):
    """predict_results_<task>.txt (mnli's mismatched test set: "<task>-mm"), predict_results.txt
    without a task."""
    if not task_name:
        return "predict_results.txt"
    return f"predict_results_{task_name}{'-mm' if split == 'test_mismatched' else ''}.txt"


def prediction_lines(predictions, names):
    """The lines of a prediction file: a header, then each example's index and its label name, or
    its score (3 decimals) for a regression (`names` None)."""
    if names is None:
        return ["index\tprediction", *(f"{i}\t{score:3.3f}" for i, score in enumerate(predictions))]
    return ["index\tprediction", *(f"{i}\t{names[class_id]}" for i, class_id in enumerate(predictions))]


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class TextClassifier(Predictor):
    """run_flax_glue.py's model on one text (or sentence pair), encoded as the script encodes it:
    every label's probability, or the score of a regression."""

    auto_class = "FlaxAutoModelForSequenceClassification"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.max_length = run_args.get("max_seq_length") or min(512, self.tokenizer.model_max_length)
        named = run_args.get("text_column_name")
        task = run_args.get("task_name")
        self.pair = bool(named and "," in named) or bool(task and classification.glue_task(task).text_columns[1])
        self.is_regression = self.config.num_labels == 1
        self._logits = jax.jit(lambda params, inputs: self.model(**inputs, params=params).logits.astype(jnp.float32))

    def predict(self, text, second_text=None):
        require_text(text, "text")
        if self.pair:
            require_text(second_text, "second text")
        texts = [text] + ([second_text] if self.pair else [])
        answer = Answer()
        length = len(self.tokenizer(*texts)["input_ids"])
        if length > self.max_length:
            answer.notes.append(truncation_note(length, self.max_length))
        inputs = self.tokenizer(*texts, max_length=self.max_length, padding="max_length", truncation=True,
                                return_tensors="np")
        logits = np.asarray(self._logits(self.params, dict(inputs)))[0]
        if self.is_regression:
            answer.text = f"{logits[0]:.3f}"
            return answer
        probabilities = np.exp(logits - logits.max())
        probabilities /= probabilities.sum()
        answer.details = sorted(((self.config.id2label[i], float(p)) for i, p in enumerate(probabilities)),
                                key=lambda item: -item[1])
        answer.text = answer.details[0][0]
        return answer

    def warm_up(self):
        self("warm up", "warm up")


PREDICTOR = TextClassifier


def demo_form(st, predictor):
    with st.form("request"):
        text = st.text_area("Text" if not predictor.pair else "First text", key="text")
        second = st.text_area("Second text", key="second_text") if predictor.pair else None
        submitted = st.form_submit_button("Classify")
    if submitted:
        def show():
            answer = predictor(text, second)
            show_answer(st, answer)
            if answer.details:
                st.table({"label": [label for label, _ in answer.details],
                          "probability": [f"{p:.3f}" for _, p in answer.details]})
        return show
