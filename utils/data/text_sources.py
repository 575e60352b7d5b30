"""Where a streamed run's texts come from: local files or a hub dataset, this process's rows only,
read from a position that a checkpoint can keep.

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
A source has `start()` (its first position), `open(position)` (a reader: iterate it for the row
texts; its `position()` is the one after the last row given), `describe()` (what a resumed stream
must read again), `process_index` and `process_count`.
`groups_of_texts(reader, encoder)`: the texts in the groups an encoder tokenizes together (see
`utils.data.stream` for the encoder's interface), each with the position before it.
"""

import csv
import io
import itertools
import json
import os

from utils.base import hub_probe
from utils.base.errors import UsageError, is_disk_full
from utils.data import file_formats

FORMATS = ("json", "csv", "text")


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

    name = data_args.dataset_name
    try:
        return datasets.load_dataset(name, data_args.dataset_config_name, cache_dir=cache_dir, streaming=True)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        if is_disk_full(e):
            raise
        offline = hub_probe.offline_reason(datasets=True)
        if offline and not os.path.exists(name):
            raise UsageError(f"could not stream dataset {name!r}: {offline}; pass local files (--train_file, ...) "
                             "or run where the hub is reachable") from e
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"could not stream dataset {name!r}: {first} (check --dataset_name and "
                         "--dataset_config_name)") from e


def groups_of_texts(reader, encoder):
    """(position before, texts) of each run of `encoder.group_size` texts that `encoder.keeps`."""
    texts = (text for text in reader if encoder.keeps(text))
    while True:
        position = reader.position()
        group = list(itertools.islice(texts, encoder.group_size))
        if not group:
            return
        yield position, group
