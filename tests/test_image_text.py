"""tasks/image_text.py on its own: the contrastive loss over the global batch in both layouts (with
accumulation and padded rows) against a plain numpy InfoNCE, recall@k and zero-shot accuracy against
plain computations, image-caption data read from the shipped files, the caption draw of training."""

import csv
import gzip
import json
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tasks import image_text
from utils.layout.gradients import token_weighted_grads
from utils.layout.layouts import AXIS, DataParallel, FullySharded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "image_text")
DEVICES = 8
WIDTH, EMBED = 6, 5
LAYOUTS = {"dp": DataParallel(), "fsdp": FullySharded(DEVICES)}


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def numpy_info_nce(images, texts, scale):
    """The symmetric InfoNCE of paired rows, plainly: mean over pairs of (CE image->texts + CE text->images) / 2."""
    logits = scale * images @ texts.T
    def ce(rows):
        rows = rows - rows.max(axis=1, keepdims=True)
        log_probs = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
        return -np.diag(log_probs)
    return float(np.mean((ce(logits) + ce(logits.T)) / 2))


def encode(params, x, side):
    e = x @ params[f"w_{side}"]
    return e / jnp.linalg.norm(e, axis=-1, keepdims=True)


def linear_pairs_loss(layout, params, batch, rng):
    """A linear 'dual encoder': the task's contrastive sums of its embeddings."""
    return image_text.contrastive_sums(encode(params, batch["image"], "image"), encode(params, batch["text"], "text"),
                                       params["logit_scale"], layout, batch.get("example_weight"))


def problem(rows, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w_image": rng.normal(size=(WIDTH, EMBED)).astype(np.float32),
              "w_text": rng.normal(size=(WIDTH, EMBED)).astype(np.float32),
              "logit_scale": np.float32(np.log(10.0))}
    batch = {"image": rng.normal(size=(rows, WIDTH)).astype(np.float32),
             "text": rng.normal(size=(rows, WIDTH)).astype(np.float32)}
    return params, batch


def embeddings(params, batch):
    normalise = lambda e: e / np.linalg.norm(e, axis=-1, keepdims=True)  # noqa: E731
    return normalise(batch["image"] @ params["w_image"]), normalise(batch["text"] @ params["w_text"])


def layout_step(name, params, batch, accumulation=1):
    """(grads, sums) on the host of `token_weighted_grads` over the contrastive loss, run as the layout runs steps."""
    layout = LAYOUTS[name]
    grads_of = partial(token_weighted_grads, partial(linear_pairs_loss, layout), accumulation_steps=accumulation,
                       layout=layout)
    state = layout.create_state(None, jax.tree_util.tree_map(jnp.array, params), optax.sgd(0.0))
    key = jax.random.PRNGKey(0)
    if name == "dp":
        grads, sums = jax.pmap(grads_of, AXIS, in_axes=(0, 0, None))(state.params, layout.place_batch(batch), key)
        return jax.tree_util.tree_map(lambda x: np.asarray(x[0]), (grads, sums))
    return jax.device_get(jax.jit(grads_of)(state.params, layout.place_batch(batch), key))


@pytest.fixture(scope="module")
def global_batch():
    """A batch of 32 pairs, 4 per device; its loss and gradients in both layouts."""
    params, batch = problem(32)
    return params, batch, {name: layout_step(name, params, batch) for name in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_is_the_infonce_of_the_global_batch(global_batch, layout):
    params, batch, steps = global_batch
    _, sums = steps[layout]
    images, texts = embeddings(params, batch)
    expected = numpy_info_nce(images, texts, 10.0)
    assert float(sums["tokens"]) == 32
    assert float(sums["loss"]) / 32 == pytest.approx(expected, rel=1e-5)
    # The classic per-device loss (each image against its own device's 3 other texts) is another number.
    per_device = np.mean([numpy_info_nce(images[4 * d:4 * d + 4],
                                         texts[4 * d:4 * d + 4], 10.0) for d in range(DEVICES)])
    assert abs(per_device - expected) > 0.1


def test_dp_and_fsdp_compute_the_same_gradients_as_the_plain_loss(global_batch):
    params, batch, steps = global_batch

    def plain_mean(params):  # the global loss written out, with no layout
        images, texts = encode(params, batch["image"], "image"), encode(params, batch["text"], "text")
        logits = jnp.exp(params["logit_scale"]) * images @ texts.T
        labels = jnp.arange(len(logits))
        return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
                + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()) / 2

    expected = jax.grad(plain_mean)(jax.tree_util.tree_map(jnp.array, params))
    for name in LAYOUTS:
        grads, _ = steps[name]
        for key in params:
            np.testing.assert_allclose(grads[key], expected[key], rtol=1e-4, atol=1e-6, err_msg=f"{name} {key}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_accumulation_each_micro_batch_is_its_own_global_batch(layout):
    """Micro-batch i holds the i-th half of every device's rows; its pairs' negatives are its own."""
    params, batch = problem(32, seed=1)
    _, sums = layout_step(layout, params, batch, accumulation=2)
    images, texts = embeddings(params, batch)
    per_device = lambda x: x.reshape(DEVICES, 2, 2, -1)  # noqa: E731  [device, micro-batch, row, width]
    micro = [(per_device(images)[:, i].reshape(16, -1), per_device(texts)[:, i].reshape(16, -1)) for i in range(2)]
    expected = np.mean([numpy_info_nce(i, t, 10.0) for i, t in micro])
    assert float(sums["loss"]) / float(sums["tokens"]) == pytest.approx(expected, rel=1e-5)
    assert abs(numpy_info_nce(images, texts, 10.0) - expected) > 0.05  # the whole batch's would differ


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_rows_count_nowhere(layout):
    """An eval batch's padded rows (weight 0) add no loss and are no one's negatives."""
    params, batch = problem(16, seed=2)
    valid = 11
    batch["example_weight"] = (np.arange(16) < valid).astype(np.float32)
    _, sums = layout_step(layout, params, batch)
    images, texts = embeddings(params, batch)
    assert float(sums["tokens"]) == valid
    assert float(sums["loss"]) / valid == pytest.approx(numpy_info_nce(images[:valid], texts[:valid], 10.0), rel=1e-5)


def test_the_temperature_is_capped_at_clips_100():
    params, batch = problem(8, seed=3)
    images, texts = embeddings(params, batch)
    loss, sums = image_text.contrastive_sums(jnp.array(images), jnp.array(texts), jnp.float32(np.log(1000.0)),
                                             FullySharded(DEVICES))
    assert float(loss) / 8 == pytest.approx(numpy_info_nce(images, texts, 100.0), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def plain_recalls(images, captions, caption_image, k):
    """Recall@k by sorting every score list, one query at a time."""
    scores = images @ captions.T
    image_hits = [bool(set(np.argsort(-scores[i])[:k]) & set(np.flatnonzero(caption_image == i)))
                  for i in range(len(images))]
    text_hits = [caption_image[c] in np.argsort(-scores[:, c])[:k] for c in range(len(captions))]
    return np.mean(image_hits), np.mean(text_hits)


def test_recall_at_k_against_sorting(monkeypatch):
    rng = np.random.default_rng(4)
    counts = rng.integers(1, 5, size=40)  # 1 to 4 captions an image
    caption_image = np.repeat(np.arange(40), counts)
    images = rng.normal(size=(40, 8))
    captions = images[caption_image] + 1.5 * rng.normal(size=(len(caption_image), 8))  # noisy matches
    metrics = image_text.retrieval_metrics(images, captions, caption_image, ks=(1, 3, 5, 10), chunk=7)
    for k in (1, 3, 5, 10):
        image_recall, text_recall = plain_recalls(images.astype(np.float32), captions.astype(np.float32),
                                                  caption_image, k)
        assert metrics[f"image_to_text_recall@{k}"] == pytest.approx(image_recall)
        assert metrics[f"text_to_image_recall@{k}"] == pytest.approx(text_recall)
    assert 0 < metrics["image_to_text_recall@1"] < metrics["image_to_text_recall@10"] < 1  # not a trivial case


def test_zero_shot_accuracy_against_a_plain_count():
    rng = np.random.default_rng(5)
    classes, templates = 6, 3
    prompts = rng.normal(size=(classes * templates, 4))
    class_ids = rng.integers(0, classes, size=50)
    images = rng.normal(size=(50, 4))
    means = prompts.reshape(classes, templates, 4).mean(axis=1)
    expected = np.mean([int(np.argmax([img @ m / np.linalg.norm(m) for m in means]) == c)
                        for img, c in zip(images, class_ids)])
    class_embeds = image_text.class_embeddings(prompts, classes)
    assert image_text.zero_shot_accuracy(images, class_embeds, class_ids) == pytest.approx(expected)
    assert image_text.zero_shot_accuracy(images, class_embeds, (images @ class_embeds.T).argmax(1)) == 1.0


def test_prediction_lines_list_the_best_matches_first():
    queries, candidates = np.eye(3, dtype=np.float32), np.array([[0, 1, 0], [1, 0, 0], [0.9, 0.1, 0]], np.float32)
    lines = image_text.prediction_lines(["q0", "q1", "q2"], ["c0", "c\tone", "c2"], queries, candidates, 2,
                                        ("image", "rank", "score", "caption"))
    assert lines[0] == "image\trank\tscore\tcaption"
    assert lines[1:3] == ["q0\t1\t1.0000\tc one", "q0\t2\t0.9000\tc2"]  # a tab in a caption is no new column
    assert len(lines) == 1 + 3 * 2


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


class DataArgs:
    image_column = caption_column = label_column = None


def load(path, fmt):
    import datasets

    return datasets.load_dataset(fmt, data_files=path, split="train")


def test_the_classic_json_lines_and_the_csv_of_one_caption_a_row_give_the_same_images():
    classic = image_text.dataset_split(DataArgs(), load(os.path.join(DATA, "valid_dataset.json"), "json"),
                                       "validation", DATA)
    rows = image_text.dataset_split(DataArgs(), load(os.path.join(DATA, "validation.csv.gz"), "csv"),
                                    "validation", DATA)
    with open(os.path.join(DATA, "valid_dataset.json"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert classic.captions == rows.captions == [line["captions"] for line in lines]
    assert classic.labels == rows.labels == [line["label"] for line in lines]
    assert [classic.sources[i] for i in range(3)] == [os.path.join(DATA, line["image_path"]) for line in lines[:3]]
    with gzip.open(os.path.join(DATA, "validation.csv.gz"), "rt", encoding="utf-8") as f:
        assert len(list(csv.DictReader(f))) == sum(map(len, rows.captions))  # one row a caption, grouped here


def test_a_row_without_a_caption_is_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"image_path": "a.png", "captions": ["x"]}\n{"image_path": "b.png", "captions": [" "]}\n')
    with pytest.raises(Exception, match=r"row 1 of the train data has no caption in column 'captions'"):
        image_text.dataset_split(DataArgs(), load(str(path), "json"), "train", str(tmp_path))
    args = DataArgs()
    args.caption_column = "text"
    with pytest.raises(Exception, match=r"the train data has no column 'text' \(--caption_column"):
        image_text.dataset_split(args, load(str(path), "json"), "train", str(tmp_path))


def test_the_caption_an_image_gets_is_a_pure_draw_of_seed_epoch_and_image():
    starts = np.array([0, 3, 4, 9])  # 3 images with 3, 1 and 5 captions
    indices = np.array([2, 0, 1, 2])
    first = image_text.caption_choice(starts, indices, seed=7, epoch=0)
    np.testing.assert_array_equal(first, image_text.caption_choice(starts, indices, seed=7, epoch=0))
    assert first[2] == 3 and 0 <= first[1] < 3 and 4 <= first[0] < 9 and first[0] == first[3]
    drawn = {int(image_text.caption_choice(starts, np.array([2]), seed=7, epoch=e)[0]) for e in range(60)}
    assert drawn == set(range(4, 9))  # over epochs, every caption of the image


def test_an_image_folder_with_captions_gives_the_images_of_the_classic_file():
    folder = os.path.join(DATA, "images", "validation")
    found = image_text.dataset_split(DataArgs(), image_text._folder_dataset(folder, None), "validation", None)
    with open(os.path.join(DATA, "valid_dataset.json"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert found.captions == [line["captions"] for line in lines]
    assert found.labels == [line["label"] for line in lines]
    assert [found.sources[i] for i in (0, 199)] == [os.path.join(DATA, lines[i]["image_path"]) for i in (0, 199)]


def test_a_fresh_dual_encoder_draws_transformers_weights_in_one_program():
    """transformers builds a dual encoder only with weights, drawn op by op (141 programs lowered for this tiny
    one); built in load_dual_encoder they come from one compiled program: the same draws for the seed (float32
    rounding apart), the class restored."""
    from transformers import BertConfig, FlaxVisionTextDualEncoderModel, VisionTextDualEncoderConfig, ViTConfig

    from fresh_draws import assert_drawn_in_one_program
    from run_hybrid_clip import DualEncoderModelArguments
    from utils.layout.layouts import make_layout

    config = VisionTextDualEncoderConfig.from_vision_text_configs(
        ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32),
        BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
        projection_dim=8)
    assert_drawn_in_one_program(FlaxVisionTextDualEncoderModel, config, 3, lambda: image_text.load_dual_encoder(
        DualEncoderModelArguments(), config, 3, make_layout("dp"))[1])
