"""The model card (README.md) every training run writes beside its export (`utils.run.model_card`)."""

import dataclasses
import json
import os

import pytest
import yaml

import run_clm_flax
import run_flax_glue
import run_flax_ner
import run_mlm_flax
import run_summarization_flax
import run_t5_mlm_flax
from script_runner import ROOT
import tasks
from utils.base.arguments import ModelArguments, TrainingArguments
from utils.run import model_card

# (script, the class its tiny config trains, the Hub's pipeline tag for it: huggingface.co/tasks).
SCRIPTS = [
    (run_summarization_flax, "FlaxT5ForConditionalGeneration", "summarization", "summarization_tiny.json"),
    (run_clm_flax, "FlaxGPT2LMHeadModel", "text-generation", "clm_tiny.json"),
    (run_mlm_flax, "FlaxRobertaForMaskedLM", "fill-mask", "mlm_tiny.json"),
    (run_t5_mlm_flax, "FlaxT5ForConditionalGeneration", "text2text-generation", "t5_mlm_tiny.json"),
    (run_flax_glue, "FlaxBertForSequenceClassification", "text-classification", "glue_tiny.json"),
    (run_flax_ner, "FlaxBertForTokenClassification", "token-classification", "ner_tiny.json"),
]


def script_run_args(script, config_name):
    """run_args.json as `script` would save it for its tiny config: every field's default, then the
    config's values (paths made absolute)."""
    data_class = script.DataTrainingArguments
    args = {}
    for cls in (ModelArguments, data_class, TrainingArguments):
        for f in dataclasses.fields(cls):
            args[f.name] = f.default if f.default is not dataclasses.MISSING else None
    with open(os.path.join(ROOT, "configs", config_name), encoding="utf-8") as f:
        config = json.load(f)
    for key, value in config.items():
        args[key] = os.path.join(ROOT, value) if key.endswith("_file") else value
    return args


def front_matter(path):
    text = open(path, encoding="utf-8").read()
    assert text.startswith("---\n")
    head, _, body = text[4:].partition("\n---\n")
    return yaml.safe_load(head), body


@pytest.mark.parametrize("script, architecture, tag, config", SCRIPTS, ids=[s[0].__name__ for s in SCRIPTS])
def test_card_has_the_scripts_pipeline_tag_and_widget_examples(tmp_path, script, architecture, tag, config):
    run_args = script_run_args(script, config)
    results = {"eval_loss": 1.25, "train_samples": 160}
    argv = [f"/somewhere/{script.__name__}.py", "config.json", "--learning_rate", "1e-3"]
    task = tasks.task_of(architecture, run_args)  # what the demo reads back from the saved files
    assert task == script.TASK.name
    model_card.write_model_card(str(tmp_path), script.TASK, run_args, results, mask_token="<mask>", argv=argv)
    meta, body = front_matter(tmp_path / "README.md")
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == tag
    assert "flax" in meta["tags"]
    widget = meta["widget"]
    assert 1 <= len(widget) <= model_card.WIDGET_EXAMPLES
    assert all(isinstance(example["text"], str) and example["text"].strip() for example in widget)
    if tag == "fill-mask":
        assert all(example["text"].count("<mask>") == 1 for example in widget)
    if tag == "text2text-generation":
        assert all("<extra_id_0>" in example["text"] for example in widget)
    assert "| eval_loss | 1.25 |" in body and "| train_samples | 160 |" in body
    assert f"python {script.__name__}.py config.json --learning_rate 1e-3" in body


def test_widget_examples_come_from_the_validation_data():
    run_args = script_run_args(run_summarization_flax, "summarization_tiny.json")
    with open(run_args["validation_file"], encoding="utf-8") as f:
        first = json.loads(f.readline())["document"]
    examples = model_card.widget_examples(run_args, "text")
    assert examples[0]["text"] == " ".join(first.split())[:1000]
    prompt = model_card.widget_examples(script_run_args(run_clm_flax, "clm_tiny.json"), "prompt")[0]["text"]
    with open(os.path.join(ROOT, "configs", "..", "data", "lm", "validation.txt"), encoding="utf-8") as f:
        assert f.readline().startswith(prompt)


def test_words_joined_and_text_quoted_safely_in_yaml(tmp_path):
    """Token lists become sentences; quotes, colons and '---' in a text cannot break the front matter."""
    assert model_card.record_text({"tokens": ["Anna", "lives", "in", "Brno"], "ner_tags": ["B-PER"]}, {}) == \
        "Anna lives in Brno"
    text = 'He said: "---\nkey: value" # not a comment'
    head = model_card.front_matter("summarization", [{"text": text}])
    assert yaml.safe_load(head.strip().strip("-"))["widget"][0]["text"] == text


def test_no_widget_and_no_tag_for_what_no_script_trains(tmp_path):
    assert tasks.task_of("FlaxWav2Vec2Model", {}) is None
    model_card.write_model_card(str(tmp_path), None, {"output_dir": str(tmp_path)}, {}, argv=["x.py"])
    meta, body = front_matter(tmp_path / "README.md")
    assert "pipeline_tag" not in meta and "widget" not in meta
    assert "No results were recorded" in body
