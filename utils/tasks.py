"""Which task a saved model was trained for, read from what every run leaves in its output dir: the
model class in config.json (`architectures`) and the arguments in run_args.json. The model card
(`utils.model_card`) and the demo (`demo.py`) both ask here, so they always agree."""

import json
import os

# Hub pipeline tag of each task (what the Hub's inference widget runs).
PIPELINE_TAGS = {
    "summarization": "summarization",
    "causal-lm": "text-generation",
    "masked-lm": "fill-mask",
    "span-corruption": "text2text-generation",
    "text-classification": "text-classification",
    "token-classification": "token-classification",
    "question-answering": "question-answering",
    "image-classification": "image-classification",
}

# Model class name ending -> task; a conditional-generation model is told apart by its arguments.
_HEADS = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForImageClassification", "image-classification"),
)
_SEQ2SEQ_HEADS = ("ForConditionalGeneration", "EncoderDecoderModel")


def task_of(architecture, run_args):
    """The task of a model of class `architecture` (e.g. "FlaxT5ForConditionalGeneration") trained
    with `run_args` (run_args.json as a dict); None when no script here trains it."""
    for ending, task in _HEADS:
        if architecture.endswith(ending):
            return task
    if architecture.endswith(_SEQ2SEQ_HEADS):
        # run_t5_mlm_flax.py's arguments have the span lengths, run_summarization_flax.py's the columns.
        return "span-corruption" if "mean_noise_span_length" in run_args else "summarization"
    return None


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def saved_task(output_dir):
    """(task, run_args) of the model exported in `output_dir`; task None when it is not one of ours.
    Raises OSError (or ValueError for broken JSON) when config.json or run_args.json is missing."""
    config = read_json(os.path.join(output_dir, "config.json"))
    run_args = read_json(os.path.join(output_dir, "run_args.json"))
    architectures = config.get("architectures") or [""]
    return task_of(architectures[0], run_args), run_args
