"""utils/base/errors.py: exit codes and the one-line, traceback-free error report."""

import errno
import logging
import signal
import sys
from types import SimpleNamespace

import pytest
from tqdm.auto import tqdm

from utils.base.errors import (RunError, Stopped, UsageError, at_exit, debug_enabled, is_disk_full, name_data_files,
                               run_main)


def raising(error):
    def main():
        raise error
    return main


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv("FLAXTUNE_DEBUG", raising=False)


@pytest.mark.parametrize("error, code, message", [
    (UsageError("bad flag\n  --foo: use --bar"), 2, "error: bad flag --foo: use --bar"),
    (RunError("loss became nan by step 3"), 1, "error: loss became nan by step 3"),
    (ZeroDivisionError("division by zero"), 1,
     "error: ZeroDivisionError: division by zero (rerun with --debug for the traceback)"),
    (KeyboardInterrupt(), 130, "error: interrupted"),
])
def test_exit_code_and_one_line(capsys, error, code, message):
    assert run_main(raising(error), argv=[]) == code
    out, err = capsys.readouterr()
    assert err.splitlines() == [message]
    assert "Traceback" not in err + out


def test_success_returns_zero(capsys):
    calls = []
    assert run_main(lambda: calls.append(1), argv=[]) == 0
    assert calls == [1] and capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, env", [(["cfg.json", "--debug"], None), ([], "1")])
def test_debug_prints_traceback(capsys, monkeypatch, argv, env):
    if env:
        monkeypatch.setenv("FLAXTUNE_DEBUG", env)
    assert run_main(raising(RunError("boom")), argv=argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RunError: boom" in err
    assert err.rstrip().splitlines()[-1] == "error: boom"


def reading(files, error):
    def main():
        name_data_files(files)
        raise error
    return main


@pytest.mark.parametrize("error, line", [
    (UsageError("row 3 of the test data: no answer"), "error: data file t.csv: row 3 of the test data: no answer"),
    (UsageError("the validation data has labels the model does not know: 'x' (the train data has 'a')"),
     "error: data file v.csv: the validation data has labels the model does not know: 'x' (the train data has 'a')"),
    (UsageError("data file t.csv:2 is not valid JSON"), "error: data file t.csv:2 is not valid JSON"),  # named already
    (UsageError("--learning_rate must be positive"), "error: --learning_rate must be positive"),  # no split's data
    (RunError("the test data ran out"), "error: the test data ran out"),  # not about the input
])
def test_an_error_about_a_splits_data_names_its_file(capsys, error, line):
    """The task modules speak of "the test data"; the report names the file the split came from (the
    split spoken of first)."""
    assert run_main(reading({"train": "train.csv", "validation": "v.csv", "test": "t.csv"}, error), argv=[]) > 0
    assert capsys.readouterr().err.splitlines() == [line]


def test_the_data_files_are_forgotten_when_the_run_ends(capsys):
    run_main(reading({"train": "old.csv"}, UsageError("x")), argv=[])
    assert run_main(raising(UsageError("the train data has one class only")), argv=[]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: the train data has one class only"


def test_debug_enabled(monkeypatch):
    assert not debug_enabled([]) and debug_enabled(["--debug"])
    monkeypatch.setenv("FLAXTUNE_DEBUG", "0")
    assert not debug_enabled([])
    monkeypatch.setenv("FLAXTUNE_DEBUG", "yes")
    assert debug_enabled([])


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stopped_exits_128_plus_signal_without_traceback(capsys, signum, code):
    assert run_main(raising(Stopped("saved step 3. To resume, rerun\n with --resume_from_checkpoint latest", signum)),
                    argv=["--debug"]) == code
    err = capsys.readouterr().err
    assert err.splitlines() == ["stopped: saved step 3. To resume, rerun with --resume_from_checkpoint latest"]


def test_at_exit_callbacks_run_last_first_even_after_an_error(capsys):
    calls = []
    at_exit(lambda: calls.append("first"))
    at_exit(lambda: calls.append("second"))
    assert run_main(raising(RunError("boom")), argv=[]) == 1
    assert calls == ["second", "first"]
    assert run_main(lambda: None, argv=[]) == 0 and calls == ["second", "first"]  # each runs once


def test_failing_at_exit_callback_fails_a_good_run_and_stays_quiet_after_a_failure(capsys):
    at_exit(raising(OSError("disk full")))
    assert run_main(lambda: None, argv=[]) == 1
    assert "error: OSError: disk full" in capsys.readouterr().err
    at_exit(raising(OSError("disk full")))
    assert run_main(raising(UsageError("bad flag")), argv=[]) == 2  # main's failure decides, and is the one line
    assert capsys.readouterr().err.splitlines() == ["error: bad flag"]
    at_exit(raising(OSError("disk full")))
    assert run_main(raising(UsageError("bad flag")), argv=["--debug"]) == 2
    err = capsys.readouterr().err
    assert "OSError: disk full" in err and err.splitlines()[-1] == "error: bad flag"  # --debug shows it before


def test_main_failure_is_the_last_line(capsys):
    at_exit(lambda: print("progress bar closing", file=sys.stderr))
    assert run_main(raising(RunError("boom")), argv=[]) == 1
    assert capsys.readouterr().err.splitlines() == ["progress bar closing", "error: boom"]


@pytest.mark.parametrize("error, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (ValueError("RESOURCE_EXHAUSTED: Failed to write: No space left on device [os_error_code='28']"), True),
    (OSError(errno.ENOENT, "No such file or directory"), False),
    (ValueError("bad value"), False),
])
def test_is_disk_full(error, full):
    assert is_disk_full(error) is full
    try:
        raise RuntimeError("wrapped") from error
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped) is full  # libraries wrap the OSError


def test_disk_full_message(capsys):
    assert run_main(raising(OSError(errno.ENOSPC, "No space left on device")), argv=[]) == 1
    assert capsys.readouterr().err.startswith("error: no space left on device ([Errno 28] No space left on device): "
                                              "free some space, or choose another --output_dir / --cache_dir")


def test_open_progress_bar_closed_before_the_error_line(capsys):
    def main():
        bar = tqdm(total=10, file=sys.stderr)
        bar.update(3)
        raise RunError("boom")

    assert run_main(main, argv=[]) == 1
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == "error: boom"


@pytest.fixture
def hooks():
    """The interpreter's error hooks and the asyncio logger's level, put back after the test."""
    import threading

    saved = sys.excepthook, threading.excepthook, sys.unraisablehook, logging.getLogger("asyncio").level
    yield
    sys.excepthook, threading.excepthook, sys.unraisablehook = saved[:3]
    logging.getLogger("asyncio").setLevel(saved[3])


def test_unraisable_exceptions_quiet_unless_debug(capsys, hooks):
    def main():
        sys.unraisablehook(SimpleNamespace(exc_value=RuntimeError("Event loop is closed")))

    hook = sys.unraisablehook
    assert run_main(main, argv=[]) == 0
    assert capsys.readouterr().err == ""
    assert sys.unraisablehook is hook  # a run that did not fail gives the hook back


def test_after_a_failure_library_errors_stay_quiet_so_the_error_line_is_last(capsys, hooks):
    """What a failed save leaves running (orbax threads, tensorstore callbacks, asyncio futures) keeps
    failing while the process ends; none of it may print after the error line."""
    import threading

    at_exit(lambda: threading.Thread(target=lambda: 1 / 0).start())
    assert run_main(raising(RunError("disk full")), argv=[]) == 1
    sys.excepthook(RuntimeError, RuntimeError("Event loop is closed"), None)
    sys.unraisablehook(SimpleNamespace(exc_value=RuntimeError("Event loop is closed")))
    logging.getLogger("asyncio").error("Future exception was never retrieved")
    assert capsys.readouterr().err == "error: disk full\n"
