"""Error types and the handler every script's entry point runs under.

A mistake by the user (bad flag, missing file, non-empty output dir) is a `UsageError`: exit 2.
A failure while running (non-finite loss, disk full) is a `RunError`: exit 1. Either way the user
sees one line on stderr naming the problem and the fix, not a traceback; `--debug` or
`FLAXTUNE_DEBUG=1` shows the traceback too.
"""

import errno
import os
import sys
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


def _close_progress_bars():
    """A bar the failure left open would redraw itself below the error line when Python exits."""
    tqdm = sys.modules.get("tqdm.std")
    if tqdm is not None:
        for bar in list(tqdm.tqdm._instances):
            bar.close()


def run_main(main, argv=None) -> int:
    """Run `main()` and turn any exception into one stderr line and an exit code."""
    debug, previous_hook = debug_enabled(argv), sys.unraisablehook
    if not debug:
        # Exceptions a library could not raise (orbax's callbacks into a closed event loop after a
        # failed save) are ignored by Python anyway; only --debug prints their tracebacks.
        sys.unraisablehook = lambda unraisable: None
    try:
        main()
        return 0
    except (UsageError, RunError) as error:
        failure, code, message = error, error.exit_code, _one_line(error)
    except KeyboardInterrupt as error:
        failure, code, message = error, 130, "interrupted"
    except Exception as error:  # noqa: BLE001 - last line of defence: never show a bare traceback
        failure, code = error, 1
        if is_disk_full(error):
            message = (f"no space left on device ({_one_line(error)[:300]}): free some space, or choose another "
                       "--output_dir / --cache_dir")
        else:
            message = f"{type(error).__name__}: {_one_line(error)} (rerun with --debug for the traceback)"
    finally:
        sys.unraisablehook = previous_hook
    _close_progress_bars()
    if debug:
        # Outside the `except` blocks sys.exc_info() is empty: print the caught exception itself.
        traceback.print_exception(failure)
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code
