"""Loading datasets and turning them into fixed-shape host batches.

Training batches are a pure function of (seed, epoch, step): the order of an epoch is a seeded
permutation, so a resumed run sees exactly the remaining batches of the uninterrupted one, and
every process of a pod derives the same order and loads only its own slice.
"""

import os

import numpy as np

from utils.errors import UsageError

EXTENSIONS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


def file_builder(path, allowed=("json", "csv", "text")):
    """The `datasets` builder for a local file, checking that the file is usable first."""
    if not os.path.isfile(path):
        raise UsageError(f"data file {path} not found: check the path")
    builder = EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if builder not in allowed:
        names = sorted(ext for ext, b in EXTENSIONS.items() if b in allowed)
        raise UsageError(f"data file {path} has an unsupported extension: use one of {', '.join(names)}")
    if os.path.getsize(path) == 0:
        raise UsageError(f"data file {path} is empty")
    return builder


def load_splits(data_args, files, cache_dir=None, allowed=("json", "csv", "text"), **builder_kwargs):
    """Load a hub dataset (`data_args.dataset_name`) or local `files` ({split: path}) as a DatasetDict."""
    import datasets

    if data_args.dataset_name:
        return datasets.load_dataset(
            data_args.dataset_name, data_args.dataset_config_name, cache_dir=cache_dir, **builder_kwargs
        )
    files = {split: path for split, path in files.items() if path}
    if not files:
        raise UsageError("no data: pass --dataset_name or local files (--train_file, --validation_file, ...)")
    builders = {split: file_builder(path, allowed) for split, path in files.items()}
    if len(set(builders.values())) > 1:
        raise UsageError(f"data files must share one format, got {', '.join(sorted(set(builders.values())))}")
    builder = next(iter(builders.values()))
    kwargs = builder_kwargs if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=files, cache_dir=cache_dir, **kwargs)


def take(dataset, max_samples):
    """The first `max_samples` examples (all when None)."""
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    return dataset.select(range(max_samples))


def to_arrays(dataset, columns):
    """Materialise fixed-length token columns as numpy arrays for fast row gathering."""
    table = dataset.with_format("numpy", columns=list(columns))
    return {name: np.asarray(table[name]) for name in columns}


def steps_per_epoch(num_examples, global_batch_size):
    return num_examples // global_batch_size


def epoch_order(num_examples, seed, epoch):
    """The permutation of example indices for one epoch: same on every process and every resume."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def train_batch_indices(num_examples, global_batch_size, seed, epoch, step_in_epoch, rows=None):
    """Indices of one training batch (the incomplete last batch of an epoch is never used).

    `rows` selects this process's part of the global batch (`sharding.process_slice`).
    """
    start = step_in_epoch * global_batch_size
    indices = epoch_order(num_examples, seed, epoch)[start: start + global_batch_size]
    return indices[rows] if rows is not None else indices


def gather(arrays, indices):
    return {name: column[indices] for name, column in arrays.items()}


def eval_batch_ranges(num_examples, global_batch_size):
    """(start, stop) of each eval batch, in order; the last may be short and is padded by the caller."""
    return [(start, min(start + global_batch_size, num_examples)) for start in range(0, num_examples, global_batch_size)]
