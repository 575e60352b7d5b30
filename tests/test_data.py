"""utils/data/file_formats.py, dataset_loading.py, arrow_columns.py, batch_order.py: local files, loading, memory-mapped
columns, seeded per-process training batches, eval ranges."""

import bz2
import gzip
import json
import lzma
import re
from types import SimpleNamespace

import numpy as np
import pytest

from utils.base.errors import UsageError
from utils.data import arrow_columns, batch_order, file_formats, loaders


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


def write(path, content, compression=""):
    """Write `content` (str: UTF-8) to `path` + `compression`, compressed accordingly; returns the path."""
    raw = content.encode("utf-8") if isinstance(content, str) else content
    path = path.with_name(path.name + compression)
    path.write_bytes(COMPRESS[compression](raw) if compression else raw)
    return str(path)


def test_file_builder(tmp_path):
    for name, builder in (("a.json", "json"), ("a.JSONL", "json"), ("a.csv", "csv"), ("a.txt", "text"),
                          ("a.jsonl.gz", "json"), ("a.JSON.GZ", "json"), ("a.csv.bz2", "csv"), ("a.txt.xz", "text")):
        (tmp_path / name).write_text("x")
        assert file_formats.file_builder(str(tmp_path / name)) == builder


def test_file_builder_missing(tmp_path):
    with pytest.raises(UsageError, match=r"data file .*missing\.json not found"):
        file_formats.file_builder(str(tmp_path / "missing.json"))


def test_file_builder_unsupported_extension(tmp_path):
    everything, no_text = ("json", "csv", "text"), ("json", "csv")
    cases = (("a.parquet", everything, ".csv, .json, .jsonl, .txt"), ("a.txt", no_text, ".csv, .json, .jsonl"),
             ("a.txt.gz", no_text, ".csv, .json, .jsonl"), ("a.gz", everything, ".csv, .json, .jsonl, .txt"),
             ("a.tar.gz", everything, ".csv, .json, .jsonl, .txt"),
             ("a.jsonl.zst", everything, ".csv, .json, .jsonl, .txt"))
    for name, allowed, names in cases:
        (tmp_path / name).write_text("x")
        with pytest.raises(UsageError, match="unsupported extension") as info:
            file_formats.file_builder(str(tmp_path / name), allowed=allowed)
        assert str(info.value).endswith(f"use one of {names}, or one of them compressed as .gz, .bz2, .xz "
                                        "(e.g. .csv.gz)")


def test_file_builder_empty(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(UsageError, match="empty"):
        file_formats.file_builder(str(tmp_path / "empty.csv"))


# ---------------------------------------------------------------------------------------------
# check_file: the cheap pre-read before anything loads a file (of the decompressed content, for a
# compressed one)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["", *COMPRESS])
@pytest.mark.parametrize("name, content, columns", [
    ("a.jsonl", '{"x": 1, "y": "a"}\n\n{"x": 2, "z": null}\r\n', ["x", "y", "z"]),
    ("a.json", '[{"x": 1},\n {"y": 2}]', ["x", "y"]),
    ("a.json", '["one", "two"]', ["text"]),
    ("a.json", '{\n  "x": [1, 2],\n  "y": ["a", "b"]\n}\n', ["x", "y"]),
    ("a.csv", '\ufeff"first, col",second\n1,2\n', ["first, col", "second"]),
    ("a.txt", "caf\u00e9\n", ["text"]),
])
def test_check_file_columns(tmp_path, name, content, columns, compression):
    assert file_formats.check_file(write(tmp_path / name, content, compression)) == columns


@pytest.mark.parametrize("compression", ["", ".gz"])
@pytest.mark.parametrize("name, content, message", [  # the message after the file's name
    ("a.jsonl", '{"x": 1}\n{"x": 2,}\n', r":2 is not valid JSON: .*\(column 9\); each line must be one JSON object"),
    ("a.jsonl", '{"x": 1}\n[1, 2]\n', r":2 is a JSON list, not an object"),
    ("a.jsonl", '{"x": 1\n', r" is not valid JSON: Expecting ',' delimiter at line 2 column 1"),
    ("a.json", '[{"x": 1},\n {"x" 2}]', r" is not valid JSON: Expecting ':' delimiter at line 2 column 7"),
    ("a.json", "[1, 2]", r" must hold JSON objects"),
    ("a.csv", "\nx,y\n", r" has no CSV header row"),
])
def test_check_file_malformed(tmp_path, name, content, message, compression):
    path = write(tmp_path / name, content, compression)
    with pytest.raises(UsageError, match=re.escape(path) + message):
        file_formats.check_file(path)


@pytest.mark.parametrize("compression", ["", *COMPRESS])
def test_check_file_not_utf8_names_offset_and_line_across_chunks(tmp_path, monkeypatch, compression):
    monkeypatch.setattr(file_formats, "_CHUNK_BYTES", 4)  # characters split across chunks must still decode
    path = write(tmp_path / "a.txt", "h\u00e9\u20ac\n\u00e9\u00e9\n".encode() + b"ab\xffc\n", compression)
    with pytest.raises(UsageError, match=r"a\.txt\S* is not UTF-8 text: byte 0xff at offset 14 \(line 3\)"):
        file_formats.check_file(path)
    path = write(tmp_path / "b.txt", b"ok\n\xe2\x82", compression)  # truncated at the end of the file
    with pytest.raises(UsageError, match=r"byte 0xe2 at offset 3 \(line 2\)"):
        file_formats.check_file(path)


def test_check_file_corrupt_or_truncated_compression(tmp_path):
    content = "".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(200)).encode()
    packed = gzip.compress(content)
    middle = len(packed) // 2
    cases = (("cut.jsonl.gz", packed[:middle], r"gzip file \(Compressed file ended before the end-of-stream marker"),
             ("flipped.jsonl.gz", packed[:middle] + bytes([packed[middle] ^ 0xFF]) + packed[middle + 1:], "gzip file"),
             ("plain.jsonl.gz", content, r"gzip file \(Not a gzipped file"),
             ("cut.csv.bz2", bz2.compress(b"a,b\n" + content)[:-10], "bzip2 file"),
             ("cut.txt.xz", lzma.compress(content)[:-10], "xz file"))
    for name, raw, kind in cases:
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(UsageError, match=rf"^data file \S*/{name} is not a valid {kind}.*\): it is corrupt "
                                             r"or truncated; compress or download it again$"):
            file_formats.check_file(str(tmp_path / name))


def test_check_file_compressed_but_empty(tmp_path):
    with pytest.raises(UsageError, match=r"a\.jsonl\.gz is empty"):
        file_formats.check_file(write(tmp_path / "a.jsonl", "", ".gz"))


def test_check_file_parses_only_the_head(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n{"y": 2}\nnot json\n')
    assert file_formats.check_file(str(path), limit=12) == ["x"]  # whole lines only: the second is cut off
    with pytest.raises(UsageError, match=r"a\.jsonl:3 is not valid JSON"):
        file_formats.check_file(str(path), limit=None)
    path.write_text('{"x": "' + "a" * 100 + '"}\n')
    assert file_formats.check_file(str(path), limit=50) is None  # no complete line: columns unknown
    path.write_text('{\n  "x": ["' + "a" * 100 + '"]\n}\n')
    assert file_formats.check_file(str(path), limit=50) is None  # a multi-line object, not read whole: left to datasets


def test_require_columns():
    file_formats.require_columns({"train": ["a", "b"], "test": None}, (("text_column", "a"), ("summary_column", "b")))
    with pytest.raises(UsageError, match=r"--summary_column 'c' is not a column of the test data; its columns: a, b"):
        file_formats.require_columns({"train": ["a", "c"], "test": ["a", "b"]}, (("summary_column", "c"),))


NO_HUB = SimpleNamespace(dataset_name=None, dataset_config_name=None)


def test_load_splits_json_and_csv(tmp_path):
    rows = [{"document": f"doc {i}", "summary": f"sum {i}"} for i in range(5)]
    (tmp_path / "train.json").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "valid.json").write_text("\n".join(json.dumps(r) for r in rows[:2]))
    files = {"train": str(tmp_path / "train.json"), "validation": str(tmp_path / "valid.json"), "test": None}
    splits = loaders.load_splits(NO_HUB, files, cache_dir=str(tmp_path / "cache"))
    assert sorted(splits) == ["train", "validation"]
    assert len(splits["train"]) == 5 and splits["validation"][1] == rows[1]

    (tmp_path / "train.csv").write_text("document,summary\n" + "".join(f"d{i},s{i}\n" for i in range(3)))
    csv = loaders.load_splits(NO_HUB, {"train": str(tmp_path / "train.csv")}, cache_dir=str(tmp_path / "cache"))
    assert csv["train"].column_names == ["document", "summary"] and csv["train"][2] == {"document": "d2",
                                                                                      "summary": "s2"}


def test_load_splits_text(tmp_path):
    (tmp_path / "train.txt").write_text("first line\nsecond line\nthird\n")
    splits = loaders.load_splits(NO_HUB, {"train": str(tmp_path / "train.txt")}, cache_dir=str(tmp_path / "cache"))
    assert list(splits["train"]["text"]) == ["first line", "second line", "third"]


def test_load_splits_compressed_and_mixed_with_plain(tmp_path):
    rows = [{"document": f"doc {i}", "summary": f"sum {i}"} for i in range(5)]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    files = {"train": write(tmp_path / "train.jsonl", lines, ".gz"),
             "validation": write(tmp_path / "valid.jsonl", lines)}
    splits = loaders.load_splits(NO_HUB, files, cache_dir=str(tmp_path / "cache"))  # one format: json
    assert list(splits["train"]) == rows and list(splits["validation"]) == rows
    text = loaders.load_splits(NO_HUB, {"train": write(tmp_path / "train.txt", "first\nsecond\n", ".xz")},
                            cache_dir=str(tmp_path / "cache"))
    assert list(text["train"]["text"]) == ["first", "second"]


@pytest.mark.parametrize("compression", ["", ".gz"])
def test_load_splits_csv_with_a_byte_order_mark(tmp_path, compression):
    """An Excel export ("CSV UTF-8") starts with a BOM: it must not become part of the first column's name."""
    path = write(tmp_path / "excel.csv", "\ufeffdocument,summary\nd0,s0\n", compression)
    assert file_formats.check_file(path) == ["document", "summary"]
    splits = loaders.load_splits(NO_HUB, {"train": path}, cache_dir=str(tmp_path / "cache"))
    assert list(splits["train"]) == [{"document": "d0", "summary": "s0"}]


def test_load_splits_errors(tmp_path):
    with pytest.raises(UsageError, match="no data"):
        loaders.load_splits(NO_HUB, {"train": None})
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.csv").write_text("a\n1\n")
    with pytest.raises(UsageError, match="share one format, got csv, json"):
        loaders.load_splits(NO_HUB, {"train": str(tmp_path / "a.json"), "validation": str(tmp_path / "b.csv")})
    (tmp_path / "c.txt").write_text("x\n")
    with pytest.raises(UsageError, match="unsupported extension"):
        loaders.load_splits(NO_HUB, {"train": str(tmp_path / "c.txt")}, allowed=("json", "csv"))


def test_take_and_to_arrays():
    import datasets

    ds = datasets.Dataset.from_dict({"ids": [[i, i + 1] for i in range(10)], "label": list(range(10))})
    assert len(loaders.take(ds, 3)) == 3 and loaders.take(ds, 3)["label"][:] == [0, 1, 2]
    assert loaders.take(ds, None) is ds and loaders.take(ds, 50) is ds
    arrays = arrow_columns.to_arrays(loaders.take(ds, 4), ["ids", "label"])
    assert arrays["ids"].shape == (4, 2) and arrays["ids"].dtype.kind == "i"
    np.testing.assert_array_equal(arrays["label"], [0, 1, 2, 3])
    np.testing.assert_array_equal(batch_order.gather(arrays, np.array([3, 0]))["ids"], [[3, 4], [0, 1]])
    assert arrays["ids"].dtype == np.int32  # what JAX computes with: half the bytes of int64 to move


def test_to_arrays_refuses_ragged_sequences():
    import datasets

    ds = datasets.Dataset.from_dict({"ids": [[1, 2], [3]]})
    with pytest.raises(ValueError, match="sequences of 1 to 2 items"):
        arrow_columns.to_arrays(ds, ["ids"])


def write_token_file(path, rows, width, rows_per_chunk=1000, dtype=np.int32):
    """An Arrow stream file as `datasets` caches a token column (list<int>, one record batch per
    `rows_per_chunk` rows), row i holding i * width ... i * width + width - 1; returns its Dataset."""
    import datasets
    import pyarrow as pa

    schema = pa.schema({"input_ids": pa.list_(pa.from_numpy_dtype(dtype))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for start in range(0, rows, rows_per_chunk):
            n = min(rows_per_chunk, rows - start)
            values = np.arange(start * width, (start + n) * width, dtype=dtype)
            column = pa.ListArray.from_arrays(np.arange(0, (n + 1) * width, width, dtype=np.int32), values)
            writer.write_batch(pa.record_batch([column], schema=schema))
    return datasets.Dataset.from_file(str(path))


def expected_rows(rows, width):
    rows = np.asarray(rows)
    return (rows[..., None] * width + np.arange(width)).astype(np.int32)


def test_to_arrays_reads_chunks_files_slices_and_index_mappings(tmp_path):
    import datasets

    first = write_token_file(tmp_path / "a.arrow", 50, 3, rows_per_chunk=7)
    second = write_token_file(tmp_path / "b.arrow", 20, 3, rows_per_chunk=6)  # rows 0..19 again
    both = datasets.concatenate_datasets([first, second])  # two memory-mapped files, 11 + 4 chunks
    truth = np.concatenate([expected_rows(range(50), 3), expected_rows(range(20), 3)])
    column = arrow_columns.to_arrays(both, ["input_ids"])["input_ids"]
    assert column.shape == (70, 3) and len(column) == 70 and column.dtype == np.int32
    rows = np.array([69, 0, 49, 50, 6, 7, 13, 14, 55, 3, 3])
    np.testing.assert_array_equal(column[rows], truth[rows])
    np.testing.assert_array_equal(np.asarray(column), truth)
    np.testing.assert_array_equal(column[45:60], truth[45:60])
    np.testing.assert_array_equal(column[-1], truth[-1])
    np.testing.assert_array_equal(np.stack(list(column)), truth)
    selections = {"slice": range(5, 66), "reversed": range(69, -1, -2),
                  "shuffled": np.random.default_rng(0).permutation(70)}
    for name, selection in selections.items():
        selected = both.select(selection)
        assert (selected._indices is None) == (name == "slice")  # a contiguous select slices the table
        np.testing.assert_array_equal(arrow_columns.to_arrays(selected, ["input_ids"])["input_ids"][np.arange(len(selection))],
                                      truth[np.asarray(selection)], err_msg=name)
    twice = both.select(range(60, 10, -1)).select([0, 5, 49])  # a mapping of a mapping
    np.testing.assert_array_equal(np.asarray(arrow_columns.to_arrays(twice, ["input_ids"])["input_ids"]), truth[[60, 55, 11]])
    with pytest.raises(IndexError, match="rows 3..70 of column 'input_ids', which has 70"):
        column[[3, 70]]


def test_to_arrays_narrows_integers_to_int32():
    import datasets

    ds = datasets.Dataset.from_dict({"ids": [[1, 2], [3, 4]], "mask": [[1, 0], [1, 1]], "score": [0.5, 1.5]})
    ds = ds.cast_column("mask", datasets.Sequence(datasets.Value("int8")))
    arrays = arrow_columns.to_arrays(ds, ["ids", "mask", "score"])
    assert ds.features["ids"].feature.dtype == "int64"
    assert arrays["ids"][[1]].dtype == arrays["mask"][[1]].dtype == np.int32
    np.testing.assert_array_equal(arrays["mask"][[0, 1]], [[1, 0], [1, 1]])
    assert arrays["score"][[1]].dtype == np.float64 and arrays["score"].shape == (2,)


def test_to_arrays_refuses_text_and_missing_values():
    import datasets

    with pytest.raises(ValueError, match="column 'text' holds string: only numbers and fixed-length lists"):
        arrow_columns.to_arrays(datasets.Dataset.from_dict({"text": ["a", "b"]}), ["text"])
    with pytest.raises(ValueError, match="column 'ids' has missing values"):
        arrow_columns.to_arrays(datasets.Dataset.from_dict({"ids": [[1, 2], None]}), ["ids"])


def anonymous_memory():
    """Bytes of this process's anonymous memory (heap, not the page cache of mapped files)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_to_arrays_copies_no_tokens_into_memory(tmp_path):
    """A 64 MB token column is read in place: gathering every row once (touching every page of the
    file) adds far less anonymous memory than a copy of the column would."""
    dataset = write_token_file(tmp_path / "big.arrow", 1 << 17, 128)
    before = anonymous_memory()
    column = arrow_columns.to_arrays(dataset, ["input_ids"])["input_ids"]
    checksum = sum(int(column[start: start + 4096][:, -1].sum()) for start in range(0, len(column), 4096))
    grown = anonymous_memory() - before
    assert checksum == int(expected_rows(np.arange(1 << 17), 128)[:, -1].sum())
    assert grown < 16 << 20, f"{grown >> 20} MB more anonymous memory for a 64 MB column"


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------
def epoch_batches(num_examples, batch, seed, epoch, rows=None):
    steps = batch_order.steps_per_epoch(num_examples, batch)
    return [batch_order.train_batch_indices(num_examples, batch, seed, epoch, step, rows) for step in range(steps)]


def test_train_batches_deterministic_and_without_repeats():
    num, batch = 103, 8
    first = epoch_batches(num, batch, seed=0, epoch=0)
    assert len(first) == batch_order.steps_per_epoch(num, batch) == 12
    assert all(len(b) == batch for b in first)
    flat = np.concatenate(first)
    assert len(set(flat.tolist())) == len(flat) == 96 and flat.min() >= 0 and flat.max() < num
    np.testing.assert_array_equal(np.concatenate(epoch_batches(num, batch, 0, 0)), flat)  # same seed and epoch
    assert not np.array_equal(np.concatenate(epoch_batches(num, batch, 0, 1)), flat)  # next epoch reshuffles
    assert not np.array_equal(np.concatenate(epoch_batches(num, batch, 1, 0)), flat)  # other seed
    np.testing.assert_array_equal(batch_order.train_batch_indices(num, batch, 0, 0, 5), first[5])  # resume mid-epoch


def todays_batch_indices(num_examples, global_batch_size, seed, epoch, step_in_epoch, rows=None):
    """How a batch's indices were defined before `TrainOrder` (the permutation recomputed every step):
    the order of a seed must never change, or resuming an older run would see other batches."""
    start = step_in_epoch * global_batch_size
    indices = np.random.default_rng([seed, epoch]).permutation(num_examples)[start: start + global_batch_size]
    return indices[rows] if rows is not None else indices


def test_train_order_keeps_the_order_of_every_seed_and_resumes_mid_epoch():
    num, batch, seed = 103, 8, 5
    per_epoch = batch_order.steps_per_epoch(num, batch)
    reference = [todays_batch_indices(num, batch, seed, *divmod(step, per_epoch)) for step in range(4 * per_epoch)]
    order = batch_order.TrainOrder(num, batch, seed, per_epoch)
    for step, indices in enumerate(reference):
        np.testing.assert_array_equal(order.batch_indices(step), indices, err_msg=f"step {step}")
        np.testing.assert_array_equal(batch_order.train_batch_indices(num, batch, seed, *divmod(step, per_epoch)), indices)
    resumed = batch_order.TrainOrder(num, batch, seed, per_epoch)  # a run resumed in the middle of epoch 2
    for step in range(2 * per_epoch + 5, 4 * per_epoch):
        np.testing.assert_array_equal(resumed.batch_indices(step), reference[step], err_msg=f"step {step}")
    rows = slice(2, 6)
    np.testing.assert_array_equal(batch_order.TrainOrder(num, batch, seed, per_epoch).batch_indices(3 * per_epoch + 1, rows),
                                  reference[3 * per_epoch + 1][rows])


@pytest.mark.parametrize("processes", [2, 4])
def test_process_rows_partition_global_batch(processes):
    num, batch = 64, 16
    local = batch // processes
    for step in range(batch_order.steps_per_epoch(num, batch)):
        whole = batch_order.train_batch_indices(num, batch, 7, 2, step)
        parts = [batch_order.train_batch_indices(num, batch, 7, 2, step, slice(p * local, (p + 1) * local))
                 for p in range(processes)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_eval_batch_ranges_cover_every_example_once():
    assert batch_order.eval_batch_ranges(21, 8) == [(0, 8), (8, 16), (16, 21)]
    assert batch_order.eval_batch_ranges(16, 8) == [(0, 8), (8, 16)]
    assert batch_order.eval_batch_ranges(3, 8) == [(0, 3)]
    assert batch_order.eval_batch_ranges(0, 8) == []
    covered = [i for start, stop in batch_order.eval_batch_ranges(1001, 64) for i in range(start, stop)]
    assert covered == list(range(1001))


def test_load_splits_error_past_the_pre_read_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"x": "a"}\n' * 3 + '{"x": "a",}\n')
    with pytest.raises(UsageError, match=r"train\.jsonl:4 is not valid JSON"):
        loaders.load_splits(NO_HUB, {"train": str(path)}, cache_dir=str(tmp_path / "cache"))


def test_load_splits_unusable_dataset(tmp_path):
    (tmp_path / "no_data").mkdir()
    args = SimpleNamespace(dataset_name=str(tmp_path / "no_data"), dataset_config_name=None)
    with pytest.raises(UsageError, match=r"could not load dataset .*no_data': .*check --dataset_name"):
        loaders.load_splits(args, {}, cache_dir=str(tmp_path / "cache"))
    args.dataset_name = "no-such/dataset"  # conftest: offline
    with pytest.raises(UsageError, match=r"'no-such/dataset': it is not in the local cache and offline mode is on"):
        loaders.load_splits(args, {}, cache_dir=str(tmp_path / "cache"))
