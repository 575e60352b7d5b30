"""Image-text dual encoders (CLIP-style): image-caption data, the contrastive loss over the global
batch, retrieval and zero-shot metrics, the prediction files, the demo's image search.

What a run does with its data and model:

- find: `load_splits` gives each phase's `ImageTextSplit` from a data file (the classic json lines
  `{"image_path": ..., "captions": [...]}`, or any json / jsonl / csv, compressed too), a hub dataset,
  or an ImageFolder with captions (a folder of images and a `metadata.jsonl` / `metadata.csv`
  naming each `file_name` with its captions). Rows naming the same image are one image with all
  their captions (a csv of one caption per row). Relative image paths are read from `--data_dir`,
  else from the data file's folder. An optional label column gives zero-shot classification.
- images: decoded, checked and transformed by `tasks.image_classification` (its `Transforms`;
  no flip by default: a caption may say what is on the left).
- captions: every caption tokenized once, padded to `--max_seq_length`. In training, each image is one
  example and the caption it is paired with in an epoch is drawn from its captions by (seed, epoch,
  image), like its crop: a resumed run pairs exactly as the uninterrupted one, and no batch holds
  two pairs of one image (each other's false negatives).
- model: `load_dual_encoder`: transformers' `FlaxVisionTextDualEncoderModel` from a text encoder and a
  vision encoder (pretrained checkpoints in any format, or new ones from a model type), or a saved
  dual encoder or CLIP model (`FlaxCLIPModel`) as it is.
- loss: `contrastive_sums`, the symmetric InfoNCE over the global batch: every image against every
  caption of the batch on all devices (`layout.all_rows`), the learnt temperature capped at 100 as
  CLIP's. With gradient accumulation the negatives of a pair are those of its micro-batch (which
  spans every device): the memory of one micro-batch, and exactly the loss of that smaller global
  batch.
- metrics: `retrieval_metrics` (image->text and text->image recall@1/5/10 over the whole split; an
  image's text match is any of its captions), `zero_shot_accuracy` (class names put into prompt
  templates, each class the mean of its prompts' embeddings).
- predict: the top captions of each image and the top images of each caption, two files.
"""

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image, UnidentifiedImageError

from tasks import Task, images
from tasks.demo import Answer, BadInput, Predictor, escape_markdown, require_text, show_answer
from utils.base import hub_probe
from utils.base.errors import UsageError
from utils.data import loaders
from utils.layout import devices
from utils.run.preflight import SPLIT_FLAGS, check_splits, needed_splits
from utils.run.run_directory import one_line
from utils.run.threaded_feed import ThreadedData

IMAGE_TO_TEXT_FILE, TEXT_TO_IMAGE_FILE = "image_to_text_predictions.txt", "text_to_image_predictions.txt"

MODEL_TYPES = ("vision-text-dual-encoder", "clip")  # what --model_name_or_path may hold
FILE_FORMATS = ("json", "csv")
IMAGE_COLUMNS, CAPTION_COLUMNS, LABEL_COLUMNS = ("image_path", "image", "img"), ("captions", "caption", "text"), (
    "label", "labels")
METADATA_FILES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")  # what makes a folder an ImageFolder
RECALL_AT = (1, 5, 10)
MAX_LOGIT_SCALE = 100.0  # CLIP clips exp(logit_scale) at 100 so the temperature cannot collapse
CAPTION_STREAM = 1  # the caption draw's own random numbers, apart from the crop's


# ---------------------------------------------------------------------------------------------
# Finding images and captions
# ---------------------------------------------------------------------------------------------


class ImageTextSplit(NamedTuple):
    """The images of a split (`sources`: `image_classification.DatasetImages`), the captions of each
    (a list of strings per image), the label of each (None without a label column) and the name each
    image is shown by (predictions, errors)."""
    sources: object
    captions: list
    labels: list
    shown: list


def check_arguments(model_args, data_args, training_args):
    """The encoders (`check_model_args`) and each phase's data (`check_data_given`), before any work."""
    check_model_args(model_args)
    check_data_given(training_args, data_args)


def check_data_given(training_args, data_args):
    """Each phase asked for has its data: a file, a folder or a dataset (not a folder and a file)."""
    for split, (phase, file_flag) in SPLIT_FLAGS.items():
        folder, file = getattr(data_args, images.SPLIT_DIRS[split]), getattr(data_args, file_flag[2:])
        if folder and file:
            raise UsageError(f"--{images.SPLIT_DIRS[split]} and {file_flag} both give {split} data: pass one")
        if getattr(training_args, phase) and not (folder or file or data_args.dataset_name):
            raise UsageError(f"--{phase} needs {split} data: pass {file_flag} (json lines with image_path and "
                             f"captions), --{images.SPLIT_DIRS[split]} (images and a metadata.jsonl) or "
                             "--dataset_name")
    if data_args.data_dir and not os.path.isdir(data_args.data_dir):
        raise UsageError(f"--data_dir {data_args.data_dir} not found: give the folder the image paths are relative to")


def check_folders(columns, model_args, data_args, training_args):
    """Each folder a phase reads is an ImageFolder with captions: checked before any work."""
    for split in needed_splits(training_args):
        flag = images.SPLIT_DIRS[split]
        folder = getattr(data_args, flag)
        if not folder:
            continue
        if not os.path.isdir(folder):
            raise UsageError(f"--{flag} {folder} not found: check the path (a folder of images and a metadata.jsonl)")
        if not any(os.path.isfile(os.path.join(folder, name)) for name in METADATA_FILES):
            raise UsageError(f"--{flag} {folder} has no {' or '.join(METADATA_FILES[:2])}: add one naming each image "
                             "(file_name) with its captions (captions)")


# Images and captions from files, ImageFolders or a dataset: the files' own checks are the engine's.
TASK = Task("image-text", "zero-shot-image-classification", outputs=(IMAGE_TO_TEXT_FILE, TEXT_TO_IMAGE_FILE),
            file_formats=FILE_FORMATS, data_files=images.data_files, check_arguments=check_arguments,
            check_data=check_folders)


def _pick(data_args, flag, defaults, columns, split, required=True):
    chosen = getattr(data_args, flag) or next((c for c in defaults if c in columns), None)
    if chosen is None:
        if not required:
            return None
        raise UsageError(f"the {split} data has no {' / '.join(map(repr, defaults))} column (its columns: "
                         f"{', '.join(columns)}): name it with --{flag}")
    if chosen not in columns:
        raise UsageError(f"the {split} data has no column {chosen!r} (--{flag}; its columns: {', '.join(columns)})")
    return chosen


def _image_keys(dataset, column):
    """What tells the images of `column` apart: a path (a string column, or an image's file), else the row."""
    import datasets
    import pyarrow.compute as pc

    values = dataset.with_format("arrow")[column]
    if isinstance(dataset.features[column], datasets.Image):
        values = pc.struct_field(values, "path")
    return [key if key is not None else ("row", row) for row, key in enumerate(values.to_pylist())]


def dataset_split(data_args, dataset, split, base):
    """The `ImageTextSplit` of a `datasets` split; image paths relative to `base` (None: as they are)."""
    columns = dataset.column_names
    image_column = _pick(data_args, "image_column", IMAGE_COLUMNS, columns, split)
    caption_column = _pick(data_args, "caption_column", CAPTION_COLUMNS, columns, split)
    label_column = _pick(data_args, "label_column", LABEL_COLUMNS, columns, split, required=False)
    images.check_images_given(dataset, image_column, split)
    raw_captions = loaders.column_values(dataset, caption_column)
    raw_labels = loaders.column_values(dataset, label_column) if label_column else None
    image_of, first_rows, captions, labels = {}, [], [], []  # image key -> its index; each image's first row
    for row, key in enumerate(_image_keys(dataset, image_column)):
        found = images.captions_of(raw_captions[row], row, caption_column, split)
        if key in image_of:  # another row of the same image: its captions join the image's
            captions[image_of[key]].extend(found)
            continue
        image_of[key] = len(first_rows)
        first_rows.append(row)
        captions.append(found)
        if raw_labels is not None:
            if raw_labels[row] is None:
                raise UsageError(f"row {row} of the {split} data has no label in column {label_column!r}: give it "
                                 "one, or drop the row")
            labels.append(str(raw_labels[row]))
    sources = images.DatasetImages(dataset.select(first_rows), image_column, base)
    return ImageTextSplit(sources, captions, labels if raw_labels is not None else None,
                          [sources.name(i) for i in range(len(sources))])


def _folder_dataset(folder, cache_dir):
    """An ImageFolder with captions as a `datasets` split (its images keep their file paths)."""
    import datasets

    try:
        return datasets.load_dataset("imagefolder", data_dir=folder, split="train", cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - whatever the folder builder raises names the folder
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"could not read the ImageFolder {folder}: {first} (its metadata.jsonl names each image's "
                         "file_name and captions)") from e


def load_splits(data_args, training_args, cache_dir):
    """{split: ImageTextSplit} of the phases asked for, each from its data file, folder or the dataset;
    each cut to its --max_*_samples first images."""
    splits = needed_splits(training_args)
    files = images.data_files(data_args)
    from_files = [split for split in splits if split in files]
    raw = {}
    if from_files:
        raw = loaders.load_splits(data_args, {s: files[s] for s in from_files}, cache_dir,
                                          allowed=FILE_FORMATS)
    loaded = {}
    for split in splits:
        if split in from_files:
            check_splits(raw, {split: split}, data_args.dataset_name, fix=f"pass --{images.SPLIT_DIRS[split]}")
            file = files[split]
            base = data_args.data_dir or (os.path.dirname(os.path.abspath(file)) if file else None)
            found = dataset_split(data_args, raw[split], split, base)
        else:
            found = dataset_split(data_args, _folder_dataset(getattr(data_args, images.SPLIT_DIRS[split]), cache_dir),
                                  split, None)
        loaded[split] = take(found, getattr(data_args, {"train": "max_train_samples", "validation": "max_eval_samples",
                                                        "test": "max_predict_samples"}[split]))
    return loaded


def take(found, max_samples):
    """The first `max_samples` images of a split (None: all)."""
    if max_samples is None or max_samples >= len(found.sources):
        return found
    return ImageTextSplit(found.sources.select(range(max_samples)), found.captions[:max_samples],
                          found.labels and found.labels[:max_samples], found.shown[:max_samples])


# ---------------------------------------------------------------------------------------------
# Captions, batches
# ---------------------------------------------------------------------------------------------


def tokenize(tokenizer, texts, max_seq_length):
    """{"input_ids", "attention_mask"} int32 [len(texts), max_seq_length] (padded, truncated)."""
    encoded = tokenizer(list(texts), max_length=max_seq_length, padding="max_length", truncation=True,
                        return_tensors="np", return_token_type_ids=False)
    return {key: encoded[key].astype(np.int32) for key in ("input_ids", "attention_mask")}


class Captions(NamedTuple):
    """Every caption of a split tokenized (`tokens`, one row per caption), the image of each caption
    (`image`), and where each image's captions start (`starts`, one more than the images)."""
    tokens: dict
    image: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, captions, tokenizer, max_seq_length):
        counts = np.array([len(c) for c in captions], np.int64)
        flat = [caption for per_image in captions for caption in per_image]
        return cls(tokenize(tokenizer, flat, max_seq_length), np.repeat(np.arange(len(captions)), counts),
                   np.concatenate([[0], np.cumsum(counts)]))

    def first(self):
        """The tokens of each image's first caption (what the eval loss pairs it with)."""
        return {key: value[self.starts[:-1]] for key, value in self.tokens.items()}


class ImageTextData(ThreadedData):
    """The training pairs of a run: each image with one of its captions, for `utils.run.spine`, batched by
    `utils.run.threaded_feed`'s threads. Images are cropped as `tasks.images.Transforms` does it; the caption
    an image gets in an epoch is drawn by `caption_choice` (seed, epoch, image): a batch is a pure function
    of (seed, step), so a checkpoint needs only the step.
    """

    def __init__(self, sources, captions, transforms, workers=None):
        super().__init__(len(sources), workers)
        self.sources, self.captions, self.transforms = sources, captions, transforms

    def host_batch(self, indices, seed, epoch):
        """{"pixel_values", "input_ids", "attention_mask"} of the images `indices` in epoch `epoch`."""
        indices = np.asarray(indices, np.int64)
        pixels = [self.transforms.train(self.sources[int(i)], seed, epoch, int(i)) for i in indices]
        rows = caption_choice(self.captions.starts, indices, seed, epoch)
        return {"pixel_values": np.stack(pixels), **{k: v[rows] for k, v in self.captions.tokens.items()}}


def caption_choice(starts, indices, seed, epoch):
    """The caption row each image of `indices` is paired with in `epoch`: one of its captions, drawn
    by its own generator of (seed, epoch, image)."""
    counts = starts[indices + 1] - starts[indices]
    picks = [np.random.default_rng([seed, epoch, int(i), CAPTION_STREAM]).integers(n) for i, n in zip(indices, counts)]
    return starts[indices] + np.asarray(picks, np.int64)


class EvalData(NamedTuple):
    """What evaluating or predicting a split reads: `images` (pixels, each with its first caption: the
    eval loss's pairs), `captions` (every caption), and the zero-shot prompts' tokens (None without labels)."""
    images: dict
    captions: Captions
    labels: object  # (class names, each image's class id, prompt tokens [classes * templates]) or None


def eval_data(found, tokenizer, max_seq_length, transforms, templates, workers=None):
    """The `EvalData` of an `ImageTextSplit`."""
    captions = Captions.of(found.captions, tokenizer, max_seq_length)
    pixels = {"pixel_values": images.ImageColumn(found.sources, transforms, workers), **captions.first()}
    labels = None
    if found.labels is not None:
        names = sorted(set(found.labels), key=images.class_order)
        index = {name: i for i, name in enumerate(names)}
        prompts = [template.format(name) for name in names for template in templates]
        labels = (names, np.array([index[name] for name in found.labels]), tokenize(tokenizer, prompts, max_seq_length))
    return EvalData(pixels, captions, labels)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def check_model_args(model_args):
    """A saved dual encoder (--model_name_or_path), or a text and a vision encoder, each pretrained or new."""
    towers = {side: (getattr(model_args, f"{side}_model_name_or_path"), getattr(model_args, f"{side}_model_type"))
              for side in ("text", "vision")}
    if model_args.model_name_or_path:
        given = [f"--{side}_model_{'name_or_path' if name else 'type'}" for side, (name, kind) in towers.items()
                 if name or kind]
        if given:
            raise UsageError(f"--model_name_or_path is a whole dual encoder: drop {' and '.join(given)} (or drop "
                             "--model_name_or_path to compose one from a text and a vision encoder)")
        return
    for side, (name, kind) in towers.items():
        if not name and not kind:
            raise UsageError(f"no {side} encoder: pass --{side}_model_name_or_path (a pretrained one) or "
                             f"--{side}_model_type (a new one), or --model_name_or_path (a saved dual encoder or "
                             "CLIP model)")
        if name and kind:
            raise UsageError(f"--{side}_model_name_or_path and --{side}_model_type both give the {side} encoder: "
                             "pass one")
        if name and hub_probe.looks_like_path(name) and not os.path.exists(name):
            raise UsageError(f"--{side}_model_name_or_path {name} not found: check the path")


def tower_args(model_args, side):
    """`model_args` as the text or vision encoder's own ModelArguments (its name, type and overrides)."""
    import dataclasses

    return dataclasses.replace(model_args, model_name_or_path=getattr(model_args, f"{side}_model_name_or_path"),
                               model_type=getattr(model_args, f"{side}_model_type"), config_name=None,
                               config_overrides=getattr(model_args, f"{side}_config_overrides"))


def tower_config(model_args, side):
    """The config of the text or vision encoder (a CLIP checkpoint's own tower, for a CLIP name)."""
    from transformers.models.auto import modeling_flax_auto

    from utils.models.loading import load_config

    allowed = modeling_flax_auto.FLAX_MODEL_MAPPING_NAMES
    config = load_config(tower_args(model_args, side), task=None, model_types=tuple(allowed))
    if config.model_type == "clip":  # a whole CLIP model names its towers' configs
        config = getattr(config, f"{side}_config")
    return config


def dual_encoder_config(model_args, text_config, vision_config):
    from transformers import VisionTextDualEncoderConfig

    return VisionTextDualEncoderConfig.from_vision_text_configs(
        vision_config, text_config, projection_dim=model_args.projection_dim,
        logit_scale_init_value=model_args.logit_scale_init_value)


def load_dual_encoder(model_args, config, seed, layout):
    """(model, params placed by `layout`): the saved dual encoder or CLIP model of --model_name_or_path,
    or transformers' `FlaxVisionTextDualEncoderModel` of `config` with the pretrained encoders'
    weights where --text_model_name_or_path / --vision_model_name_or_path name them (any checkpoint
    format); the projections and the temperature start fresh. With --lora_rank, adapters on both
    towers' attention; the projections and the temperature train in full (`utils.models.lora.head_modules`)."""
    from transformers import FlaxAutoModel, FlaxVisionTextDualEncoderModel

    from utils.models import weights
    from utils.models.loading import (init_in_one_program, load_model, plan_adapters, pretrained_params, storage_cast,
                                      with_adapters)

    if model_args.model_name_or_path:
        return load_model(FlaxAutoModel, model_args, config, seed, layout)
    # transformers' dual encoder makes its fresh weights as it is built
    with weights.on_host(), init_in_one_program(FlaxVisionTextDualEncoderModel):
        model = FlaxVisionTextDualEncoderModel(config, seed=seed, dtype=devices.to_dtype(model_args.dtype))
    params = dict(model.params)
    for side in ("text", "vision"):
        args = tower_args(model_args, side)
        if args.model_name_or_path:
            tower = getattr(config, f"{side}_config")
            params[f"{side}_model"] = pretrained_params(FlaxAutoModel, args, tower, seed)
    adapters = plan_adapters(model, model_args, type(model).__name__)
    cast = storage_cast(model_args, adapters)
    # Planning for a TPU: shapes only (a compile-only device holds no array)
    params = layout.init_params(lambda: cast(params)) if layout.plan else layout.place_params(cast(params))
    return with_adapters(model, params, adapters, model_args, seed, layout)


def processor_of(image_processor, tokenizer):
    """The tokenizer and image processor as one `VisionTextDualEncoderProcessor`: what a run saves
    with the model, and `AutoProcessor` / `AutoTokenizer` / `AutoImageProcessor` load."""
    from transformers import VisionTextDualEncoderProcessor

    return VisionTextDualEncoderProcessor(image_processor=image_processor, tokenizer=tokenizer)


def embeddings_fn(model):
    """`embeddings_of(params, batch, dropout_rng=None, train=False) -> (image embeds, text embeds,
    logit scale)`: the model's normalised embeddings of batch["pixel_values"] and its captions."""

    def embeddings_of(params, batch, dropout_rng=None, train=False):
        out = model(batch["input_ids"], batch["pixel_values"], batch["attention_mask"], params=params,
                    dropout_rng=dropout_rng, train=train)
        return out.image_embeds, out.text_embeds, params["logit_scale"]

    return embeddings_of


def _normalised(x):
    x = x.astype(jnp.float32)
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def image_embeddings_fn(model):
    """`(params, batch) -> normalised image embeddings` of batch["pixel_values"], through the model's
    whole forward pass as the loss sees them (the batch's captions ride along: transformers 4.57's
    dual encoder `get_image_features` skips the channels-last transpose its forward pass does)."""
    embeddings_of = embeddings_fn(model)
    return lambda params, batch: _normalised(embeddings_of(params, batch)[0])


def text_embeddings_fn(model):
    """`(params, batch) -> normalised text embeddings` of batch["input_ids"] / ["attention_mask"]."""
    return lambda params, batch: _normalised(model.get_text_features(batch["input_ids"], batch["attention_mask"],
                                                                     params=params))


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def contrastive_sums(image_embeds, text_embeds, logit_scale, layout, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}): the symmetric InfoNCE of this device's pairs against the whole
    global batch, summed over them; "tokens" counts the pairs (padded rows weigh 0, and are nobody's
    negatives). The mean over the global batch is

        (CE(image_i -> its text among all texts) + CE(text_i -> its image among all images)) / 2

    with logits s * <image, text>, s = exp(logit_scale) capped at `MAX_LOGIT_SCALE`. Under "dp" the
    other devices' embeddings come by `layout.all_rows` (and their gradients go back to them)."""
    image_embeds, text_embeds = image_embeds.astype(jnp.float32), text_embeds.astype(jnp.float32)
    rows = image_embeds.shape[0]
    weights = jnp.ones((rows,), jnp.float32) if example_weight is None else example_weight.astype(jnp.float32)
    all_images, first = layout.all_rows(image_embeds)
    all_texts, _ = layout.all_rows(text_embeds)
    all_weights, _ = layout.all_rows(weights)
    scale = jnp.minimum(jnp.exp(logit_scale.astype(jnp.float32)), MAX_LOGIT_SCALE)
    targets = first + jnp.arange(rows)
    real = all_weights > 0
    # A padded row is no one's negative; its own column stays, so its (unweighted) loss is finite.
    columns = real[None, :] | (jnp.arange(all_weights.shape[0])[None, :] == targets[:, None])
    losses = 0.0
    for logits in (image_embeds @ all_texts.T, text_embeds @ all_images.T):
        logits = jnp.where(columns, scale * logits, -jnp.inf)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        target_log_prob = jnp.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
        if label_smoothing:  # the rest spread evenly over the real columns
            uniform = jnp.where(columns, log_probs, 0.0).sum(-1) / columns.sum(-1)
            target_log_prob = (1 - label_smoothing) * target_log_prob + label_smoothing * uniform
        losses = losses - 0.5 * target_log_prob
    loss = (losses * weights).sum()
    return loss, {"loss": loss, "tokens": weights.sum()}


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def retrieval_metrics(image_embeds, caption_embeds, caption_image, ks=RECALL_AT, chunk=1024):
    """Recall@k both ways over a whole split: image->text counts an image when one of its captions
    is among the k captions scoring highest with it; text->image counts a caption when its image is
    among the k images scoring highest with it. A rank is the number of wrong candidates scoring
    strictly higher than the best right one. Computed in chunks: no n_images x n_captions matrix."""
    image_embeds, caption_embeds = np.asarray(image_embeds, np.float32), np.asarray(caption_embeds, np.float32)
    caption_image = np.asarray(caption_image)
    n_images = len(image_embeds)
    image_ranks = np.empty(n_images, np.int64)
    for start in range(0, n_images, chunk):
        scores = image_embeds[start:start + chunk] @ caption_embeds.T
        own = caption_image[None, :] == np.arange(start, start + len(scores))[:, None]
        best_own = np.where(own, scores, -np.inf).max(axis=1)
        image_ranks[start:start + chunk] = (scores > best_own[:, None]).sum(axis=1)
    text_ranks = np.empty(len(caption_embeds), np.int64)
    for start in range(0, len(caption_embeds), chunk):
        scores = caption_embeds[start:start + chunk] @ image_embeds.T
        right = scores[np.arange(len(scores)), caption_image[start:start + chunk]]
        text_ranks[start:start + chunk] = (scores > right[:, None]).sum(axis=1)
    metrics = {}
    for k in ks:
        metrics[f"image_to_text_recall@{k}"] = float((image_ranks < k).mean())
        metrics[f"text_to_image_recall@{k}"] = float((text_ranks < k).mean())
    return metrics


def class_embeddings(prompt_embeds, num_classes):
    """Each class's text embedding: the normalised mean of its prompts' (`prompt_embeds` [classes *
    templates, dim], class by class)."""
    per_class = np.asarray(prompt_embeds, np.float32).reshape(num_classes, -1, prompt_embeds.shape[-1]).mean(axis=1)
    return per_class / np.linalg.norm(per_class, axis=-1, keepdims=True)


def zero_shot_accuracy(image_embeds, class_embeds, class_ids):
    """The share of images whose best-scoring class embedding is their class's."""
    predicted = (np.asarray(image_embeds, np.float32) @ class_embeds.T).argmax(axis=1)
    return float((predicted == np.asarray(class_ids)).mean())


# ---------------------------------------------------------------------------------------------
# Prediction files
# ---------------------------------------------------------------------------------------------


def top_matches(query_embeds, candidate_embeds, k):
    """(indices, scores) [queries, min(k, candidates)] of each query's best candidates, best first."""
    scores = np.asarray(query_embeds, np.float32) @ np.asarray(candidate_embeds, np.float32).T
    k = min(k, scores.shape[1])
    best = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return best, np.take_along_axis(scores, best, axis=1)


def prediction_lines(query_names, candidate_names, query_embeds, candidate_embeds, k, header):
    """Lines of a prediction file: `header`, then "<query>\\t<rank>\\t<score>\\t<candidate>" for each
    query's k best candidates."""
    best, scores = top_matches(query_embeds, candidate_embeds, k)
    lines = ["\t".join(header)]
    for query, row, row_scores in zip(query_names, best, scores):
        lines.extend(f"{one_line(query)}\t{rank}\t{score:.4f}\t{one_line(candidate_names[i])}"
                     for rank, (i, score) in enumerate(zip(row, row_scores), start=1))
    return lines


# ---------------------------------------------------------------------------------------------
# The demo page (demo.py): image search and zero-shot labels
# ---------------------------------------------------------------------------------------------


def _validation_images(output_dir, run_args):
    """The run's validation images (`ImageTextSplit`) where its arguments name a local file or folder, else None."""
    import types

    import datasets

    args = types.SimpleNamespace(**{name: run_args.get(name) for name in ("image_column", "caption_column",
                                                                         "label_column")})
    file, folder = run_args.get("validation_file"), run_args.get("validation_dir")
    if file and os.path.isfile(file):
        dataset = datasets.load_dataset("json" if ".json" in file else "csv", data_files=file, split="train")
        return dataset_split(args, dataset, "validation", run_args.get("data_dir") or os.path.dirname(
            os.path.abspath(file)))
    if folder and os.path.isdir(folder):
        return dataset_split(args, _folder_dataset(folder, None), "validation", None)
    return None


def _features(model):
    """(image features of channels-first pixels, text features), normalised, jitted. transformers 4.57's dual
    encoder `get_image_features` wants channels-last pixels (its forward pass transposes, it does not);
    CLIP's transposes itself."""
    from transformers import FlaxVisionTextDualEncoderModel

    channels_last = isinstance(model, FlaxVisionTextDualEncoderModel)

    def image(params, pixels):
        pixels = jnp.transpose(pixels, (0, 2, 3, 1)) if channels_last else pixels
        return _normalised(model.get_image_features(pixels, params=params))

    def text(params, input_ids, attention_mask):
        return _normalised(model.get_text_features(input_ids, attention_mask, params=params))

    return jax.jit(image), jax.jit(text)


class ImageSearch(Predictor):
    """run_hybrid_clip.py's model: a query against a set of images (the uploaded ones, else the run's
    validation images), the `TOP` best with their cosine scores; or one image against comma-separated
    labels (zero-shot: softmax of the model's scaled similarities). Images are transformed as the
    script evaluates them, with the image processor saved beside the model; queries are padded to the
    run's --max_seq_length (one compiled shape each)."""

    auto_class = "FlaxAutoModel"
    TOP = 5

    def __init__(self, output_dir, run_args):
        from transformers import AutoImageProcessor

        super().__init__(output_dir, run_args)
        processor = AutoImageProcessor.from_pretrained(output_dir)
        vision = self.config.vision_config
        size = run_args.get("image_size") or getattr(vision, "image_size", None) or images.processor_size(processor)
        self.transforms = images.Transforms(size, images.Normalisation(processor))
        self.max_seq_length = run_args.get("max_seq_length") or 72
        self._image, self._text = _features(self.model)
        self.gallery = _validation_images(output_dir, run_args)
        self.gallery_embeds = None

    def _embed_images(self, sources):
        return np.stack([np.asarray(self._image(self.params, self.transforms.eval(source)[None]))[0]
                         for source in sources])

    def _embed_texts(self, texts):
        tokens = tokenize(self.tokenizer, texts, self.max_seq_length)
        return np.asarray(self._text(self.params, tokens["input_ids"], tokens["attention_mask"]))

    def _read(self, image_bytes):
        try:
            return self.transforms.eval(bytes(image_bytes))
        except Image.DecompressionBombError as e:
            raise BadInput(f"an image is too large to decode ({e}): upload a smaller one") from e
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise BadInput(f"a file is not an image that can be read ({type(e).__name__}): upload PNG, JPEG, GIF, "
                           "BMP, WebP or TIFF files") from e

    def predict(self, query, uploads=(), labels=""):
        """Labels given: zero-shot on the first upload. Else: the query's best images (uploads or the gallery)."""
        uploads = [u for u in uploads if u]
        names = [name.strip() for name in labels.split(",") if name.strip()]
        if names:
            if not uploads:
                raise BadInput("zero-shot labels need an image: upload one")
            pixels = self._read(uploads[0])
            image = np.asarray(self._image(self.params, pixels[None]))[0]
            scale = min(float(np.exp(np.asarray(self.params["logit_scale"]))), MAX_LOGIT_SCALE)
            logits = scale * self._embed_texts(names) @ image
            probabilities = np.exp(logits - logits.max())
            probabilities /= probabilities.sum()
            order = np.argsort(-probabilities, kind="stable")
            answer = Answer(details=[(names[i], float(probabilities[i])) for i in order])
        else:
            require_text(query, "query")
            if uploads:
                embeds = np.stack([np.asarray(self._image(self.params, self._read(u)[None]))[0] for u in uploads])
                shown = [f"upload {i + 1}" for i in range(len(uploads))]
            elif self.gallery is not None:
                embeds, shown = self.gallery_embeds, self.gallery.shown
            else:
                raise BadInput("no images to search: upload some (the run's validation images are not here)")
            best, scores = top_matches(self._embed_texts([query]), embeds, self.TOP)
            answer = Answer(details=[(shown[i], float(score)) for i, score in zip(best[0], scores[0])])
        answer.text = answer.details[0][0]
        return answer

    def gallery_image(self, name):
        """The gallery image shown as `name` (its source: a path or encoded bytes)."""
        return self.gallery.sources[self.gallery.shown.index(name)]

    def warm_up(self):
        side = self.transforms.size
        jax.block_until_ready(self._image(self.params, np.zeros((1, 3, side, side), np.float32)))
        self._embed_texts(["warm up"])
        if self.gallery is not None:
            self.gallery_embeds = self._embed_images(self.gallery.sources)


PREDICTOR = ImageSearch


def demo_form(st, predictor):
    with st.form("request"):
        query = st.text_input("Query (search the images)", key="query")
        labels = st.text_input("Or labels, comma-separated (zero-shot on the first image)", key="labels")
        uploads = st.file_uploader("Images (default: the run's validation images)", key="images",
                                   accept_multiple_files=True)
        submitted = st.form_submit_button("Match")
    if submitted:
        def show():
            files = [upload.getvalue() for upload in uploads or []]
            answer = predictor(query, files, labels)
            show_answer(st, answer)
            column = "label" if labels.strip() else "image"
            st.table({column: [escape_markdown(name) for name, _ in answer.details],
                      "score": [f"{score:.3f}" for _, score in answer.details]})
            if not labels.strip() and not files:
                st.image([predictor.gallery_image(name) for name, _ in answer.details], width=96)
        return show
