"""When a training run saves, and the save itself.

`SavePolicy` answers the one question the loop asks after every step: should this step be saved,
and why. `Saver` writes the checkpoint (full state, data position, fingerprint), then the Hugging
Face export beside it and a hub push; it never saves a non-finite state, and after a stop request
(SIGTERM / SIGINT) it writes the checkpoint only and ends the run with `Stopped`. A full disk is one
`RunError` that names the newest checkpoint still intact.
"""

import logging
import os
import secrets

import jax
import numpy as np
from jax.experimental import multihost_utils

from utils.base.errors import RunError, Stopped, at_exit
from utils.checkpoints import preemption
from utils.checkpoints.store import Checkpointer, all_finite, checkpoint_steps, disk_full_is_fatal, find_checkpoint_dir
from utils.layout import devices
from utils.models import lora

logger = logging.getLogger(__name__)

STOP = "stop requested"


def check_shared(directory, why):
    """RunError unless every process sees the files process 0 writes in `directory` (a shared file
    system): process 0 leaves a token there, the others must read it back."""
    marker = os.path.join(directory, ".flaxtune-shared")
    token = int(multihost_utils.broadcast_one_to_all(np.int64(secrets.randbits(62))))
    if jax.process_index() == 0:
        with open(marker, "w", encoding="utf-8") as f:
            f.write(str(token))
    devices.sync_processes("flaxtune: shared storage written")
    try:
        with open(marker, encoding="utf-8") as f:
            seen = f.read() == str(token)
    except OSError:
        seen = False
    everyone = bool(np.all(multihost_utils.process_allgather(np.int32(seen))))
    if jax.process_index() == 0:
        os.remove(marker)
    if not everyone:
        raise RunError(f"--output_dir {os.path.dirname(directory)} is not shared by all hosts ({why}): put it on "
                       "storage every host mounts at the same path (NFS, a gcsfuse bucket)")


class SavePolicy:
    """Every `save_steps`, at the last step, at epoch ends with `save_on_epoch_end`, and when a stop
    was requested."""

    def __init__(self, save_steps, save_on_epoch_end, steps_per_epoch, total_steps):
        self.save_steps, self.save_on_epoch_end = save_steps, save_on_epoch_end
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps

    def reason(self, step):
        """Why `step` is to be saved, or None. Call it once after every step, on every process."""
        if preemption.stop_due(step):  # first: processes agree on a stop step only if all ask at every step
            return STOP
        if step == self.total_steps:
            return "last step"
        if step % self.save_steps == 0:
            return "save_steps"
        if self.save_on_epoch_end and step % self.steps_per_epoch == 0:
            return "end of epoch"
        return None


class Saver:
    """The checkpoints of a training run in `output_dir/checkpoints`, and the exports beside them.

    A checkpoint holds the state (`layout`), and the data position (the epoch and step; for a
    streamed `train_data` also the stream's state). Created when training starts (at `start_step`):
    a resumed run first drops the checkpoints after
    the step it continues from, and from here on SIGTERM / SIGINT stop the run cleanly after the
    current step. Every process makes one (checkpoint saves are collective): under dp process 0 writes
    the checkpoints, under fsdp every process writes its shards; the export is process 0's alone.
    """

    def __init__(self, output_dir, save_total_limit, run_dir, layout, train_data, fingerprint, steps_per_epoch,
                 total_steps, start_step, is_main):
        self.output_dir, self.run_dir, self.layout = output_dir, run_dir, layout
        self.train_data, self.fingerprint = train_data, fingerprint
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.checkpointer = Checkpointer(find_checkpoint_dir(self.output_dir),
                                         max_to_keep=save_total_limit, is_main_process=is_main)
        self._closed = False
        if layout.writes_shards and jax.process_count() > 1:
            check_shared(self.checkpointer.directory, "--sharding fsdp: every process writes its shards of each "
                                                      "checkpoint there")
        if start_step:
            dropped = self.checkpointer.delete_after(start_step)
            if dropped:
                logger.warning("deleted the checkpoints of steps %s: this run continues from step %d instead",
                               dropped, start_step)
        preemption.install()
        # However the run ends (an error included), checkpoints being written are finished first.
        at_exit(self.close)

    def save_if_the_data_ran_out(self, step, state):
        """After the training loop: a stream that ended (its last pass, `--max_stream_passes`) stopped
        every process at `step`, before the run's last step; say so and save there (nothing to do
        when the loop ran to its end)."""
        if step < self.total_steps:
            logger.warning("the training data ran out after step %d of %d: training ends there", step,
                           self.total_steps)
            self.save(step, state, "end of the data")

    def save(self, step, state, reason):
        """Checkpoint `state` at `step` for `reason` (`SavePolicy.reason`), export and push it."""
        saved = lora.checkpointed(state)  # a frozen base is not saved: the model's weights give it back
        if not all_finite((saved.params, saved.opt_state)):
            raise RunError(f"the parameters became non-finite in step {step} (its loss was still finite): lower "
                           f"--learning_rate; {self.kept()}")
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        meta = {"step": step, "epoch": epoch, "step_in_epoch": step_in_epoch, "fingerprint": self.fingerprint}
        data = None
        stream = self.train_data.state_after(step)  # a streamed run's place in its stream (None: in memory)
        if stream is not None:  # every process has its own: they go into one checkpoint, a row each
            meta["data"] = devices.gather_json(stream["meta"])
            data = {name: devices.gather_rows(rows) for name, rows in stream["arrays"].items()}
        tree = self.layout.checkpoint_tree(saved)
        with self._disk_full_is_fatal():
            self.checkpointer.save(step, tree, meta, data)
            if reason == STOP:  # the grace period before a machine goes is short: the checkpoint only
                self.close()
                signal = preemption.stop_signal()
                raise Stopped(f"{signal.name} received: saved the checkpoint of step {step} in "
                              f"{self.checkpointer.directory}. To resume, rerun the same command with "
                              f"--resume_from_checkpoint latest: {preemption.resume_command()}", signal)
            # The checkpoint's host copy of the weights serves the export where it holds them all (not a layout's
            # shards, nor a state whose frozen base it leaves out): no second copy beside it.
            whole = not self.layout.writes_shards and saved.params is state.params
            self.run_dir.export(tree.params if whole else self.layout.params_to_host(state.params), f"step {step}")
        if step == self.total_steps:
            preemption.uninstall()  # training is over: nothing left to stop cleanly

    def kept(self):
        """What the run leaves to resume from, for the end of an error line: its complete checkpoints
        (once those being written are finished), or that there is none."""
        try:
            self.checkpointer.wait()
        except Exception:  # noqa: BLE001 - a failed write leaves no checkpoint to list, which is the answer
            pass
        steps = checkpoint_steps(self.checkpointer.directory)
        if not steps:
            return ("no checkpoint was saved before that step: start again (with --overwrite_output_dir, which "
                    "replaces this run's files)")
        which = f"step {steps[0]} is" if len(steps) == 1 else f"steps {', '.join(map(str, steps))} are"
        return (f"the checkpoint of {which} kept in {self.checkpointer.directory}: resume from step {steps[-1]} with "
                "--resume_from_checkpoint latest")

    def close(self):
        """Wait for the checkpoints being written, then stop the checkpointer. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        preemption.uninstall()
        with self._disk_full_is_fatal():
            self.checkpointer.close()

    def _disk_full_is_fatal(self):
        return disk_full_is_fatal(self.output_dir, before_listing=self._stop_writing)

    def _stop_writing(self):
        """After a failed write: wait for the writes still going (they fail the same way), stop orbax."""
        self._closed = True
        preemption.uninstall()
        self.checkpointer.close(raise_errors=False)
