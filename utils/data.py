"""Loading datasets and turning them into fixed-shape host batches.

Training batches are a pure function of (seed, epoch, step): the order of an epoch is a seeded
permutation, so a resumed run sees exactly the remaining batches of the uninterrupted one, and
every process of a pod derives the same order and loads only its own slice. `TrainOrder` computes
each epoch's permutation once, so a batch costs O(batch) on the host whatever the dataset's size.

Token columns are read in place from the Arrow tables of the `datasets` cache (`to_arrays` ->
`ArrowColumn`): the cache files are memory-mapped, so the corpus is never copied into the process's
memory; only the rows of a batch are.
"""

import bz2
import codecs
import contextlib
import csv
import gzip
import io
import json
import lzma
import os
import zlib

import numpy as np
import pyarrow as pa

from utils import hub
from utils.errors import UsageError, is_disk_full

EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}
# Compressions `datasets` decompresses by itself (map-style and streaming) that the stdlib can stream
# for `check_file` too: (name, opener). zstd would need the zstandard package.
COMPRESSIONS = {".gz": ("gzip", gzip.open), ".bz2": ("bzip2", bz2.open), ".xz": ("xz", lzma.open)}
# How much of a local file `check_file` parses (JSON lines, CSV header) before anything loads it;
# its UTF-8 check reads the whole file (about a second per GB).
PREREAD_BYTES = 16 << 20
_CHUNK_BYTES = 16 << 20


def file_builder(path, allowed=("json", "csv", "text")):
    """The `datasets` builder for a local file, checking that the file is usable first."""
    if not os.path.isfile(path):
        raise UsageError(f"data file {path} not found: check the path")
    builder = EXTENSIONS.get(_extensions(path)[0])
    if builder not in allowed:
        names = sorted(ext for ext, b in EXTENSIONS.items() if b in allowed)
        raise UsageError(f"data file {path} has an unsupported extension: use one of {', '.join(names)}, "
                         f"or one of them compressed as {', '.join(COMPRESSIONS)} (e.g. {names[0]}.gz)")
    if os.path.getsize(path) == 0:
        raise UsageError(f"data file {path} is empty")
    return builder


def _extensions(path):
    """(format extension, compression extension or ""), lower case: "a.JSONL.gz" -> (".jsonl", ".gz")."""
    root, last = os.path.splitext(path.lower())
    if last in COMPRESSIONS:
        return os.path.splitext(root)[1], last
    return last, ""


@contextlib.contextmanager
def open_content(path):
    """The file's content as a binary stream, decompressed on the fly when the name says it is compressed.

    A corrupt or truncated compressed file shows when it is read: a UsageError naming the file.
    """
    compression = _extensions(path)[1]
    if not compression:
        with open(path, "rb") as f:
            yield f
        return
    name, opener = COMPRESSIONS[compression]
    with opener(path, "rb") as f:
        try:
            yield f
        except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:
            raise UsageError(f"data file {path} is not a valid {name} file ({e}): it is corrupt or truncated; "
                             "compress or download it again") from None


def check_file(path, allowed=("json", "csv", "text"), limit=PREREAD_BYTES):
    """Check a local data file before anything loads it; returns its column names.

    A compressed file (see `COMPRESSIONS`) is checked on its content, decompressed as it is read.
    Every byte must be UTF-8 (`datasets` would read some other encodings silently as garbage);
    JSON must parse (one object per line, or one array or object for the whole file) and a CSV
    must have a header row, checked on the first `limit` bytes (None: all). The columns are those
    of that part (None when it holds no complete line).
    """
    builder = file_builder(path, allowed)
    _check_utf8(path)
    with open_content(path) as f:
        head = f.read() if limit is None else f.read(limit)
        complete = not f.read(1)
    if complete and not head:  # a compressed file can be empty inside
        raise UsageError(f"data file {path} is empty")
    if not complete:
        head = head[: head.rfind(b"\n") + 1]  # whole lines only
        if not head:
            return None
    text = head.decode("utf-8").removeprefix("\ufeff")
    if builder == "json":
        return _json_columns(path, text, complete)
    if builder == "csv":
        return _csv_columns(path, text)
    return ["text"]


def _check_utf8(path):
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open_content(path) as f:
        while True:
            chunk = f.read(_CHUNK_BYTES)
            pending = len(decoder.getstate()[0])  # bytes of a character split across chunks
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                _not_utf8(path, offset - pending + e.start, e.object[e.start])
            if not chunk:
                return
            offset += len(chunk)


def _not_utf8(path, offset, byte):
    line, remaining = 1, offset
    with open_content(path) as f:
        while remaining:
            chunk = f.read(min(remaining, _CHUNK_BYTES))
            line, remaining = line + chunk.count(b"\n"), remaining - len(chunk)
    raise UsageError(f"data file {path} is not UTF-8 text: byte 0x{byte:02x} at offset {offset} (line {line}); "
                     "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def _json_columns(path, text, complete):
    """Columns of JSON lines, or of a whole-file JSON array/object (checked only when read completely)."""
    if text.lstrip().startswith("["):
        return _json_document_columns(path, text) if complete else None
    columns = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if not columns:  # a first line that does not parse: maybe one multi-line object
                return _json_document_columns(path, text) if complete else None
            raise UsageError(f"data file {path}:{number} is not valid JSON: {e.msg} (column {e.colno}); "
                             "each line must be one JSON object") from None
        if not isinstance(row, dict):
            raise UsageError(f"data file {path}:{number} is a JSON {type(row).__name__}, not an object: "
                             'each line must be one JSON object, e.g. {"text": "..."}')
        columns.update(dict.fromkeys(row))
    return list(columns)


def _json_document_columns(path, text):
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"data file {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if isinstance(document, dict):  # {"column": [values], ...}
        return list(document)
    rows = document if isinstance(document, list) else []
    if rows and all(isinstance(row, str) for row in rows):
        return ["text"]  # how `datasets` reads a list of strings
    if not rows or not all(isinstance(row, dict) for row in rows):
        raise UsageError(f"data file {path} must hold JSON objects (one per line, or a list of them)")
    return list({key: None for row in rows for key in row})


def _csv_columns(path, text):
    try:
        header = next(csv.reader(io.StringIO(text)), [])
    except csv.Error as e:
        raise UsageError(f"data file {path} has a malformed CSV header: {e}") from None
    if not any(name.strip() for name in header):
        raise UsageError(f"data file {path} has no CSV header row: its first line must name the columns")
    return header


def require_columns(columns, needed):
    """Raise if a column of `needed` ((flag, name) pairs) is missing from `columns` ({split: names}).

    Splits whose columns are unknown (None) are skipped.
    """
    for split, names in columns.items():
        for flag, name in needed:
            if names is not None and name not in names:
                raise UsageError(f"--{flag} {name!r} is not a column of the {split} data; "
                                 f"its columns: {', '.join(names)}")


def load_splits(data_args, files, cache_dir=None, allowed=("json", "csv", "text"), **builder_kwargs):
    """Load a hub dataset (`data_args.dataset_name`) or local `files` ({split: path}) as a DatasetDict."""
    import datasets

    if data_args.dataset_name:
        name = data_args.dataset_name
        try:
            return datasets.load_dataset(name, data_args.dataset_config_name, cache_dir=cache_dir, **builder_kwargs)
        except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
            if is_disk_full(e):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            offline = hub.offline_reason(datasets=True)
            if offline and not os.path.exists(name):
                raise UsageError(f"could not load dataset {name!r}: it is not in the local cache and {offline}; "
                                 "pass local files (--train_file, ...) or run where the hub is reachable") from e
            raise UsageError(f"could not load dataset {name!r}: {first} (check --dataset_name and "
                             "--dataset_config_name)") from e
    files = {split: path for split, path in files.items() if path}
    if not files:
        raise UsageError("no data: pass --dataset_name or local files (--train_file, --validation_file, ...)")
    builders = {split: file_builder(path, allowed) for split, path in files.items()}
    if len(set(builders.values())) > 1:
        raise UsageError(f"data files must share one format, got {', '.join(sorted(set(builders.values())))}")
    builder = next(iter(builders.values()))
    kwargs = builder_kwargs if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=files, cache_dir=cache_dir, **kwargs)
    except datasets.exceptions.DatasetGenerationError as e:
        if is_disk_full(e):
            raise
        # Past the part `check_file` parsed up front: a full check names the file and line.
        for path in files.values():
            check_file(path, allowed, limit=None)
        cause = e.__cause__ or e
        raise UsageError(f"could not read the data files ({', '.join(files.values())}): "
                         f"{type(cause).__name__}: {str(cause).strip()}") from e


def take(dataset, max_samples):
    """The first `max_samples` examples (all when None)."""
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    return dataset.select(range(max_samples))


def to_arrays(dataset, columns):
    """{name: ArrowColumn} of columns (fixed-length number lists, or numbers) for fast row gathering.

    Nothing is copied: the columns are read where `datasets` keeps them (its memory-mapped cache
    files, several of them after a multi-process map), through the dataset's indices mapping when it
    has one (after `select`, `shuffle`, `filter`). Gathered rows of integer columns are int32, which
    is what JAX computes with anyway.
    """
    table = dataset.data.table
    # `_indices` is how `datasets` keeps a row selection without rewriting the table; reading through
    # it costs one lookup per gathered row, where `flatten_indices` would rewrite the whole corpus.
    mapping = dataset._indices
    indices = ArrowColumn(mapping.column(0), "indices") if mapping is not None else None
    return {name: ArrowColumn(table.column(name), name, indices) for name in columns}


def _root(buffer):
    while buffer.parent is not None:
        buffer = buffer.parent
    return buffer


class ArrowColumn:
    """One Arrow column of numbers or fixed-length number lists, gathered by row without copying it.

    Each chunk's values are located inside the buffer that holds them (for a memory-mapped cache file:
    the whole file), and the chunks of one buffer are read through one numpy view of it, so a
    gather costs one numpy indexing per buffer, not per chunk (a `datasets` cache has a chunk per
    1000 rows). Indexing (`column[rows]`, `column[a:b]`, `column[i]`) returns numpy rows; integers
    come back as int32. With `indices` (another ArrowColumn) row i is the table's row `indices[i]`.
    """

    def __init__(self, chunked, name, indices=None):
        self.name, self._indices = name, indices
        views, view_ids = [], {}
        starts, firsts, segments, widths = [0], [], [], set()
        for chunk in chunked.chunks:
            if not len(chunk):
                continue
            values, chunk_widths = self._values(chunk, name)
            widths.update(chunk_widths)
            itemsize = values.type.byte_width
            buffer = values.buffers()[1]
            root = _root(buffer)
            byte = buffer.address - root.address + values.offset * itemsize
            # One view per buffer (and alignment: a view's elements start where the values do).
            key = (root.address, root.size, byte % itemsize)
            if key not in view_ids:
                view_ids[key] = len(views)
                views.append(np.frombuffer(root, values.type.to_pandas_dtype(), count=(root.size - key[2]) // itemsize,
                                           offset=key[2]))
            segments.append(view_ids[key])
            firsts.append(byte // itemsize)
            starts.append(starts[-1] + len(chunk))
        if len(widths) > 1:
            shortest, longest = min(widths), max(widths)
            raise ValueError(f"column {name!r} holds sequences of {shortest} to {longest} items; pad them first")
        self.width = widths.pop() if widths else None
        stored = views[0].dtype if views else np.dtype(np.int32)
        self.dtype = np.dtype(np.int32) if np.issubdtype(stored, np.integer) else stored
        self._starts, self._firsts, self._segments = np.array(starts), np.array(firsts, np.int64), np.array(segments)
        # Row views: row k of `views[s]` holds the `width` values from element k on.
        self._views = [view if self.width is None else np.lib.stride_tricks.as_strided(
            view, (max(len(view) - self.width + 1, 0), self.width), (view.itemsize, view.itemsize), writeable=False)
            for view in views]
        self._table_rows = starts[-1]

    @staticmethod
    def _values(chunk, name):
        """(flat values, the row lengths found: {items per row}, or {None} for numbers) of one chunk, zero-copy."""
        kind = chunk.type
        if pa.types.is_fixed_size_list(kind):
            values, widths = chunk.flatten(), {kind.list_size}
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
            lengths = np.diff(np.asarray(chunk.offsets))
            values, widths = chunk.flatten(), {int(lengths.min()), int(lengths.max())}
        else:
            values, widths = chunk, {None}
        if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
            raise ValueError(f"column {name!r} holds {kind}: only numbers and fixed-length lists of numbers "
                             "become arrays")
        if chunk.null_count or values.null_count:
            raise ValueError(f"column {name!r} has missing values: fill or drop them first")
        return values, widths

    def __len__(self):
        return len(self._indices) if self._indices is not None else self._table_rows

    @property
    def shape(self):
        return (len(self),) if self.width is None else (len(self), self.width)

    @property
    def ndim(self):
        return len(self.shape)

    def _table_values(self, rows):
        """The values of table `rows` (int64, in range), in their stored dtype."""
        chunk = np.searchsorted(self._starts, rows, side="right") - 1
        first = self._firsts[chunk] + (rows - self._starts[chunk]) * (self.width or 1)
        segments = self._segments[chunk]
        if len(self._views) == 1:
            return self._views[0][first]
        out = np.empty((len(rows),) + self.shape[1:], self._views[0].dtype)
        for segment in np.unique(segments):
            where = segments == segment
            out[where] = self._views[segment][first[where]]
        return out

    def _take(self, rows):
        rows = np.asarray(rows, np.int64)
        if not rows.size:
            return np.empty((0,) + self.shape[1:], self.dtype)
        if rows.min() < 0 or rows.max() >= len(self):
            raise IndexError(f"rows {rows.min()}..{rows.max()} of column {self.name!r}, which has {len(self)}")
        if self._indices is not None:
            rows = self._indices._table_values(rows).astype(np.int64)
        return self._table_values(rows)

    def __getitem__(self, key):
        if isinstance(key, slice):
            rows = np.arange(*key.indices(len(self)))
        elif isinstance(key, (int, np.integer)):
            return self[np.array([key])][0]
        else:
            rows = np.asarray(key)
            if rows.dtype == bool:
                rows = np.flatnonzero(rows)
        rows = np.where(rows < 0, rows + len(self), rows)
        values = self._take(rows.reshape(-1)).astype(self.dtype, copy=False)
        return values.reshape(rows.shape + self.shape[1:])

    def __iter__(self):
        for start in range(0, len(self), 4096):
            yield from self[start: start + 4096]

    def __array__(self, dtype=None, copy=None):
        values = self[:]
        return values if dtype is None else values.astype(dtype, copy=False)


def steps_per_epoch(num_examples, global_batch_size):
    return num_examples // global_batch_size


def epoch_order(num_examples, seed, epoch):
    """The permutation of example indices for one epoch: same on every process and every resume."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def train_batch_indices(num_examples, global_batch_size, seed, epoch, step_in_epoch, rows=None):
    """Indices of one training batch (the incomplete last batch of an epoch is never used).

    `rows` selects this process's part of the global batch (`devices.process_slice`). This computes
    the epoch's permutation anew: a loop over batches uses `TrainOrder`, which keeps it.
    """
    return _batch_of(epoch_order(num_examples, seed, epoch), global_batch_size, step_in_epoch, rows)


def _batch_of(order, global_batch_size, step_in_epoch, rows):
    start = step_in_epoch * global_batch_size
    indices = order[start: start + global_batch_size]
    return indices[rows] if rows is not None else indices


def row_uniforms(key, row_ids, shape, count=1):
    """`count` arrays of uniform [0, 1) numbers of `shape` ([rows, ...]); row i comes from its own
    generator, seeded with (*key, row_ids[i]), so it does not depend on the other rows of its batch."""
    rows = [np.random.default_rng([*key, int(row)]).random((count, *shape[1:])) for row in row_ids]
    return np.stack(rows, axis=1) if rows else np.zeros((count, *shape))


class TrainOrder:
    """`train_batch_indices` of every step, with each epoch's permutation computed once (when the
    step after an epoch's last is asked for, or the first step of a resumed run)."""

    def __init__(self, num_examples, global_batch_size, seed, steps_per_epoch):
        self.num_examples, self.global_batch_size, self.seed = num_examples, global_batch_size, seed
        self.steps_per_epoch = steps_per_epoch
        self._epoch, self._order = None, None

    def batch_indices(self, step, rows=None):
        """Indices of the batch of (0-based) `step`; `rows` as in `train_batch_indices`."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.num_examples, self.seed, epoch)
        return _batch_of(self._order, self.global_batch_size, step_in_epoch, rows)


def gather(arrays, indices):
    return {name: column[indices] for name, column in arrays.items()}


def eval_batch_ranges(num_examples, global_batch_size):
    """(start, stop) of each eval batch, in order; the last may be short and is padded by the caller."""
    return [(start, min(start + global_batch_size, num_examples)) for start in range(0, num_examples, global_batch_size)]
