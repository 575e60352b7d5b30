"""The checks every script runs before any work, in one call (`check_before_work`): the task's own (its
arguments, data files and columns), the phases and their data, the output directory (never where the run
reads), resume compatibility, the hub; and the splits each phase reads."""

import os
from typing import NamedTuple

from huggingface_hub import get_token

from utils.base import hub_probe
from utils.base.arguments import check_output_dir, check_phases, input_paths
from utils.base.errors import UsageError, name_data_files
from utils.checkpoints.resume import find_checkpoint
from utils.checkpoints.store import checkpoint_steps, find_checkpoint_dir, locate_checkpoint
from utils.data import file_formats, loaders
from utils.run import hub_push
from utils.run.run_directory import check_replaceable

SPLIT_FLAGS = {"train": ("do_train", "--train_file"), "validation": ("do_eval", "--validation_file"),
               "test": ("do_predict", "--test_file")}


class Preflight(NamedTuple):
    columns: dict  # {split: column names} of the local data files, where a cheap pre-read found them
    resume: object  # the `utils.checkpoints.resume.ResumePoint` to continue from, or None to start afresh
    findings: object  # what the task's `check_data` returned (None without one)


def check_before_work(task, model_args, data_args, training_args):
    """Everything that can be checked before a model or dataset is touched, as a `Preflight`, in the order: the
    task's `check_arguments`, the common checks of its `data_files` (`check_common`), its `check_data`.

    `task` is the script's `tasks.Task`: the files its runs write and the checks it declares.
    """
    if task.check_arguments:
        task.check_arguments(model_args, data_args, training_args)
    files = (task.data_files or phase_files)(data_args)
    implied = task.implied_dataset(vars(data_args)) if task.implied_dataset else {}
    dataset_name = data_args.dataset_name or implied.get("dataset_name")
    columns, resume = check_common(training_args, model_args, data_args, dataset_name, task, files)
    findings = task.check_data(columns, model_args, data_args, training_args) if task.check_data else None
    return Preflight(columns, resume, findings)


def phase_files(data_args):
    """{split: file or None} of the --train_file / --validation_file / --test_file flags `data_args` has."""
    return {split: getattr(data_args, flag[2:]) for split, (_, flag) in SPLIT_FLAGS.items()
            if hasattr(data_args, flag[2:])}


def check_common(training_args, model_args, data_args, dataset_name, task, files):
    """(columns, resume) after the checks every run makes: phases, the output dir, resume, the hub, and each
    phase's data (`files` maps split -> local path or None, in one of `task.file_formats`; a phase needs its
    split's file or the hub dataset `dataset_name`). Names that are not local paths (the model, config and
    tokenizer, the dataset) make one short probe of the hub, which switches to offline mode if it does not
    answer."""
    check_phases(training_args)
    name_data_files(files)  # an error about "the train data" names its file
    check_output_apart(training_args, model_args, data_args)
    out = training_args.output_dir
    check_output_dir(training_args, has_checkpoint=bool(checkpoint_steps(find_checkpoint_dir(out))))
    resume = find_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    if training_args.compile_only:
        check_plan_dir(out)
    elif training_args.do_train and resume is None:
        check_replaceable(out, task.outputs)  # a fresh training run first removes an earlier run's files
    if training_args.push_to_hub and not (training_args.hub_token or get_token()):
        raise UsageError("--push_to_hub needs --hub_token (a token with write access to the repository) "
                         "or a saved login (huggingface-cli login)")
    columns = {}
    for split, (phase, option) in SPLIT_FLAGS.items():
        if split not in files:
            continue
        if getattr(training_args, phase) and not dataset_name and not files[split]:
            raise UsageError(f"--{phase} needs {split} data: pass {option} or --dataset_name")
        if files[split]:
            names = file_formats.check_file(files[split], task.file_formats)
            if names is not None:
                columns[split] = names
    names = {"dataset_name": dataset_name, "model_name_or_path": model_args.model_name_or_path,
             "config_name": model_args.config_name, "tokenizer_name": model_args.tokenizer_name}
    for flag, name in names.items():
        if name and hub_probe.looks_like_path(name) and not os.path.exists(name):
            raise UsageError(f"--{flag} {name} not found: check the path")
    offline = hub_probe.check_access(names.values(), need_hub=training_args.push_to_hub)
    if training_args.push_to_hub:
        if offline:
            raise UsageError(f"--push_to_hub needs the hub, but {offline}: run where it is reachable, or drop "
                             "--push_to_hub")
        hub_push.check_token(training_args.hub_token)
    return columns, resume


def check_output_apart(training_args, *arg_sets):
    """A run never writes where it reads: --output_dir neither is, nor holds, nor lies inside a local path the
    run reads a model, config, tokenizer, checkpoint, ... from (`utils.base.arguments.input_paths` of `training_args`
    and `arg_sets`), whatever --overwrite_output_dir says: a run there would replace the model it loads (a LoRA
    run's merged export over its base) or remove it with an earlier run's files. Paths are compared resolved
    (relative, `..`, symlinks, `~`); a name that is no local path is a hub id. --resume_from_checkpoint naming
    this run's own checkpoints is what resuming is."""
    out = training_args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        return  # a file: `check_output_dir` says so
    real_out = os.path.realpath(out)
    for source in input_paths(training_args, *arg_sets):
        if source.flag == "resume_from_checkpoint" and _is_own_checkpoint(source.path, out):
            continue
        path = os.path.expanduser(source.path)
        if not os.path.exists(path):
            continue
        real = os.path.realpath(path)
        if real == real_out:
            problem, harm = f"is the directory {source.reader}", "writing there would replace it"
        elif _lies_inside(real, real_out):
            kind = "directory" if os.path.isdir(real) else "file"
            problem, harm = f"holds the {kind} {source.reader}", "writing there could replace or remove it"
        elif os.path.isdir(real) and _lies_inside(real_out, real):
            problem, harm = f"lies inside the directory {source.reader}", "writing there would change it"
        else:
            continue
        raise UsageError(f"--output_dir {out} {problem}: {harm}; pass another --output_dir")


def _lies_inside(path, directory):
    """Whether resolved `path` lies somewhere below resolved `directory`."""
    return path != directory and os.path.commonpath([path, directory]) == directory


def _is_own_checkpoint(resume, output_dir):
    """Whether --resume_from_checkpoint `resume` reads `output_dir`'s own checkpoints ('latest', a step, the
    output dir, its checkpoints directory or one of its steps)."""
    directory, _ = locate_checkpoint(resume, output_dir)
    return os.path.realpath(directory) == os.path.realpath(find_checkpoint_dir(output_dir))


PLAN_FILES = ("all_results.json", "metrics.jsonl")  # all that --compile_only writes


def check_plan_dir(output_dir):
    """--compile_only writes its figures into an output dir that is empty or holds only an earlier
    plan's files: an earlier run's results and checkpoints are never mixed with a plan's."""
    others = sorted(set(os.listdir(output_dir)) - set(PLAN_FILES)) if os.path.isdir(output_dir) else []
    if others:
        raise UsageError(f"--compile_only writes {' and '.join(PLAN_FILES)} into --output_dir, but {output_dir} holds "
                         f"other files ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): use an empty "
                         "or new --output_dir")


def needed_splits(training_args, splits=("train", "validation", "test")):
    return [split for split in splits if getattr(training_args, SPLIT_FLAGS[split][0])]


def column_check(resolve):
    """A task's `check_data` that runs its column resolution `resolve(data_args, {split: column names})` (which
    fails on a wrong column) on the local files of the splits the phases read, when `phase_columns` knows them
    all; a hub dataset's columns are resolved once it is loaded."""
    def check_columns(columns, model_args, data_args, training_args):
        known = phase_columns(columns, training_args, data_args.dataset_name)
        if known:
            resolve(data_args, known)

    return check_columns


def phase_columns(columns, training_args, dataset_name):
    """{split: column names} of the local files of every split a phase reads, when the preflight's pre-read
    found them all, so that a wrong column fails at once; None when a hub dataset is read (`dataset_name`)
    or a file's columns are not known yet: they are checked once the data is loaded."""
    splits = needed_splits(training_args)
    if dataset_name or not all(split in columns for split in splits):
        return None
    return {split: columns[split] for split in splits}


MAX_SAMPLES = {"train": "max_train_samples", "validation": "max_eval_samples", "test": "max_predict_samples"}


def check_splits(available, phase_of, dataset_name, fix=None):
    """Stop when a phase's split is not among `available` (a loaded dataset's split names):
    `phase_of` maps each split the run reads to its phase ("train", "validation", "test")."""
    for split, phase in phase_of.items():
        if split not in available:
            flag = SPLIT_FLAGS[phase][0]
            fix = fix or f"drop --{flag}, or pass local files instead of --dataset_name"
            raise UsageError(f"--{flag} needs a {split!r} split, but dataset {dataset_name!r} has only "
                             f"{', '.join(available)}: {fix}")


def sample_limit(data_args, phase):
    """The --max_train_samples / --max_eval_samples / --max_predict_samples of `phase` (None: all)."""
    return getattr(data_args, MAX_SAMPLES[phase], None)


def phase_datasets(raw, phase_of, data_args):
    """{split: its first --max_*_samples examples} of each split a phase reads (`phase_of`: split ->
    phase), after `check_splits`: every script's phases read their data through here."""
    check_splits(raw, phase_of, data_args.dataset_name)
    return {split: loaders.take(raw[split], sample_limit(data_args, phase))
            for split, phase in phase_of.items()}
