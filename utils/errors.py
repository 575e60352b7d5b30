"""Error types and the handler every script's entry point runs under.

A mistake by the user (bad flag, missing file, non-empty output dir) is a `UsageError`: exit 2.
A failure while running (non-finite loss, disk full) is a `RunError`: exit 1. Either way the user
sees one line on stderr naming the problem and the fix, not a traceback; `--debug` or
`FLAXTUNE_DEBUG=1` shows the traceback too. A run stopped by SIGTERM / SIGINT after saving a
checkpoint is `Stopped`: exit 128 + the signal number (143 / 130, what shells and schedulers expect
of a process ended by that signal), with a line saying how to resume.
"""

import os
import sys
import traceback


class UsageError(Exception):
    """Bad arguments, configuration or input data: the user can fix it. Exit code 2."""

    exit_code = 2


class RunError(Exception):
    """A failure during the run itself. Exit code 1."""

    exit_code = 1


class Stopped(Exception):
    """Training stopped on a signal after saving a checkpoint. Exit code 128 + signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def debug_enabled(argv=None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return os.environ.get("FLAXTUNE_DEBUG", "") not in ("", "0") or "--debug" in argv


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


_at_exit = []


def at_exit(callback):
    """Have `run_main` call `callback()` once `main` has ended, however it ended (last registered first).

    For work that must finish while the interpreter still runs, such as a checkpoint being written
    in the background: `atexit` callbacks come after the thread pools that work needs are shut down.
    """
    _at_exit.append(callback)


def run_main(main, argv=None) -> int:
    """Run `main()`, then the `at_exit` callbacks; a failure becomes one stderr line and an exit code.

    The line about `main` comes last, after anything the callbacks print (e.g. a progress bar closing).
    """
    failure = _call(main)
    while _at_exit:
        late = _call(_at_exit.pop())
        if late is not None and failure is None:
            failure = late
        elif late is not None:
            _report(late, argv)
    return 0 if failure is None else _report(failure, argv)


def _call(function):
    """The exception `function()` raised (KeyboardInterrupt included), or None."""
    try:
        function()
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - each one is reported by `_report`
        return error
    return None


def _report(error, argv) -> int:
    """Print the one line for `error` (and its traceback with --debug); returns the exit code."""
    if isinstance(error, Stopped):  # not a failure: no traceback, even with --debug
        sys.stdout.flush()
        print(f"stopped: {_one_line(error)}", file=sys.stderr, flush=True)
        return error.exit_code
    if isinstance(error, (UsageError, RunError)):
        code, message = error.exit_code, _one_line(error)
    elif isinstance(error, KeyboardInterrupt):
        code, message = 130, "interrupted"
    else:  # last line of defence: never show a bare traceback
        code, message = 1, f"{type(error).__name__}: {_one_line(error)} (rerun with --debug for the traceback)"
    if debug_enabled(argv):
        traceback.print_exception(error)
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code
