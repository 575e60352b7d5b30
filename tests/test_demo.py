"""The demo (demo.py, tasks/demo.py) against the training scripts' own predict paths.

The models are the scripts' tiny "dp" runs the cross-layout tests make anyway (the session's
`layout_runs`): no training here. Every task's predictor is checked in this process against the
script's prediction files (span filling, which writes none, against a plain greedy loop); the page
is checked in a real browser, Debian's chromium driven by Playwright with the network closed, for
summarization, causal LM and masked LM (and a bad input, and the request log), one demo server per
model and one browser for them all. Screenshots go to $FLAXTUNE_TEST_ARTIFACTS (else the test's tmp
dir). Without chromium, Streamlit or Playwright the browser tests skip, except in CI ($CI set),
where they fail.
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
def models(layout_runs):
    """models(name) -> the output dir of the tiny "dp" run of `name` (tests/layout_runs.py), run
    when first asked for and shared with the other modules that compare layouts."""
    return lambda name: layout_runs[(name, "dp")]


@pytest.fixture(scope="module")
def servers(models):
    """servers(task) -> the base url of a demo server for the model of `task`, started when first
    asked for; all are stopped at the end of the module."""
    started = {}

    def url(task):
        if task not in started:
            port = free_port()
            server = subprocess.Popen([sys.executable, os.path.join(ROOT, "demo.py"), str(models(task)), "--port",
                                       str(port)], cwd=ROOT, env=script_env(devices=1),
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
    # Two documents the model summarizes differently, so that the page cannot pass by chance.
    second = next(i for i, prediction in enumerate(predictions) if prediction != predictions[0])
    for i in (0, second):
        page = open_page(browser, servers("summarization"))
        submit(page, documents[i], "Summarize")
        assert answer_of(page) == predictions[i]
    page.screenshot(path=os.path.join(artifacts, "demo-summarization.png"), full_page=True)


def greedy_reference(output_dir, prompt, new_tokens):
    """A plain greedy loop over the model's full forward pass (no cache, no `generate`). The ids are
    right-padded to one length (one compiled forward): causal attention makes the logits at a
    position independent of what follows it."""
    import jax
    from transformers import AutoTokenizer, FlaxAutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = FlaxAutoModelForCausalLM.from_pretrained(output_dir)
    forward = jax.jit(lambda ids: model(ids, params=model.params).logits)
    ids = tokenizer(prompt)["input_ids"]
    prompt_length = len(ids)
    padded = np.zeros((1, prompt_length + new_tokens), np.int32)
    padded[0, :prompt_length] = ids
    for _ in range(new_tokens):
        token = int(np.asarray(forward(padded))[0, len(ids) - 1].argmax())
        if token == model.config.eos_token_id:
            break
        padded[0, len(ids)] = token
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
    from tasks.demo import check_output_dir
    from utils.base.errors import UsageError

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
    from tasks.demo import bucket_for, buckets

    assert buckets(96) == [16, 32, 64, 96] and buckets(16) == [16] and buckets(64, smallest=32) == [32, 64]
    sizes = buckets(100)
    assert all(bucket_for(n, sizes) >= n for n in range(1, 101))


# ----------------------------------------------------------------------------------------------
# Every task's predictor against its script's predict path (in this process, no browser)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def predictors(models):
    """predictors(name) -> (task, the warmed-up predictor of `name`'s run), loaded when first asked for."""
    from tasks.demo import load

    loaded = {}

    def predictor(name):
        if name not in loaded:
            loaded[name] = load(str(models(name)))
        return loaded[name]

    return predictor


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def t5_greedy_spans(output_dir, text, max_length):
    """{sentinel number: span} from a plain greedy loop over the T5 model's full forward pass (no
    cache, no `generate`), read as run_t5_mlm_flax.py's targets are made: each sentinel, then its
    span. The decoder input is padded to `max_length` (one compiled forward): it is causal, so the
    logits at a position do not depend on what follows it."""
    import re

    import jax
    from transformers import AutoTokenizer, FlaxAutoModelForSeq2SeqLM

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = FlaxAutoModelForSeq2SeqLM.from_pretrained(output_dir)
    forward = jax.jit(lambda ids, decoded: model(ids, decoder_input_ids=decoded, params=model.params).logits)
    ids = np.array([tokenizer(text)["input_ids"]])
    decoded = np.full((1, max_length), model.config.pad_token_id, np.int32)
    decoded[0, 0] = model.config.decoder_start_token_id
    for length in range(1, max_length):
        decoded[0, length] = int(np.asarray(forward(ids, decoded))[0, length - 1].argmax())
        if decoded[0, length] == tokenizer.eos_token_id:
            break
    target = tokenizer.decode(decoded[0, :length + 1], skip_special_tokens=False)
    spans, number = {}, None
    for piece in re.split(r"(<extra_id_\d+>)", target.replace(tokenizer.pad_token, "").replace(tokenizer.eos_token, "")):
        if re.fullmatch(r"<extra_id_\d+>", piece):
            number = int(piece[len("<extra_id_"):-1])
            spans[number] = ""
        elif number is not None:
            spans[number] = piece.strip()
    return spans


@pytest.mark.slow
def test_span_filler_fills_like_a_plain_greedy_loop(predictors, models):
    task, predictor = predictors("t5 mlm")
    assert task == "span-corruption"
    lines = [line.split() for line in open(os.path.join(ROOT, "data", "lm", "validation.txt"), encoding="utf-8")
             if len(line.split()) >= 6]
    for words in lines[:2]:
        text = " ".join(words[:2] + ["<extra_id_0>"] + words[3:5] + ["<extra_id_1>"] + words[6:])
        expected = t5_greedy_spans(str(models("t5 mlm")), text, predictor.max_length)
        answer = predictor(text)
        assert answer.details == [(f"<extra_id_{n}>", expected.get(n, "")) for n in (0, 1)]


@pytest.mark.slow
def test_summarizer_sizes_documents_as_the_script_did(tmp_path):
    """run_args.json keeps the --max_source_length the user passed (512); the model has 64 positions,
    so the script encodes documents to 64 tokens, and so does the demo's summarizer."""
    from tasks.demo import load

    bart = ("d_model=16,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
            "encoder_ffn_dim=32,decoder_ffn_dim=32,max_position_embeddings=64")
    out = tmp_path / "out"
    result = run_script("run_summarization_flax.py", [
        "--model_type", "bart", "--config_overrides", bart, "--tokenizer_name", "data/lm/tokenizer",
        "--train_file", "data/summarization/train.jsonl", "--max_train_samples", 16,
        "--per_device_train_batch_size", 2, "--max_steps", 1, "--do_train", "--max_source_length", 512,
        "--max_target_length", 16, "--output_dir", out, "--compilation_cache_dir", "none"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--max_source_length 512 is more than the model's 64 positions: using 64" in result.stderr
    assert json.loads((out / "run_args.json").read_text())["max_source_length"] == 512
    task, summarizer = load(str(out))
    answer = summarizer("Ann met Bob in Rome. " * 40)
    assert task == "summarization" and summarizer.max_length == 64
    assert answer.notes[0].endswith("so it was truncated to the first 64")


@pytest.mark.slow
def test_text_classifier_gives_the_scripts_predictions(predictors, models):
    task, predictor = predictors("glue")
    assert task == "text-classification" and not predictor.pair  # CoLA: one sentence
    with open(os.path.join(ROOT, "data", "glue", "cola", "test.csv"), encoding="utf-8") as f:
        sentences = [line.rstrip("\n") for line in f][1:]
    lines = (models("glue") / "predict_results_cola.txt").read_text(encoding="utf-8").splitlines()[1:]
    assert len(lines) == 21
    for line in lines:
        index, label = line.split("\t")
        answer = predictor(sentences[int(index)])
        assert answer.text == label
        assert sorted(p for _, p in answer.details)[::-1] == [p for _, p in answer.details]
        assert sum(p for _, p in answer.details) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_entity_tagger_gives_the_scripts_predictions(predictors, models):
    task, predictor = predictors("ner")
    assert task == "token-classification"
    sentences = [row["tokens"] for row in read_jsonl(os.path.join(ROOT, "data", "ner", "test.jsonl"))]
    blocks = (models("ner") / "predictions.txt").read_text(encoding="utf-8").strip("\n").split("\n\n")
    assert len(blocks) == 21
    # The page splits typed text into words at punctuation: the sentences it splits as the data does.
    split_alike = [(words, block) for words, block in zip(sentences, blocks)
                   if predictor.WORD.findall(" ".join(words)) == words]
    assert len(split_alike) >= 15
    for words, block in split_alike:
        tagged = [line.split(" ") for line in block.splitlines()]  # the words within --max_seq_length
        answer = predictor(" ".join(words))
        assert answer.text == " ".join(f"{word}/{tag}" for word, tag in tagged)
        assert bool(answer.notes) == (len(tagged) < len(words))


@pytest.mark.slow
def test_question_answerer_gives_the_scripts_answers_and_nbest(predictors, models):
    task, predictor = predictors("qa")
    assert task == "question-answering"
    answers = json.loads((models("qa") / "predict_predictions.json").read_text(encoding="utf-8"))
    nbest = json.loads((models("qa") / "predict_nbest_predictions.json").read_text(encoding="utf-8"))
    rows = read_jsonl(os.path.join(ROOT, "data", "qa", "test.jsonl"))[:len(answers)]
    assert len(rows) == 13
    for row in rows:
        answer = predictor(row["question"], row["context"])
        assert answer.text == answers[row["id"]]
        expected = nbest[row["id"]]
        assert [(e["text"], e["offsets"]) for e in answer.details] == [(e["text"], e["offsets"]) for e in expected]
        for shown, written in zip(answer.details, expected):
            assert shown["score"] == pytest.approx(written["score"], abs=1e-4)
            assert shown["probability"] == pytest.approx(written["probability"], abs=1e-5)


@pytest.mark.slow
def test_question_answerer_refuses_what_it_cannot_read(predictors):
    from tasks.demo import BadInput

    _, predictor = predictors("qa")
    with pytest.raises(BadInput, match="the context is empty"):
        predictor("Who?", "  ")
    with pytest.raises(BadInput, match="ask a shorter question"):
        predictor("who " * predictor.seq_length, "Anna lives in Oslo.")
    long_context = "Anna lives in Oslo . " * 200
    assert "windows" in " ".join(predictor("Where does Anna live?", long_context).notes)


@pytest.mark.slow
def test_question_answerer_cuts_a_long_question_as_the_run_did(predictors):
    """A model trained with --max_question_length 20 (here: its predictor told so) answers a long
    question as the script reads it, cut to its first 20 tokens, and says so."""
    import copy

    from tasks.demo import BadInput

    _, predictor = predictors("qa")
    cutting = copy.copy(predictor)
    cutting.run_args = {**predictor.run_args, "max_question_length": 20}
    question, context = "Where does Anna , who " + "met Bob and " * 15 + "sang , live ?", "Anna lives in Oslo ."
    first_20 = predictor.tokenizer.convert_tokens_to_string(predictor.tokenizer.tokenize(question)[:20])
    answer = cutting(question, context)
    assert answer.notes == ["the question was cut to its first 20 tokens, as the model was trained"]
    assert (answer.text, answer.details) == (predictor(first_20, context).text, predictor(first_20, context).details)
    with pytest.raises(BadInput, match="ask a shorter question"):
        predictor(question, context)  # whole, as a run before --max_question_length read it: too long


@pytest.mark.slow
def test_image_classifier_gives_the_scripts_predictions_and_top_5(predictors, models):
    from PIL import Image
    from transformers import AutoImageProcessor, FlaxAutoModelForImageClassification

    task, predictor = predictors("image")
    assert task == "image-classification"
    lines = (models("image") / "predict_results.txt").read_text(encoding="utf-8").splitlines()[1:]
    assert len(lines) == 21
    for line in lines:
        name, label = line.split("\t")
        with open(os.path.join(ROOT, "data", "images", "validation", name), "rb") as f:
            answer = predictor(f.read())
        assert answer.text == label
    # The top 5 of the last image against transformers' own processing of it: the image processor
    # the run saved, the model, a numpy softmax.
    processor = AutoImageProcessor.from_pretrained(str(models("image")))
    model = FlaxAutoModelForImageClassification.from_pretrained(str(models("image")))
    pixels = processor(images=Image.open(os.path.join(ROOT, "data", "images", "validation", name)).convert("RGB"),
                       return_tensors="np")["pixel_values"]
    logits = np.asarray(model(pixels, params=model.params).logits, np.float64)[0]
    probabilities = np.exp(logits - logits.max())
    probabilities /= probabilities.sum()
    top = np.argsort(-probabilities)[:5]
    assert [label for label, _ in answer.details] == [model.config.id2label[int(i)] for i in top]
    assert [p for _, p in answer.details] == pytest.approx(probabilities[top], abs=1e-5)


@pytest.mark.slow
def test_image_classifier_says_a_file_is_not_an_image(predictors):
    from tasks.demo import BadInput

    _, predictor = predictors("image")
    with pytest.raises(BadInput, match="the file is not an image"):
        predictor(b"name,label\nfox,1\n")
    with pytest.raises(BadInput, match="no image"):
        predictor(b"")
    with open(os.path.join(ROOT, "data", "images", "validation", "0", sorted(os.listdir(
            os.path.join(ROOT, "data", "images", "validation", "0")))[0]), "rb") as f:
        assert len(predictor(f.read()).details) == 5  # and it keeps answering
