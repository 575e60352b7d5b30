#!/usr/bin/env python
"""Latency and throughput of the demo page (demo.py), after warm-up, on loopback.

    python benchmarks/demo_latency.py outputs/summarization_tiny outputs/clm_tiny outputs/mlm_tiny
    python benchmarks/demo_latency.py OUTPUT_DIR --requests 40 --clients 8 --seconds 60 --out results.json

For each output dir: the model's own time per request (the predictor the page calls, in this
process); then a demo server on 127.0.0.1 (`python demo.py`, as a user starts it) driven through
the websocket its page talks over, with the messages the page sends: a session opens (the page
loads), the form is submitted (the text typed, the button pressed), and a request lasts until the
server says the page's run finished, the answer in it (an error or a missing answer fails the
run). Latency: one client after another, p50 / p95 over --requests after one warm-up request.
Throughput: --clients sessions submitting at once (each from a thread of its own) until --requests
in all are answered or --seconds have passed. Every wait is bounded (--timeout per request). One
JSON line per model is printed; with --out all of them, with the machine's load, go to a JSON file.
benchmarks/README.md says why no browser is needed to measure this.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SERVER_START_S = 300  # the server answers its health check within this
FIRST_RUN_S = 600  # the first page run loads the model and compiles every shape bucket


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
    predictor(texts[0])  # warm-up, as for the page
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


def start_server(output_dir, log):
    port = free_port()
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "demo.py"), output_dir, "--port", str(port)],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"demo.py exited with {server.returncode} (its output: {log.name})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                return server, port
        except OSError:
            time.sleep(0.5)
    stop(server)
    raise SystemExit(f"the demo server did not start in {SERVER_START_S} s (its output: {log.name})")


def stop(server):
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(timeout=30)


class PageSession:
    """One browser tab's session, spoken over the page's websocket: Streamlit's BackMsg /
    ForwardMsg protocol messages, as its page sends and reads them."""

    def __init__(self, port, timeout):
        from websockets.sync.client import connect

        self.timeout = timeout
        self.socket = connect(f"ws://127.0.0.1:{port}/_stcore/stream", subprotocols=["streamlit"],
                              open_timeout=30, close_timeout=5, max_size=None)
        # The page's first run: it shows the form (and, the first time, loads and warms up the model).
        elements = self.run([], FIRST_RUN_S)
        widgets = {kind: getattr(element, kind) for kind, element in elements
                   if kind in ("text_area", "text_input", "button")}
        self.text_id = (widgets.get("text_area") or widgets["text_input"]).id
        self.button_id = widgets["button"].id

    def run(self, widget_states, timeout):
        """The elements [(kind, element)] of one page run started with `widget_states`."""
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        message = BackMsg()
        message.rerun_script.widget_states.widgets.extend(widget_states)
        self.socket.send(message.SerializeToString())
        deadline = time.monotonic() + timeout
        elements = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the page's run did not finish in {timeout} s")
            reply = ForwardMsg()
            reply.ParseFromString(self.socket.recv(timeout=left))
            kind = reply.WhichOneof("type")
            if kind == "delta" and reply.delta.WhichOneof("type") == "new_element":
                element = reply.delta.new_element
                elements.append((element.WhichOneof("type"), element))
            elif kind == "script_finished":
                if reply.script_finished != ForwardMsg.FINISHED_SUCCESSFULLY:
                    raise RuntimeError(f"the page's run ended with status {reply.script_finished}")
                return elements

    def request(self, text):
        """Seconds from the submit to the end of the page's run, which must show an answer."""
        from streamlit.proto.Alert_pb2 import Alert
        from streamlit.proto.WidgetStates_pb2 import WidgetState

        typed, pressed = WidgetState(id=self.text_id, string_value=text), WidgetState(id=self.button_id,
                                                                                     trigger_value=True)
        start = time.perf_counter()
        elements = self.run([typed, pressed], self.timeout)
        seconds = time.perf_counter() - start
        kinds = [kind for kind, _ in elements]
        errors = [str(getattr(element, kind)).strip() for kind, element in elements
                  if kind == "exception" or kind == "alert" and element.alert.format == Alert.ERROR]
        if errors or "text" not in kinds:
            raise RuntimeError(f"no answer for {text[:60]!r}: {errors[0] if errors else 'the page shows none'}")
        return seconds

    def close(self):
        self.socket.close()


def page_benchmark(port, texts, clients, time_limit, timeout):
    first = PageSession(port, timeout)
    first.request(texts[0])  # warm-up: the session's first answer
    sequential = [first.request(text) for text in texts]
    sessions = [first] + [PageSession(port, timeout) for _ in range(clients - 1)]
    for session in sessions[1:]:
        session.request(texts[0])
    queue, lock, done, failures = list(texts), threading.Lock(), [], []
    deadline = time.monotonic() + time_limit

    def client(session):
        while time.monotonic() < deadline and not failures:
            with lock:
                if not queue:
                    return
                text = queue.pop()
            try:
                seconds = session.request(text)
            except Exception as e:  # noqa: BLE001  reported below, and the run fails
                failures.append(f"{type(e).__name__}: {e}")
                return
            with lock:
                done.append(seconds)

    threads = [threading.Thread(target=client, args=(session,), daemon=True) for session in sessions]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()) + timeout + 5)
    elapsed = time.perf_counter() - start
    for session in sessions:
        session.close()
    if any(thread.is_alive() for thread in threads):
        failures.append("a client was still waiting for its answer after the time limit and the request timeout")
    if failures:
        raise SystemExit(f"the concurrent part failed: {failures[0]}")
    return {"page": percentiles(sequential),
            "concurrent": {"clients": clients, "requests": len(done), "seconds": round(elapsed, 2),
                           "requests_per_s": round(len(done) / elapsed, 2), "errors": 0, **percentiles(done)}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dirs", nargs="+")
    parser.add_argument("--requests", type=int, default=40, help="Requests per measurement (default 40).")
    parser.add_argument("--clients", type=int, default=8, help="Sessions submitting at once (default 8).")
    parser.add_argument("--seconds", type=float, default=60, help="Time limit of the concurrent part (default 60).")
    parser.add_argument("--timeout", type=float, default=120, help="Longest wait for one answer (default 120 s).")
    parser.add_argument("--out", help="Write every model's figures and the machine's load to this JSON file.")
    args = parser.parse_args()
    for flag in ("requests", "clients", "seconds", "timeout"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive")
    from tasks import demo

    rows = []
    for output_dir in args.output_dirs:
        start = time.perf_counter()
        task, predictor = demo.load(output_dir)
        load_seconds = time.perf_counter() - start
        if task not in ("summarization", "causal-lm", "masked-lm"):
            raise SystemExit(f"{output_dir}: a {task} model; this benchmark sends summarization, causal LM and "
                             "masked LM requests")
        texts = inputs_for(task, args.requests)
        row = {"output_dir": os.path.basename(os.path.normpath(output_dir)), "task": task,
               "load_and_warm_up_s": round(load_seconds, 1), "model": model_latency(predictor, texts)}
        load_before = os.getloadavg()
        # The server's output, kept (and named) only when it fails.
        with tempfile.NamedTemporaryFile("w", prefix="demo_latency_server_", suffix=".log", delete=False) as log:
            server, port = start_server(output_dir, log)
            try:
                row.update(page_benchmark(port, texts, args.clients, args.seconds, args.timeout))
            finally:
                stop(server)
        os.remove(log.name)
        row["load_average"] = {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in os.getloadavg()]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"what": "benchmarks/demo_latency.py: the demo's latency per request after warm-up and "
                               "requests/s with concurrent clients, on loopback",
                       "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
                       "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                       "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
