"""One home per task: each module here holds everything that is its task (data preparation, loss,
metrics, prediction and post-processing, the files its runs write, its model-card details and its
demo predictor), used by its script, the demo and the tests alike. `utils/` is the engine and never
imports from here; a script hands its task's `Task` declaration to the engine.

This package module stays light (no model or data library): it names the tasks and tells which one
a saved model was trained for, from what every run leaves in its output dir (the model class in
config.json, `architectures`, and the arguments in run_args.json). The model card and the demo
(`demo.py`) both ask here, so they always agree.
"""

import importlib
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """What the engine must know of a task; each task module declares one as `TASK`.

    `outputs`: glob patterns of the files its runs write into --output_dir beside the engine's own
    (results, metrics, checkpoints, the export): a run writes no other file, a rerun removes them,
    and an output dir holding anything else is never emptied. `widget`: how an example's text
    becomes the Hub widget's input in the model card ("text" whole, "prompt" its first words,
    "mask" / "sentinel" a middle word masked with the tokenizer's mask token / T5's first
    sentinel), None when the widget takes more than a text. `implied_dataset(run_args)`: the
    `dataset_name` / `dataset_config_name` a run read without their being among its arguments (a
    GLUE --task_name alone reads GLUE from the hub), {} when none; the model card names that data.

    What a run reads, checked in the engine's one preflight before any work
    (`utils.run.preflight.check_before_work`): `check_arguments(model_args, data_args, training_args)`
    what the flags alone tell, first; `data_files(data_args)` the local file of each split
    a phase may read ({split: path or None}; None: the --train_file / --validation_file / --test_file the
    data arguments have), in one of `file_formats`; `check_data(columns, model_args, data_args,
    training_args)` what the files' columns ({split: names}, where a cheap pre-read found them) and folders
    tell, last: what it returns is the preflight's `findings` (e.g. causal LM's rows format)."""
    name: str
    pipeline_tag: str
    outputs: tuple = ()
    widget: str = None
    implied_dataset: object = None
    file_formats: tuple = ("json", "csv")
    data_files: object = None
    check_arguments: object = None
    check_data: object = None


# Task name -> the module that is its home.
MODULES = {
    "summarization": "tasks.summarization",
    "causal-lm": "tasks.causal_lm",
    "masked-lm": "tasks.masked_lm",
    "span-corruption": "tasks.span_corruption",
    "denoising": "tasks.denoising",
    "text-classification": "tasks.text_classification",
    "token-classification": "tasks.token_classification",
    "question-answering": "tasks.question_answering",
    "long-question-answering": "tasks.long_qa",
    "image-classification": "tasks.image_classification",
    "image-text": "tasks.image_text",
    "image-captioning": "tasks.image_captioning",
    "speech-recognition": "tasks.speech_recognition",
    "wav2vec2-pretraining": "tasks.wav2vec2_pretraining",
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
    ("VisionTextDualEncoderModel", "image-text"),
    ("CLIPModel", "image-text"),
    ("VisionEncoderDecoderModel", "image-captioning"),
    ("Wav2Vec2ForPreTraining", "wav2vec2-pretraining"),
)
_SEQ2SEQ_HEADS = ("ForConditionalGeneration", "EncoderDecoderModel")


def module_of(task):
    """The module of task `task` (a name of `MODULES`), imported."""
    return importlib.import_module(MODULES[task])


def task_of(architecture, run_args):
    """The task of a model of class `architecture` (e.g. "FlaxT5ForConditionalGeneration") trained
    with `run_args` (run_args.json as a dict); None when no script here trains it."""
    for ending, task in _HEADS:
        if architecture.endswith(ending):
            # run_qa.py --answer_categories: the same model class with a category head beside it.
            return "long-question-answering" if task == "question-answering" and run_args.get(
                "answer_categories") else task
    if architecture.endswith(_SEQ2SEQ_HEADS):
        # run_t5_mlm_flax.py's arguments have the span lengths, run_bart_dlm_flax.py's the Poisson mean,
        # run_speech_recognition_seq2seq.py's the audio column, run_summarization_flax.py's the text columns.
        if "mean_noise_span_length" in run_args:
            return "span-corruption"
        if "poisson_lambda" in run_args:
            return "denoising"
        return "speech-recognition" if "audio_column_name" in run_args else "summarization"
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
