"""Script scaffolding shared by every `run_*_flax.py`: start-up checks, set-up, the training plan,
and the run's outputs (results files, checkpoints, Hugging Face export, hub pushes)."""

import contextlib
import json
import logging
import os
import shutil

import jax
import numpy as np
from huggingface_hub import get_token

from utils import compat, data, hub, preemption, sharding
from utils.args import check_output_dir, check_phases, public_args, save_args
from utils.checkpoint import (Checkpointer, HubPusher, all_finite, checkpoint_steps, export_pretrained,
                              find_checkpoint_dir, locate_checkpoint)
from utils.errors import RunError, Stopped, UsageError, at_exit, is_disk_full
from utils.logging import MetricsLogger, setup_logging
from utils.loop import write_results
from utils.perf import memory_report

logger = logging.getLogger(__name__)

SPLIT_FLAGS = {"train": ("do_train", "--train_file"), "validation": ("do_eval", "--validation_file"),
               "test": ("do_predict", "--test_file")}


def check_before_work(training_args, data_args, files, allowed, model_args=None):
    """Everything that can be checked before a model or dataset is touched; returns the columns of
    the local data files ({split: names}, where a cheap pre-read found them).

    `files` maps split -> local path (or None); a phase needs its split's file or a hub dataset.
    Names that are not local paths (`model_args`' model, config and tokenizer, the dataset) make
    one short probe of the hub, which switches to offline mode if it does not answer.
    """
    check_phases(training_args)
    has_checkpoint = bool(checkpoint_steps(find_checkpoint_dir(training_args.output_dir)))
    check_output_dir(training_args, has_checkpoint=has_checkpoint)
    if training_args.push_to_hub and not (training_args.hub_token or get_token()):
        raise UsageError("--push_to_hub needs --hub_token (a token with write access to the repository) "
                         "or a saved login (huggingface-cli login)")
    columns = {}
    for split, (phase, option) in SPLIT_FLAGS.items():
        if split not in files:
            continue
        if getattr(training_args, phase) and not data_args.dataset_name and not files[split]:
            raise UsageError(f"--{phase} needs {split} data: pass {option} or --dataset_name")
        if files[split]:
            names = data.check_file(files[split], allowed)
            if names is not None:
                columns[split] = names
    names = {"dataset_name": data_args.dataset_name}
    if model_args is not None:
        names.update(model_name_or_path=model_args.model_name_or_path, config_name=model_args.config_name,
                     tokenizer_name=model_args.tokenizer_name)
    for flag, name in names.items():
        if name and hub.looks_like_path(name) and not os.path.exists(name):
            raise UsageError(f"--{flag} {name} not found: check the path")
    offline = hub.check_access(names.values(), need_hub=training_args.push_to_hub)
    if training_args.push_to_hub:
        if offline:
            raise UsageError(f"--push_to_hub needs the hub, but {offline}: run where it is reachable, or drop "
                             "--push_to_hub")
        hub.check_token(training_args.hub_token)
    return columns


def needed_splits(training_args, splits=("train", "validation", "test")):
    return [split for split in splits if getattr(training_args, SPLIT_FLAGS[split][0])]


def set_up(training_args):
    """Multi-host start-up, version shims, compilation cache, logging; returns (logger, is_main_process)."""
    sharding.initialize_processes(training_args.coordinator_address, training_args.num_processes,
                                  training_args.process_id)
    sharding.check_tpu_backend()
    compat.apply()
    sharding.enable_compilation_cache(training_args.compilation_cache_dir)
    is_main = jax.process_index() == 0
    logger = setup_logging(is_main, debug=training_args.debug)
    logger.info("devices: %d local of %d in all (%s), process %d of %d", jax.local_device_count(),
                jax.device_count(), jax.devices()[0].device_kind, jax.process_index(), jax.process_count())
    return logger, is_main


def training_plan(training_args, num_train_examples):
    """(global train batch, steps per epoch, total optimizer steps)."""
    batch = sharding.global_batch_size(training_args.per_device_train_batch_size,
                                       training_args.gradient_accumulation_steps)
    steps_per_epoch = data.steps_per_epoch(num_train_examples, batch)
    if steps_per_epoch == 0:
        raise UsageError(
            f"{num_train_examples} training examples are fewer than one global batch of {batch} "
            f"(per_device_train_batch_size x {jax.device_count()} devices x gradient_accumulation_steps): "
            "lower the batch size or add data"
        )
    if training_args.max_steps > 0:
        total = training_args.max_steps
    else:
        total = int(np.ceil(training_args.num_train_epochs * steps_per_epoch))
    return batch, steps_per_epoch, total


# Config entries that say where a model came from, not what it computes.
_CONFIG_METADATA = ("_name_or_path", "_commit_hash", "transformers_version", "architectures", "dtype", "torch_dtype")
# How to get each fingerprint entry back to the checkpoint's value.
_FINGERPRINT_HINTS = {
    "model config": "the model config (--model_name_or_path, --config_name, --config_overrides)",
    "global batch size": "per_device_train_batch_size x devices x gradient_accumulation_steps",
    "training examples": "the training data and --max_train_samples",
    "seed": "--seed",
    "optimizer": "--adafactor",
    "devices": "the machine: every device has its own dropout key",
}


def run_fingerprint(config, training_args, train_examples=None):
    """The settings a resumed run must share with the checkpoint it continues, by name.

    The model config (shapes and everything the model computes with); when training also the
    global batch size, the number of training examples and the seed (together they fix the examples
    of every step), the optimizer (the structure of its state) and the number of devices (one dropout
    key each). Anything else may change.
    """
    config = json.loads(config.to_json_string(use_diff=False))
    fingerprint = {"model config": {k: v for k, v in config.items() if k not in _CONFIG_METADATA}}
    if train_examples is not None:
        fingerprint.update({
            "global batch size": sharding.global_batch_size(training_args.per_device_train_batch_size,
                                                            training_args.gradient_accumulation_steps),
            "training examples": train_examples,
            "seed": training_args.seed,
            "optimizer": "adafactor" if training_args.adafactor else "adamw",
            "devices": jax.device_count(),
        })
    return fingerprint


def fingerprint_difference(saved, current):
    """The first difference between two fingerprints as a phrase, or None (entries only one has are skipped)."""
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


class Outputs:
    """Everything a run writes: results files, metrics, checkpoints, model export, hub pushes.

    Only process 0 writes; other processes take part in the (collective) checkpoint saves.
    `train_examples` (the size of the training set) is needed when training: it is part of the
    fingerprint a resume is checked against and places each checkpoint in its epoch.
    """

    def __init__(self, training_args, all_args, model, tokenizer, total_steps, is_main, train_examples=None):
        out = training_args.output_dir
        self.args, self.model, self.tokenizer, self.is_main = training_args, model, tokenizer, is_main
        self.total_steps = total_steps
        training = training_args.do_train
        self.steps_per_epoch = training_plan(training_args, train_examples)[1] if training else None
        self.fingerprint = run_fingerprint(model.config, training_args, train_examples if training else None)
        self.pusher = None
        if training_args.push_to_hub and is_main:  # first: a bad token or name leaves the output dir as it was
            repo_id = training_args.hub_model_id or os.path.basename(os.path.abspath(out))
            try:
                self.pusher = HubPusher(repo_id, training_args.hub_token, out)
            except OSError as e:  # requests' HTTP and connection errors
                raise UsageError(f"could not create the hub repository {repo_id!r}: {e}; check --hub_token "
                                 "(it needs write access) and --hub_model_id") from e
        checkpoint_dir = find_checkpoint_dir(out)
        fresh_training = training and training_args.overwrite_output_dir and not training_args.resume_from_checkpoint
        if is_main and fresh_training:
            # Overwriting a run: its checkpoints and metrics would be mistaken for this run's.
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
            if os.path.exists(os.path.join(out, "metrics.jsonl")):
                os.remove(os.path.join(out, "metrics.jsonl"))
        # No process may list the checkpoints before process 0 has removed an overwritten run's.
        sharding.sync_processes("flaxtune: output_dir ready")
        self.checkpointer = Checkpointer(checkpoint_dir, max_to_keep=training_args.save_total_limit,
                                         is_main_process=is_main)
        # Checked before anything is written: a resume that cannot work leaves the output dir as it was.
        self.resume_from = self._checkpoint_to_resume()
        os.makedirs(out, exist_ok=True)
        if is_main:
            save_args(out, *all_args)
        self.writer = MetricsLogger(out, is_main_process=is_main, total_steps=total_steps)
        self.writer.hparams(public_args(*all_args))
        self.results = {}
        # However the run ends (an error included), checkpoints being written are finished first.
        at_exit(self.close)

    def restore_or_start(self, state, logger):
        """Replicated state and the step to start from: 0, or the checkpoint's step when resuming.

        A resumed training run drops the checkpoints and metric lines after the restored step, so the
        output directory reads like the uninterrupted run. From here until the end of training,
        SIGTERM / SIGINT stop the run cleanly after the current step (see `save`).
        """
        start_step = 0
        if self.resume_from:
            checkpointer, step = self.resume_from
            try:
                state, meta = checkpointer.restore(step, state)
            except ValueError as error:  # shapes, dtypes or device count differ
                raise UsageError(f"cannot resume from {checkpointer.directory}/{step}: {error}") from error
            start_step = int(meta["step"])
            logger.info("resumed from the checkpoint of step %d in %s", start_step, checkpointer.directory)
        state = sharding.replicate_state(state)
        if self.args.do_train:
            if start_step > self.total_steps:
                raise UsageError(f"the checkpoint is at step {start_step}, past the {self.total_steps} steps of this "
                                 "run: raise --max_steps or --num_train_epochs")
            if self.args.resume_from_checkpoint:
                dropped = self.checkpointer.delete_after(start_step)
                if dropped:
                    logger.warning("deleted the checkpoints of steps %s: this run continues from step %d instead",
                                   dropped, start_step)
                self.writer.rewind(start_step)
            preemption.install()
        return state, start_step

    def _checkpoint_to_resume(self):
        """(Checkpointer, step) that --resume_from_checkpoint names, checked against this run; None: start afresh."""
        resume = self.args.resume_from_checkpoint
        if not resume:
            return None
        directory, step = locate_checkpoint(resume, self.args.output_dir)
        if os.path.abspath(directory) == self.checkpointer.directory:
            checkpointer = self.checkpointer
        else:
            checkpointer = Checkpointer(directory, is_main_process=False)
        if step is None:
            step = checkpointer.latest_step()
            if step is None:  # "latest" before the first save: one command starts and restarts a run
                logger.warning("no checkpoint in %s yet: starting from scratch", directory)
                return None
        try:
            saved = checkpointer.read_meta(step).get("fingerprint", {})
        except FileNotFoundError as error:
            raise UsageError(f"--resume_from_checkpoint {resume}: {error}") from error
        difference = fingerprint_difference(saved, self.fingerprint)
        if difference:
            raise UsageError(f"cannot resume from {directory}/{step}: {difference}; resume with the same settings, "
                             "or start a new run with --overwrite_output_dir or another --output_dir")
        return checkpointer, step

    @contextlib.contextmanager
    def _saving(self):
        """A full disk while saving becomes a RunError that says which checkpoint is intact.

        Saves are asynchronous: a failed write shows up at the next save or at the final wait.
        """
        try:
            yield
        except Exception as error:
            if not is_disk_full(error):
                raise
            latest = self.checkpointer.latest_step()
            kept = ("no checkpoint was completed" if latest is None else
                    f"the checkpoint of step {latest} is intact (resume with --resume_from_checkpoint latest)")
            raise RunError(f"no space left on device while saving to {self.args.output_dir}: free some space or "
                           f"choose another --output_dir; {kept}") from error

    def save(self, step, state):
        """Full-state checkpoint (with the data position and fingerprint), Hugging Face export beside
        it, and a hub push.

        A state that is not finite is never saved: `RunError`, and the last checkpoint stays a good
        one. After a stop request (SIGTERM / SIGINT) only the checkpoint is written (the grace period
        before a machine goes is short); then pending writes finish, logs are flushed and `Stopped`
        says how to resume.
        """
        if not all_finite((state.params, state.opt_state)):
            raise RunError(f"the parameters became non-finite in step {step} (its loss was still finite): lower "
                           "--learning_rate; the checkpoints saved before that step are kept")
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        with self._saving():
            self.checkpointer.save(step, state, {"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                                                 "fingerprint": self.fingerprint})
        if preemption.stop_due(step):
            self.close()
            signal = preemption.stop_signal()
            raise Stopped(f"{signal.name} received: saved the checkpoint of step {step} in "
                          f"{self.checkpointer.directory}. To resume, rerun the same command with "
                          f"--resume_from_checkpoint latest: {preemption.resume_command()}", signal)
        with self._saving():
            export_pretrained(self.model, state.params, self.tokenizer, self.args.output_dir,
                              is_main_process=self.is_main)
        if self.pusher:
            self.pusher.push(f"step {step}")
        if step == self.total_steps:
            preemption.uninstall()  # training is over: nothing left to stop cleanly

    def report(self, prefix, metrics, step):
        """Log `metrics` and write `{prefix}_results.json`; remembered for all_results.json."""
        self.writer.log(step, metrics, split=prefix)
        results = write_results(self.args.output_dir, prefix, metrics, self.is_main)
        self.results.update(results)
        return results

    def write_text(self, name, lines):
        if self.is_main:
            with open(os.path.join(self.args.output_dir, name), "w", encoding="utf-8") as f:
                f.writelines(" ".join(line.split()) + "\n" for line in lines)

    def close(self):
        """Wait for checkpoints being written and flush the logs. Safe to call more than once."""
        try:
            with self._saving():
                self.checkpointer.wait()
        finally:
            self.writer.close()
            preemption.uninstall()

    def finish(self):
        if self.is_main:
            with open(os.path.join(self.args.output_dir, "all_results.json"), "w", encoding="utf-8") as f:
                json.dump(self.results, f, indent=2)
        self.close()
        self.checkpointer.close()
        if self.pusher:
            self.pusher.push("end of training")
            self.pusher.wait()
        logger.info("%s", memory_report())
