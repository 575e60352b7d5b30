"""Streaming language-modeling data: read, tokenize, group, shuffle and batch on the fly, resumably.

For corpora that should not be tokenized into a `datasets` cache first. Per process:

    source (this process's rows) -> tokenizer thread(s) -> fixed-length rows (blocks, or padded lines)
        -> seeded shuffle pool -> bounded queue of host batches -> the caller puts them on the devices

Interface
---------
Sources (each reads only this process's rows, before tokenization):
  `FileSource(paths, text_column=None, keep_linebreaks=True, process_index=0, process_count=1)`
      local txt (a row per line, as `datasets`' text builder), JSON lines (an object per line) or csv
      files, also .gz / .bz2 / .xz; rows dealt round-robin: process p reads the rows r with
      r % process_count == p, counted over all files in order.
  `DatasetSource(dataset, text_column=None, process_index=0, process_count=1)`
      a `datasets.IterableDataset` (`load_dataset(..., streaming=True)`), split over the processes
      by `datasets.distributed.split_dataset_by_node`.
  `open_sources(data_args, process_index, process_count, cache_dir=None)`
      {"train": source, "validation": source when the data has one} from the scripts' data flags
      (`dataset_name`, `dataset_config_name`, `train_file`, `validation_file`, `text_column`,
      `keep_linebreaks`): the training source split over the processes, the validation one whole.
Encoders (texts -> rows of a fixed length, the same rows as the in-memory path):
  `Blocks(tokenizer, block_size)`: `lm.tokenize_and_group` (clm; mlm; a T5 span-corruption script
      would add its noise as the `transform` of the stream).
  `Lines(tokenizer, max_length)`: `lm.tokenize_lines` (mlm --line_by_line): input_ids + attention_mask.
`Stream(source, encoder, batch_size, shuffle_buffer_size=10000, seed=0, workers=1, state=None,
        start=None, transform=None, queue_size=8, agree=all_processes_have, max_passes=1)`
  Iterate it for this process's host batches ({column: int32 [batch_size, length]}), batch_size being
  this process's rows of a global batch, pass after pass over the source (each from `start`, the
  position after the held-out rows, or the source's start), `max_passes` of them (None: until the
  caller stops). `transform(batch, index)` runs in the background thread on
  batch `index` (0-based, counted from the start of training: the step, as in `loop.train_batches`).
  Reading starts when the stream is made, so the shuffle pool fills while the model compiles.
  `workers` tokenizer threads (`--preprocessing_num_workers`, default 1), each with its own copy of
  the tokenizer. `close()` (or `with Stream(...) as stream:`) stops the threads.
`eval_set(train_source, encoder, held_out, validation_source=None, max_examples=None)`
  -> (arrays for `loop.eval_batches`, `start` for the training Stream or None).
`check_one_batch(train_source, encoder, local_batch_size, start, global_batch_size)`: UsageError
  unless every process's part of a pass gives a batch (before a run writes anything).
`read_examples(source, encoder, limit=None, start=None)` -> (arrays, position after them).
`all_processes_have(flag)`: True when every process passes True (a host allgather; no-op alone).

How a batch is drawn: fixed-length rows enter a pool of `shuffle_buffer_size + batch_size` rows;
once it is full, each batch takes `batch_size` distinct random rows of it (numpy Generator seeded by
(seed, process index, pass - 1): each pass is reshuffled, the same way in every run) and the next
rows of the stream take their places. When the source runs dry the pool drains in random order;
the rows left, fewer than `batch_size`, are dropped (as an in-memory epoch drops its remainder), and
the next pass starts with an empty pool. `shuffle_buffer_size=0` gives the rows in stream order.
A hub dataset is read in its own order every pass (it is not shuffled by `datasets`, so
`set_epoch` would change nothing): the pool's per-pass seed is the reshuffle.

Passes: a pass ends when one process runs out of its rows (`agree`, below); every process then
starts the next one at the same step, logging "pass N of the training stream starts at step S".
A pass that gives not one batch is a UsageError (never an endless loop of empty passes).

Grouping: like `lm.tokenize_and_group` (which groups per `datasets.map` batch of `lm.GROUP_ROWS`
rows of the tokenized, i.e. non-blank, texts), the stream concatenates each run of `lm.GROUP_ROWS`
non-blank texts of this process and drops each run's tail shorter than a block; on one process and
without shuffling, the rows equal the in-memory path's (with `--preprocessing_num_workers` the
in-memory path groups each worker's part alone: its rows then differ at the parts' borders).

Exact resume
------------
`stream.state_after(n)` -> {"meta": JSON-able dict, "arrays": {column: int32 [shuffle_buffer_size +
batch_size, length]}} is the stream after its first n batches: the source position of the group of
texts being read and how many of its rows were taken, the pool (its first meta["size"] rows count,
the rest are zeros), the RNG state, the batch count, the pass and the steps before it.
`Stream(..., state=saved)` continues exactly as the uninterrupted stream would have (shuffling and
passes included); it refuses (UsageError) a state made with other settings (source, encoder, batch
size, shuffle size, seed, process index and count, the held-out `start`). The
arrays have a shape known from the flags (`state_template()`), so they can be one more item of the
orbax checkpoint, restored into a template. Saving copies the pool (~20 MB for 10,000 blocks of 512
tokens) and nothing else.
- n may be any of the last `HISTORY` + 1 batches handed out, not only the last one: a caller that
  prefetches k batches onto the devices saves step s with `state_after(s)` although it has taken
  s + k batches (the stream undoes its later pool changes on the copy, a new pass's included: the
  pool is copied once a pass for that, while the steps before the pass can still be asked for).
- With several processes every process has its own state: each saves its own (orbax writes only
  process 0's host arrays and JSON: gather them with a host allgather, they have one shape on every
  process, or write one item per process) and resumes from its own.
- What a resume re-reads: local uncompressed files are opened at the saved byte offset (a seek: the
  consumed part is never read again), plus the one group of texts being read at the save (at most
  `lm.GROUP_ROWS` texts, re-tokenized). Compressed files cannot seek: the file being read is
  decompressed from its start up to the offset (not parsed, not tokenized: 0.14 s more for 71 MB of
  gzipped text in benchmarks/data.py), the files before it are skipped. `DatasetSource` (hub data) resumes with datasets'
  `IterableDataset.load_state_dict`, which skips the shards (files) already read but regenerates and
  discards the examples before the saved one inside the current shard (datasets 5.0.1:
  `ExamplesIterable.__iter__` islices the shard's generator from its start, `ArrowExamplesIterable`
  reads and drops its tables): the consumed part of the current shard is downloaded and parsed
  again, not tokenized.
- The held-out eval rows (`eval_set`) are not in the state: rebuild them on resume (they are the
  first rows of the stream, cheap to read) and pass the same `start` (every later pass begins there).

Multi-host
----------
Each process reads its own rows (above) and makes its own batches; every `next()` asks
`agree(has_batch)` (default `all_processes_have`, a tiny allgather in the consumer's thread), so all
processes end a pass at the same step as soon as one runs dry, dropping the others' last batches of
it (the next pass, or the end after `max_passes`). When do 2 processes x 4 devices see the same
global batches (as sets of rows per step) as 1 x 8? (The answers hold for every pass: one process's
pass has floor(N / B) batches, and so has the process with the fewest rows.)
- One example per row (`Lines`), `shuffle_buffer_size=0`, no blank rows, a `FileSource` (or a
  `DatasetSource` whose shard count is not a multiple of the process count, which datasets splits by
  examples too): yes. Process p's i-th row is global row i * P + p, so the P local batches of step s
  hold exactly global rows [s * B, (s + 1) * B) (B the global batch), as one process's batch s does;
  only their order within the global batch differs (and MLM masks, drawn per process).
- Blank rows: no (they are dropped per process after the split, so the processes' rows shift).
- Blocks: no. Each process concatenates its own texts, so a block mixes other texts.
- Shuffling: no. Each process has its own pool and RNG (seeded with its index).
- `DatasetSource` with a shard count that is a multiple of the process count: no (each process
  reads whole shards of its own).
The held-out eval set is the first ceil(N / P) rows of each process's stream, gathered in process
order: the same on every process, but it depends on P.
"""

import collections
import contextlib
import copy
import csv
import io
import itertools
import json
import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.experimental import multihost_utils

from utils import devices, file_formats
from tasks import lm
from utils.errors import UsageError, is_disk_full

FORMATS = ("json", "csv", "text")
STATE_VERSION = 2  # 2: passes (the pass, its first step, the start of every pass)
# Steps before the last one handed out that `state_after` can still describe: covers a caller's prefetch.
HISTORY = 16
logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Multi-host
# ----------------------------------------------------------------------------------------------
def all_processes_have(flag):
    """Whether every process passed a true `flag` (call it on every process at the same point)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.all(multihost_utils.process_allgather(np.int32(bool(flag)))))


def _gather_processes(rows):
    """Every process's `rows` concatenated in process order (the identity alone)."""
    if jax.process_count() == 1:
        return rows
    return np.asarray(multihost_utils.process_allgather(rows, tiled=True))


# ----------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------
def _decode(raw, path, offset):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"data file {path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {offset + e.start}; "
                         "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _text_lines(text, keep_linebreaks):
    """A file line as `datasets`' text builder reads it: universal newlines (a lone \\r ends a line too)."""
    if "\r" in text:
        lines = io.StringIO(text.replace("\r\n", "\n").replace("\r", "\n")).readlines()
    else:
        lines = [text]
    return lines if keep_linebreaks else [line.rstrip("\n") for line in lines]


class FileSource:
    """Local data files read by byte offset, one row after another, this process's rows only.

    Rows: a line of a txt file (its text), an object of a JSON lines file, a record of a csv file (the
    text column's value; None where it is missing). Blank JSON and csv lines are not rows.
    """

    def __init__(self, paths, text_column=None, keep_linebreaks=True, process_index=0, process_count=1):
        self.paths = [os.path.abspath(path) for path in ([paths] if isinstance(paths, str) else paths)]
        if not self.paths:
            raise UsageError("no data files to stream: pass --train_file")
        formats = {file_formats.file_builder(path, FORMATS) for path in self.paths}
        if len(formats) > 1:
            raise UsageError(f"data files must share one format, got {', '.join(sorted(formats))}")
        self.format = formats.pop()
        self.keep_linebreaks = keep_linebreaks
        self.process_index, self.process_count = process_index, process_count
        self.text_column = self._resolve_column(text_column)

    def _resolve_column(self, requested):
        """`requested`, else "text" when present, else the first column (of the first file)."""
        if self.format == "text":
            if requested not in (None, "text"):
                raise UsageError(f"--text_column {requested!r}: txt files have one column, 'text'")
            return "text"
        columns = self._columns(self.paths[0])
        name = requested or ("text" if "text" in columns else columns[0])
        if name not in columns:
            raise UsageError(f"--text_column {name!r} is not a column of {self.paths[0]}; its columns: "
                             f"{', '.join(columns)}")
        return name

    def _columns(self, path):
        with file_formats.open_content(path) as f:
            offset = 0
            for raw in f:
                if self.format == "csv":
                    return self._header(path, raw)
                if raw.strip():
                    return list(self._json_row(path, raw, offset))
                offset += len(raw)
        raise UsageError(f"data file {path} has no rows")

    @staticmethod
    def _header(path, raw):
        header = next(csv.reader([_decode(raw, path, 0).removeprefix("\ufeff")]), [])
        if not any(name.strip() for name in header):
            raise UsageError(f"data file {path} has no CSV header row: its first line must name the columns")
        return header

    @staticmethod
    def _json_row(path, raw, offset):
        text = _decode(raw, path, offset)
        try:
            row = json.loads(text.removeprefix("\ufeff") if offset == 0 else text)
        except json.JSONDecodeError as e:
            raise UsageError(f"data file {path} at byte {offset} is not a JSON line ({e.msg}): streaming reads "
                             "one JSON object per line (JSON lines); convert a JSON document, e.g. "
                             "jq -c '.[]' in.json > out.jsonl") from None
        if not isinstance(row, dict):
            raise UsageError(f"data file {path} at byte {offset} holds a JSON {type(row).__name__}, not an object: "
                             'streaming reads one JSON object per line, e.g. {"text": "..."}')
        return row

    def describe(self):
        """What a resumed stream must read again (compared with the checkpoint's)."""
        return {"files": self.paths, "text_column": self.text_column, "keep_linebreaks": self.keep_linebreaks,
                "process": [self.process_index, self.process_count]}

    def start(self):
        return {"file": 0, "offset": 0, "skip": 0, "row": 0}

    def open(self, position):
        return _FileReader(self, position)


class _FileReader:
    """This process's row texts from `position` on; `position()` is the one after the last row given.

    A position: the file, the byte offset (of the decompressed content) of the next line, how many
    rows of that line were already given (a txt line holding lone \\r is several rows), the
    global row number (for the split over processes).
    """

    def __init__(self, source, position):
        self.source = source
        self.file, self.offset, self.skip, self.row = (position[key] for key in ("file", "offset", "skip", "row"))

    def position(self):
        return {"file": self.file, "offset": self.offset, "skip": self.skip, "row": self.row}

    def __iter__(self):
        source = self.source
        while self.file < len(source.paths):
            path = source.paths[self.file]
            rows = {"text": self._text_rows, "json": self._json_rows, "csv": self._csv_rows}[source.format]
            for text in rows(path):
                mine = self.row % source.process_count == source.process_index
                self.row += 1
                if mine:
                    yield text
            self.file, self.offset, self.skip = self.file + 1, 0, 0

    def _text_rows(self, path):
        with file_formats.open_content(path) as f:
            f.seek(self.offset)  # compressed: decompresses up to there
            for raw in f:
                start = self.offset
                lines = _text_lines(_decode(raw, path, start), self.source.keep_linebreaks)
                for index in range(self.skip, len(lines)):
                    if index + 1 < len(lines):
                        self.skip = index + 1
                    else:  # the line's last row: the next one starts after it
                        self.offset, self.skip = start + len(raw), 0
                    yield lines[index]
                self.offset, self.skip = start + len(raw), 0

    def _json_rows(self, path):
        with file_formats.open_content(path) as f:
            f.seek(self.offset)
            for raw in f:
                start = self.offset
                self.offset = start + len(raw)
                if raw.strip():
                    value = FileSource._json_row(path, raw, start).get(self.source.text_column)
                    yield self._checked(value, path, start)

    def _csv_rows(self, path):
        with file_formats.open_content(path) as f:
            header_line = f.readline()
            header = FileSource._header(path, header_line)
            if self.source.text_column not in header:
                raise UsageError(f"--text_column {self.source.text_column!r} is not a column of {path}; its columns: "
                                 f"{', '.join(header)}")
            index = header.index(self.source.text_column)
            self.offset = max(self.offset, len(header_line))
            f.seek(self.offset)
            # csv takes a record's lines (a quoted field may span several) and no more: the offset
            # after each record is where the next one starts.
            for record in csv.reader(self._counted_lines(f, path)):
                if record:  # a blank line is no record
                    yield record[index] if index < len(record) else None

    def _counted_lines(self, f, path):
        for raw in f:
            start = self.offset
            self.offset = start + len(raw)
            yield _decode(raw, path, start)

    @staticmethod
    def _checked(value, path, offset):
        if value is not None and not isinstance(value, str):
            raise UsageError(f"data file {path} at byte {offset}: the text column holds {type(value).__name__}, "
                             "not text: pass --text_column")
        return value


class DatasetSource:
    """The rows of a `datasets.IterableDataset` (hub streaming), this process's part only."""

    def __init__(self, dataset, text_column=None, process_index=0, process_count=1):
        from datasets.distributed import split_dataset_by_node

        columns = dataset.column_names  # None when the dataset does not declare its features
        name = text_column or ("text" if not columns or "text" in columns else columns[0])
        if columns and name not in columns:
            raise UsageError(f"--text_column {name!r} is not a column of the data; columns: {', '.join(columns)}")
        self.text_column = name
        self.process_index, self.process_count = process_index, process_count
        self.dataset = split_dataset_by_node(dataset, process_index, process_count) if process_count > 1 else dataset
        self._description = {"dataset": dataset.info.dataset_name, "config": dataset.info.config_name,
                             "split": str(dataset.split), "text_column": name,
                             "process": [process_index, process_count]}

    def describe(self):
        return self._description

    def start(self):
        return None  # datasets' own state dicts; None: from the beginning

    def open(self, position):
        return _DatasetReader(self, position)


class _DatasetReader:
    def __init__(self, source, position):
        self.source, self.opened_at, self.started = source, position, False
        source.dataset.load_state_dict(position)

    def position(self):
        return self.source.dataset.state_dict() if self.started else self.opened_at

    def __iter__(self):
        for example in self.source.dataset:
            self.started = True
            value = example.get(self.source.text_column)
            if value is not None and not isinstance(value, str):
                raise UsageError(f"column {self.source.text_column!r} holds {type(value).__name__}, not text: "
                                 "pass --text_column")
            yield value


def open_sources(data_args, process_index=0, process_count=1, cache_dir=None):
    """{"train": the training source split over the processes, "validation": the whole validation
    source, when the data has one} for the scripts' data arguments."""
    if data_args.dataset_name:
        splits = _stream_hub_dataset(data_args, cache_dir)
        if "train" not in splits:
            raise UsageError(f"the dataset has no 'train' split (it has: {', '.join(splits)})")
        sources = {"train": DatasetSource(splits["train"], data_args.text_column, process_index, process_count)}
        if "validation" in splits:
            sources["validation"] = DatasetSource(splits["validation"], data_args.text_column)
        return sources
    if not data_args.train_file:
        raise UsageError("no data: pass --dataset_name or --train_file")
    text_column, breaks = data_args.text_column, data_args.keep_linebreaks
    sources = {"train": FileSource(data_args.train_file, text_column, breaks, process_index, process_count)}
    if data_args.validation_file:
        sources["validation"] = FileSource(data_args.validation_file, text_column, breaks)
    return sources


def _stream_hub_dataset(data_args, cache_dir):
    import datasets

    from utils import hub

    name = data_args.dataset_name
    try:
        return datasets.load_dataset(name, data_args.dataset_config_name, cache_dir=cache_dir, streaming=True)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        if is_disk_full(e):
            raise
        offline = hub.offline_reason(datasets=True)
        if offline and not os.path.exists(name):
            raise UsageError(f"could not stream dataset {name!r}: {offline}; pass local files (--train_file, ...) "
                             "or run where the hub is reachable") from e
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"could not stream dataset {name!r}: {first} (check --dataset_name and "
                         "--dataset_config_name)") from e


# ----------------------------------------------------------------------------------------------
# Encoders
# ----------------------------------------------------------------------------------------------
class Blocks:
    """Texts -> consecutive blocks of `block_size` tokens, the tail shorter than a block dropped."""

    columns = ("input_ids",)

    def __init__(self, tokenizer, block_size):
        self.tokenizer, self.width = tokenizer, block_size

    def __call__(self, texts):
        ids = lm.encode_texts(self.tokenizer, texts)
        tokens = sum(map(len, ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=tokens)
        return {"input_ids": flat[: tokens // self.width * self.width].reshape(-1, self.width)}

    def copy(self):
        return type(self)(copy.deepcopy(self.tokenizer), self.width)

    def describe(self):
        return {"rows": "blocks", "length": self.width, "vocabulary": len(self.tokenizer)}


class Lines:
    """Texts -> one example per text, truncated and padded to `max_length`, with its attention mask."""

    columns = ("input_ids", "attention_mask")

    def __init__(self, tokenizer, max_length):
        lm.check_lines_tokenizer(tokenizer)
        self.tokenizer, self.width = tokenizer, max_length

    def __call__(self, texts):
        encoded = lm.encode_lines(self.tokenizer, texts, self.width)
        return {name: np.asarray(encoded[name], np.int32).reshape(-1, self.width) for name in self.columns}

    def copy(self):
        return type(self)(copy.deepcopy(self.tokenizer), self.width)

    def describe(self):
        return {"rows": "lines", "length": self.width, "vocabulary": len(self.tokenizer)}


def _groups_of_texts(reader):
    """(position before, texts) of each run of `lm.GROUP_ROWS` non-blank texts."""
    texts = (text for text in reader if lm.has_text(text))
    while True:
        position = reader.position()
        group = list(itertools.islice(texts, lm.GROUP_ROWS))
        if not group:
            return
        yield position, group


# ----------------------------------------------------------------------------------------------
# Reading whole (eval sets)
# ----------------------------------------------------------------------------------------------
def read_examples(source, encoder, limit=None, start=None):
    """(arrays, position after them) of the first `limit` rows (None: all) from `start` on, in order.

    A position is {"source": the source position of a group of texts, "taken": its rows already
    read}: what `Stream(start=...)` continues from.
    """
    position, taken = (start["source"], start["taken"]) if start else (source.start(), 0)
    parts, count, skip = {name: [] for name in encoder.columns}, 0, taken
    for group_position, texts in _groups_of_texts(source.open(position)):
        rows = encoder(texts)
        available = len(rows[encoder.columns[0]])
        stop = available if limit is None else min(available, skip + limit - count)
        for name in encoder.columns:
            parts[name].append(rows[name][skip:stop])
        count += max(stop - skip, 0)
        position, taken, skip = group_position, stop, 0
        if limit is not None and count >= limit:
            break
    arrays = {name: np.concatenate(parts[name]) if parts[name] else np.zeros((0, encoder.width), np.int32)
              for name in encoder.columns}
    return arrays, {"source": position, "taken": taken}


def eval_set(train_source, encoder, held_out, validation_source=None, max_examples=None, gather=_gather_processes):
    """(eval arrays, training start) for a streamed run: the validation source's first `max_examples`
    rows (None: all) and start None when there is one; else the first `held_out` rows of the training
    stream, which the training Stream skips when made with `start=` the returned start.

    Every process gets the same eval arrays. Held out: each process takes the first
    ceil(held_out / processes) rows of its own part, gathered in process order (`gather`).
    """
    if validation_source is not None:
        arrays, _ = read_examples(validation_source, encoder, max_examples)
        if not len(arrays["input_ids"]):
            raise UsageError("the validation data gives no examples (no text, or fewer tokens than one block)")
        return arrays, None
    local = -(-held_out // train_source.process_count)
    arrays, start = read_examples(train_source, encoder, local)
    if len(arrays["input_ids"]) < local:
        raise UsageError(f"the training data of process {train_source.process_index} gives only "
                         f"{len(arrays['input_ids'])} examples, fewer than the {local} to hold out for evaluation: "
                         "hold out fewer, pass --validation_file, or add data")
    return {name: gather(rows) for name, rows in arrays.items()}, start


# ----------------------------------------------------------------------------------------------
# The stream
# ----------------------------------------------------------------------------------------------
class _Batch:
    def __init__(self, pass_, event, batch):
        self.pass_, self.event, self.batch = pass_, event, batch


class _PassEnd:
    def __init__(self, pass_):
        self.pass_ = pass_


class _Failed:
    def __init__(self, error):
        self.error = error


def _first_difference(saved, current, where=""):
    """(key path, saved value, current value) of the first difference of two JSON values, or None."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            found = _first_difference(saved.get(key), current.get(key), f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    return None if saved == current else (where, saved, current)


# What a resume refused for a setting must change back (the settings' own flags otherwise).
_SETTING_HINTS = {"start": " (the rows held out for evaluation: --do_eval, --max_eval_samples, --validation_file)"}


class Stream:
    """This process's host batches of a streamed source, pass after pass; see the module docstring."""

    def __init__(self, source, encoder, batch_size, shuffle_buffer_size=10000, seed=0, workers=1, state=None,
                 start=None, transform=None, queue_size=8, agree=all_processes_have, max_passes=1):
        if batch_size <= 0 or shuffle_buffer_size < 0 or workers <= 0 or (max_passes is not None and max_passes < 1):
            raise ValueError(f"batch_size {batch_size}, workers {workers} and max_passes {max_passes} must be "
                             f"positive, shuffle_buffer_size {shuffle_buffer_size} not negative")
        self.source, self.encoder, self.batch_size = source, encoder, batch_size
        self.shuffle_buffer_size, self.workers = shuffle_buffer_size, workers
        self.transform, self.agree, self.max_passes = transform, agree, max_passes
        self.seed = seed
        self._start = (start["source"], start["taken"]) if start else (source.start(), 0)
        self.settings = {"source": source.describe(), "encoder": encoder.describe(), "batch_size": batch_size,
                         "shuffle_buffer_size": shuffle_buffer_size, "seed": seed, "start": start}
        capacity = shuffle_buffer_size + batch_size
        self._pool = {name: np.zeros((capacity, encoder.width), np.int32) for name in encoder.columns}
        # Producer (the pass it reads and its place in it) and consumer (steps handed out, the pass
        # all processes are in and the steps before it) start where the state says, else at pass 1.
        self._begin_pass(1)
        self._step, self._pass, self._first = 0, 1, 0
        if state is not None:
            self._load(state)
        self._meta = self._snapshot(*self._group)
        # Undo entries of the producer's events (batches drawn, passes begun), numbered from 1, and
        # the event after which each recent step's batch came: `state_after` undoes the later ones.
        self._events, self._history = 0, collections.deque()
        self._steps = collections.deque([(self._step, 0, self._first)], maxlen=HISTORY + 1)
        self._lock, self._local = threading.Lock(), threading.local()
        self._entered = threading.Condition()  # the consumer entered a pass: its first step is known
        self._queue, self._stop = queue.Queue(maxsize=queue_size), threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="stream", daemon=True)
        self._thread.start()

    # --- state ---------------------------------------------------------------------------------
    def state_template(self):
        """{column: (shape, dtype)} of the state's arrays (e.g. for an orbax restore template)."""
        return {name: (pool.shape, pool.dtype) for name, pool in self._pool.items()}

    def _begin_pass(self, number):
        """The producer at the start of pass `number`: an empty pool, the source at `start`, the
        pass's own RNG (a pure function of the seed, the process and the pass)."""
        self._reading, self._size, self._exhausted = number, 0, False
        self._group = self._start
        # Pass 1's RNG is [seed, process]'s (trailing zeros do not change a numpy SeedSequence).
        self._rng = np.random.default_rng([self.seed, self.source.process_index, number - 1])

    def _snapshot(self, position, taken):
        return {"version": STATE_VERSION, "settings": self.settings, "pass": self._reading, "source": position,
                "taken": taken, "size": self._size, "exhausted": self._exhausted,
                "rng": self._rng.bit_generator.state}

    def _load(self, state):
        meta, arrays = state["meta"], state["arrays"]
        if meta.get("version") != STATE_VERSION:
            raise UsageError(f"cannot resume the data stream: its state has version {meta.get('version')}, this "
                             f"code reads version {STATE_VERSION}")
        difference = _first_difference(meta["settings"], self.settings)
        if difference:
            key, saved, current = difference
            raise UsageError(f"cannot resume the data stream: {key} is {saved!r} in the checkpoint but {current!r} "
                             f"in this run{_SETTING_HINTS.get(key.split('.')[0], '')}; resume with the same data "
                             "settings")
        for name, pool in self._pool.items():
            pool[...] = arrays[name]
        self._reading, self._size, self._exhausted = meta["pass"], meta["size"], meta["exhausted"]
        self._rng.bit_generator.state = meta["rng"]
        self._group = (meta["source"], meta["taken"])
        self._step, self._pass, self._first = meta["batches"], meta["pass"], meta["first"]

    def state_after(self, batches):
        """The state after the first `batches` batches (counted from the start of training): one of
        the last `HISTORY` + 1 handed out (a caller may have taken some more ahead)."""
        with self._lock:
            found = [entry for entry in self._steps if entry[0] == batches]
            if not found:
                raise ValueError(f"the stream can describe batches {self._steps[0][0]} to {self._steps[-1][0]}, "
                                 f"not {batches}")
            _, event, first = found[0]
            meta = self._meta
            undo = [entry for entry in self._history if entry[0] > event]
            pool = {name: rows.copy() for name, rows in self._pool.items()}
        for _, meta_before, kept, rows_before in reversed(undo):
            for name in pool:
                pool[name][kept] = rows_before[name]
            meta = meta_before
        for rows in pool.values():
            rows[meta["size"]:] = 0
        return {"meta": {**copy.deepcopy(meta), "batches": batches, "first": first}, "arrays": pool}

    def _record(self, kept):
        """Log how to undo the event about to change the pool rows `kept` (call with the lock held)."""
        self._events += 1
        self._history.append((self._events, self._meta, kept,
                              {name: pool[kept].copy() for name, pool in self._pool.items()}))
        return self._events

    # --- producer (background thread) ----------------------------------------------------------
    def _encode(self, texts):
        if not hasattr(self._local, "encoder"):  # tokenizers are not safe to share between threads
            self._local.encoder = self.encoder.copy()
        return self._local.encoder(texts)

    def _encoded_groups(self):
        """(position before, rows) of each group of texts from the group being read on, tokenized by
        `workers` threads, in order (none once the source was read to its end)."""
        if self._exhausted:
            return
        reader = self.source.open(self._group[0])
        groups, pending = _groups_of_texts(reader), collections.deque()
        with ThreadPoolExecutor(self.workers, thread_name_prefix="stream-tokenizer") as pool:
            for position, texts in groups:
                pending.append((position, pool.submit(self._encode, texts)))
                if len(pending) > self.workers:
                    position, future = pending.popleft()
                    yield position, future.result()
                if self._stop.is_set() or self._pass > self._reading:
                    return
            for position, future in pending:
                yield position, future.result()

    def _draw(self):
        """(event, batch) of each batch of the pass being read, until it drains or the consumer
        leaves it, changing the pool in place and logging how to undo it."""
        columns = self.encoder.columns
        capacity = len(self._pool[columns[0]])
        position, used = self._group
        skip = used  # rows of the first group read (the one at `position`) taken before
        rows = None
        groups = self._encoded_groups()
        try:
            while self._pass <= self._reading:  # until the consumer leaves this pass (its rest would be dropped)
                size_before = size = self._size
                while size < capacity and not self._exhausted:
                    if rows is None or used == len(rows[columns[0]]):
                        group = next(groups, None)
                        if group is None:
                            self._exhausted = True
                            break
                        (position, rows), used, skip = group, skip, 0
                        continue
                    count = min(capacity - size, len(rows[columns[0]]) - used)
                    for name in columns:
                        self._pool[name][size: size + count] = rows[name][used: used + count]
                    size, used = size + count, used + count
                if size < self.batch_size:  # the pass is over: fewer rows than a batch are left (dropped)
                    return
                if self.shuffle_buffer_size:
                    chosen = self._rng.choice(size, self.batch_size, replace=False)
                else:
                    chosen = np.arange(self.batch_size)
                batch = {name: self._pool[name][chosen] for name in columns}
                # The rows left fill the chosen places below the new size; the pool stays contiguous.
                remaining = size - self.batch_size
                holes = chosen[chosen < remaining]
                movers = np.setdiff1d(np.arange(remaining, size), chosen, assume_unique=True)
                with self._lock:
                    event = self._record(holes[holes < size_before])  # rows of the pool before this batch that change
                    for name in columns:
                        self._pool[name][holes] = self._pool[name][movers]
                    self._size = remaining
                    self._meta = self._snapshot(position, used)
                yield event, batch
        finally:
            groups.close()

    def _next_pass(self):
        """Begin the next pass. The whole pool is logged for undo: the new pass's rows overwrite rows
        that the states of the last pass still hold."""
        with self._lock:
            self._record(np.arange(len(self._pool[self.encoder.columns[0]])))
            self._begin_pass(self._reading + 1)
            self._meta = self._snapshot(*self._group)

    def _first_step_of(self, pass_):
        """The step index of pass `pass_`'s first batch, once the consumer has entered that pass
        (every process ended the one before at the same step); None when the stream stops."""
        with self._entered:
            while self._pass < pass_ and not self._stop.is_set():
                self._entered.wait(0.1)
            return self._first if self._pass == pass_ else None

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self):
        index = self._step  # of the next batch, for `transform`; None until the consumer enters a new pass
        try:
            while True:
                with contextlib.closing(self._draw()) as draws:  # closing it stops the tokenizer threads
                    for event, batch in draws:
                        if index is None:
                            index = self._first_step_of(self._reading)
                            if index is None:
                                return
                        if self.transform:
                            batch = self.transform(batch, index)
                        if not self._put(_Batch(self._reading, event, batch)):
                            return
                        index += 1
                if not self._put(_PassEnd(self._reading)) or self._reading == self.max_passes:
                    return
                self._next_pass()
                index = None
        except BaseException as error:  # raised again in the consumer's thread
            self._put(_Failed(error))

    # --- consumer ------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        while not self._finished:
            item = self._queue.get()
            if isinstance(item, _Failed):
                self.close()
                raise item.error
            if item.pass_ < self._pass:
                continue  # the rest of a pass that another process's end of data ended
            if self.agree(isinstance(item, _Batch)):
                return self._hand_out(item)
            # A process ran out of this pass's rows: every process ends the pass at this step.
            if self._step == self._first:
                self.close()
                raise UsageError(f"the training data gives no batch in pass {self._pass}: a process has fewer than "
                                 f"{self.batch_size} examples (its rows of a global batch): add data or lower the "
                                 "batch size")
            if self._pass == self.max_passes:
                logger.info("pass %d of the training stream ended at step %d, the last of --max_stream_passes %d",
                            self._pass, self._step, self.max_passes)
                break
            with self._entered:
                self._pass, self._first = self._pass + 1, self._step
                self._entered.notify_all()
            logger.info("pass %d of the training stream starts at step %d", self._pass, self._step + 1)
        self.close()
        raise StopIteration

    def _hand_out(self, item):
        self._step += 1
        with self._lock:
            self._steps.append((self._step, item.event, self._first))
            while self._history and self._history[0][0] <= self._steps[0][1]:
                self._history.popleft()  # no state `state_after` can still be asked for needs it
        return item.batch

    def close(self):
        """Stop reading (the threads end after the group they are on). Safe to call again."""
        self._finished = True
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------------
# A streamed training run's data, as the LM scripts use it
# ----------------------------------------------------------------------------------------------
DEFAULT_EVAL_EXAMPLES = 10000


class StreamedData:
    """`--streaming`: the eval set (the validation data's first `--max_eval_samples` examples, else
    that many of the training stream's first, held out from training on every pass) and the
    training batches, read, tokenized and shuffled on the fly, pass after pass until `--max_steps`
    (or `--max_stream_passes`). The methods are those of `utils.loop.InMemoryData`; checkpoints keep
    the stream's state (`state_after`), a resumed run gets it back (`resume_from`)."""

    def __init__(self, data_args, training_args, encoder, cache_dir=None):
        self.data_args, self.encoder = data_args, encoder
        self.size = None  # a stream has no length
        self.sources = open_sources(data_args, jax.process_index(), jax.process_count(), cache_dir)
        self.eval_arrays, self._start = None, None
        if training_args.do_eval:
            limit = data_args.max_eval_samples or DEFAULT_EVAL_EXAMPLES
            self.eval_arrays, self._start = eval_set(self.sources["train"], encoder, limit,
                                                     self.sources.get("validation"), limit)
        global_batch_size = devices.global_batch_size(training_args.per_device_train_batch_size,
                                                      training_args.gradient_accumulation_steps)
        # Process p reads rows p, p + P, ... of the stream (round robin): those are its rows' places in
        # the global batch, so an example's mask is the same on any number of processes.
        local = global_batch_size // jax.process_count()
        self._row_ids = np.arange(local) * jax.process_count() + jax.process_index()
        if training_args.do_train:
            check_one_batch(self.sources["train"], encoder, local, self._start, global_batch_size)
        self._state, self._stream = None, None

    def example_batch(self, global_batch_size, transform=None):
        batch = {name: np.zeros((len(self._row_ids), self.encoder.width), np.int32) for name in self.encoder.columns}
        return transform(batch, 0, self._row_ids) if transform else batch

    def batches(self, global_batch_size, seed, steps_per_epoch, start_step, total_steps, layout, transform=None):
        """This process's rows of each global batch from `start_step` on, placed by `layout`; fewer
        than `total_steps - start_step` when `--max_stream_passes` ends the stream first (every
        process stops at the same step)."""
        masked = None if transform is None else (lambda batch, step: transform(batch, step, self._row_ids))
        self._stream = Stream(self.sources["train"], self.encoder, len(self._row_ids),
                              self.data_args.shuffle_buffer_size, seed, self.data_args.preprocessing_num_workers or 1,
                              state=self._state, start=self._start, transform=masked,
                              max_passes=self.data_args.max_stream_passes)
        return layout.prefetch(itertools.islice(self._stream, total_steps - start_step))

    def state_template(self):
        """{column: (shape, dtype)} of the stream state's arrays (the shuffle pool) for this run."""
        rows = self.data_args.shuffle_buffer_size + len(self._row_ids)
        return {name: ((rows, self.encoder.width), np.dtype(np.int32)) for name in self.encoder.columns}

    def state_after(self, step):
        return self._stream.state_after(step)

    def resume_from(self, state):
        self._state = state


def check_one_batch(train_source, encoder, local_batch_size, start, global_batch_size, gather=_gather_processes):
    """UsageError, on every process, unless each process's part of a pass (from `start`, after the
    held-out rows) gives one batch: else no pass could ever give a step (checked before the run
    writes anything, by reading at most the first group of texts)."""
    arrays, _ = read_examples(train_source, encoder, local_batch_size, start)
    counts = gather(np.array([len(arrays["input_ids"])]))
    if counts.min() >= local_batch_size:
        return
    if len(counts) == 1:
        where, need = "", f"one global batch of {global_batch_size}"
    else:
        where = f" in process {int(counts.argmin())}'s part"
        need = f"its {local_batch_size} rows of a global batch of {global_batch_size}"
    held_out = " after the rows held out for evaluation" if start else ""
    raise UsageError(f"the training data gives {int(counts.min())} examples{where}{held_out}, fewer than {need} "
                     "(per_device_train_batch_size x devices x gradient_accumulation_steps): lower the batch size, "
                     f"add data{' or hold out fewer (--max_eval_samples)' if start else ''}")
