"""Script scaffolding shared by every `run_*_flax.py`: start-up checks, set-up, the training plan,
and the run's outputs (results files, checkpoints, Hugging Face export, hub pushes)."""

import contextlib
import json
import os
import shutil

import jax
import numpy as np
from huggingface_hub import get_token

from utils import compat, data, hub, sharding
from utils.args import check_output_dir, check_phases, public_args, save_args
from utils.checkpoint import Checkpointer, HubPusher, export_pretrained, find_checkpoint_dir
from utils.errors import RunError, UsageError, is_disk_full
from utils.logging import MetricsLogger, setup_logging
from utils.loop import write_results

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
    check_output_dir(training_args, has_checkpoint=os.path.isdir(find_checkpoint_dir(training_args.output_dir)))
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


class Outputs:
    """Everything a run writes: results files, metrics, checkpoints, model export, hub pushes.

    Only process 0 writes; other processes take part in the (collective) checkpoint saves.
    """

    def __init__(self, training_args, all_args, model, tokenizer, total_steps, is_main):
        out = training_args.output_dir
        self.args, self.model, self.tokenizer, self.is_main = training_args, model, tokenizer, is_main
        self.pusher = None
        if training_args.push_to_hub and is_main:  # first: a bad token or name leaves the output dir as it was
            repo_id = training_args.hub_model_id or os.path.basename(os.path.abspath(out))
            try:
                self.pusher = HubPusher(repo_id, training_args.hub_token, out)
            except OSError as e:  # requests' HTTP and connection errors
                raise UsageError(f"could not create the hub repository {repo_id!r}: {e}; check --hub_token "
                                 "(it needs write access) and --hub_model_id") from e
        checkpoint_dir = find_checkpoint_dir(out)
        fresh_training = (training_args.do_train and training_args.overwrite_output_dir
                          and not training_args.resume_from_checkpoint)
        if is_main and fresh_training:
            # Overwriting a run: its checkpoints and metrics would be mistaken for this run's.
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
            if os.path.exists(os.path.join(out, "metrics.jsonl")):
                os.remove(os.path.join(out, "metrics.jsonl"))
        os.makedirs(out, exist_ok=True)
        if is_main:
            save_args(out, *all_args)
        # No process may list the checkpoints before process 0 has removed an overwritten run's.
        sharding.sync_processes("flaxtune: output_dir ready")
        self.checkpointer = Checkpointer(checkpoint_dir, max_to_keep=training_args.save_total_limit,
                                         is_main_process=is_main)
        self.writer = MetricsLogger(out, is_main_process=is_main, total_steps=total_steps)
        self.writer.hparams(public_args(*all_args))
        self.results = {}

    def restore_or_start(self, state, logger):
        """Replicated state and the step to start from (0, or the checkpoint's step when resuming)."""
        start_step, resume = 0, self.args.resume_from_checkpoint
        if resume:
            step = None if resume == "latest" else int(resume)
            state, meta = self.checkpointer.restore(step, state)
            start_step = int(meta["step"])
            logger.info("resumed from the checkpoint of step %d", start_step)
        return sharding.replicate_state(state), start_step

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

    def save(self, step, state, meta):
        """Full-state checkpoint, Hugging Face export beside it, and a hub push."""
        with self._saving():
            self.checkpointer.save(step, state, {"step": step, **meta})
            export_pretrained(self.model, state.params, self.tokenizer, self.args.output_dir,
                              is_main_process=self.is_main)
        if self.pusher:
            self.pusher.push(f"step {step}")

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

    def finish(self):
        if self.is_main:
            with open(os.path.join(self.args.output_dir, "all_results.json"), "w", encoding="utf-8") as f:
                json.dump(self.results, f, indent=2)
        with self._saving():
            self.checkpointer.wait()
        self.writer.close()
        self.checkpointer.close()
        if self.pusher:
            self.pusher.push("end of training")
            self.pusher.wait()
