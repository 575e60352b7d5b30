"""What the language-model tasks share (`tasks.causal_lm`, `tasks.masked_lm`, `tasks.span_corruption`;
the token sums also `tasks.summarization`).

Arguments the LM scripts take, loading with a validation split carved off the training data when
the data has none, text-column resolution, tokenizing into fixed-length blocks (or padded lines)
read into memory or streamed (the stream's encoders `Blocks`, `Lines`), the sequence-length
defaults, the random streams of host-side masking, the token-weighted loss sums and the validation
metrics (loss, perplexity).
"""

import copy
import itertools
import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import jax.numpy as jnp
import numpy as np

from utils.base.arguments import BaseDataArguments
from utils.base.errors import UsageError
from utils.data import arrow_columns, file_formats, loaders
from utils.models.loading import fit_length, max_positions
from utils.run import preflight, setup
from utils.run.loop import InMemoryData
from utils.run.stream_feed import StreamedData
from utils.scoring.losses import cross_entropy_sums
from utils.scoring.metrics import perplexity

FILE_FORMATS = ("json", "csv", "text")
logger = logging.getLogger(__name__)
# Random streams of host-side masking (`tasks.masked_lm`, `tasks.span_corruption`): training and
# evaluation masks never coincide.
TRAIN_STREAM, EVAL_STREAM = 0, 1


@dataclass
class LMDataArguments(BaseDataArguments):
    text_column: Optional[str] = field(
        default=None, metadata={"help": "Column with the text (default: 'text' if present, else the first column)."}
    )
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of the training data held out for validation when there is no "
                                     "validation split (the first rows, so every run holds out the same ones)."}
    )
    keep_linebreaks: bool = field(default=True, metadata={
        "help": "Keep line breaks when reading txt files.",
        "negated_help": "Strip each line's line break when reading txt files."})
    streaming: bool = field(
        default=False, metadata={"help": "Read, tokenize and shuffle the data on the fly instead of into memory "
                                         "(for corpora larger than memory, or hub datasets not to download); needs "
                                         "--max_steps: each time the stream ends it starts again, reshuffled, "
                                         "until then. Evaluation: the validation data, else the first "
                                         "--max_eval_samples (10000 if unset) examples of the stream, held out on "
                                         "every pass."}
    )
    shuffle_buffer_size: int = field(
        default=10000, metadata={"help": "With --streaming: examples in the seeded shuffle pool (0: stream order)."}
    )
    max_stream_passes: Optional[int] = field(
        default=None, metadata={"help": "With --streaming: at most this many passes over the training data; "
                                        "training ends (and saves) at the end of the last one, even before "
                                        "--max_steps (default: as many as --max_steps takes)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.shuffle_buffer_size < 0:
            raise UsageError(f"--shuffle_buffer_size must be 0 or more, got {self.shuffle_buffer_size}")
        if self.max_stream_passes is not None:
            if not self.streaming:
                raise UsageError("--max_stream_passes applies with --streaming only (in memory, --num_train_epochs "
                                 "counts the passes)")
            if self.max_stream_passes < 1:
                raise UsageError(f"--max_stream_passes must be 1 or more, got {self.max_stream_passes}")
        if not 0 < self.validation_split_percentage < 100:
            raise UsageError(
                f"--validation_split_percentage must be between 1 and 99, got {self.validation_split_percentage}"
            )


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
def check_arguments(model_args, data_args, training_args):
    """What LM flags alone tell, before any work: --do_predict reads a --test_file (chat rows of
    `run_clm_flax.py`), without one it has nothing; a stream needs --max_steps and takes no sample limit."""
    if training_args.do_predict and not getattr(data_args, "test_file", None):
        raise UsageError("--do_predict does not apply to language modeling (there is no test split): use --do_eval")
    if data_args.streaming and training_args.do_train and training_args.max_steps <= 0:
        raise UsageError("--streaming needs --max_steps: a stream has no epochs to count (--num_train_epochs)")
    if data_args.streaming and data_args.max_train_samples:
        raise UsageError("--max_train_samples does not apply with --streaming: bound the run with --max_steps")


def data_files(data_args):
    """{split: local file or None} an LM run may read: a validation file is optional when a train file is
    given (evaluation then uses the part of the training data `load_splits` holds out)."""
    files = {"train": data_args.train_file}
    if data_args.validation_file or not data_args.train_file:
        files["validation"] = data_args.validation_file
    if getattr(data_args, "test_file", None):
        files["test"] = data_args.test_file
    return files


def check_data(columns, model_args, data_args, training_args):
    """An explicit --text_column is checked against the local files' columns now, not after loading them."""
    if data_args.text_column and not data_args.dataset_name:
        file_formats.require_columns(columns, (("text_column", data_args.text_column),))


# What an LM task declares of its inputs (`tasks.Task`): the engine's preflight runs these checks.
INPUTS = dict(file_formats=FILE_FORMATS, data_files=data_files, check_arguments=check_arguments,
              check_data=check_data)


def load_splits(data_args, do_train, do_eval, cache_dir=None):
    """The DatasetDict a run of these phases needs, with "validation" carved off "train" when the data has none."""
    files = {}
    if do_train or not data_args.validation_file:
        files["train"] = data_args.train_file
    if do_eval:
        files["validation"] = data_args.validation_file
    # `keep_linebreaks` configures the local text builder only; a hub dataset would reject it.
    kwargs = {} if data_args.dataset_name else {"keep_linebreaks": data_args.keep_linebreaks}
    raw = loaders.load_splits(data_args, files, cache_dir, allowed=FILE_FORMATS, **kwargs)
    if "validation" not in raw and not data_args.validation_file and "train" in raw:
        raw["train"], raw["validation"] = split_off_validation(raw["train"], data_args.validation_split_percentage)
    for split, phase in (("train", do_train), ("validation", do_eval)):
        if phase and split not in raw:
            raise UsageError(f"the dataset has no {split!r} split (it has: {', '.join(raw)})")
    return raw


def split_off_validation(dataset, percentage):
    """(train, validation): the first `percentage` percent of the rows (at least one) validate."""
    held_out = max(1, round(len(dataset) * percentage / 100))
    if held_out >= len(dataset):
        raise UsageError(
            f"{len(dataset)} training examples are too few to hold out {percentage}% for validation: "
            "pass --validation_file or add data"
        )
    return dataset.select(range(held_out, len(dataset))), dataset.select(range(held_out))


def resolve_text_column(text_column, dataset):
    """`text_column`, else "text" when present, else the first column; it must hold strings."""
    names = dataset.column_names
    name = text_column or ("text" if "text" in names else names[0])
    if name not in names:
        raise UsageError(f"--text_column {name!r} is not a column of the data; columns: {', '.join(names)}")
    dtype = getattr(dataset.features[name], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise UsageError(f"column {name!r} holds {dtype or 'non-text values'}, not text: pass --text_column")
    return name


# ----------------------------------------------------------------------------------------------
# Sequence length
# ----------------------------------------------------------------------------------------------
def sequence_length(requested, default_cap, tokenizer, config, flag):
    """`--block_size` / `--max_seq_length`: None -> min(default_cap, tokenizer max); at most the model's."""
    return fit_length(requested or min(default_cap, tokenizer.model_max_length), max_positions(config), flag, logger)


# ----------------------------------------------------------------------------------------------
# Tokenizing
# ----------------------------------------------------------------------------------------------
# Rows per `datasets.map` batch. Grouping concatenates one batch's texts and drops its tail shorter
# than a block, so the blocks depend on it: the streamed `Blocks` group the same number of texts.
GROUP_ROWS = 1000


def has_text(text):
    # Blank lines carry no text: alone they would only add special tokens.
    return bool(text) and not text.isspace()


def encode_texts(tokenizer, texts):
    """The token ids (special tokens included) of each text that is not blank."""
    # verbose=False: lines longer than the model are expected here, grouping cuts them up.
    texts = [text for text in texts if has_text(text)]
    if not texts:  # a batch of blank or missing texts only: the fast tokenizers fail on an empty list
        return []
    return tokenizer(texts, return_attention_mask=False, verbose=False)["input_ids"]


def encode_lines(tokenizer, texts, max_length):
    """{"input_ids", "attention_mask"} of each text that is not blank, truncated and padded to `max_length`."""
    texts = [text for text in texts if has_text(text)]
    if not texts:  # as in `encode_texts`
        return {"input_ids": [], "attention_mask": []}
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length)
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def check_lines_tokenizer(tokenizer):
    if tokenizer.pad_token is None:
        raise UsageError("one example per line needs a tokenizer with a padding token: set one, or drop --line_by_line")


def group_texts(examples, block_size):
    """Concatenate every column and cut it into `block_size` chunks; the remainder is dropped.

    Applied per `datasets.map` batch (`GROUP_ROWS` rows), so each batch drops its own short tail.
    """
    concatenated = {key: list(itertools.chain.from_iterable(values)) for key, values in examples.items()}
    total = len(next(iter(concatenated.values()), [])) // block_size * block_size
    return {key: [values[i: i + block_size] for i in range(0, total, block_size)]
            for key, values in concatenated.items()}


def _map(dataset, function, data_args, desc, remove_columns=None):
    return dataset.map(function, batched=True, batch_size=GROUP_ROWS, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=remove_columns, load_from_cache_file=not data_args.overwrite_cache, desc=desc)


def tokenize_and_group(dataset, tokenizer, text_column, block_size, data_args, encode=encode_texts):
    """Every non-blank text tokenized (special tokens included) by `encode(tokenizer, texts)`,
    concatenated, cut into blocks.

    With `preprocessing_num_workers` each worker's part of the rows is grouped on its own, so the
    blocks at the parts' borders differ from a run without workers (and from the streamed `Blocks`').
    """

    def tokenize(examples):
        return {"input_ids": encode(tokenizer, examples[text_column])}

    tokens = _map(dataset, tokenize, data_args, "tokenizing", remove_columns=dataset.column_names)
    return _map(tokens, partial(group_texts, block_size=block_size), data_args, f"grouping into blocks of {block_size}")


def tokenize_lines(dataset, tokenizer, text_column, max_length, data_args):
    """One example per non-blank text, truncated and always padded to `max_length` (fixed shapes)."""
    check_lines_tokenizer(tokenizer)

    def tokenize(examples):
        return encode_lines(tokenizer, examples[text_column], max_length)

    return _map(dataset, tokenize, data_args, "tokenizing lines", remove_columns=dataset.column_names)


# The streamed path's encoders (`utils.data.stream`): texts -> the rows the in-memory path makes of them. Each
# group of `GROUP_ROWS` non-blank texts is encoded on its own, as a `datasets.map` batch is: on one process
# and without shuffling, a stream's blocks equal `tokenize_and_group`'s (with `--preprocessing_num_workers`
# the in-memory path groups each worker's part alone: its rows then differ at the parts' borders).
class Blocks:
    """Texts -> consecutive blocks of `block_size` tokens, the tail shorter than a block dropped."""

    columns = ("input_ids",)
    group_size = GROUP_ROWS
    keeps = staticmethod(has_text)

    def __init__(self, tokenizer, block_size):
        self.tokenizer, self.width = tokenizer, block_size

    def __call__(self, texts):
        ids = self.encode(texts)
        tokens = sum(map(len, ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=tokens)
        return {"input_ids": flat[: tokens // self.width * self.width].reshape(-1, self.width)}

    def encode(self, texts):
        """The token ids of each kept text (`encode_texts`; a subclass may encode otherwise)."""
        return encode_texts(self.tokenizer, texts)

    def copy(self):
        return type(self)(copy.deepcopy(self.tokenizer), self.width)

    def describe(self):
        return {"rows": "blocks", "length": self.width, "vocabulary": len(self.tokenizer)}


class Lines:
    """Texts -> one example per text, truncated and padded to `max_length`, with its attention mask."""

    columns = ("input_ids", "attention_mask")
    group_size = GROUP_ROWS
    keeps = staticmethod(has_text)

    def __init__(self, tokenizer, max_length):
        check_lines_tokenizer(tokenizer)
        self.tokenizer, self.width = tokenizer, max_length

    def __call__(self, texts):
        encoded = encode_lines(self.tokenizer, texts, self.width)
        return {name: np.asarray(encoded[name], np.int32).reshape(-1, self.width) for name in self.columns}

    def copy(self):
        return type(self)(copy.deepcopy(self.tokenizer), self.width)

    def describe(self):
        return {"rows": "lines", "length": self.width, "vocabulary": len(self.tokenizer)}


def read_into_memory(data_args, do_train, do_eval, cache_dir, make_examples, columns, no_examples):
    """(train data or None, validation arrays or None) for the phases that run, read in memory.

    Each split is loaded, cut into examples by `make_examples(dataset, text_column)`, truncated to
    --max_train_samples / --max_eval_samples and kept as memory-mapped `columns`. A split left with
    no example raises UsageError(`no_examples(split)`): the script knows what its examples need.
    """
    splits = [split for split, phase in (("train", do_train), ("validation", do_eval)) if phase]
    raw = load_splits(data_args, do_train, do_eval, cache_dir)
    text_column = resolve_text_column(data_args.text_column, raw[splits[0]])
    arrays = {}
    for split in splits:
        examples = loaders.take(make_examples(raw[split], text_column), preflight.sample_limit(data_args, split))
        if len(examples) == 0:
            raise UsageError(no_examples(split))
        arrays[split] = arrow_columns.to_arrays(examples, columns)
        logger.info("%s: %d examples of %d tokens", split, len(examples), arrays[split]["input_ids"].shape[1])
    train_data = InMemoryData(arrays["train"], len(arrays["train"]["input_ids"])) if "train" in arrays else None
    return train_data, arrays.get("validation")


def read_examples(data_args, training_args, encoder, make_examples, columns, no_examples, cache_dir=None):
    """(train data, validation arrays or None) of an LM task's run: streamed through the task's
    `encoder` (`Blocks`, `Lines`) with --streaming, else read into memory (`read_into_memory`)."""
    if data_args.streaming:
        train_data = StreamedData(data_args, encoder, setup.train_batch_size(training_args), training_args.do_train,
                                  training_args.do_eval, cache_dir)
        return train_data, train_data.eval_arrays
    return read_into_memory(data_args, training_args.do_train, training_args.do_eval, cache_dir, make_examples,
                            columns, no_examples)


# ----------------------------------------------------------------------------------------------
# Loss and metrics
# ----------------------------------------------------------------------------------------------
def token_sums(logits, labels, weights=None, example_weight=None, label_smoothing=0.0, accuracy=False):
    """(loss sum, {"loss", "accuracy" (with `accuracy`), "tokens"}) over the tokens `weights` scores
    (None: every token): their cross-entropy sum, how many the model predicts right, and their weight.

    `example_weight` (eval and predict: 0 for padded rows) scales a row's tokens.
    """
    if weights is None:
        weights = jnp.ones(labels.shape, jnp.float32)
    if example_weight is not None:
        weights = weights * example_weight[:, None]
    loss, tokens = cross_entropy_sums(logits, labels, weights, label_smoothing)
    sums = {"loss": loss}
    if accuracy:
        sums["accuracy"] = ((logits.argmax(-1) == labels) * weights).sum()
    return loss, {**sums, "tokens": tokens}


def num_examples(arrays):
    """The rows of validation `arrays`; 0 for None (no validation data)."""
    return len(arrays["input_ids"]) if arrays is not None else 0


def evaluate(steps, params, arrays, transform=None):
    """The validation metrics of an LM run: the eval step's token-weighted means over every example
    of `arrays` (after `transform`, the same every time), the perplexity of the loss, and "samples"."""
    size = num_examples(arrays)
    metrics, _ = steps.evaluate(params, arrays, size, transform=transform)
    return {**metrics, "perplexity": perplexity(metrics["loss"]), "samples": size}
