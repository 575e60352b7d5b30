"""The suite's own set-up: `python -m pytest` spreads the files over pytest-xdist workers, and `-n 0` or
`-p no:xdist` (pytest without the plugin) run it in one process (tests/conftest.py's
`pytest_cmdline_main`, not pyproject's addopts, sets the workers)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_TEST = "tests/test_args.py::test_json_config_alone"


def run_pytest(*flags):
    # A nested run of its own: not one of this run's xdist workers, and no cache written into the checkout.
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_XDIST")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *flags, ONE_TEST], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("flags", [("-n", "0"), ("-p", "no:xdist")])
def test_the_suite_runs_in_one_process_when_asked(flags):
    returncode, output = run_pytest(*flags)
    assert returncode == 0 and "1 passed" in output, output[-2000:]
    assert "workers" not in output


def test_the_suite_runs_on_xdist_workers_by_default():
    returncode, output = run_pytest()
    assert returncode == 0 and "1 passed" in output, output[-2000:]
    assert re.search(r"created: \d+/\d+ workers", output), output[-2000:]
