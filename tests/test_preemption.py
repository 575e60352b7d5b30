"""utils/checkpoints/preemption.py: SIGTERM / SIGINT become a stop request; a second signal is left to the system."""

import os
import signal

import pytest

from utils.checkpoints import preemption


@pytest.fixture
def installed():
    before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
    preemption.install()
    yield
    preemption.uninstall()
    assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before


def test_no_stop_without_a_signal(installed):
    assert not preemption.stop_due(1)


@pytest.mark.parametrize("signum", preemption.SIGNALS)
def test_first_signal_requests_a_stop_and_a_second_one_kills(installed, signum):
    os.kill(os.getpid(), signum)
    assert preemption.stop_due(7)
    assert preemption.stop_signal() == signum
    # The next one gets the system's default action (the process ends at once).
    assert all(signal.getsignal(s) == signal.SIG_DFL for s in preemption.SIGNALS)


def test_install_forgets_an_earlier_request(installed):
    os.kill(os.getpid(), signal.SIGTERM)
    preemption.uninstall()
    preemption.install()
    assert not preemption.stop_due(1)


@pytest.mark.parametrize("argv", [
    ["run_clm_flax.py", "cfg.json", "--output_dir", "out dir"],
    ["run_clm_flax.py", "cfg.json", "--resume_from_checkpoint", "12", "--output_dir", "out dir"],
    ["run_clm_flax.py", "cfg.json", "--resume_from_checkpoint=out/checkpoints/12", "--output_dir", "out dir"],
])
def test_resume_command_replaces_any_earlier_resume_flag(argv):
    assert preemption.resume_command(argv) == (
        "python run_clm_flax.py cfg.json --output_dir 'out dir' --resume_from_checkpoint latest")
