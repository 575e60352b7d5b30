"""Error types and the handler every script's entry point runs under.

A mistake by the user (bad flag, missing file, non-empty output dir) is a `UsageError`: exit 2.
A failure while running (non-finite loss, disk full) is a `RunError`: exit 1. Either way the user
sees one line on stderr naming the problem and the fix, not a traceback; `--debug` or
`FLAXTUNE_DEBUG=1` shows the traceback too. A run stopped by SIGTERM / SIGINT after saving a
checkpoint is `Stopped`: exit 128 + the signal number (143 / 130, what shells and schedulers expect
of a process ended by that signal), with a line saying how to resume.
"""

import errno
import logging
import os
import sys
import threading
import traceback

# How a full disk shows: OSError's errno, or the message of libraries that wrap it (tensorstore,
# under orbax, raises ValueError("... No space left on device [os_error_code='28']")).
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


class UsageError(Exception):
    """Bad arguments, configuration or input data: the user can fix it. Exit code 2."""

    exit_code = 2


class RunError(Exception):
    """A failure during the run itself. Exit code 1."""

    exit_code = 1


class Done(Exception):
    """`main` has done all it was asked to before the end of its flow (`--compile_only`): exit 0."""


class Stopped(Exception):
    """Training stopped on a signal after saving a checkpoint. Exit code 128 + signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from, says the disk (or quota) is full."""
    while error is not None:
        if getattr(error, "errno", None) in _DISK_FULL_ERRNOS or any(t in str(error) for t in _DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def debug_enabled(argv=None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return os.environ.get("FLAXTUNE_DEBUG", "") not in ("", "0") or "--debug" in argv


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


_at_exit = []
_data_files = {}


def name_data_files(files):
    """Record the local file each split is read from (`files`: {split: path or None}).

    The task modules speak of "the train data" (they know splits, not files); the error report puts
    the split's file in front of a `UsageError` that speaks of it, so that every error about a row,
    a label or an answer names its file. `run_main` forgets the files when it ends.
    """
    _data_files.update({split: path for split, path in files.items() if path})


def _naming_the_file(message):
    """`message` with "data file PATH: " in front when it speaks of a recorded split's data without
    naming its file (the split mentioned first, where it speaks of several)."""
    mentioned = [(message.find(f"the {split} data"), path) for split, path in _data_files.items()]
    mentioned = sorted((at, path) for at, path in mentioned if at >= 0)
    if not mentioned or mentioned[0][1] in message:
        return message
    return f"data file {mentioned[0][1]}: {message}"


def at_exit(callback):
    """Have `run_main` call `callback()` once `main` has ended, however it ended (last registered first).

    For work that must finish while the interpreter still runs, such as a checkpoint being written
    in the background: `atexit` callbacks come after the thread pools that work needs are shut down.
    """
    _at_exit.append(callback)


def _close_progress_bars():
    """A bar the failure left open would redraw itself below the error line when Python exits."""
    tqdm = sys.modules.get("tqdm.std")
    if tqdm is not None:
        for bar in list(tqdm.tqdm._instances):
            bar.close()


def run_main(main, argv=None) -> int:
    """Run `main()`, then the `at_exit` callbacks; a failure becomes one stderr line and an exit code.

    The line comes last, after anything the callbacks print. It is about the first failure: a
    callback that fails after `main` failed (e.g. the wait for a checkpoint on a disk that is full)
    shows only with --debug.
    """
    debug, previous_hook = debug_enabled(argv), sys.unraisablehook
    if not debug:
        # Exceptions a library could not raise (orbax's callbacks into a closed event loop after a
        # failed save) are ignored by Python anyway; only --debug prints their tracebacks.
        sys.unraisablehook = lambda unraisable: None
    failure = None
    try:
        failure = _call(main)
        if failure is not None and not debug:
            _quiet_library_errors()
        while _at_exit:
            late = _call(_at_exit.pop())
            if failure is None and late is not None:
                failure = late
                if not debug:
                    _quiet_library_errors()
            elif late is not None and debug:  # a clean-up failing after the failure: the same cause, as a rule
                traceback.print_exception(late)
    finally:
        if failure is None:
            sys.unraisablehook = previous_hook
    try:
        return 0 if failure is None or isinstance(failure, Done) else _report(failure, debug)
    finally:
        _data_files.clear()


def _quiet_library_errors():
    """Once the run has failed, what libraries print about their own follow-on failures stays quiet
    until the process ends, so the one error line is the last: after a failed save, orbax's
    background writes keep failing in their threads and event loops, and their tracebacks (threads,
    callbacks, "Future exception was never retrieved" when asyncio collects them at exit) would
    otherwise land after it, at random. --debug shows them all."""
    sys.excepthook = threading.excepthook = sys.unraisablehook = lambda *args: None
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def _call(function):
    """The exception `function()` raised (KeyboardInterrupt included), or None."""
    try:
        function()
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - each one is reported by `_report`
        return error
    return None


def _report(error, debug) -> int:
    """Print the one line for `error` (and its traceback with --debug); returns the exit code."""
    _close_progress_bars()
    if isinstance(error, Stopped):  # not a failure: no traceback, even with --debug
        sys.stdout.flush()
        print(f"stopped: {_one_line(error)}", file=sys.stderr, flush=True)
        return error.exit_code
    if isinstance(error, UsageError):
        code, message = error.exit_code, _naming_the_file(_one_line(error))
    elif isinstance(error, RunError):
        code, message = error.exit_code, _one_line(error)
    elif isinstance(error, KeyboardInterrupt):
        code, message = 130, "interrupted"
    elif is_disk_full(error):
        code, message = 1, (f"no space left on device ({_one_line(error)[:300]}): free some space, or choose "
                            "another --output_dir / --cache_dir")
    else:  # last line of defence: never show a bare traceback
        code, message = 1, f"{type(error).__name__}: {_one_line(error)} (rerun with --debug for the traceback)"
    if debug:
        traceback.print_exception(error)
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code
