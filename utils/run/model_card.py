"""The model card every training run leaves beside its export: README.md in --output_dir, with the
YAML front matter the Hub reads (`library_name`, `pipeline_tag`, `widget` examples from the
validation data, so a pushed model gets its inference widget), the results table, and the command
that trained the model."""

import logging
import os
import shlex
import sys

import yaml

logger = logging.getLogger(__name__)

CARD = "README.md"
WIDGET_EXAMPLES = 3
_PROMPT_WORDS = 8  # a causal LM continues the first words of an example
_MASKED_WORDS = 16  # a fill-mask example: this many words, the middle one masked
_MAX_EXAMPLE_CHARS = 1000  # a widget shows its text in a box: long documents are cut


def example_records(run_args, count):
    """The first `count` records of the validation data (else the training data), [] when there is
    none to read here (a hub dataset not in the local cache)."""
    import datasets

    from utils.data import file_formats

    path = run_args.get("validation_file") or run_args.get("train_file")
    try:
        if path:
            dataset = datasets.load_dataset(file_formats.file_builder(path), data_files=path, split="train",
                                            cache_dir=run_args.get("cache_dir"))
        elif run_args.get("dataset_name"):
            splits = datasets.load_dataset(run_args["dataset_name"], run_args.get("dataset_config_name"),
                                           cache_dir=run_args.get("cache_dir"))
            dataset = splits["validation"] if "validation" in splits else next(iter(splits.values()))
        else:
            return []
    except Exception as e:  # noqa: BLE001  examples are a nicety: a card without them is still a card
        logger.warning("model card: no widget examples (%s: %s)", type(e).__name__, e)
        return []
    return [dataset[i] for i in range(min(count, len(dataset)))]


def record_text(record, run_args):
    """The input text of a record: the script's text column (the first one for sentence pairs), else
    `text`, `tokens`, `sentence` or the first text column; a list of words is joined by spaces."""
    named = run_args.get("text_column") or run_args.get("text_column_name")
    candidates = [named.split(",")[0]] if named else []
    candidates += ["text", "tokens", "sentence", "document", *record]
    for name in candidates:
        value = record.get(name)
        if isinstance(value, list) and value and all(isinstance(word, str) for word in value):
            value = " ".join(value)
        if isinstance(value, str) and value.strip():
            return " ".join(value.split())
    return None


def widget_text(text, widget, mask_token):
    """The widget input made from an example's text, as the task's `widget` kind says
    (`tasks.Task`)."""
    words = text.split()
    if widget == "prompt":
        return " ".join(words[:_PROMPT_WORDS])
    if widget in ("mask", "sentinel"):
        words = words[:_MASKED_WORDS]
        words[len(words) // 2] = mask_token if widget == "mask" else "<extra_id_0>"
        return " ".join(words)
    return text[:_MAX_EXAMPLE_CHARS]


def widget_examples(run_args, widget, mask_token=None, count=WIDGET_EXAMPLES):
    """[{"text": ...}] for the Hub's widget, from the validation data. A fill-mask widget needs the
    tokenizer's mask token; tasks whose widget takes more than a text (question answering, images:
    `widget` None) get none here."""
    if widget is None or (widget == "mask" and not mask_token):
        return []
    texts = [record_text(record, run_args) for record in example_records(run_args, count)]
    return [{"text": widget_text(text, widget, mask_token)} for text in texts if text]


def front_matter(pipeline_tag, widget, base_model=None):
    meta = {"library_name": "transformers", "tags": ["flax", "flaxtune"]}
    if pipeline_tag:
        meta["pipeline_tag"] = pipeline_tag
    if base_model:
        meta["base_model"] = base_model
    if widget:
        meta["widget"] = widget
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=1000) + "---\n"


def results_table(results):
    if not results:
        return "No results were recorded (no evaluation ran).\n"
    rows = [f"| {name} | {value:g} |" if isinstance(value, float) else f"| {name} | {value} |"
            for name, value in sorted(results.items())]
    return "\n".join(["| metric | value |", "|---|---|", *rows]) + "\n"


def training_command(argv):
    return shlex.join(["python", os.path.basename(argv[0]), *argv[1:]])


def card_text(name, pipeline_tag, run_args, results, argv, widget):
    base = run_args.get("model_name_or_path")
    data = run_args.get("dataset_name") or ", ".join(
        os.path.basename(run_args[key]) for key in ("train_file", "validation_file") if run_args.get(key))
    config = run_args.get("model_type") or run_args.get("config_name")  # a config file names no model type
    origin = f"fine-tuned from `{base}`" if base else f"trained from scratch (a `{config}` config)"
    return "\n".join([
        front_matter(pipeline_tag, widget, base),
        f"# {name}",
        "",
        f"A Flax model {origin} by flaxtune's `{os.path.basename(argv[0])}`"
        + (f" on {data}." if data else "."),
        "",
        "## Results",
        "",
        results_table(results),
        "## Training command",
        "",
        "```bash",
        training_command(argv),
        "```",
        "",
        "Every argument of the run is in `run_args.json` beside this card.",
        "",
        "## Try it",
        "",
        "```bash",
        f"python demo.py {shlex.quote(run_args.get('output_dir') or name)}",
        "```",
        "",
        "serves a page for this model on http://127.0.0.1:8501 (`pip install -r requirements-demo.txt` first).",
        "",
    ])


def write_model_card(output_dir, task, run_args, results, mask_token=None, argv=None):
    """Write `output_dir`/README.md for a model of `task` (its `tasks.Task` declaration, or None:
    no pipeline tag, no widget) trained with `run_args` (the public arguments), its `results`
    (all_results.json's entries) and command line `argv`. Data the run read without naming it
    (`tasks.Task.implied_dataset`) is named as if it had been given."""
    argv = list(sys.argv if argv is None else argv)
    if task and task.implied_dataset:
        run_args = {**run_args, **task.implied_dataset(run_args)}
    widget = widget_examples(run_args, task and task.widget, mask_token)
    name = os.path.basename(os.path.normpath(output_dir))
    with open(os.path.join(output_dir, CARD), "w", encoding="utf-8") as f:
        f.write(card_text(name, task and task.pipeline_tag, run_args, results, argv, widget))
