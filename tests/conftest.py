"""Test set-up: 8 virtual CPU devices, offline hubs, and the repo root importable."""

import os
import shutil
import sys
import tempfile

from script_runner import xla_flags  # imports no jax

# Must happen before jax is imported anywhere.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One JAX compilation cache for the whole session, every script process and xdist worker included:
# the tests' runs compile the same tiny steps again and again (each layout, resume, eval-only, ...).
# JAX reads these when it is imported; a script's own --compilation_cache_dir (the tests pass "none")
# then leaves them as they are. Entries are keyed by the program, so a hit is the program it replaces.
_OWN_JAX_CACHE = "FLAXTUNE_TESTS_JAX_CACHE" not in os.environ  # only in the process that starts the workers
if _OWN_JAX_CACHE:
    os.environ["FLAXTUNE_TESTS_JAX_CACHE"] = tempfile.mkdtemp(prefix="flaxtune-tests-jax-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["FLAXTUNE_TESTS_JAX_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402  (after the environment set-up above)


def pytest_unconfigure(config):
    if _OWN_JAX_CACHE:  # after every worker has finished
        shutil.rmtree(os.environ["FLAXTUNE_TESTS_JAX_CACHE"], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Without `-n`, one pytest-xdist worker per core, at most four: most tests wait on one script process
    compiling, which keeps a single core busy. Whole files go to one worker, so a file's fixtures are built
    once. Set here rather than in addopts so that `-p no:xdist` (no `-n` option at all) and `-n 0` run in one
    process. Runs before xdist's own hook, which turns "auto" into a count."""
    option = config.option
    if not hasattr(option, "numprocesses") or hasattr(config, "workerinput"):
        return  # xdist is off, or this is one of its workers
    if option.numprocesses is None:
        option.numprocesses = "auto"
        option.maxprocesses = option.maxprocesses or 4
    if option.numprocesses != 0 and option.dist == "no":
        option.dist = "loadfile"
        # Files in the order of pytest_collection_modifyitems below, not xdist's (most tests first).
        option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files with end-to-end runs (marked `slow`) first, the unit-test files after them. xdist hands out
    whole files as workers free up, so the quick files fill the end of the session, instead of one core idling
    while the other finishes a long file (test_transfer.py's minute, alone at the end, in one measured run)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: each file keeps its order, in one piece


@pytest.fixture
def hub_online(monkeypatch):
    """Offline mode off (set above) and the probe's finding forgotten, all restored afterwards.

    Returns a setter for the hub endpoint; point it at a port nothing listens on to act out a
    machine without a network.
    """
    import datasets.config
    import transformers.utils.hub
    from huggingface_hub import constants

    from utils.base import hub_probe

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(transformers.utils.hub, "_is_offline_mode", False)
    monkeypatch.setattr(hub_probe, "_unreachable", None)
    return lambda url: monkeypatch.setattr(constants, "ENDPOINT", url)


@pytest.fixture
def jax_platforms():
    """A setter for `jax.config.jax_platforms` (what $JAX_PLATFORMS fills in when jax is imported),
    restored afterwards. The backends are opened first, as $JAX_PLATFORMS says: the setter changes
    what code reads, never which devices the tests run on."""
    import jax

    jax.devices()
    saved = jax.config.jax_platforms
    yield lambda value: jax.config.update("jax_platforms", value)
    jax.config.update("jax_platforms", saved)


@pytest.fixture(scope="session")
def layout_runs(tmp_path_factory):
    """Every script's tiny run in each layout, run when first asked for (tests/layout_runs.py)."""
    from layout_runs import LayoutRuns

    # Under xdist every worker has a temporary dir of its own below one they share: the runs go there,
    # so each runs once per session whichever worker asks first.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    return LayoutRuns(shared / "layouts")
