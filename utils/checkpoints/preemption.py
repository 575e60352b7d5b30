"""Stopping a training run cleanly when the machine is taken away (SIGTERM) or the user presses Ctrl-C.

While training, the first SIGTERM or SIGINT only sets a flag: the loop finishes the step it is in,
saves a checkpoint and exits with the command that resumes the run (see `utils.run.preflight.Outputs.save`).
The handlers are then reset to the system default, so a second signal ends the process at once
(already-finished checkpoints stay valid: orbax writes each one atomically).

With several processes, the stop step must be the same on every process or the collective save
hangs. JAX's preemption service (started by `jax.distributed.initialize`) listens for SIGTERM on
each host and agrees on that step; our handlers stay out of its way there.
"""

import logging
import shlex
import signal
import sys

import jax
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RESUME_FLAG = "--resume_from_checkpoint"

_received = None  # the number of the first signal received while installed
_previous = {}  # signal -> handler to put back on uninstall


def _handle(signum, frame):
    global _received
    _received = signum
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    logger.warning("received %s: finishing the current step, then saving a checkpoint and stopping "
                   "(send it again to stop at once, without saving)", signal.Signals(signum).name)


def install():
    """Turn SIGTERM / SIGINT into a stop request for the training loop (single process only)."""
    global _received
    _received = None
    if jax.process_count() > 1 or _previous:
        return
    for s in SIGNALS:
        _previous[s] = signal.signal(s, _handle)


def uninstall():
    """Give the signals back their handlers from before `install` (after training ends)."""
    for s, handler in _previous.items():
        signal.signal(s, handler)
    _previous.clear()


def stop_due(step: int) -> bool:
    """Whether training must stop after `step` (call once per step, on every process)."""
    if jax.process_count() > 1:
        return multihost_utils.reached_preemption_sync_point(step)
    return _received is not None


def stop_signal() -> signal.Signals:
    """The signal that stopped the run (SIGTERM when JAX's preemption service did)."""
    return signal.Signals(_received or signal.SIGTERM)


def resume_command(argv=None) -> str:
    """The command line of this run with `--resume_from_checkpoint latest` in place of any earlier one."""
    argv = list(sys.argv if argv is None else argv)
    args, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == RESUME_FLAG:
            skip = True
        elif not arg.startswith(RESUME_FLAG + "="):
            args.append(arg)
    return shlex.join(["python", argv[0], *args, RESUME_FLAG, "latest"])
