"""utils/base/hub_probe.py: one short probe of the hub, offline mode when it does not answer, nothing otherwise;
utils/run/hub_push.py: pushes."""

import concurrent.futures
import http.server
import logging
import os
import threading
import time
import urllib.request

import pytest
from huggingface_hub import constants

from utils.base import hub_probe
from utils.run import hub_push


class _Status(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):
        self.send_response(int(self.path.strip("/") or 200))
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_any_answer_counts_as_reachable(server):
    assert hub_probe.unreachable_reason(server) is None
    assert hub_probe.unreachable_reason(server + "/404") is None
    assert "refused" in hub_probe.unreachable_reason("http://127.0.0.1:9")


def test_probe_is_bounded_even_if_the_lookup_hangs(monkeypatch):
    release = threading.Event()

    def hanging(*args, **kwargs):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(urllib.request, "urlopen", hanging)
    start = time.time()
    try:
        assert hub_probe.unreachable_reason("http://hub.example", timeout=0.5) == "no answer within 0.5 s"
    finally:
        release.set()  # let the abandoned probe thread end now, not in a later test
    assert time.time() - start < 5


def test_local_names_never_probe(hub_online, monkeypatch, tmp_path):
    monkeypatch.setattr(hub_probe, "unreachable_reason", lambda url: pytest.fail("probed the hub"))
    assert hub_probe.check_access([str(tmp_path), None]) is None


def test_unreachable_hub_turns_offline_mode_on(hub_online, monkeypatch):
    import datasets.config
    import transformers.utils.hub

    hub_online("http://127.0.0.1:9")
    reason = hub_probe.check_access(["t5-small"])
    assert reason.startswith("the hub at http://127.0.0.1:9 is unreachable (")
    assert hub_probe.offline_reason() == hub_probe.offline_reason(datasets=True) == reason
    assert constants.HF_HUB_OFFLINE and datasets.config.HF_HUB_OFFLINE and transformers.utils.hub._is_offline_mode
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"  # for worker processes


def test_reachable_hub_is_left_alone(hub_online, server):
    hub_online(server)
    assert hub_probe.check_access(["t5-small"], need_hub=True) is None
    assert not constants.HF_HUB_OFFLINE and "HF_HUB_OFFLINE" not in os.environ


def test_offline_flags_skip_the_probe(hub_online, monkeypatch):
    monkeypatch.setattr(hub_probe, "unreachable_reason", lambda url: pytest.fail("probed the hub"))
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert hub_probe.check_access(["t5-small"]) == "offline mode is on (TRANSFORMERS_OFFLINE=1)"


def test_datasets_offline_flag_only_concerns_datasets(hub_online, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "yes")
    assert hub_probe.offline_reason() is None
    assert hub_probe.offline_reason(datasets=True) == "offline mode is on (HF_DATASETS_OFFLINE=yes)"


@pytest.mark.parametrize("name, path", [("t5-small", False), ("google/flan-t5-small", False), ("/models/t5", True),
                                        ("./t5", True), ("~/t5", True), ("runs/t5/final", True)])
def test_looks_like_path(name, path):
    assert hub_probe.looks_like_path(name) is path


# ---------------------------------------------------------------------------------------------
# HubPusher (a fake HfApi: no network)
# ---------------------------------------------------------------------------------------------
class FakeHfApi:
    """Records calls instead of talking to the hub."""

    instances = []

    def __init__(self, token=None):
        self.token = token
        self.calls = []
        FakeHfApi.instances.append(self)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        future = concurrent.futures.Future()
        future.set_result("commit-url")
        return future


def test_hub_pusher_with_fake_api(tmp_path, monkeypatch, caplog):
    import huggingface_hub

    token = "hf_secretTOKEN123"
    FakeHfApi.instances.clear()
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    caplog.set_level(logging.DEBUG)

    pusher = hub_push.HubPusher("me/tiny-t5", token, str(tmp_path), private=True)
    api = FakeHfApi.instances[0]
    assert api.token == token
    assert api.calls == [("create_repo", "me/tiny-t5", {"private": True, "exist_ok": True})]

    pusher.push("Step 100")
    pusher.push("End of training")
    pusher.wait()
    uploads = [call[1] for call in api.calls[1:]]
    assert [u["commit_message"] for u in uploads] == ["Step 100", "End of training"]
    for upload in uploads:
        assert upload["repo_id"] == "me/tiny-t5"
        assert upload["folder_path"] == str(tmp_path)
        assert upload["run_as_future"] is True
        assert "checkpoints/*" in upload["ignore_patterns"]
        assert "*.orbax-checkpoint-tmp*" in upload["ignore_patterns"]
    assert "me/tiny-t5" in caplog.text
    assert token not in caplog.text
    assert token not in repr(vars(pusher))  # kept by HfApi only, not as an attribute here


def test_hub_pusher_wait_reraises_upload_errors(tmp_path, monkeypatch):
    import huggingface_hub

    class FailingApi(FakeHfApi):
        def upload_folder(self, **kwargs):
            future = concurrent.futures.Future()
            future.set_exception(RuntimeError("403 Forbidden"))
            return future

    monkeypatch.setattr(huggingface_hub, "HfApi", FailingApi)
    pusher = hub_push.HubPusher("me/tiny-t5", "hf_x", str(tmp_path))
    pusher.push("Step 1")
    with pytest.raises(RuntimeError, match="403"):
        pusher.wait()

