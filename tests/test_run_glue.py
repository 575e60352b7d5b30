"""run_flax_glue.py: a tiny BERT from scratch on the cola-like toy task (string labels) over 8 virtual
devices, checked against a plain forward of the saved model; a short regression run; the losses and
labels on their own."""

import csv
import importlib.util
import json
import logging
import os

import numpy as np
import pytest
from datasets import Dataset
from scipy.special import log_softmax
from scipy.stats import pearsonr
from sklearn.metrics import matthews_corrcoef

from tasks import classification, text_classification
from tests.script_runner import ROOT, calls_of_steps_compiled_once, read_json, run_script, script_env
from utils.base.errors import UsageError

SCRIPT = "run_flax_glue.py"
TOKENIZER = os.path.join(ROOT, "data", "glue", "tokenizer")
MAX_STEPS = 200
# Calibrated: this run ends near 0.8 (configs/glue_tiny.json reaches 0.84 in 360 steps); an
# untrained model or a constant answer scores 0.
MATTHEWS_THRESHOLD = 0.5
VALIDATION = 200  # 3 full global eval batches of 64, then 8 real rows and 56 padded ones
NAMES = {0: "unacceptable", 1: "acceptable"}  # sorted, "acceptable" gets id 0
MODEL = ["--model_type", "bert", "--tokenizer_name", TOKENIZER, "--config_overrides",
         "hidden_size=128,num_hidden_layers=2,num_attention_heads=4,intermediate_size=256,max_position_embeddings=16,"
         "hidden_dropout_prob=0,attention_probs_dropout_prob=0", "--max_seq_length", "16"]


def rows_of(path):
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(f))


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


@pytest.fixture(scope="module")
def cola_files(tmp_path_factory):
    """The cola-like data with string labels, as users' data often has them."""
    d = tmp_path_factory.mktemp("cola")
    files = {}
    for split in ("train", "validation"):
        rows = [{"sentence": r["sentence"], "label": NAMES[int(r["label"])]}
                for r in rows_of(os.path.join(ROOT, "data", "glue", "cola", f"{split}.csv"))]
        files[split] = write_jsonl(d / f"{split}.jsonl", rows)
    files["test"] = write_jsonl(d / "test.jsonl", rows_of(os.path.join(ROOT, "data", "glue", "cola", "test.csv")))
    return files


def data_args(files, *phases):
    return ["--task_name", "cola", "--train_file", files["train"], "--validation_file", files["validation"],
            "--test_file", files["test"], *phases]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cola_files, cache_dir):
    out = str(tmp_path_factory.mktemp("glue"))
    result = run_script(SCRIPT, MODEL + data_args(cola_files, "--do_train", "--do_eval", "--do_predict") + [
        "--output_dir", out, "--overwrite_output_dir", "--max_steps", MAX_STEPS, "--total_train_batch_size", "32",
        "--per_device_eval_batch_size", "8", "--learning_rate", "1e-3", "--warmup_steps", "30",
        "--logging_steps", "50", "--eval_steps", "100", "--save_steps", "1000", "--compilation_cache_dir", cache_dir],
        steps_report=out + "_steps.json", env=script_env(optimized_code=True))  # 200 steps: 12.3 s -> 9.3 s alone
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def plain_forward(model_dir, rows):
    """(class ids, logits) of `rows` from the saved model: transformers' own loading and a forward in
    one host batch, no padding rows, no devices."""
    from transformers import AutoTokenizer, FlaxAutoModelForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = FlaxAutoModelForSequenceClassification.from_pretrained(model_dir)
    encoded = tokenizer([row["sentence"] for row in rows], max_length=16, padding="max_length", truncation=True,
                        return_tensors="np")
    logits = np.asarray(model(**encoded).logits, np.float64)
    return logits.argmax(-1), logits


def read_predictions(path):
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


@pytest.mark.slow
def test_learns_and_every_real_eval_row_counts_once(trained, cola_files):
    """The results against a plain forward of the saved model over the 200 validation rows: a padded
    row counted would change the count, the loss and the score."""
    results = read_json(os.path.join(trained, "eval_results.json"))
    assert set(results) == {"eval_loss", "eval_matthews_correlation", "eval_samples"}
    assert results["eval_samples"] == VALIDATION
    assert results["eval_matthews_correlation"] > MATTHEWS_THRESHOLD
    rows = [json.loads(line) for line in open(cola_files["validation"], encoding="utf-8")]
    predicted, logits = plain_forward(trained, rows)
    labels = np.array([{"acceptable": 0, "unacceptable": 1}[row["label"]] for row in rows])
    loss = -log_softmax(logits, axis=-1)[np.arange(len(rows)), labels].mean()
    # Result files round to 4 decimals (5e-5), plus float32 logits in other batch shapes (~1e-6): 1e-4.
    assert results["eval_loss"] == pytest.approx(loss, abs=1e-4)
    assert results["eval_matthews_correlation"] == pytest.approx(matthews_corrcoef(labels, predicted), abs=1e-4)
    config = read_json(os.path.join(trained, "config.json"))
    assert config["id2label"] == {"0": "acceptable", "1": "unacceptable"}
    assert config["label2id"] == {"acceptable": 0, "unacceptable": 1}
    assert config["problem_type"] == "single_label_classification" and config["finetuning_task"] == "cola"
    everything = read_json(os.path.join(trained, "all_results.json"))
    assert everything["predict_samples"] == 200 and everything["train_samples"] == 600


@pytest.mark.slow
def test_predictions_file_names_each_test_row(trained, cola_files):
    lines = read_predictions(os.path.join(trained, "predict_results_cola.txt"))
    rows = [json.loads(line) for line in open(cola_files["test"], encoding="utf-8")]
    predicted, _ = plain_forward(trained, rows)
    assert lines == ["index\tprediction"] + [f"{i}\t{['acceptable', 'unacceptable'][p]}"
                                             for i, p in enumerate(predicted)] + [""]


@pytest.mark.slow
def test_each_step_compiles_once(trained):
    calls = calls_of_steps_compiled_once(trained + "_steps.json")
    # Evaluated at steps 100 and 200 (4 batches each); predicted once (4 batches).
    assert calls == {"train_step": MAX_STEPS, "eval_step": 8, "predict_step": 4}


@pytest.mark.slow
def test_eval_and_predict_from_the_saved_dir(trained, cola_files, tmp_path, cache_dir):
    """Eval and predict without training: the same results; predict alone takes the label names from
    the saved config (the test data has no labels)."""
    result = run_script(SCRIPT, ["--model_name_or_path", trained, *data_args(cola_files, "--do_eval", "--do_predict"),
                                 "--max_seq_length", "16", "--output_dir", tmp_path / "both",
                                 "--compilation_cache_dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(tmp_path / "both" / "eval_results.json") == read_json(os.path.join(trained, "eval_results.json"))
    expected = read_predictions(os.path.join(trained, "predict_results_cola.txt"))
    assert read_predictions(tmp_path / "both" / "predict_results_cola.txt") == expected
    result = run_script(SCRIPT, ["--model_name_or_path", trained, "--test_file", cola_files["test"], "--do_predict",
                                 "--max_seq_length", "16", "--max_predict_samples", "10",
                                 "--output_dir", tmp_path / "predict", "--compilation_cache_dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_predictions(tmp_path / "predict" / "predict_results.txt") == expected[:11] + [""]
    assert not os.path.exists(tmp_path / "predict" / "eval_results.json")


@pytest.mark.slow
def test_float_labels_train_a_regression(tmp_path, cache_dir):
    """stsb-like float scores: one output trained on the squared error, scored by Pearson / Spearman,
    predicted as floats with 3 decimals. As a classification the scores would be classes."""
    out = tmp_path / "out"
    stsb = os.path.join(ROOT, "data", "glue", "stsb")
    result = run_script(SCRIPT, [
        "--model_type", "bert", "--tokenizer_name", TOKENIZER, "--config_overrides",
        "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,max_position_embeddings=64",
        "--max_seq_length", "64", "--train_file", os.path.join(stsb, "train.csv"), "--validation_file",
        os.path.join(stsb, "validation.csv"), "--test_file", os.path.join(stsb, "test.csv"), "--do_train", "--do_eval",
        "--do_predict", "--max_steps", "30", "--total_train_batch_size", "32", "--learning_rate", "3e-3",
        "--max_eval_samples", "50", "--max_predict_samples", "20", "--output_dir", out,
        "--compilation_cache_dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    config = read_json(out / "config.json")
    assert len(config["id2label"]) == 1  # one output
    assert config["problem_type"] == "regression"
    results = read_json(out / "eval_results.json")
    assert set(results) == {"eval_loss", "eval_pearson", "eval_spearmanr", "eval_samples"}
    lines = read_predictions(out / "predict_results.txt")
    assert lines[0] == "index\tprediction" and len(lines) == 22 and lines[-1] == ""
    scores = [float(line.split("\t")[1]) for line in lines[1:-1]]
    assert all(line == f"{i}\t{s:.3f}" for i, (line, s) in enumerate(zip(lines[1:-1], scores)))
    # The loss is the mean squared error of the saved model's one output (30 steps: not yet a good fit).
    from transformers import AutoTokenizer, FlaxAutoModelForSequenceClassification

    rows = rows_of(os.path.join(stsb, "validation.csv"))[:50]
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = FlaxAutoModelForSequenceClassification.from_pretrained(out)
    encoded = tokenizer([r["sentence1"] for r in rows], [r["sentence2"] for r in rows], max_length=64,
                        padding="max_length", truncation=True, return_tensors="np")
    outputs = np.asarray(model(**encoded).logits, np.float64)[:, 0]
    labels = np.array([float(r["label"]) for r in rows])
    # 4-decimal rounding of the results (5e-5) and float32 outputs of size ~3 (~1e-6): 1e-4 (loss ~1-10: rel).
    assert results["eval_loss"] == pytest.approx(np.mean((outputs - labels) ** 2), rel=1e-4, abs=1e-4)
    assert results["eval_pearson"] == pytest.approx(pearsonr(outputs, labels)[0], abs=1e-4)


# ----------------------------------------------------------------------------------------------
# Losses and labels, on their own
# ----------------------------------------------------------------------------------------------
def test_classification_loss_sums_real_rows_only():
    logits = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0], [9.0, -9.0, 0.0]], np.float32)
    labels = np.array([0, 2, 1])
    weight = np.array([1.0, 1.0, 0.0], np.float32)  # the last row is eval padding (and badly wrong)
    loss, sums = text_classification.classification_loss(logits, labels, weight)
    log_probs = log_softmax(logits.astype(np.float64), axis=-1)
    expected = -(log_probs[0, 0] + log_probs[1, 2])
    assert float(sums["tokens"]) == 2
    assert float(loss) == float(sums["loss"]) == pytest.approx(expected, rel=1e-6)  # float32 vs float64


def test_regression_loss_is_the_squared_error_of_the_one_output():
    outputs = np.array([[1.5], [4.0], [0.0]], np.float32)
    labels = np.array([1.0, 2.5, 5.0], np.float32)
    loss, sums = text_classification.regression_loss(outputs, labels, np.array([1.0, 1.0, 0.0], np.float32))
    assert float(sums["tokens"]) == 2 and float(loss) == pytest.approx(0.5 ** 2 + 1.5 ** 2, rel=1e-6)
    loss, sums = text_classification.regression_loss(outputs, labels)
    assert float(sums["tokens"]) == 3 and float(loss) == pytest.approx(0.25 + 2.25 + 25, rel=1e-6)


class FakeConfig:
    def __init__(self, id2label, problem_type=None):
        self.id2label, self.num_labels, self.problem_type = id2label, len(id2label), problem_type


def test_labels_from_data_task_and_checkpoint():
    strings = {"train": Dataset.from_dict({"label": ["pos", "neg", "pos"]})}
    floats = {"train": Dataset.from_dict({"label": [0.5, 3.0, 2.0]})}
    unlabelled = {"test": Dataset.from_dict({"sentence": ["a", "b"]})}
    placeholder = FakeConfig({0: "LABEL_0", 1: "LABEL_1"})
    choose_labels = text_classification.choose_labels
    assert choose_labels(None, strings, "label", placeholder, False) == ["neg", "pos"]
    assert choose_labels(None, floats, "label", placeholder, False) is None  # a regression
    assert choose_labels(classification.glue_task("stsb"), strings, "label", placeholder, False) is None
    named = FakeConfig({0: "POS", 1: "NEG", 2: "MIXED"})  # its ids and spelling kept
    assert choose_labels(None, strings, "label", named, True) == ["POS", "NEG", "MIXED"]
    assert choose_labels(None, unlabelled, "label", named, True) == ["POS", "NEG", "MIXED"]
    with pytest.raises(UsageError, match=r"labels not in the checkpoint's label map: 'neg'"):
        choose_labels(None, strings, "label", FakeConfig({0: "pos", 1: "other"}), True)
    with pytest.raises(UsageError, match="prediction alone needs the label names"):
        choose_labels(None, unlabelled, "label", placeholder, True)
    with pytest.raises(UsageError, match=r"the validation data has labels the model does not know: 'meh'"):
        text_classification.label_ids("validation", ["pos", "meh"], ["neg", "pos"])
    assert text_classification.label_ids("validation", ["pos", "neg"], ["neg", "pos"]).tolist() == [1, 0]


def test_a_head_for_another_number_of_labels_is_replaced_with_a_warning(tmp_path, caplog):
    from transformers import BertConfig, FlaxAutoModelForSequenceClassification

    from utils.models import compat
    from utils.base.arguments import ModelArguments
    from utils.layout.layouts import DataParallel
    from utils.models.loading import load_model

    compat.apply()
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=3)
    saved = FlaxAutoModelForSequenceClassification.from_config(config, seed=0)
    saved.save_pretrained(tmp_path)
    two = BertConfig.from_pretrained(tmp_path, num_labels=2)
    with caplog.at_level(logging.WARNING):
        _, params = load_model(FlaxAutoModelForSequenceClassification, ModelArguments(model_name_or_path=str(tmp_path)),
                               two, 0, DataParallel(), new_head_if_mismatched=True)
    assert "classifier/kernel (16, 3) -> (16, 2)" in caplog.text
    assert params["classifier"]["kernel"].shape == (16, 2)
    np.testing.assert_array_equal(params["bert"]["embeddings"]["word_embeddings"]["embedding"],
                                  saved.params["bert"]["embeddings"]["word_embeddings"]["embedding"])


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed")
def test_gradient_checkpointing_shrinks_the_train_steps_temporaries(tmp_path):
    """--gradient_checkpointing reaches glue's train step (run_flax_glue.py once ignored it): compiled
    with it, the step keeps fewer activations for the backward pass. The TPU compiler's plan shows it
    (--compile_only's, `utils.layout.tpu_plan`: measured 0.74 of the temporaries); XLA's CPU plan does not."""
    from transformers import BertConfig, FlaxAutoModelForSequenceClassification

    from utils.layout import tpu_plan
    from utils.models import compat
    from utils.base.arguments import TrainingArguments
    from utils.layout.layouts import DataParallel
    from utils.run.loop import InMemoryData
    from utils.run.setup import training_plan
    from utils.run.spine import make_steps

    compat.apply()
    v3 = tpu_plan.load("v3-8")
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    rows, length, inputs = 64, 128, ["input_ids", "attention_mask", "token_type_ids"]
    rng = np.random.default_rng(0)
    arrays = {"input_ids": rng.integers(0, 64, (rows, length)).astype(np.int32),
              "attention_mask": np.ones((rows, length), np.int32),
              "token_type_ids": np.zeros((rows, length), np.int32), "labels": rng.integers(0, 2, rows).astype(np.int32)}
    temporaries = {}
    for checkpointing in (False, True):
        model = FlaxAutoModelForSequenceClassification.from_config(config, seed=0)
        args = TrainingArguments(output_dir=str(tmp_path), do_train=True, per_device_train_batch_size=rows // 8,
                                 gradient_checkpointing=checkpointing)
        layout = DataParallel(v3)
        loss_fn, _ = text_classification.step_fns(model, inputs, is_regression=False)
        make_steps(loss_fn, model, model.params, layout, args, training_plan(args, rows), InMemoryData(arrays, rows))
        temporaries[checkpointing] = layout.train_step_memory["temporaries"]
    assert temporaries[True] < 0.8 * temporaries[False]


def test_a_task_alone_reads_glue_from_the_hub_and_the_arguments_stay_as_given(tmp_path):
    """The script loads GLUE's own dataset for a --task_name without data; run_args.json still records
    what was passed, and the model card names the dataset the run read."""
    import run_flax_glue

    from utils.base.arguments import public_args
    from utils.run.model_card import write_model_card

    args = run_flax_glue.DataTrainingArguments(task_name="MRPC")
    source = text_classification.data_source(args)
    assert (source.dataset_name, source.dataset_config_name) == ("nyu-mll/glue", "mrpc")
    assert (args.dataset_name, args.dataset_config_name) == (None, None)
    for named in ({"train_file": "train.csv"}, {"dataset_name": "me/data"}):
        args = run_flax_glue.DataTrainingArguments(task_name="mrpc", **named)
        assert text_classification.data_source(args) is args
    run_args = public_args(run_flax_glue.DataTrainingArguments(task_name="mrpc"))
    write_model_card(str(tmp_path), text_classification.TASK, run_args, {}, argv=["run_flax_glue.py"])
    assert "by flaxtune's `run_flax_glue.py` on nyu-mll/glue." in (tmp_path / "README.md").read_text()
