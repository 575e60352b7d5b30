"""Local data files: their formats and compressions, their content read decompressed, and the checks
that run before anything loads them (UTF-8, JSON that parses, a CSV header; the columns they hold).
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

from utils.base.errors import UsageError

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
        return _csv_columns(path, text, complete)
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
    if complete and not columns:  # `datasets` would say only 'Instruction "train" corresponds to no data!'
        raise UsageError(f"data file {path} holds no rows, only blank lines: add its examples, one JSON object per "
                         "line")
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


def _csv_columns(path, text, complete):
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader, [])
    except csv.Error as e:
        raise UsageError(f"data file {path} has a malformed CSV header: {e}") from None
    if not any(name.strip() for name in header):
        raise UsageError(f"data file {path} has no CSV header row: its first line must name the columns")
    if complete and not _has_a_row(reader):  # `datasets` would say only 'Instruction "train" corresponds to no data!'
        raise UsageError(f"data file {path} has a CSV header ({', '.join(header)}) but no rows: add its examples "
                         "below the header")
    return header


def _has_a_row(reader):
    """Whether a csv reader past the header gives a row with a value; a malformed row counts as one
    (`datasets` reports it with its line)."""
    try:
        return any(any(cell.strip() for cell in row) for row in reader)
    except csv.Error:
        return True


def require_columns(columns, needed):
    """Raise if a column of `needed` ((flag, name) pairs) is missing from `columns` ({split: names}).

    Splits whose columns are unknown (None) are skipped.
    """
    for split, names in columns.items():
        for flag, name in needed:
            if names is not None and name not in names:
                raise UsageError(f"--{flag} {name!r} is not a column of the {split} data; "
                                 f"its columns: {', '.join(names)}")
