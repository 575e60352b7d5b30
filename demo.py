#!/usr/bin/env python
"""A demo page for a model any flaxtune script trained: type, submit, see what the model answers.

    python demo.py outputs/summarization_tiny                  # http://127.0.0.1:8501
    python demo.py OUTPUT_DIR --host 0.0.0.0 --port 8080       # reachable from other machines

The task comes from the saved model (`tasks`); the answers are the training script's own
predict path (`tasks.demo`). A Streamlit app (`pip install -r requirements-demo.txt`) that needs no
network: usage statistics off, nothing fetched from outside, 127.0.0.1 unless told otherwise.
Run as `python demo.py`, it checks the output dir and starts Streamlit on this same file, which
then draws the page.
"""

import utils  # noqa: F401  first of all: the version shims every model needs

import argparse
import os
import sys

from utils.base.errors import UsageError, run_main

# Streamlit options the demo always runs with: offline, no file watching, no developer menus.
STREAMLIT_OPTIONS = {
    "browser.gatherUsageStats": "false",
    "server.headless": "true",
    "server.fileWatcherType": "none",
    "server.runOnSave": "false",
    "global.developmentMode": "false",
    "client.toolbarMode": "minimal",
    "client.showErrorDetails": "false",
}


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Serve a demo page for a model a flaxtune script trained.")
    parser.add_argument("output_dir", help="The --output_dir of a training run (its exported model).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1, this "
                                                            "machine only).")
    parser.add_argument("--port", type=int, default=8501, help="Port to listen on (default: 8501).")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be between 1 and 65535, got {args.port}")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tasks.demo import check_output_dir

    check_output_dir(args.output_dir)  # a wrong directory fails here, before a server starts
    try:
        from streamlit.web import cli as streamlit_cli
    except ImportError as e:
        raise UsageError("the demo needs Streamlit: pip install -r requirements-demo.txt") from e
    options = {**STREAMLIT_OPTIONS, "server.address": args.host, "server.port": str(args.port)}
    flags = [f"--{name}={value}" for name, value in options.items()]
    streamlit_cli.main(["run", os.path.abspath(__file__), *flags, "--", args.output_dir],
                       prog_name="streamlit", standalone_mode=False)


# ----------------------------------------------------------------------------------------------
# The page (run by Streamlit: once per request, top to bottom)
# ----------------------------------------------------------------------------------------------


def page(output_dir):
    import streamlit as st

    import tasks
    from tasks.demo import BadInput, escape_markdown, load
    from utils.run.logs import hide_notices_in_transformers_handlers

    hide_notices_in_transformers_handlers()  # the notices the scripts hide, before a model is loaded
    st.set_page_config(page_title=f"flaxtune: {os.path.basename(output_dir)}")

    @st.cache_resource(show_spinner="Loading the model and compiling its input shapes...")
    def loaded(path):
        return load(path)

    task, predictor = loaded(output_dir)
    st.title(os.path.basename(output_dir))
    st.caption(f"{task} · {type(predictor.model).__name__} · {output_dir}")
    show = tasks.module_of(task).demo_form(st, predictor)
    if show is not None:
        try:
            show()
        except BadInput as e:
            with st.container(key="error"):
                st.error(escape_markdown(str(e)))


def running_in_streamlit():
    try:
        from streamlit import runtime
    except ImportError:
        return False
    return runtime.exists()


if __name__ == "__main__":
    if running_in_streamlit():
        page(sys.argv[1])
    else:
        sys.exit(run_main(main))
