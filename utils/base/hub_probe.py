"""Is the Hugging Face hub reachable? Fail in seconds, not after ~24 s of retries.

Without a network, transformers and datasets retry every hub request for about 24 s before they
fail. `check_access` probes the endpoint (`HF_ENDPOINT`) once, with a short timeout, when a name is
not a local path; if nothing answers it switches the libraries to offline mode, so that names in
the local cache still load and the others fail at once (`offline_reason` then explains why). A
reachable hub, or a run with only local paths, is left exactly as it is.
"""

import os
import threading
import urllib.error
import urllib.request

from huggingface_hub import constants

PROBE_TIMEOUT_S = 5.0
_TRUE = ("1", "ON", "YES", "TRUE")
_unreachable = None  # the probe's finding, once it found the hub unreachable


def endpoint() -> str:
    return constants.ENDPOINT


def looks_like_path(name: str) -> bool:
    """Hub ids are `name` or `owner/name`: anything else is meant as a local path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def offline_reason(datasets=False):
    """Why the hub cannot be used in this process (by `datasets`, if asked), or None when it (probably) can."""
    if _unreachable:
        return _unreachable
    flags = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") + (("HF_DATASETS_OFFLINE",) if datasets else ())
    for name in flags:
        if os.environ.get(name, "").upper() in _TRUE:
            return f"offline mode is on ({name}={os.environ[name]})"
    return None


def unreachable_reason(url: str, timeout: float = PROBE_TIMEOUT_S):
    """None if an HTTP server answers at `url` (any status counts) within `timeout` seconds, else why not."""
    outcome = []

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # an error status is still an answer
        except (OSError, ValueError) as e:
            outcome.append(str(getattr(e, "reason", e)))

    # A thread bounds the whole probe: urlopen's timeout does not cover a hanging DNS lookup.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def go_offline(reason: str):
    """Offline mode for this process and its children, including libraries that read it at import."""
    global _unreachable
    _unreachable = reason
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    import datasets.config
    import transformers.utils.hub

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    transformers.utils.hub._is_offline_mode = True


def check_access(names, need_hub=False):
    """Probe the hub if one of `names` (model, tokenizer, dataset names or paths) is not a local path.

    Returns `offline_reason()` (None: the hub is usable or not needed). `need_hub` (pushing) probes
    whatever the names are.
    """
    remote = [name for name in names if name and not os.path.exists(name)]
    if not (remote or need_hub):
        return None
    if offline_reason() is None:
        reason = unreachable_reason(endpoint())
        if reason:
            go_offline(f"the hub at {endpoint()} is unreachable ({reason})")
    return offline_reason()
