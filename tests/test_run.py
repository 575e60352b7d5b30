"""utils/run/preflight.py and setup.py: what the checks before any work decide (the checkpoint to resume, whether a
directory may be emptied) and the training plan."""

import os
from types import SimpleNamespace

import pytest

from tasks.summarization import TASK
from utils.base.arguments import ModelArguments, TrainingArguments
from utils.base.errors import UsageError
from utils.checkpoints.resume import ResumePoint
from utils.run.preflight import check_before_work
from utils.run.setup import training_plan

NO_DATA = SimpleNamespace(dataset_name=None)


def preflight(out, **training):
    return check_before_work(TASK, ModelArguments(), NO_DATA, TrainingArguments(output_dir=str(out), **training))


def make_checkpoints(out, *names):
    for name in names:
        os.makedirs(os.path.join(out, "checkpoints", name))


def test_the_checkpoint_to_resume(tmp_path):
    out = tmp_path / "run"
    make_checkpoints(out, "4", "8", "12.orbax-checkpoint-tmp-1")
    here = str(out / "checkpoints")
    assert preflight(out, do_train=True, resume_from_checkpoint="latest").resume == ResumePoint(here, 8)
    assert preflight(out, do_train=True, resume_from_checkpoint="4").resume == ResumePoint(here, 4)
    assert preflight(tmp_path / "new", do_train=True, resume_from_checkpoint=str(out)).resume == ResumePoint(here, 8)
    # The run's own checkpoints, named as paths: resuming there is no writing over what it reads.
    assert preflight(out, do_train=True, resume_from_checkpoint=str(out)).resume == ResumePoint(here, 8)
    assert preflight(out, do_train=True, resume_from_checkpoint=here + "/4").resume == ResumePoint(here, 4)
    assert preflight(tmp_path / "fresh", do_train=True, resume_from_checkpoint="latest").resume is None
    assert preflight(tmp_path / "fresh", do_train=True).resume is None
    with pytest.raises(UsageError, match=r"no checkpoint of step 6 in .*checkpoints \(its steps: 4, 8\)"):
        preflight(out, do_train=True, resume_from_checkpoint="6")


def test_a_fresh_run_may_replace_only_what_runs_write(tmp_path):
    out = tmp_path / "run"
    make_checkpoints(out, "4")
    for name in ("metrics.jsonl", "run_args.json", "eval_results.json", "events.out.tfevents.1.host", "config.json",
                 "flax_model.msgpack", "generation_config.json", "tokenizer.json", "spiece.model", "vocab.txt"):
        (out / name).write_text("{}")
    assert preflight(out, do_train=True, overwrite_output_dir=True).resume is None
    (out / "train.py").write_text("print('mine')")
    (out / "data").mkdir()
    with pytest.raises(UsageError, match=r"a new run in .*run first removes the previous run's outputs, but the "
                                         r"directory also holds files no run of this script writes "
                                         r"\(data, train.py\): move them"):
        preflight(out, do_train=True, overwrite_output_dir=True)
    assert preflight(out, do_eval=True).resume is None  # evaluation removes nothing
    assert preflight(out, do_train=True, resume_from_checkpoint="latest").resume.step == 4  # a resume keeps all


def test_latest_before_the_first_checkpoint_replaces_the_killed_run(tmp_path):
    out = tmp_path / "run"
    os.makedirs(out)
    (out / "metrics.jsonl").write_text("")
    assert preflight(out, do_train=True, resume_from_checkpoint="latest").resume is None
    (out / "notes.md").write_text("mine")
    with pytest.raises(UsageError, match=r"holds files no run of this script writes \(notes.md\)"):
        preflight(out, do_train=True, resume_from_checkpoint="latest")


def test_explicit_output_dir_without_a_checkpoint_says_what_happened(tmp_path):
    out = tmp_path / "killed"
    make_checkpoints(out, "4.orbax-checkpoint-tmp-7")
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError, match=r"no complete checkpoint there; if it is the output directory of a run, that "
                                         r"run stopped before its first checkpoint: start it again without "
                                         r"--resume_from_checkpoint .* or with --resume_from_checkpoint latest"):
        preflight(tmp_path / "new", do_train=True, resume_from_checkpoint=str(out))


def test_training_plan():
    args = TrainingArguments(output_dir="out", do_train=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, num_train_epochs=2)
    plan = training_plan(args, 100)
    assert plan[:3] == (48, 2, 4)  # 2 x 8 devices x 3; 100 // 48 steps per epoch
    # linear decay to 0 at the last of the 4 steps, from 5e-5 (the default learning rate, no warmup)
    assert [float(plan.schedule(step)) for step in (0, 2, 4)] == pytest.approx([5e-5, 2.5e-5, 0.0])
    assert training_plan(TrainingArguments(output_dir="out", do_train=True, max_steps=7), 64)[:3] == (64, 1, 7)
    assert training_plan(TrainingArguments(output_dir="out", do_eval=True), None)[:3] == (0, 0, 0)
    with pytest.raises(UsageError, match="47 training examples are fewer than one global batch of 48"):
        training_plan(args, 47)


def test_phase_datasets_cut_each_phase_and_name_the_missing_split():
    """Every script's phases read their data through `phase_datasets`: --max_*_samples per phase, and a
    phase whose split the dataset lacks stops with the flag to drop."""
    import datasets

    from utils.base.arguments import BaseDataArguments
    from utils.run.preflight import phase_datasets

    raw = {name: datasets.Dataset.from_dict({"x": list(range(10))}) for name in ("train", "validation", "test")}
    data_args = BaseDataArguments(dataset_name="some/set", max_train_samples=3, max_eval_samples=4)
    data_args.max_predict_samples = 5  # a field of the scripts that predict
    cut = phase_datasets(raw, {"train": "train", "validation": "validation", "test": "test"}, data_args)
    assert {split: cut[split]["x"][:] for split in cut} == {"train": [0, 1, 2], "validation": [0, 1, 2, 3],
                                                            "test": [0, 1, 2, 3, 4]}
    assert len(phase_datasets(raw, {"train": "train"}, BaseDataArguments())["train"]) == 10  # no limit: all
    with pytest.raises(UsageError, match=r"^--do_eval needs a 'validation_matched' split, but dataset 'some/set' "
                                         r"has only train, validation, test: drop --do_eval, or pass local files"):
        phase_datasets(raw, {"train": "train", "validation_matched": "validation"}, data_args)


def test_train_batch_size_reads_the_arguments_and_leaves_them_as_parsed():
    """--total_train_batch_size fixes the global batch without rewriting --per_device_train_batch_size
    (run_args.json keeps what the user passed)."""
    import jax

    from utils.run.setup import train_batch_size

    devices = jax.device_count()
    args = TrainingArguments(output_dir="x", total_train_batch_size=4 * devices, gradient_accumulation_steps=2)
    assert train_batch_size(args) == 4 * devices
    assert args.per_device_train_batch_size == TrainingArguments(output_dir="x").per_device_train_batch_size
    args = TrainingArguments(output_dir="x", per_device_train_batch_size=3, gradient_accumulation_steps=2)
    assert train_batch_size(args) == 3 * devices * 2
    with pytest.raises(UsageError, match=rf"--total_train_batch_size {4 * devices + 2} does not split over "
                                         rf"{devices} devices x 2 gradient_accumulation_steps: use a multiple of "
                                         rf"{2 * devices}"):
        train_batch_size(TrainingArguments(output_dir="x", total_train_batch_size=4 * devices + 2,
                                           gradient_accumulation_steps=2))
