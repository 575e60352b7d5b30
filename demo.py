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

from utils.errors import UsageError, run_main

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
def escape_markdown(text):
    """`text` shown literally by Streamlit's markdown (generated text may hold `*`, `_`, `<mask>`...)."""
    return "".join("\\" + c if c in "\\`*_{}[]()#+-.!|<>:~$" else c for c in text)


def shown_token(token):
    """A token as a table cell: its text, or for a token of whitespace only, its repr ('\\n')."""
    return escape_markdown(token.strip()) or repr(token)


def show_answer(st, answer):
    with st.container(key="answer"):
        st.markdown("**Answer**")
        for note in answer.notes:
            st.info(escape_markdown(note))
        st.text(answer.text)


def summarization_form(st, predictor):
    with st.form("request"):
        text = st.text_area("Document", height=150, key="text")
        submitted = st.form_submit_button("Summarize")
    if submitted:
        return lambda: show_answer(st, predictor(text))


def text_generation_form(st, predictor):
    with st.form("request"):
        prompt = st.text_area("Prompt", key="text")
        left, middle, right = st.columns(3)
        max_new_tokens = left.number_input("Max new tokens", 1, predictor.max_new_tokens,
                                           min(32, predictor.max_new_tokens), key="max_new_tokens")
        decoding = middle.radio("Decoding", ("greedy", "sampling"), key="decoding")
        seed = right.number_input("Seed (sampling)", 0, 2**31 - 1, 0, key="seed")
        submitted = st.form_submit_button("Continue")
    if submitted:
        return lambda: show_answer(st, predictor(prompt, int(max_new_tokens), decoding == "sampling", int(seed)))


def fill_mask_form(st, predictor):
    from tasks.demo import TOP_K

    mask = predictor.tokenizer.mask_token
    with st.form("request"):
        text = st.text_input(f"Text with {mask}", key="text")
        top_k = st.slider("Top k", 1, TOP_K, 5, key="top_k")
        submitted = st.form_submit_button("Fill")
    if submitted:
        def show():
            answer = predictor(text, int(top_k))
            show_answer(st, answer)
            for number, candidates in enumerate(answer.details, start=1):
                st.table({f"{escape_markdown(mask)} {number}": [shown_token(token) for token, _ in candidates],
                          "probability": [f"{p:.3f}" for _, p in candidates]})
        return show


def span_filling_form(st, predictor):
    with st.form("request"):
        text = st.text_input("Text with <extra_id_0>, <extra_id_1>, ...", key="text")
        submitted = st.form_submit_button("Fill the spans")
    if submitted:
        def show():
            answer = predictor(text)
            show_answer(st, answer)
            st.table({"sentinel": [s for s, _ in answer.details], "span": [span for _, span in answer.details]})
        return show


def text_classification_form(st, predictor):
    with st.form("request"):
        text = st.text_area("Text" if not predictor.pair else "First text", key="text")
        second = st.text_area("Second text", key="second_text") if predictor.pair else None
        submitted = st.form_submit_button("Classify")
    if submitted:
        def show():
            answer = predictor(text, second)
            show_answer(st, answer)
            if answer.details:
                st.table({"label": [label for label, _ in answer.details],
                          "probability": [f"{p:.3f}" for _, p in answer.details]})
        return show


def token_classification_form(st, predictor):
    with st.form("request"):
        text = st.text_area("Sentence", key="text")
        submitted = st.form_submit_button("Tag")
    if submitted:
        def show():
            answer = predictor(text)
            show_answer(st, answer)
            st.markdown(" ".join(f":blue-background[{escape_markdown(words)}] **{escape_markdown(kind)}**"
                                 for words, kind in answer.details) or "No entities found.")
        return show


def highlighted(context, first, last):
    """`context` as markdown with characters [first, last) (the answer) highlighted."""
    return (escape_markdown(context[:first]) + f":orange-background[{escape_markdown(context[first:last])}]"
            + escape_markdown(context[last:]))


def question_answering_form(st, predictor):
    with st.form("request"):
        question = st.text_input("Question", key="text")
        context = st.text_area("Context", height=150, key="context")
        submitted = st.form_submit_button("Answer")
    if submitted:
        def show():
            answer = predictor(question, context)
            show_answer(st, answer)
            with st.container(key="context_shown"):
                if answer.text:  # the best span with text (tasks.question_answering.best_answers)
                    st.markdown(highlighted(context, *next(e["offsets"] for e in answer.details if e["text"])))
                else:
                    st.markdown("The model finds no answer to this question in the context.")
            st.table({"answer": [escape_markdown(entry["text"]) or "(no answer)" for entry in answer.details],
                      "probability": [f"{entry['probability']:.3f}" for entry in answer.details],
                      "score": [f"{entry['score']:.3f}" for entry in answer.details]})
        return show


def image_classification_form(st, predictor):
    with st.form("request"):
        upload = st.file_uploader("Image", key="image")
        submitted = st.form_submit_button("Classify")
    if submitted:
        def show():
            answer = predictor(upload.getvalue() if upload is not None else b"")
            st.image(upload.getvalue(), width=224)
            show_answer(st, answer)
            st.table({"label": [escape_markdown(label) for label, _ in answer.details],
                      "probability": [f"{p:.3f}" for _, p in answer.details]})
        return show


# Task -> the form asking for its input (`tasks.demo.PREDICTORS` has the same keys).
FORMS = {
    "summarization": summarization_form,
    "causal-lm": text_generation_form,
    "masked-lm": fill_mask_form,
    "span-corruption": span_filling_form,
    "text-classification": text_classification_form,
    "token-classification": token_classification_form,
    "question-answering": question_answering_form,
    "image-classification": image_classification_form,
}


def page(output_dir):
    import streamlit as st

    from tasks.demo import BadInput, load

    st.set_page_config(page_title=f"flaxtune: {os.path.basename(output_dir)}")

    @st.cache_resource(show_spinner="Loading the model and compiling its input shapes...")
    def loaded(path):
        return load(path)

    task, predictor = loaded(output_dir)
    st.title(os.path.basename(output_dir))
    st.caption(f"{task} · {type(predictor.model).__name__} · {output_dir}")
    show = FORMS[task](st, predictor)
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
