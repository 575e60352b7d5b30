"""run_qa.py --answer_categories end to end (8 virtual CPU devices): a tiny BigBird with block-sparse
attention trained on a few of the shipped long documents, then evaluated again from its output dir,
where the answer-category head must come back from the export.

Negative control (broken on purpose and seen failing): `add_category_head` ignoring the saved head
(always fresh): `test_eval_only_from_the_saved_dir_reloads_the_category_head`.
"""

import gzip
import json
import os

import pytest

from script_runner import ROOT, read_json, run_script, script_env
from tasks import long_qa

DATA = os.path.join(ROOT, "data", "long_qa")
TINY_BIG_BIRD = ("hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64,"
                 "max_position_embeddings=128,hidden_dropout_prob=0.1,attention_probs_dropout_prob=0")
WINDOWS = ["--max_seq_length", 128, "--doc_stride", 32, "--block_size", 16, "--num_random_blocks", 1,
           "--attention_type", "block_sparse", "--answer_categories", "--max_long_answer_length", 64]
EVAL_EXAMPLES = 6
KEYS = {"loss", "category_loss", "features", "exact_match", "category_accuracy", "has_answer_total",
        "has_answer_exact_match", "samples"}
pytestmark = pytest.mark.slow


def run_ok(args):
    result = run_script("run_qa.py", args, env=script_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_qa") / "out"
    result = run_ok(["--model_type", "big_bird", "--config_overrides", TINY_BIG_BIRD, "--tokenizer_name",
                     os.path.join(DATA, "tokenizer"), "--train_file", os.path.join(DATA, "train.jsonl.gz"),
                     "--validation_file", os.path.join(DATA, "validation.jsonl.gz"), *WINDOWS,
                     "--keep_null_windows", 0.3, "--max_train_samples", 24, "--max_eval_samples", EVAL_EXAMPLES,
                     "--do_train", "--do_eval", "--per_device_train_batch_size", 1, "--per_device_eval_batch_size", 2,
                     "--max_steps", 6, "--learning_rate", 1e-3, "--logging_steps", 3, "--output_dir", out,
                     "--compilation_cache_dir", "none"])
    return out, result.stderr


def test_the_run_scores_every_example_with_its_category(trained):
    out, log = trained
    results = read_json(out / "eval_results.json")
    assert set(results) == {f"eval_{key}" for key in KEYS}
    assert results["eval_samples"] == EVAL_EXAMPLES and results["eval_features"] > 3 * EVAL_EXAMPLES  # long documents
    predictions = read_json(out / "eval_predictions.json")
    assert len(predictions) == EVAL_EXAMPLES
    assert all(p["category"] in long_qa.CATEGORIES for p in predictions.values())
    assert "null ones kept (--keep_null_windows 0.3)" in log


def test_eval_only_from_the_saved_dir_reloads_the_category_head(trained, tmp_path):
    """The same model evaluated from its export gives the same categories, answers and scores as
    the training run's final evaluation; the log says the head came back."""
    out, _ = trained
    again = tmp_path / "eval"
    result = run_ok(["--model_name_or_path", out, "--validation_file", os.path.join(DATA, "validation.jsonl.gz"),
                     *WINDOWS, "--max_eval_samples", EVAL_EXAMPLES, "--do_eval", "--per_device_eval_batch_size", 1,
                     "--output_dir", again, "--compilation_cache_dir", "none"])
    assert "answer-category head reloaded from" in result.stderr
    before, after = read_json(out / "eval_predictions.json"), read_json(again / "eval_predictions.json")
    assert list(before) == list(after)
    for example_id in before:
        assert before[example_id]["category"] == after[example_id]["category"]
        assert before[example_id]["answer"] == after[example_id]["answer"]
        assert before[example_id]["score"] == pytest.approx(after[example_id]["score"], abs=1e-4)
    expected, got = read_json(out / "eval_results.json"), read_json(again / "eval_results.json")
    for key in ("eval_loss", "eval_category_loss"):
        assert got[key] == pytest.approx(expected[key], abs=1e-4)
    with open(out / "flax_model.msgpack", "rb") as f:
        assert long_qa.HEAD.encode() in f.read()


def test_the_demo_answers_as_the_run_predicted(trained):
    """The saved run is served as long-question-answering; its predictor gives each validation
    question the category, answer and score of the run's own eval_predictions.json."""
    import tasks
    from tasks.demo import BadInput

    out, _ = trained
    task, run_args = tasks.saved_task(str(out))
    assert task == "long-question-answering"
    predictor = tasks.module_of(task).PREDICTOR(str(out), run_args)  # no warm-up: only the shapes used compile
    predictions = read_json(out / "eval_predictions.json")
    rows = [json.loads(line) for line in gzip.open(os.path.join(DATA, "validation.jsonl.gz"), "rt")][:EVAL_EXAMPLES]
    for row in rows:
        answer = predictor(row["question"], row["context"])
        expected = predictions[row["id"]]
        assert (answer.text, answer.details[0]["category"]) == (expected["answer"], expected["category"])
        assert answer.details[0]["score"] == pytest.approx(expected["score"], abs=1e-4)
        assert not answer.notes
    with pytest.raises(BadInput, match="the context is empty"):
        predictor("Who?", " ")
