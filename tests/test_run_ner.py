"""run_flax_ner.py: the loss and the word-label alignment against plain references, one end-to-end
run on the shipped NER data (8 virtual CPU devices) checked against an oracle that rescores the
exported model itself, and bad inputs that stop before a model is built.

Negative controls (each was broken on purpose and seen failing):
- loss averaged over padded positions: `test_loss_counts_only_labelled_tokens_of_real_rows` (numpy
  reference with padding) and `test_eval_matches_an_oracle_on_the_exported_model` (eval_loss, eval_tokens);
- labels shifted by one word: `test_labels_go_to_each_words_first_sub_token` (reference alignment
  from tokenizing each word alone) and `test_learns` (trained F1 far above the untrained model's);
- a padded eval row counted: `test_eval_matches_an_oracle_on_the_exported_model` (37 validation
  sentences in batches of 16: 11 padded rows) and the batch-size independence of eval-only runs.
"""

import json
import os
import re
import shutil

import numpy as np
import pytest
from transformers import AutoTokenizer, BertConfig, FlaxAutoModelForTokenClassification

import run_flax_ner as ner
from tasks import token_classification as tagging
from script_runner import (ROOT, calls_of_steps_compiled_once, directory_state, read_json, read_metrics, run_script,
                           script_env)
from test_errors_cli import check_failure, run_in_process
from test_weights import pytorch_state_dict, write_pytorch_safetensors
from tasks.classification import IGNORE_INDEX, entity_metrics, inside_label_ids

SCRIPT = "run_flax_ner.py"
DATA = os.path.join(ROOT, "data", "ner")
TOKENIZER = os.path.join(DATA, "tokenizer")
TINY_BERT = ("hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=128,"
             "max_position_embeddings=64,hidden_dropout_prob=0.1,attention_probs_dropout_prob=0")
# 640 training sentences / (2 per device x 8 devices) = 40 steps per epoch; 37 validation sentences
# in eval batches of 16 (3 batches, 11 padded rows), 21 test sentences (2 batches).
CONFIG = {
    "model_type": "bert",
    "config_overrides": TINY_BERT,
    "tokenizer_name": TOKENIZER,
    "train_file": os.path.join(DATA, "train.jsonl"),
    "validation_file": os.path.join(DATA, "validation.jsonl"),
    "test_file": os.path.join(DATA, "test.jsonl"),
    "max_seq_length": 64,
    "max_train_samples": 640,
    "max_eval_samples": 37,
    "max_predict_samples": 21,
    "do_train": True,
    "do_eval": True,
    "do_predict": True,
    "return_entity_level_metrics": True,
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 2,
    "learning_rate": 3e-3,
    "warmup_steps": 10,
    "num_train_epochs": 3,
    "logging_steps": 20,
    "eval_steps": 40,
    "save_steps": 1000,
    "compilation_cache_dir": "none",
}
TYPES = ("DATE", "LOC", "ORG", "PER")


def run_ok(args, **kwargs):
    result = run_script(SCRIPT, args, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_jsonl(path, limit):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f][:limit]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ner")
    config = tmp / "config.json"
    config.write_text(json.dumps({**CONFIG, "output_dir": str(tmp / "out")}))
    run_ok([config], steps_report=tmp / "steps.json", env=script_env(optimized_code=True))
    return tmp / "out"


# ----------------------------------------------------------------------------------------------
# Units: loss and alignment against plain references
# ----------------------------------------------------------------------------------------------
def test_loss_counts_only_labelled_tokens_of_real_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 6, 4)).astype(np.float32)
    labels = np.array([[IGNORE_INDEX, 2, 1, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX],  # [CLS] w w [SEP] pad pad
                       [IGNORE_INDEX, 3, IGNORE_INDEX, 0, 1, IGNORE_INDEX],
                       [IGNORE_INDEX, 1, 1, 1, 1, IGNORE_INDEX]])  # an eval padding row
    example_weight = np.array([1.0, 1.0, 0.0], np.float32)
    loss, sums = tagging.tagging_loss(logits, labels, example_weight)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = [-log_probs[r, t, labels[r, t]] for r in range(2) for t in range(6) if labels[r, t] != IGNORE_INDEX]
    assert float(sums["tokens"]) == 5
    # float32 log-softmax of 5 terms of size ~2: within ~1e-6 of the float64 reference.
    assert float(loss) == pytest.approx(np.sum(picked), abs=1e-5)
    assert float(sums["loss"]) == float(loss)


def test_labels_go_to_each_words_first_sub_token():
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    words = ["Adeyemi", "joined", "Ljubljana", "Orchestra", "."]  # held-out names: several sub-tokens
    tags = ["B-PER", "O", "B-ORG", "I-ORG", "O"]
    label_list = ["B-ORG", "B-PER", "I-ORG", "I-PER", "O"]
    ids = {tag: i for i, tag in enumerate(label_list)}
    pieces = [len(tokenizer.tokenize(word)) for word in words]
    assert max(pieces) > 1
    expected = [IGNORE_INDEX]  # [CLS]
    expected_all = [IGNORE_INDEX]
    for tag, n in zip(tags, pieces):
        expected += [ids[tag]] + [IGNORE_INDEX] * (n - 1)
        inside = ids["I-" + tag[2:]] if tag.startswith("B-") else ids[tag]
        expected_all += [ids[tag]] + [inside] * (n - 1)
    seq_length = 24
    pad = [IGNORE_INDEX] * (seq_length - len(expected))  # [SEP] and padding
    import datasets

    sentences = datasets.Dataset.from_dict({"words": [words], "tags": [tags]})
    for label_all_tokens, want in ((False, expected), (True, expected_all)):
        args = ner.DataTrainingArguments(label_all_tokens=label_all_tokens)
        inside_ids = inside_label_ids(label_list)
        row = tagging.tokenize_and_align(sentences, tokenizer, seq_length, ids, inside_ids, args)[0]
        assert row["labels"] == want + pad
        assert row["word_starts"] == [int(label != IGNORE_INDEX) for label in expected + pad]


# ----------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_each_step_compiles_once(trained):
    """120 train steps; 3 evaluations of 3 batches and a 2-batch test set, the last batches padded."""
    assert calls_of_steps_compiled_once(trained.parent / "steps.json") == {"train_step": 120, "eval_step": 3 * 3 + 2}


@pytest.mark.slow
def test_result_keys_are_seqevals(trained):
    keys = ["loss", "tokens", "precision", "recall", "f1", "accuracy", "samples"]
    keys += [f"{t}_{m}" for t in TYPES for m in ("precision", "recall", "f1", "number")]
    eval_results, predict_results = read_json(trained / "eval_results.json"), read_json(trained / "predict_results.json")
    assert set(eval_results) == {f"eval_{key}" for key in keys}
    assert set(predict_results) == {f"predict_{key}" for key in keys}
    assert eval_results["eval_samples"] == 37 and predict_results["predict_samples"] == 21
    saved = read_json(trained / "config.json")
    tags = sorted(f"{b}-{t}" for t in TYPES for b in "BI") + ["O"]  # the data's tags, sorted
    assert saved["label2id"] == {tag: i for i, tag in enumerate(tags)}
    assert saved["id2label"] == {str(i): tag for tag, i in saved["label2id"].items()}


@pytest.mark.slow
def test_learns(trained, tmp_path):
    """Untrained, the tagger finds almost no entity (measured: F1 0.03, word accuracy 0.04); after 120
    steps on 640 sentences F1 0.33 and accuracy 0.77 (dates and the context of names; validation's
    names never occur in training). Thresholds halfway-ish, far from both."""
    out = tmp_path / "untrained"
    run_ok(["--model_type", "bert", "--config_overrides", TINY_BERT, "--tokenizer_name", TOKENIZER,
            "--validation_file", CONFIG["validation_file"], "--max_eval_samples", 37, "--max_seq_length", 64,
            "--do_eval", "--output_dir", out, "--compilation_cache_dir", "none"])
    untrained = read_json(out / "eval_results.json")["eval_f1"]
    trained_f1 = read_json(trained / "eval_results.json")["eval_f1"]
    assert untrained < 0.1
    assert trained_f1 > 0.25
    assert read_json(trained / "eval_results.json")["eval_accuracy"] > 0.6
    evals = read_metrics(trained, "eval")
    assert [row["step"] for row in evals] == [40, 80, 120]
    train = read_metrics(trained, "train")
    assert train[-1]["loss"] < 0.3 * train[0]["loss"]


def oracle_scores(model_dir, rows, seq_length=64):
    """Loss and seqeval's own scores of the exported model on `rows` (no padded row), each word tagged
    by its first sub-token (found by tokenizing each word alone). One forward pass of all rows, each
    padded to `seq_length` behind an attention mask (which leaves the real tokens' outputs alone)."""
    import seqeval.metrics

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = FlaxAutoModelForTokenClassification.from_pretrained(model_dir)
    label2id, id2label = model.config.label2id, model.config.id2label
    input_ids = np.full((len(rows), seq_length), tokenizer.pad_token_id)
    attention_mask = np.zeros((len(rows), seq_length), np.int32)
    starts = []
    for r, row in enumerate(rows):
        pieces = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(word)) for word in row["tokens"]]
        ids = [tokenizer.cls_token_id] + [i for word in pieces for i in word] + [tokenizer.sep_token_id]
        input_ids[r, :len(ids)], attention_mask[r, :len(ids)] = ids, 1
        starts.append(1 + np.cumsum([0] + [len(word) for word in pieces[:-1]]))
    logits = np.asarray(model(input_ids, attention_mask=attention_mask, train=False).logits, np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    losses, true, predicted = [], [], []
    for r, row in enumerate(rows):
        losses += [-log_probs[r, s, label2id[tag]] for s, tag in zip(starts[r], row["ner_tags"])]
        true.append(row["ner_tags"])
        predicted.append([id2label[int(i)] for i in logits[r, starts[r]].argmax(-1)])
    return {"loss": np.mean(losses), "tokens": len(losses),
            "precision": seqeval.metrics.precision_score(true, predicted),
            "recall": seqeval.metrics.recall_score(true, predicted),
            "f1": seqeval.metrics.f1_score(true, predicted), "accuracy": seqeval.metrics.accuracy_score(true, predicted)}


@pytest.mark.slow
def test_eval_matches_an_oracle_on_the_exported_model(trained):
    rows = read_jsonl(CONFIG["validation_file"], 37)
    expected = oracle_scores(trained, rows)
    results = read_json(trained / "eval_results.json")
    assert results["eval_tokens"] == expected["tokens"] == sum(len(row["tokens"]) for row in rows)
    # Results are rounded to 4 decimals (5e-5); the loss also sums float32 terms in another order
    # (~1e-6 relative). The scores are counts: a prediction flipped by float32 noise would move them
    # by ~1/1000 (no near-tie has been seen; each run compares the same exported weights).
    assert results["eval_loss"] == pytest.approx(expected["loss"], abs=2e-4)
    for key in ("precision", "recall", "f1", "accuracy"):
        assert results[f"eval_{key}"] == pytest.approx(expected[key], abs=2e-3), key


@pytest.mark.slow
def test_predictions_file(trained):
    rows = read_jsonl(CONFIG["test_file"], 21)
    sentences = (trained / "predictions.txt").read_text(encoding="utf-8").split("\n\n")
    assert len(sentences) == 21
    labels = set(read_json(trained / "config.json")["label2id"])
    predicted = []
    for row, sentence in zip(rows, sentences):
        lines = sentence.strip("\n").split("\n")
        assert [line.split(" ")[0] for line in lines] == row["tokens"]
        assert all(re.fullmatch(r"\S+ \S+", line) for line in lines)
        predicted.append([line.split(" ")[1] for line in lines])
        assert set(predicted[-1]) <= labels
    # The file holds the tags that were scored.
    scores = entity_metrics([row["ner_tags"] for row in rows], predicted)
    assert read_json(trained / "predict_results.json")["predict_f1"] == pytest.approx(scores["f1"], abs=1e-4)


@pytest.mark.slow
def test_eval_and_predict_only_from_the_saved_dir(trained, tmp_path):
    """Another eval batch size (1 per device: no padded row) gives the same scores; predict-only
    writes the same predictions."""
    out = tmp_path / "eval"
    run_ok(["--model_name_or_path", trained, "--validation_file", CONFIG["validation_file"], "--test_file",
            CONFIG["test_file"], "--max_eval_samples", 37, "--max_predict_samples", 21, "--max_seq_length", 64,
            "--do_eval", "--do_predict", "--per_device_eval_batch_size", 1, "--return_entity_level_metrics",
            "--output_dir", out, "--compilation_cache_dir", "none"])
    again, before = read_json(out / "eval_results.json"), read_json(trained / "eval_results.json")
    assert again.keys() == before.keys()
    for key in before:
        # 4-decimal rounding and float32 sums in another order (loss); counts are exact.
        assert again[key] == pytest.approx(before[key], abs=2e-4), key
    assert (out / "predictions.txt").read_text() == (trained / "predictions.txt").read_text()
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_pytorch_checkpoint_with_another_head_fine_tunes_over_an_earlier_run(trained, tmp_path):
    """A PyTorch-format tagger with 3 unnamed labels (as hub checkpoints come) gets a fresh 9-tag head.
    It trains into an earlier run's output dir, which it replaces, predictions.txt included (a rerun
    was once refused: that file was not known as the task's)."""
    out = tmp_path / "out"
    shutil.copytree(trained, out)
    config = BertConfig(vocab_size=len(AutoTokenizer.from_pretrained(TOKENIZER)), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64, num_labels=3)
    model = FlaxAutoModelForTokenClassification.from_config(config, seed=3)
    checkpoint = write_pytorch_safetensors(tmp_path / "pt", config, pytorch_state_dict(model.params, "bert"))
    result = run_ok(["--model_name_or_path", checkpoint, "--tokenizer_name", TOKENIZER, "--train_file",
                     CONFIG["train_file"], "--max_train_samples", 160, "--test_file", CONFIG["test_file"],
                     "--max_predict_samples", 3, "--max_seq_length", 64, "--do_train", "--do_predict",
                     "--per_device_train_batch_size", 2, "--learning_rate", 3e-3, "--num_train_epochs", 2,
                     "--logging_steps", 5, "--output_dir", out, "--overwrite_output_dir",
                     "--compilation_cache_dir", "none"])
    assert re.search(r"initialised fresh .*classifier/kernel \(32, 3\) -> \(32, 9\)", result.stderr)
    train = read_metrics(out, "train")
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]
    assert len(read_json(out / "config.json")["id2label"]) == 9
    assert (out / "predictions.txt").read_text(encoding="utf-8").count("\n\n") == 2  # this run's 3 sentences
    assert not (out / "eval_results.json").exists()  # the earlier run's, removed


# ----------------------------------------------------------------------------------------------
# Bad input: one error line, before any model is built, the output directory untouched
# ----------------------------------------------------------------------------------------------
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def fails(monkeypatch, capsys, tmp_path):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was built before the error was found")

    monkeypatch.setattr(ner, "load_model", load_model)

    def run(argv, pattern):
        out = str(tmp_path / "out")
        before = directory_state(out)
        check_failure(2, run_in_process(ner, [*argv, "--output_dir", out], tmp_path), capsys.readouterr().err,
                      pattern)
        assert directory_state(out) == before

    return run


def scratch(train, *args):
    return ["--model_type", "bert", "--config_overrides", TINY_BERT, "--tokenizer_name", TOKENIZER,
            "--train_file", train, "--per_device_train_batch_size", 1, "--do_train", *args]


SENTENCE = {"tokens": ["Ann", "met", "Bob", "."], "ner_tags": ["B-PER", "O", "B-PER", "O"]}


def test_unknown_task(fails, tmp_path):
    fails(scratch(write_jsonl(tmp_path / "t.jsonl", [SENTENCE] * 8), "--task_name", "sentiment"),
          r"unknown --task_name 'sentiment': use one of ner, pos, chunk")


def test_missing_label_column(fails, tmp_path):
    fails(scratch(write_jsonl(tmp_path / "t.jsonl", [SENTENCE] * 8), "--label_column_name", "pos_tags"),
          r"--label_column_name 'pos_tags' is not a column of the train data; its columns: tokens, ner_tags")


def test_words_only(fails, tmp_path):
    fails(scratch(write_jsonl(tmp_path / "t.jsonl", [{"tokens": ["a"]}] * 8)),
          r"the train data has only the column 'tokens': tagging needs a column of words and one of tags")


def test_tags_of_another_length_than_the_words(fails, tmp_path):
    rows = [SENTENCE] * 5 + [{"tokens": ["Ann", "left"], "ner_tags": ["B-PER"]}] + [SENTENCE] * 2
    fails(scratch(write_jsonl(tmp_path / "t.jsonl", rows)), r"row 5 of the train data has 2 words but 1 tags")


def test_tokenizer_that_is_not_fast(fails, tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    vocab = AutoTokenizer.from_pretrained(TOKENIZER).get_vocab()
    (slow / "vocab.txt").write_text("".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])))
    (slow / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": False}))
    args = scratch(write_jsonl(tmp_path / "t.jsonl", [SENTENCE] * 8), "--use_fast_tokenizer", "false")
    args[args.index(TOKENIZER)] = str(slow)
    fails(args, r"BertTokenizer is not a fast tokenizer: .*word ids")


def test_tags_the_checkpoint_does_not_know(fails, tmp_path):
    checkpoint = tmp_path / "tagger"
    BertConfig(vocab_size=len(AutoTokenizer.from_pretrained(TOKENIZER)), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               id2label={0: "O", 1: "B-LOC", 2: "I-LOC"}).save_pretrained(checkpoint)
    valid = write_jsonl(tmp_path / "v.jsonl", [SENTENCE] * 3)
    fails(["--model_name_or_path", checkpoint, "--tokenizer_name", TOKENIZER, "--validation_file", valid, "--do_eval"],
          r"the data has tags B-PER that .*tagger' does not know \(its labels: O, B-LOC, I-LOC\): .*--do_train")
