"""Loading a run's splits: a hub dataset by name, or local files (checked by `utils.data.file_formats`)."""

import os

from utils.base import hub_probe
from utils.base.errors import UsageError, is_disk_full
from utils.data.file_formats import check_file, file_builder


def holds_mixed_values(feature):
    """Whether a `datasets` feature is the JSON text that `datasets` (4.7 on) keeps a column of values of
    different types as (a number among paths); older versions refuse such a file at load, which
    `load_splits` names, so there the answer is always no."""
    import datasets

    return isinstance(feature, getattr(datasets, "Json", ()))


def column_values(dataset, column):
    """The values of a `datasets` column as Python objects, read from its Arrow table; a column whose
    rows hold values of different types (a number among texts) is kept by `datasets` as JSON text (its
    `Json` feature), which is decoded, so each row's own value is checked."""
    feature = dataset.features[column]
    if any(holds_mixed_values(f) for f in (feature, getattr(feature, "feature", None))):
        return list(dataset[column])
    return dataset.with_format("arrow")[column].to_pylist()


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
            offline = hub_probe.offline_reason(datasets=True)
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
    except Exception as e:  # noqa: BLE001 - whatever a reader raises (pyarrow, pandas, datasets) names the files
        if is_disk_full(e) or isinstance(e, UsageError):
            raise
        # Past the part `check_file` parsed up front: a full check names the file and line.
        for path in files.values():
            check_file(path, allowed, limit=None)
        cause = e.__cause__ or e
        first = (str(cause).strip().splitlines() or [""])[0]
        raise UsageError(f"could not read the data files ({', '.join(files.values())}): {type(cause).__name__}: "
                         f"{first}; check that each is a valid {builder} file (rerun with --debug for the "
                         "traceback)") from e


def take(dataset, max_samples):
    """The first `max_samples` examples (all when None)."""
    if max_samples is None or max_samples >= len(dataset):
        return dataset
    return dataset.select(range(max_samples))
