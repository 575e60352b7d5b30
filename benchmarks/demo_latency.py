#!/usr/bin/env python
"""Latency and throughput of the demo page (demo.py), after warm-up, on loopback.

    python benchmarks/demo_latency.py outputs/summarization_tiny outputs/clm_tiny outputs/mlm_tiny
    python benchmarks/demo_latency.py OUTPUT_DIR --requests 40 --clients 8 --seconds 60

For each output dir: the model's own time per request (the predictor the page calls, in this
process), then a demo server on 127.0.0.1 driven by Debian's chromium (Playwright): the time from
a click on the submit button to the end of the page's run, one client after another (p50 / p95
over --requests), and requests per second with --clients pages submitting at once (each until
--requests in all or --seconds have passed). One JSON line per model; an error fails the run.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BUTTONS = {"summarization": "Summarize", "causal-lm": "Continue", "masked-lm": "Fill",
           "span-corruption": "Fill the spans", "text-classification": "Classify", "token-classification": "Tag"}
# Counts the page's finished script runs (the app's state going from running to not running).
COUNT_RUNS = """() => {
    window.finishedRuns = 0;
    const app = document.querySelector('[data-testid=stApp]');
    new MutationObserver(records => {
        window.finishedRuns += records.filter(r => r.oldValue === 'running').length;
    }).observe(app, {attributes: true, attributeOldValue: true, attributeFilter: ['data-test-script-state']});
}"""


def inputs_for(task, count):
    """`count` request texts for `task` from the shipped validation data."""
    if task == "summarization":
        with open(os.path.join(ROOT, "data", "summarization", "validation.jsonl"), encoding="utf-8") as f:
            texts = [json.loads(line)["document"] for line in f]
    else:
        with open(os.path.join(ROOT, "data", "lm", "validation.txt"), encoding="utf-8") as f:
            lines = [line.split() for line in f if line.split()]
        if task == "masked-lm":
            texts = [" ".join(words[:len(words) // 2] + ["<mask>"] + words[len(words) // 2 + 1:]) for words in lines]
        else:
            texts = [" ".join(words[:6]) for words in lines]
    return [texts[i % len(texts)] for i in range(count)]


def percentiles(seconds):
    ms = sorted(1000 * s for s in seconds)
    return {"p50_ms": round(statistics.median(ms), 1), "p95_ms": round(ms[min(len(ms) - 1, int(0.95 * len(ms)))], 1)}


def model_latency(predictor, texts):
    seconds = []
    for text in texts:
        start = time.perf_counter()
        predictor(text)
        seconds.append(time.perf_counter() - start)
    return percentiles(seconds)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(output_dir):
    port = free_port()
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "demo.py"), output_dir, "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"demo.py exited with {server.returncode}: {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit("the demo server did not start in 5 minutes")


async def open_page(context, url):
    page = await context.new_page()
    page.set_default_timeout(300_000)
    await page.goto(url)
    await page.locator("textarea, input[type=text]").first.wait_for()
    await page.evaluate(COUNT_RUNS)
    return page


async def request(page, text, button):
    """Seconds from the click to the end of the run; fails if the page shows an error."""
    await page.locator("textarea, input[type=text]").first.fill(text)
    runs = await page.evaluate("window.finishedRuns")
    start = time.perf_counter()
    await page.get_by_role("button", name=button).click()
    await page.wait_for_function("runs => window.finishedRuns > runs", arg=runs, polling=5)
    seconds = time.perf_counter() - start
    errors = page.locator(".st-key-error, [data-testid=stException]")
    if await errors.count():
        raise SystemExit(f"the page showed an error for {text[:60]!r}: {await errors.first.inner_text()}")
    return seconds


async def page_benchmark(url, task, texts, clients, time_limit):
    from playwright.async_api import async_playwright

    button = BUTTONS[task]
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        context = await browser.new_context()
        first = await open_page(context, url)
        await request(first, texts[0], button)  # warm-up: the session's first run
        sequential = [await request(first, text, button) for text in texts]
        pages = [first] + [await open_page(context, url) for _ in range(clients - 1)]
        for page in pages[1:]:
            await request(page, texts[0], button)
        queue = list(texts)
        deadline = time.time() + time_limit
        done = []

        async def client(page):
            while queue and time.time() < deadline:
                done.append(await request(page, queue.pop(), button))

        start = time.perf_counter()
        await asyncio.gather(*(client(page) for page in pages))
        elapsed = time.perf_counter() - start
        await browser.close()
    return {"page": percentiles(sequential),
            "concurrent": {"clients": clients, "requests": len(done), "seconds": round(elapsed, 2),
                           "requests_per_s": round(len(done) / elapsed, 2), **percentiles(done)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dirs", nargs="+")
    parser.add_argument("--requests", type=int, default=40, help="Requests per measurement (default 40).")
    parser.add_argument("--clients", type=int, default=8, help="Pages submitting at once (default 8).")
    parser.add_argument("--seconds", type=float, default=60, help="Time limit of the concurrent part (default 60).")
    args = parser.parse_args()
    from utils import demo

    for output_dir in args.output_dirs:
        start = time.perf_counter()
        task, predictor = demo.load(output_dir)
        load_seconds = time.perf_counter() - start
        texts = inputs_for(task, args.requests)
        row = {"output_dir": os.path.basename(os.path.normpath(output_dir)), "task": task,
               "load_and_warm_up_s": round(load_seconds, 1), "model": model_latency(predictor, texts)}
        server, url = start_server(output_dir)
        try:
            row.update(asyncio.run(page_benchmark(url, task, texts, args.clients, args.seconds)))
        finally:
            server.terminate()
            server.wait(timeout=30)
        row["load_average"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
