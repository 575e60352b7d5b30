"""run_hybrid_clip.py end to end on the shapes data (data/make_image_text_data.py), 8 virtual CPU
devices: one training run of configs/hybrid_clip_tiny.json, shortened, then one evaluation and
prediction from its output dir; the export read back by transformers' own classes. The loss, recall
and zero-shot pieces on their own: tests/test_image_text.py; bad inputs: tests/test_errors_data.py.
"""

import json
import os

import numpy as np
import pytest

from script_runner import ROOT, read_json, read_metrics, run_script, script_env

pytestmark = pytest.mark.slow

SCRIPT = "run_hybrid_clip.py"
DATA = os.path.join(ROOT, "data", "image_text")
# The whole config (200 steps) on one device, where it runs fastest.
RUN = ["--logging_steps", 25, "--eval_steps", 1000]
CHANCE_AT_10 = 10 / 200  # recall@10 of a model that ranks the 200 validation images at random


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(output dir, the eval-only run's output dir): trained, then evaluated and predicted from the
    saved model alone."""
    tmp = tmp_path_factory.mktemp("clip")
    out, again = tmp / "trained", tmp / "again"
    result = run_script(SCRIPT, ["configs/hybrid_clip_tiny.json", *RUN, "--output_dir", out],
                        env=script_env(devices=1, optimized_code=True))
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = run_script(SCRIPT, [
        "--model_name_or_path", out, "--validation_file", os.path.join(DATA, "valid_dataset.json"),
        "--test_file", os.path.join(DATA, "test_dataset.json"), "--do_eval", "--do_predict",
        "--zero_shot_templates", "a {} on the left", "a {} at the top", "--max_seq_length", 24,
        "--per_device_eval_batch_size", 8, "--output_dir", again], env=script_env(devices=1, optimized_code=True))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    return out, again


def lines_of(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_learns_far_above_chance(trained):
    results = read_json(trained[0] / "all_results.json")
    assert results["eval_samples"] == 200 and results["train_samples"] == 1600
    for direction in ("image_to_text", "text_to_image"):
        assert results[f"eval_{direction}_recall@10"] > 3 * CHANCE_AT_10
        assert (results[f"eval_{direction}_recall@1"] <= results[f"eval_{direction}_recall@5"]
                <= results[f"eval_{direction}_recall@10"])
    assert results["eval_zero_shot_accuracy"] > 2 / 24  # 24 classes (the left or upper shape)
    losses = [row["loss"] for row in read_metrics(trained[0])]
    assert losses[-1] < 0.9 * losses[0]


def test_eval_only_from_the_saved_dir_reproduces_the_run(trained):
    out, again = trained
    assert read_json(again / "eval_results.json") == read_json(out / "eval_results.json")
    for name in ("image_to_text_predictions.txt", "text_to_image_predictions.txt"):
        assert (again / name).read_text() == (out / name).read_text()


def test_the_prediction_files_agree_with_the_test_recall(trained):
    """Image->text recall@1 is the share of test images whose first listed caption is one of theirs."""
    out = trained[0]
    rows = lines_of(os.path.join(DATA, "test_dataset.json"))
    captions = {row["image_path"]: set(row["captions"]) for row in rows}
    lines = (out / "image_to_text_predictions.txt").read_text().splitlines()
    assert lines[0] == "image\trank\tscore\tcaption" and len(lines) == 1 + 5 * len(rows)
    firsts = [line.split("\t") for line in lines[1:] if line.split("\t")[1] == "1"]
    assert [image for image, *_ in firsts] == [row["image_path"] for row in rows]
    hits = np.mean([caption in captions[image] for image, _, _, caption in firsts])
    assert read_json(out / "test_results.json")["test_image_to_text_recall@1"] == round(hits, 4)
    queries = (out / "text_to_image_predictions.txt").read_text().splitlines()
    assert len(queries) == 1 + 5 * sum(len(row["captions"]) for row in rows)


def test_the_export_loads_in_transformers_own_classes_and_ranks_alike(trained):
    """transformers' FlaxVisionTextDualEncoderModel and AutoProcessor read the output dir; their embeddings of
    the validation set, ranked plainly here, give the recall the run reported."""
    from PIL import Image
    from transformers import AutoProcessor, FlaxVisionTextDualEncoderModel

    out = trained[0]
    model = FlaxVisionTextDualEncoderModel.from_pretrained(out)
    processor = AutoProcessor.from_pretrained(out)
    rows = lines_of(os.path.join(DATA, "valid_dataset.json"))
    pixels = processor(images=[Image.open(os.path.join(DATA, row["image_path"])).convert("RGB") for row in rows],
                       return_tensors="np")["pixel_values"]
    texts = [caption for row in rows for caption in row["captions"]]
    tokens = processor(text=texts, padding="max_length", max_length=24, return_tensors="np")
    # The model's forward pass transposes channels-first pixels (its get_image_features does not).
    output = model(tokens["input_ids"][: len(rows)], pixels, tokens["attention_mask"][: len(rows)])
    images = np.asarray(output.image_embeds)
    text = np.array(model.get_text_features(tokens["input_ids"], tokens["attention_mask"]))
    text /= np.linalg.norm(text, axis=-1, keepdims=True)
    owner = np.repeat(np.arange(len(rows)), [len(row["captions"]) for row in rows])
    scores = images @ text.T
    best_own = np.array([scores[i, owner == i].max() for i in range(len(rows))])
    image_rank = (scores > best_own[:, None]).sum(1)
    text_rank = (scores.T > scores[owner, np.arange(len(texts))][:, None]).sum(1)
    reported = read_json(out / "eval_results.json")
    for k in (1, 5, 10):
        assert reported[f"eval_image_to_text_recall@{k}"] == pytest.approx(np.mean(image_rank < k), abs=1e-4)
        assert reported[f"eval_text_to_image_recall@{k}"] == pytest.approx(np.mean(text_rank < k), abs=1e-4)


def test_the_demo_searches_the_validation_images_and_labels_an_upload(trained, monkeypatch):
    """The demo's best image for a query is the one transformers' own forward pass ranks first; zero-shot
    labels come back as probabilities, best first."""
    from PIL import Image
    from transformers import AutoProcessor, FlaxVisionTextDualEncoderModel

    from tasks.demo import BadInput
    from tasks.image_text import ImageSearch

    monkeypatch.chdir(ROOT)  # the run's data paths are relative to the repository, as the config gives them
    out = trained[0]
    predictor = ImageSearch(str(out), read_json(out / "run_args.json"))
    predictor.warm_up()
    query = "a red circle on the left and a blue square on the right"
    answer = predictor(query)
    scores = [score for _, score in answer.details]
    assert len(answer.details) == ImageSearch.TOP and scores == sorted(scores, reverse=True)

    model, processor = FlaxVisionTextDualEncoderModel.from_pretrained(out), AutoProcessor.from_pretrained(out)
    rows = lines_of(os.path.join(DATA, "valid_dataset.json"))
    pixels = processor(images=[Image.open(os.path.join(DATA, row["image_path"])).convert("RGB") for row in rows],
                       return_tensors="np")["pixel_values"]
    tokens = processor(text=[query] * len(rows), padding="max_length", max_length=24, return_tensors="np")
    output = model(tokens["input_ids"], pixels, tokens["attention_mask"])
    best = int(np.argmax(np.asarray(output.image_embeds) @ np.asarray(output.text_embeds)[0]))
    assert answer.details[0][0] == rows[best]["image_path"]

    with open(os.path.join(DATA, rows[0]["image_path"]), "rb") as f:
        upload = f.read()
    labels = predictor("", [upload], "red circle, blue square, green cross")
    probabilities = [p for _, p in labels.details]
    assert sorted(name for name, _ in labels.details) == ["blue square", "green cross", "red circle"]
    assert sum(probabilities) == pytest.approx(1.0, abs=1e-5) and probabilities == sorted(probabilities, reverse=True)
    with pytest.raises(BadInput, match="the query is empty"):
        predictor("  ")
