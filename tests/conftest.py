"""Test set-up: 8 virtual CPU devices, offline hubs, and the repo root importable."""

import os
import sys

# Must happen before jax is imported anywhere.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import pytest  # noqa: E402  (after the environment set-up above)


@pytest.fixture
def hub_online(monkeypatch):
    """Offline mode off (set above) and the probe's finding forgotten, all restored afterwards.

    Returns a setter for the hub endpoint; point it at a port nothing listens on to act out a
    machine without a network.
    """
    import datasets.config
    import transformers.utils.hub
    from huggingface_hub import constants

    from utils import hub

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(transformers.utils.hub, "_is_offline_mode", False)
    monkeypatch.setattr(hub, "_unreachable", None)
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

    return LayoutRuns(tmp_path_factory.mktemp("layouts"))
