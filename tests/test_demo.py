"""demo.py in a real browser: Debian's chromium driven by Playwright, with the network closed.

One short training run per task (summarization, causal LM, masked LM), one demo server for each;
the page's answers are checked against the script's own predictions (generated_predictions.txt)
and against plain computations of the model here (a greedy loop, a softmax). Screenshots go to
$FLAXTUNE_TEST_ARTIFACTS (else the test's tmp dir). Without chromium, Streamlit or Playwright these
tests skip, except in CI ($CI set), where they fail.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest

from script_runner import ROOT, run_script, script_env

CHROMIUM = "/usr/bin/chromium"
# Flags for a closed network: no background fetches, updates or QUIC probes (without them the
# browser keeps trying hosts it cannot reach).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGE_TIMEOUT_MS = 180_000  # the first page waits for the model to load and compile (minutes on a busy machine)


def missing_tools():
    missing = [] if os.access(CHROMIUM, os.X_OK) else [f"{CHROMIUM} (apt-get install chromium)"]
    for module in ("streamlit", "playwright"):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{module} (pip install -r requirements-test.txt)")
    return missing


MISSING = missing_tools()
if MISSING and os.environ.get("CI"):
    raise RuntimeError(f"CI must run the demo's browser tests, but these are missing: {', '.join(MISSING)}")
needs_browser = pytest.mark.skipif(bool(MISSING), reason=f"the browser tests need {', '.join(MISSING)}")

TINY = {
    "summarization": ("run_summarization_flax.py", "configs/summarization_tiny.json", [
        # 80 steps: enough for different documents to get different summaries.
        "--config_overrides",
        "d_model=64,d_ff=128,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=32,dropout_rate=0.0",
        "--max_predict_samples", "2", "--do_eval", "false", "--total_train_batch_size", "16", "--max_steps", "80",
        "--warmup_steps", "10", "--learning_rate", "0.005",
        # Summaries cut at 8 tokens: the page must generate with the saved generation settings, not defaults.
        "--val_max_target_length", "8"]),
    "clm": ("run_clm_flax.py", "configs/clm_tiny.json", [
        "--config_overrides", "n_embd=32,n_layer=1,n_head=2,n_positions=64", "--block_size", "32",
        "--max_train_samples", "64", "--do_eval", "false", "--max_steps", "10", "--warmup_steps", "1"]),
    "mlm": ("run_mlm_flax.py", "configs/mlm_tiny.json", [
        "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,"
        "max_position_embeddings=18", "--max_seq_length", "16",
        "--max_train_samples", "64", "--do_eval", "false", "--max_steps", "10", "--warmup_steps", "1"]),
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(server, port, deadline):
    while time.time() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"demo.py exited with {server.returncode}: {server.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the demo server did not answer in time")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(task) -> the output dir of a short training run for `task`, trained when first asked
    for (so -k runs only the selected ones)."""
    tmp = tmp_path_factory.mktemp("demo_models")
    dirs = {}

    def trained(task):
        if task not in dirs:
            script, config, extra = TINY[task]
            out = tmp / task
            result = run_script(script, [config, "--output_dir", out, "--compilation_cache_dir", "none", *extra])
            assert result.returncode == 0, result.stderr[-3000:]
            dirs[task] = out
        return dirs[task]

    return trained


@pytest.fixture(scope="module")
def servers(models):
    """servers(task) -> the base url of a demo server for the model of `task`, started when first
    asked for; all are stopped at the end of the module."""
    started = {}

    def url(task):
        if task not in started:
            port = free_port()
            server = subprocess.Popen([sys.executable, os.path.join(ROOT, "demo.py"), str(models(task)), "--port",
                                       str(port)], cwd=ROOT, env=script_env(XLA_FLAGS=""),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            started[task] = (port, server)
            wait_healthy(server, port, time.time() + PAGE_TIMEOUT_MS / 1000)
        return f"http://127.0.0.1:{started[task][0]}"

    try:
        yield url
    finally:
        for _, server in started.values():
            server.terminate()
            server.wait(timeout=30)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    directory = os.environ.get("FLAXTUNE_TEST_ARTIFACTS") or str(tmp_path_factory.mktemp("demo_screenshots"))
    os.makedirs(directory, exist_ok=True)
    return directory


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium_profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1000, "height": 900})
        context.outside_requests = []

        def block_outside(route):
            # The network is closed to the page: anything not for the demo server is refused and noted.
            if urllib.parse.urlsplit(route.request.url).hostname == "127.0.0.1":
                route.continue_()
            else:
                context.outside_requests.append(route.request.url)
                route.abort()

        context.route("**/*", block_outside)
        context.requests = []
        context.on("request", lambda request: context.requests.append(request.url))
        yield context
        context.close()


def open_page(browser, url):
    page = browser.new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    page.goto(url)
    page.locator("textarea, input[type=text]").first.wait_for()
    return page


def submit(page, text, button):
    field = page.locator("textarea, input[type=text]").first
    field.fill(text)
    page.get_by_role("button", name=button).click()


def answer_of(page):
    """The answer's text, once the page shows one (a fresh page has none, so the first one seen is
    this request's)."""
    text = page.locator(".st-key-answer [data-testid=stText]")
    text.wait_for(state="attached")
    return text.text_content()


@pytest.mark.slow
@needs_browser
def test_summarization_page_shows_the_scripts_prediction(browser, servers, models, artifacts):
    documents = [json.loads(line)["document"] for line in
                 open(os.path.join(ROOT, "data", "summarization", "test.jsonl"), encoding="utf-8")]
    predictions = (models("summarization") / "generated_predictions.txt").read_text(encoding="utf-8").splitlines()
    assert len(set(predictions[:2])) == 2 and all(predictions[:2]), "the model must tell documents apart"
    for document, prediction in list(zip(documents, predictions))[:2]:
        page = open_page(browser, servers("summarization"))
        submit(page, document, "Summarize")
        assert answer_of(page) == prediction
    page.screenshot(path=os.path.join(artifacts, "demo-summarization.png"), full_page=True)


def greedy_reference(output_dir, prompt, new_tokens):
    """A plain greedy loop over the model's full forward pass (no cache, no padding, no `generate`)."""
    from transformers import AutoTokenizer, FlaxAutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = FlaxAutoModelForCausalLM.from_pretrained(output_dir)
    ids = tokenizer(prompt)["input_ids"]
    prompt_length = len(ids)
    for _ in range(new_tokens):
        logits = np.asarray(model(np.array([ids]), params=model.params).logits)[0, -1]
        token = int(logits.argmax())
        if token == model.config.eos_token_id:
            break
        ids.append(token)
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids) - prompt_length


@pytest.mark.slow
@needs_browser
def test_causal_lm_page_continues_greedily_like_a_plain_loop(browser, servers, models, artifacts):
    prompt = "Anna has a green car. The car of"
    expected, _ = greedy_reference(models("clm"), prompt, 8)
    page = open_page(browser, servers("clm"))
    page.get_by_label("Max new tokens").fill("8")
    submit(page, prompt, "Continue")
    assert answer_of(page) == expected
    page.screenshot(path=os.path.join(artifacts, "demo-clm.png"), full_page=True)


def fill_mask_reference(output_dir, text, k):
    """[(token, probability)] of the top `k` at the (one) mask: a forward pass and a numpy softmax."""
    from transformers import AutoTokenizer, FlaxAutoModelForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = FlaxAutoModelForMaskedLM.from_pretrained(output_dir)
    ids = tokenizer(text)["input_ids"]
    logits = np.asarray(model(np.array([ids]), params=model.params).logits, np.float64)[0, ids.index(
        tokenizer.mask_token_id)]
    probabilities = np.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    top = np.argsort(-probabilities)[:k]
    return [(tokenizer.decode([int(t)]), probabilities[t]) for t in top]


@pytest.mark.slow
@needs_browser
def test_fill_mask_page_bad_input_then_top_k(browser, servers, models, artifacts):
    page = open_page(browser, servers("mlm"))
    submit(page, "Anna has a green car.", "Fill")
    error = page.locator(".st-key-error")
    error.wait_for()
    assert "the text has no <mask>" in error.inner_text()

    text = "Anna has a green <mask>."
    expected = fill_mask_reference(models("mlm"), text, 5)
    submit(page, text, "Fill")
    answer_of(page)
    rows = page.locator("[data-testid=stTable] tbody tr")
    rows.nth(len(expected) - 1).wait_for()
    assert page.locator(".st-key-error").count() == 0  # the server kept serving: the error is gone
    shown = [[cell.strip() for cell in row.locator("td").all_inner_texts()] for row in rows.all()]
    # A token of whitespace only shows as its repr.
    assert [token for token, _ in shown] == [token.strip() or repr(token) for token, _ in expected]
    for (_, probability), (_, reference) in zip(shown, expected):
        # Shown with 3 decimals: off by at most half a unit of the last one, plus float32 vs float64.
        assert abs(float(probability) - reference) <= 5e-4 + 1e-6
    page.screenshot(path=os.path.join(artifacts, "demo-mlm.png"), full_page=True)


@pytest.mark.slow
@needs_browser
def test_no_request_leaves_loopback(browser, servers):
    """Every page opened here loaded whole (the answers above came) with anything else refused."""
    page = open_page(browser, servers("mlm"))
    page.close()
    assert browser.requests, "the request log is empty: the listener saw nothing"
    assert browser.outside_requests == []
    assert {urllib.parse.urlsplit(url).hostname for url in browser.requests} == {"127.0.0.1"}


def test_output_dir_without_a_model_is_one_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("no model here")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "demo.py"), str(tmp_path)], cwd=ROOT,
                            env=script_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path} holds no model")
    assert "Traceback" not in result.stderr


def test_output_dir_checks_name_what_is_missing(tmp_path):
    from utils.demo import check_output_dir
    from utils.errors import UsageError

    with pytest.raises(UsageError, match="is not a directory"):
        check_output_dir(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FlaxGPT2LMHeadModel"]}))
    (tmp_path / "run_args.json").write_text("{}")
    with pytest.raises(UsageError, match="holds no model.*flax_model.msgpack missing"):
        check_output_dir(str(tmp_path))
    (tmp_path / "flax_model.msgpack").write_bytes(b"")
    assert check_output_dir(str(tmp_path))[0] == "causal-lm"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FlaxWav2Vec2Model"]}))
    with pytest.raises(UsageError, match="does not serve this kind of models"):
        check_output_dir(str(tmp_path))


def test_buckets_cover_every_length_up_to_the_limit():
    from utils.demo import bucket_for, buckets

    assert buckets(96) == [16, 32, 64, 96] and buckets(16) == [16] and buckets(64, smallest=32) == [32, 64]
    sizes = buckets(100)
    assert all(bucket_for(n, sizes) >= n for n in range(1, 101))
