"""Full-state checkpoints: save, restore, and finding them on disk.

A checkpoint step directory holds two orbax items:
- "state": the TrainState as global arrays, whatever the layout that saved it
  (`utils.layout.layouts.Layout.checkpoint_tree`): params, opt_state and step at their full shapes (host
  copies of the replicas under "dp"; the sharded arrays as they are under "fsdp", each process
  writing its shards). So any layout, on any number of devices, restores any checkpoint: the
  target says where each leaf goes (a sharding, or the host). There are no dropout keys to save:
  a step derives its own (`utils.layout.layouts.Layout.dropout_key`).
- "meta": a JSON dict chosen by the caller (`utils.checkpoints.saving.Saver` stores the step, the data position
  and a fingerprint of the settings a resume must not change).
- "data", in streamed runs only: the host arrays of the data stream's state (`utils.data.stream`), one
  row per process (their JSON part is in "meta").

Orbax writes each step into a `*.orbax-checkpoint-tmp*` directory and renames it when complete, so a
save killed half-way never shows up in `all_steps`/`latest_step` and is never restored.

Multi-host runs: orbax coordinates a save with barriers, so every process must call `save` with the
same step, and orbax lets only the primary process (process 0) write host arrays and JSON.
`is_main_process` is therefore ignored when `jax.process_count() > 1`.
With a single process, `is_main_process=False` opens the checkpoints read-only: it writes nothing.
"""

import contextlib
import inspect
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from utils.base.errors import RunError, UsageError, is_disk_full
from utils.layout.devices import fetch_replicated

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
# The dropout keys that checkpoints written before the keys were derived from (seed, step) hold:
# restoring one ignores them.
OLD_KEYS = "dropout_rng"


def find_checkpoint_dir(output_dir: str) -> str:
    """Where a run keeps its checkpoints: `output_dir/checkpoints`."""
    return os.path.join(output_dir, CHECKPOINT_SUBDIR)


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints in `directory`, found without opening any.

    A save cut short leaves `<step>.orbax-checkpoint-tmp*`, which is not a step directory.
    """
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def locate_checkpoint(resume: str, output_dir: str) -> tuple[str, int | None]:
    """(checkpoints directory, step or None for its latest) named by `--resume_from_checkpoint resume`.

    `resume` is "latest" or a step number (both in `output_dir`), a step directory
    (`out/checkpoints/120`), a checkpoints directory, or an output directory holding one.
    """
    if resume == "latest":
        return find_checkpoint_dir(output_dir), None
    if resume.isdigit():
        return find_checkpoint_dir(output_dir), int(resume)
    path = os.path.abspath(os.path.expanduser(resume))
    parent, name = os.path.split(path)
    if ".orbax-checkpoint-tmp" in name:
        raise UsageError(f"--resume_from_checkpoint {resume} is an incomplete checkpoint (its save was cut short): "
                         f"resume from a complete one in {parent}")
    if name.isdigit() and int(name) in checkpoint_steps(parent):
        return parent, int(name)
    for directory in (path, find_checkpoint_dir(path)):
        if checkpoint_steps(directory):
            return directory, None
    if os.path.isdir(path):
        raise UsageError(f"--resume_from_checkpoint {resume}: no complete checkpoint there; if it is the output "
                         "directory of a run, that run stopped before its first checkpoint: start it again without "
                         "--resume_from_checkpoint (add --overwrite_output_dir), or with --resume_from_checkpoint "
                         "latest, which starts afresh while there is no checkpoint")
    raise UsageError(f"--resume_from_checkpoint {resume} not found: pass 'latest', a step number, a step "
                     "directory (OUTPUT_DIR/checkpoints/120), a checkpoints directory or an output directory")


@contextlib.contextmanager
def disk_full_is_fatal(output_dir: str, before_listing=None):
    """A full disk while writing into a run's `output_dir` becomes one RunError that names the newest
    complete checkpoint there (the one to resume from). `before_listing()` runs first (the saver waits
    for its writes still going: they fail the same way, and one may still complete)."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        if before_listing:
            before_listing()
        steps = checkpoint_steps(find_checkpoint_dir(output_dir))
        kept = (f"the checkpoint of step {steps[-1]} is intact (resume with --resume_from_checkpoint latest)"
                if steps else "no checkpoint was completed")
        raise RunError(f"no space left on device while saving to {output_dir}: free some space or choose another "
                       f"--output_dir; {kept}") from error


@jax.jit
def _leaves_finite(leaves):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def all_finite(tree) -> bool:
    """Whether every floating-point value of `tree` (e.g. replicated params) is finite, checked on device."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return bool(fetch_replicated(_leaves_finite(leaves))) if leaves else True


def _shape_dtypes(tree) -> dict:
    """{"params/encoder/...": (shape, dtype)} for every array leaf, in tree order."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): (tuple(leaf.shape), np.dtype(leaf.dtype))
        for path, leaf in leaves
    }


def _check_compatible(step: int, saved: dict, expected: dict):
    """Raise ValueError at the first entry where the checkpoint and the model disagree (an old
    checkpoint's dropout keys aside)."""
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
    extra = [path for path in saved if path not in expected and path != OLD_KEYS]
    if extra:
        raise ValueError(f"checkpoint at step {step} has {extra[0]}, which the model lacks: the model config changed")


# The state's host arrays are written as they are, not copied first: they are `Layout.checkpoint_tree`'s own
# copies (or views of device buffers, which a step cannot donate while a view is alive), which nothing
# changes. Orbax's copy cost a second host copy of the state while it was written: 5.1 GiB more host memory
# for the Llama row's 455M parameters on a TPU host. A streamed run's "data" rows keep the copy.
# orbax-checkpoint before 0.12.5 (what some TPU VMs' own package index holds) always copies: there the state
# is written with its default handler, at the cost of that second copy (docs/running.md).
WRITES_HOST_ARRAYS_IN_PLACE = "deepcopy_host_arrays" in inspect.signature(ocp.type_handlers.NumpyHandler).parameters
# Nor are they compressed (`use_compression=False` below): trained float weights and Adam's moments shrink by
# ~10%, and tensorstore held compressed chunks of most of the state until the write was done (3.7 GiB for the
# Llama row; on this project's CPU 1.27 GiB for a 1.5 GiB state, against 0.11 uncompressed, in twice the time).
_STATE_TYPES = ocp.type_handlers.create_type_handler_registry(*[
    (kind, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)
     if kind is np.ndarray and WRITES_HOST_ARRAYS_IN_PLACE else ocp.type_handlers.get_type_handler(kind))
    for kind in ocp.type_handlers.supported_types()])


def _restore_args(leaf):
    if getattr(leaf, "sharding", None) is None:
        return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(sharding=leaf.sharding)


class Checkpointer:
    """Keeps the last `max_to_keep` full training states of a run in `directory`."""

    def __init__(
        self,
        directory: str,
        max_to_keep: int | None = 2,
        async_save: bool = True,
        is_main_process: bool = True,
        read_only: bool = False,
    ):
        self.directory = os.path.abspath(directory)
        read_only = read_only or (not is_main_process and jax.process_count() == 1)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            create=not read_only,
            read_only=read_only,
            enable_async_checkpointing=async_save,
        )
        # Handlers named up front: without them a fresh manager cannot read an item's metadata.
        handlers = {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=_STATE_TYPES, use_compression=False),
                    "meta": ocp.JsonCheckpointHandler(),
                    "data": ocp.PyTreeCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._closed = False

    def save(self, step: int, tree, meta: dict, data=None, force: bool = False) -> bool:
        """Save `tree` (`Layout.checkpoint_tree`: global arrays, host or sharded; its host arrays are written
        as they are, so nothing may change them until the write is done), `meta` and `data` (host
        arrays, or None) at `step`; returns whether a save happened.

        Returns as soon as the arrays are copied off the devices; the write continues in the background
        when async (call `wait()` before reading the files or exiting).
        """
        if step in self._manager.all_steps():
            return False  # e.g. the final save landing on a periodic one
        items = {"state": ocp.args.PyTreeSave(tree), "meta": ocp.args.JsonSave(meta)}
        if data is not None:
            items["data"] = ocp.args.PyTreeSave(data)
        saved = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
        if saved:
            logger.info("Saving checkpoint at step %d to %s", step, self.directory)
        return saved

    def read_meta(self, step: int | None) -> dict:
        """The meta dict saved at `step` (None: the latest), without reading the state."""
        step = self._resolve_step(step)
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def delete_after(self, step: int) -> list[int]:
        """Delete the checkpoints of steps after `step`; returns their steps."""
        later = [s for s in self.all_steps() if s > step]
        for s in later:
            self._manager.delete(s)
        return later

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, step: int | None, target):
        """Restore (state, meta) at `step` (None: the latest) into `target` (`Layout.checkpoint_target`).

        Each leaf of `target` (a `jax.ShapeDtypeStruct`) gives the shape and dtype, checked against the
        checkpoint first, and where the value goes: into that sharding when it has one, else the host
        (numpy).
        """
        step = self.check_compatible(step, target)
        restore_args = jax.tree.map(_restore_args, target)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                # Partial: the leaves of `target` only, so an old checkpoint's dropout keys stay on disk.
                state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
                meta=ocp.args.JsonRestore(),
            ),
        )
        logger.info("Restored checkpoint at step %d from %s", step, self.directory)
        return restored["state"], restored["meta"]

    def restore_data(self, step: int, template: dict):
        """The "data" item of `step` as host arrays shaped like `template` ({name: (shape, dtype)}), or
        None when the checkpoint has none (it was saved by a run that read its data into memory)."""
        if "data" not in self._manager.item_metadata(step) or self._manager.item_metadata(step)["data"] is None:
            return None
        target = {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in template.items()}
        restore_args = jax.tree.map(_restore_args, target)
        args = ocp.args.Composite(data=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
        return self._manager.restore(step, args=args)["data"]

    def saved_shapes(self, step: int) -> dict:
        """{"params/...": (shape, dtype)} of the checkpoint of `step`, from its metadata alone."""
        return _shape_dtypes(self._manager.item_metadata(step)["state"].tree)

    def check_compatible(self, step: int | None, target) -> int:
        """Check, from the checkpoint's metadata alone, that `target` can restore `step` (None: the
        latest): the same tree, shapes and dtypes. Returns the step; ValueError names the first
        difference."""
        step = self._resolve_step(step)
        _check_compatible(step, self.saved_shapes(step), _shape_dtypes(target))
        return step

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is None:
            return max(steps)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint at step {step} in {self.directory} (found steps {steps})")
        return step

    def wait(self):
        """Block until pending async saves are written (and old steps pruned)."""
        self._manager.wait_until_finished()

    def close(self, raise_errors: bool = True):
        """Wait for the saves still being written, then stop orbax's threads, after a failed save too
        (left running, they print tracebacks after the run's last line). Safe to call again."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.wait_until_finished()  # raises the error of a failed background write, once
        except Exception:
            if raise_errors:
                raise
        finally:
            self._manager.close()
