"""run_qa.py end to end on the shipped toy stories (8 virtual CPU devices): one SQuAD v1.1 training
run reused by every test (it learns, its files are complete and score as a reference scorer says),
then eval-only / predict-only of the saved model as SQuAD v2.0, with another eval batch.

Negative controls (each was broken on purpose and seen failing):
- `--max_eval_samples` counting windows (`dataset_loading.take` on the windows):
  `test_prediction_files_have_one_entry_per_example` (and the scores of `test_results_score_the_prediction_files`);
- a padded eval row scored, or a window given to the wrong example: `test_results_score_the_prediction_files`
  (41 examples in windows of batches of 16) and `test_eval_and_predict_only_from_the_saved_dir`
  (batches of 8 without padding give the same best spans).
"""

import json
import os

import pytest

from script_runner import ROOT, calls_of_steps_compiled_once, read_json, read_metrics, run_script, script_env
from test_qa import reference_v2

SCRIPT = "run_qa.py"
DATA = os.path.join(ROOT, "data", "qa")
TINY_BERT = ("hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,"
             "max_position_embeddings=64,hidden_dropout_prob=0.1,attention_probs_dropout_prob=0")
EVAL_EXAMPLES, TEST_EXAMPLES = 41, 13
CONFIG = {
    "model_type": "bert",
    "config_overrides": TINY_BERT,
    "tokenizer_name": os.path.join(DATA, "tokenizer"),
    "train_file": os.path.join(DATA, "train.json.gz"),
    "validation_file": os.path.join(DATA, "validation.json"),
    "test_file": os.path.join(DATA, "test.jsonl"),
    "max_seq_length": 64,
    "doc_stride": 16,
    "max_answer_length": 8,
    "max_train_samples": 800,
    "max_eval_samples": EVAL_EXAMPLES,
    "max_predict_samples": TEST_EXAMPLES,
    "do_train": True,
    "do_eval": True,
    "do_predict": True,
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 2,
    "learning_rate": 2e-3,
    "warmup_steps": 20,
    "num_train_epochs": 3,
    "logging_steps": 20,
    "save_steps": 1000,
    "compilation_cache_dir": "none",
}
V2_KEYS = ["exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact", "NoAns_f1",
           "NoAns_total", "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"]
V1_KEYS = ["exact_match", "f1"]


def run_ok(args, **kwargs):
    result = run_script(SCRIPT, args, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def squad_rows(path, limit=None):
    """(id, context, answer texts) of a SQuAD document's questions, in file order."""
    rows = [(qa["id"], paragraph["context"], [a["text"] for a in qa["answers"]])
            for article in read_json(path)["data"] for paragraph in article["paragraphs"] for qa in paragraph["qas"]]
    return rows[:limit]


def predict_rows(limit):
    with open(CONFIG["test_file"], encoding="utf-8") as f:
        return [json.loads(line) for line in f][:limit]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qa")
    config = tmp / "config.json"
    config.write_text(json.dumps({**CONFIG, "output_dir": str(tmp / "out")}))
    run_ok([config], steps_report=tmp / "steps.json", env=script_env(optimized_code=True))
    return tmp / "out"


@pytest.mark.slow
def test_learns(trained):
    """Untrained, the model finds no answer (measured on these 41 questions: exact match 0, F1 1.9,
    eval_loss 4.36); after 129 steps it has learnt which kind of answer a question wants (a place, a
    job, a day: exact match 14.6, eval_loss 2.42), which person only partly (qa_tiny's longer run
    gets further). Thresholds halfway-ish, far from both."""
    results = read_json(trained / "eval_results.json")
    assert results["eval_exact_match"] > 7 and results["eval_f1"] > 7
    assert results["eval_loss"] < 3.2
    train = read_metrics(trained)
    assert train[-1]["loss"] < 0.75 * train[0]["loss"]


@pytest.mark.slow
def test_result_keys_are_the_classic_ones(trained):
    results = read_json(trained / "eval_results.json")
    assert set(results) == {f"eval_{key}" for key in V1_KEYS + ["loss", "features", "samples"]}
    assert results["eval_samples"] == EVAL_EXAMPLES
    assert results["eval_features"] > EVAL_EXAMPLES  # several windows per story
    assert not (trained / "predict_results.json").exists()  # the test file has no answers: predictions only
    assert set(read_json(trained / "all_results.json")) >= set(results)


@pytest.mark.slow
def test_each_step_compiles_once(trained):
    calls = calls_of_steps_compiled_once(trained.parent / "steps.json")
    assert set(calls) == {"train_step", "eval_step"}


@pytest.mark.slow
def test_prediction_files_have_one_entry_per_example(trained):
    """--max_eval_samples / --max_predict_samples keep whole examples: the first 41 questions, every one answered."""
    rows = squad_rows(CONFIG["validation_file"], EVAL_EXAMPLES)
    ids = [example_id for example_id, _, _ in rows]
    predictions = read_json(trained / "eval_predictions.json")
    nbest = read_json(trained / "eval_nbest_predictions.json")
    assert list(predictions) == list(nbest) == ids
    assert not (trained / "eval_null_odds.json").exists()  # SQuAD v2.0 only
    for example_id, context, _ in rows:
        entries = nbest[example_id]
        assert 0 < len(entries) <= 20  # --n_best_size
        for entry in entries:
            assert set(entry) == {"text", "score", "probability", "start_logit", "end_logit", "offsets"}
            assert entry["text"] == context[entry["offsets"][0]:entry["offsets"][1]]
        assert sum(entry["probability"] for entry in entries) == pytest.approx(1.0)
        assert predictions[example_id] == [entry["text"] for entry in entries if entry["text"]][0]
    test_ids = [row["id"] for row in predict_rows(TEST_EXAMPLES)]
    assert list(read_json(trained / "predict_predictions.json")) == test_ids
    assert list(read_json(trained / "predict_nbest_predictions.json")) == test_ids


@pytest.mark.slow
def test_results_score_the_prediction_files(trained):
    """eval_results.json is the reference scorer's verdict on eval_predictions.json (v1.1: exact match
    and F1 of the best gold answer; no gold answer here normalises to nothing, where v1.1 and the
    reference's v2.0 rules differ)."""
    rows = squad_rows(CONFIG["validation_file"], EVAL_EXAMPLES)
    predictions = read_json(trained / "eval_predictions.json")
    references = {example_id: answers for example_id, _, answers in rows}
    expected = reference_v2(predictions, references, dict.fromkeys(references, 0.0), 1.0)
    results = read_json(trained / "eval_results.json")
    assert results["eval_exact_match"] == pytest.approx(expected["exact"], abs=1e-4)  # files round to 4 decimals
    assert results["eval_f1"] == pytest.approx(expected["f1"], abs=1e-4)


@pytest.mark.slow
def test_eval_and_predict_only_from_the_saved_dir(trained, tmp_path):
    """The saved model evaluated as SQuAD v2.0 on the same stories with unanswerable questions added,
    in batches of 1 per device (no padded row): the v2.0 keys, scored as the reference scorer
    says, null odds that decide the answers, and every answer the training run's best span or ""."""
    v2_file = os.path.join(DATA, "validation_v2.json")
    before = read_json(trained / "eval_nbest_predictions.json")
    v2_rows = squad_rows(v2_file)
    count = next(i for i, (example_id, _, answers) in enumerate(v2_rows) if answers and example_id not in before)
    out = tmp_path / "eval"
    run_ok(["--model_name_or_path", trained, "--validation_file", v2_file, "--version_2_with_negative",
            "--test_file", CONFIG["test_file"], "--max_eval_samples", count, "--max_predict_samples", TEST_EXAMPLES,
            "--max_seq_length", 64, "--doc_stride", 16, "--max_answer_length", 8, "--do_eval", "--do_predict",
            "--per_device_eval_batch_size", 1, "--output_dir", out, "--compilation_cache_dir", "none"])
    results = read_json(out / "eval_results.json")
    assert set(results) == {f"eval_{key}" for key in V2_KEYS + ["loss", "features", "samples"]}
    predictions = read_json(out / "eval_predictions.json")
    references = {example_id: answers for example_id, _, answers in v2_rows[:count]}
    expected = reference_v2(predictions, references, dict.fromkeys(references, 0.0), 1.0)
    for key in V2_KEYS:
        assert results[f"eval_{key}"] == pytest.approx(expected[key], abs=1e-4), key  # rounded to 4 decimals
    assert results["eval_samples"] == count and 0 < results["eval_NoAns_total"] < count
    null_odds = read_json(out / "eval_null_odds.json")
    assert list(null_odds) == list(predictions) == list(references)
    for example_id, odds in null_odds.items():  # "" exactly where the null score wins by more than 0
        assert (predictions[example_id] == "") == (odds is None or odds > 0.0), example_id
    assert not (out / "checkpoints").exists() and not (out / "predict_results.json").exists()
    for prefix in ("eval", "predict"):
        answers = read_json(out / f"{prefix}_nbest_predictions.json")
        trained_nbest = read_json(trained / f"{prefix}_nbest_predictions.json")
        for example_id, entries in answers.items():
            if example_id in trained_nbest:  # the answerable questions, asked in both runs
                best = [entry["text"] for entry in entries if entry["text"]][0]
                assert best == trained_nbest[example_id][0]["text"], example_id
