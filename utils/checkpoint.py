"""Full-state checkpoints (save / restore / resume), Hugging Face export, and hub push.

A checkpoint step directory holds two orbax items:
- "state": the TrainState as host numpy arrays, stored device-independently: params, opt_state and
  step once (the replicas are identical), dropout_rng as one row per device of the run
  (`[n_devices, ...]`), because every device draws its own dropout key and an exact resume needs them
  all.
- "meta": a JSON dict chosen by the script (data position, a fingerprint of settings, ...).

Orbax writes each step into a `*.orbax-checkpoint-tmp*` directory and renames it when complete, so a
save killed half-way never shows up in `all_steps`/`latest_step` and is never restored.

Multi-host runs: orbax coordinates a save with barriers, so every process must call `save` with the
same step, and orbax lets only the primary process (process 0) write host arrays and JSON.
`is_main_process` is therefore ignored when `jax.process_count() > 1`; the dropout keys of all
processes are gathered before the save, and `restore` gives each process its own rows back.
With a single process, `is_main_process=False` opens the checkpoints read-only: it writes nothing.
"""

import logging
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"


def find_checkpoint_dir(output_dir: str) -> str:
    """Where a run keeps its checkpoints: `output_dir/checkpoints`."""
    return os.path.join(output_dir, CHECKPOINT_SUBDIR)


def _first_replica(x):
    """The first local device's copy of a pmap-replicated array, on the host.

    Replicated arrays carry a leading device axis and live on several devices (a NamedSharding even
    with one device); anything else (numpy, a single-device array) is already unreplicated.
    """
    if isinstance(x, jax.Array) and not isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
        return np.asarray(x.addressable_data(0)).reshape(x.shape[1:])
    return np.asarray(x)


def _host_state(state):
    """The replicated device state as host numpy arrays, with the keys of every device kept."""
    # `tiled` concatenates each process's local keys: one row per device of the whole run.
    keys = multihost_utils.process_allgather(state.dropout_rng, tiled=True)
    # Copies are made now, not in the async writer: the next pmap step may donate the device buffers.
    return jax.tree.map(_first_replica, state.replace(dropout_rng=None)).replace(dropout_rng=keys)


def _shape_dtypes(tree) -> dict:
    """{"params/encoder/...": (shape, dtype)} for every array leaf, in tree order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): (tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in leaves
    }


def _check_compatible(step: int, saved: dict, expected: dict):
    """Raise ValueError at the first entry where the checkpoint and the model disagree."""
    for path, (shape, dtype) in expected.items():
        if path not in saved:
            raise ValueError(f"checkpoint at step {step} has no {path}, which the model has: the model config changed")
        saved_shape, saved_dtype = saved[path]
        if saved_shape != shape:
            raise ValueError(
                f"checkpoint at step {step} has shape {saved_shape} for {path}, model has {shape}: "
                "the model config changed"
            )
        if saved_dtype != dtype:
            raise ValueError(
                f"checkpoint at step {step} has dtype {saved_dtype} for {path}, model has {dtype}: "
                "the model config or dtype changed"
            )
    extra = [path for path in saved if path not in expected]
    if extra:
        raise ValueError(f"checkpoint at step {step} has {extra[0]}, which the model lacks: the model config changed")


class Checkpointer:
    """Keeps the last `max_to_keep` full training states of a run in `directory`."""

    def __init__(
        self,
        directory: str,
        max_to_keep: int | None = 2,
        async_save: bool = True,
        is_main_process: bool = True,
    ):
        self.directory = os.path.abspath(directory)
        read_only = not is_main_process and jax.process_count() == 1
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            create=not read_only,
            read_only=read_only,
            enable_async_checkpointing=async_save,
        )
        # Handlers named up front: without them a fresh manager cannot read an item's metadata.
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        """Save the replicated `state` and `meta` at `step`; returns whether a save happened.

        Returns as soon as the state is on the host; the write continues in the background when
        async (call `wait()` before reading the files or exiting).
        """
        if step in self._manager.all_steps():
            return False  # e.g. the final save landing on a periodic one
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(_host_state(state)), meta=ocp.args.JsonSave(meta))
        saved = self._manager.save(step, args=args, force=force)
        if saved:
            logger.info("Saving checkpoint at step %d to %s", step, self.directory)
        return saved

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, step: int | None, template_state):
        """Restore (host state, meta) at `step` (None: the latest).

        `template_state` is an unreplicated host TrainState built like the fresh one; it gives the
        tree structure, shapes and dtypes, which are checked against the checkpoint first. The
        returned state has numpy leaves and dropout_rng of shape [local devices, ...], ready to be
        replicated.
        """
        step = self._resolve_step(step)
        target = self._abstract_target(template_state)
        saved = _shape_dtypes(self._manager.item_metadata(step)["state"].tree)
        saved_devices = saved["dropout_rng"][0][0]
        if saved_devices != jax.device_count():
            raise ValueError(
                f"checkpoint at step {step} was saved by a run on {saved_devices} devices, this run has "
                f"{jax.device_count()}: its per-device dropout keys cannot resume exactly"
            )
        _check_compatible(step, saved, _shape_dtypes(target))
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args),
                meta=ocp.args.JsonRestore(),
            ),
        )
        state = restored["state"]
        n_local = jax.local_device_count()
        first = jax.process_index() * n_local
        logger.info("Restored checkpoint at step %d from %s", step, self.directory)
        return state.replace(dropout_rng=state.dropout_rng[first : first + n_local]), restored["meta"]

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint at step {step} in {self.directory} (found steps {steps})")
        return step

    @staticmethod
    def _abstract_target(template_state):
        """Shapes/dtypes of what the checkpoint must hold: the template, one key per device of the run."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), template_state)
        key = abstract.dropout_rng
        keys = jax.ShapeDtypeStruct((jax.device_count(), *key.shape), key.dtype)
        return abstract.replace(dropout_rng=keys)

    def wait(self):
        """Block until pending async saves are written (and old steps pruned)."""
        self._manager.wait_until_finished()

    def close(self):
        self._manager.close()


def export_pretrained(model, params, tokenizer, output_dir: str, is_main_process: bool = True):
    """Write what `from_pretrained(output_dir)` loads: config, weights, and the tokenizer if given.

    `params` may be the pmap-replicated ones; the first device's copy is written.
    """
    if not is_main_process:
        return
    # Written beside and then moved into place, so a failed write (a full disk) leaves the previous
    # export whole: each file is replaced by a rename, which needs no space.
    staging = tempfile.mkdtemp(prefix=".export-", dir=output_dir)
    try:
        model.save_pretrained(staging, params=jax.tree.map(_first_replica, params))
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Exported model to %s", output_dir)


class HubPusher:
    """Uploads `output_dir` (minus checkpoints) to a hub repo in the background.

    The repo is created up front so a bad token or name fails before training. The token goes to
    `HfApi` only: it is never logged or kept as an attribute here.
    """

    def __init__(self, repo_id: str, token: str, output_dir: str, private: bool | None = None):
        from huggingface_hub import HfApi

        self.repo_id = repo_id
        self.output_dir = output_dir
        self._api = HfApi(token=token)
        self._api.create_repo(repo_id, private=private, exist_ok=True)
        self._futures = []

    def push(self, commit_message: str):
        """Start an upload of the current contents of `output_dir`; returns without waiting."""
        logger.info("Pushing %s to the hub repo %s", self.output_dir, self.repo_id)
        future = self._api.upload_folder(
            repo_id=self.repo_id,
            folder_path=self.output_dir,
            commit_message=commit_message,
            run_as_future=True,
            ignore_patterns=[f"{CHECKPOINT_SUBDIR}/*", "*.orbax-checkpoint-tmp*", ".export-*"],
        )
        self._futures.append(future)

    def wait(self):
        """Wait for every pending upload; re-raises the first upload error."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()
