"""Resuming a run from a checkpoint: which one, whether this run may continue it, and the restore.

Every check happens before the run writes anything: `find_checkpoint` (with the other start-up
checks, before data or model are touched) says which checkpoint `--resume_from_checkpoint` names;
`resume_or_start` (once the model and the training plan are known) checks that this run can continue
it, then restores it.
"""

import json
import logging
import os
from typing import NamedTuple

import jax

from utils.base.errors import UsageError
from utils.checkpoints.store import Checkpointer, checkpoint_steps, locate_checkpoint
from utils.models import lora

logger = logging.getLogger(__name__)


class ResumePoint(NamedTuple):
    directory: str  # a checkpoints directory
    step: int


def find_checkpoint(resume, output_dir):
    """The checkpoint `--resume_from_checkpoint resume` names (in `--output_dir output_dir` for `latest` or a
    step), or None to start afresh (no flag, or `latest` before the first checkpoint: one command both
    starts a job and restarts it)."""
    if not resume:
        return None
    directory, step = locate_checkpoint(resume, output_dir)
    steps = checkpoint_steps(directory)  # a listing: nothing is opened, nothing created
    if step is None:
        if not steps:
            return None
        step = steps[-1]
    elif step not in steps:
        raise UsageError(f"--resume_from_checkpoint {resume}: no checkpoint of step {step} in {directory} "
                         f"(its steps: {', '.join(map(str, steps)) or 'none'})")
    return ResumePoint(os.path.abspath(directory), step)


# Config entries that say where a model came from, not what it computes.
_CONFIG_METADATA = ("_name_or_path", "_commit_hash", "transformers_version", "architectures", "dtype", "torch_dtype")
# How to get each fingerprint entry back to the checkpoint's value.
_FINGERPRINT_HINTS = {
    "model config": "the model config (--model_name_or_path, --config_name, --config_overrides)",
    "global batch size": "per_device_train_batch_size x devices x gradient_accumulation_steps, or "
                         "--total_train_batch_size",
    "training examples": "the training data, --max_train_samples and --streaming",
    "seed": "--seed",
    "optimizer": "--adafactor",
    "adapters": "--lora_rank, --lora_alpha, --lora_dropout, --lora_target and --lora_base_dtype",
}


def run_fingerprint(config, train_examples=None, global_batch_size=None, seed=None, adafactor=False, adapters=None):
    """The settings a resumed run must share with the checkpoint it continues, by name.

    The model config (shapes and everything the model computes with); when training
    (`train_examples`: their number, or "streamed") also the global batch size (accumulation
    included), the number of training examples and the seed (together they fix the examples and
    dropout masks of every step), the optimizer (`--adafactor`: the structure of its state) and the
    LoRA adapters (`utils.models.lora.Adapters`, None without).
    Anything else may change, the layout and the number of devices included: a resumed run
    continues exactly what its own layout and devices would have done from that step.
    """
    config = json.loads(config.to_json_string(use_diff=False))
    fingerprint = {"model config": {k: v for k, v in config.items() if k not in _CONFIG_METADATA}}
    if train_examples is not None:
        fingerprint.update({
            "global batch size": global_batch_size,
            "training examples": train_examples,
            "seed": seed,
            "optimizer": "adafactor" if adafactor else "adamw",
            "adapters": adapters.describe() if adapters else None,
        })
    return fingerprint


def fingerprint_difference(saved, current):
    """The first difference between two fingerprints that forbids a resume, as a phrase, or None
    (entries only one has are skipped: older checkpoints also recorded their layout and devices)."""
    for name, value in current.items():
        if name not in saved or saved[name] == value:
            continue
        what, saved_value = name, saved[name]
        if name == "model config":
            key = next(k for k in sorted(set(value) | set(saved_value)) if value.get(k) != saved_value.get(k))
            what, saved_value, value = f"model config {key!r}", saved_value.get(key), value.get(key)
        return (f"{what} is {saved_value!r} in the checkpoint but {value!r} in this run "
                f"(set by {_FINGERPRINT_HINTS[name]})")
    return None


def resume_or_start(resume, fingerprint, state, total_steps, layout, train_data=None):
    """The state to train from and its step: the checkpoint's, or `state` (placed by `layout`) at
    step 0 when `resume` is None.

    The last check of a run, before it writes anything: the checkpoint must have this run's
    `fingerprint`, parameter shapes and dtypes (those of `state`), and, when training
    (`total_steps`, the run's last step; 0 when not training), a step that is not past the last one.
    It may come from another layout or device count: the weights and optimizer state restore
    exactly, and the run goes on as one started on this layout and these devices would have from
    that step (dropout keys are derived from the seed and the step, `Layout.dropout_key`). A
    streamed `train_data` gets its stream's state back (`resume_from`).
    """
    if resume is None:
        return state, 0
    where = f"{resume.directory}/{resume.step}"
    target = layout.checkpoint_target(lora.checkpointed(state))  # with LoRA: no frozen base
    reader = Checkpointer(resume.directory, read_only=True)
    try:
        saved = reader.read_meta(resume.step).get("fingerprint", {})
        difference = fingerprint_difference(saved, fingerprint)
        if difference:
            raise UsageError(f"cannot resume from {where}: {difference}; resume with the same settings, or start a "
                             "new run with --overwrite_output_dir or another --output_dir")
        try:
            reader.check_compatible(resume.step, target)
        except ValueError as error:  # shapes or dtypes (e.g. --param_dtype) differ
            raise UsageError(f"cannot resume from {where}: {error}") from error
        if total_steps and resume.step > total_steps:
            raise UsageError(f"the checkpoint {where} is at step {resume.step}, past the {total_steps} steps of this "
                             "run: raise --max_steps or --num_train_epochs")
        # The fresh state only told the shapes and places: its memory goes before the restore needs it.
        jax.tree_util.tree_map(lambda x: x.delete() if isinstance(x, jax.Array) else None, lora.checkpointed(state))
        restored, meta = reader.restore(resume.step, target)
        _restore_stream(reader, resume, meta, train_data)
    finally:
        reader.close()
    logger.info("resumed from the checkpoint of step %d in %s", resume.step, resume.directory)
    return lora.restored(state, layout.from_checkpoint(restored)), int(meta["step"])


def _restore_stream(reader, resume, meta, train_data):
    """Give a streamed run this process's row of the stream states the checkpoint holds."""
    template = train_data.state_template() if train_data is not None else None
    if template is None:
        return
    saved = meta.get("data")
    if saved is None:
        raise UsageError(f"cannot resume from {resume.directory}/{resume.step} with --streaming: that run read its "
                         "data into memory; resume it without --streaming")
    if len(saved) != jax.process_count():
        raise UsageError(f"cannot resume from {resume.directory}/{resume.step}: its data stream was read by "
                         f"{len(saved)} processes, this run has {jax.process_count()}; resume on as many")
    rows = reader.restore_data(resume.step, {name: ((len(saved), *shape), dtype)
                                             for name, (shape, dtype) in template.items()})
    index = jax.process_index()
    train_data.resume_from({"meta": saved[index], "arrays": {name: array[index] for name, array in rows.items()}})
