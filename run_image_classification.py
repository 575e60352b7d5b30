#!/usr/bin/env python
"""Fine-tune a Flax vision model (ViT, BEiT, DINOv2, ResNet, RegNet) to classify images, without torch.

    python run_image_classification.py configs/image_tiny.json
    python run_image_classification.py --model_name_or_path google/vit-base-patch16-224-in21k \\
        --train_dir imagenette/train --validation_dir imagenette/val --do_train --do_eval \\
        --output_dir runs/imagenette

Images come from folders in the ImageFolder layout (`root/<class>/<image>`, the class folders name
the labels) or from a `datasets` dataset (an image and a label column). They are decoded with
Pillow and transformed in NumPy (`utils/images.py`): training takes a random-resized crop flipped
half of the time, a pure function of (seed, epoch, example) so a resumed run sees the same pixels;
evaluation resizes and takes the center crop; both normalise as the model's image processor, which
is saved with the model. A pool of threads prepares the batches ahead of the step. One train /
eval loop, each step defined once for both layouts (`--sharding dp`, jax.pmap over the local
devices, the default; `--sharding fsdp`, the model split over all devices); everything mechanical
(layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.perf.seconds_since_start)

import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from transformers import FlaxAutoModelForImageClassification

from tasks import classification, image_classification as images
from tasks.image_classification import TASK
from utils import dataset_loading, file_formats
from utils.args import BaseDataArguments, ModelArguments, TrainingArguments, parse_args
from utils.errors import UsageError, run_main
from utils.layout import make_layout
from utils.models import load_config, load_model
from utils.run import SPLIT_FLAGS, check_before_work, set_up, training_plan
from utils.steps import cross_entropy_sums
from utils.training import TrainingRun, make_steps

# Normalisation of a model trained from scratch: transformers' IMAGENET_STANDARD_MEAN / _STD (ViT's).
DEFAULT_MEAN, DEFAULT_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
DEFAULT_IMAGE_SIZE = 224
# Families whose position embeddings are interpolated to any input size (the others need their config's).
RESIZABLE_POSITIONS = ("dinov2",)
TOP_K = 5

@dataclass
class ImageModelArguments(ModelArguments):
    image_processor_name: Optional[str] = field(
        default=None, metadata={"help": "Image processor (name or path) whose normalisation the images get "
                                        "(default: the model's; from scratch: mean 0.5, std 0.5)."})

@dataclass
class ImageDataArguments(BaseDataArguments):
    train_dir: Optional[str] = field(
        default=None, metadata={"help": "Training images in the ImageFolder layout: root/<class>/<image> (png, jpg, "
                                        "...); the class folders' names are the labels."})
    validation_dir: Optional[str] = field(
        default=None, metadata={"help": "Validation images, same layout (classes among the training ones)."})
    test_dir: Optional[str] = field(
        default=None, metadata={"help": "Images to predict: every image under this folder, class folders or not."})
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file (json, jsonl or csv) with an image path column."})
    image_column_name: Optional[str] = field(
        default=None, metadata={"help": "Image column of a dataset or data file: images, or paths relative to the "
                                        "file (default: 'image' if present, else 'img')."})
    label_column_name: Optional[str] = field(
        default=None, metadata={"help": "Label column of a dataset or data file (default: 'label' if present, else "
                                        "'labels')."})
    image_size: Optional[int] = field(
        default=None, metadata={"help": "Side of the square images the model sees (default: the model config's "
                                        "image_size, else the image processor's crop size, else 224)."})
    min_crop_scale: float = field(
        default=0.08, metadata={"help": "Smallest share of an image's area the random training crop covers."})
    random_flip: bool = field(
        default=True, metadata={"help": "Flip training images horizontally half of the time (never at eval)."})
    max_predict_samples: Optional[int] = field(
        default=None, metadata={"help": "Predict this many test images, drawn at random (seeded by --seed)."})

    def __post_init__(self):
        super().__post_init__()
        if self.image_size is not None and self.image_size <= 0:
            raise UsageError(f"--image_size must be positive, got {self.image_size}")
        if not 0 < self.min_crop_scale <= 1:
            raise UsageError(f"--min_crop_scale must be in (0, 1], got {self.min_crop_scale}")

SPLIT_DIRS = {"train": "train_dir", "validation": "validation_dir", "test": "test_dir"}

# ----------------------------------------------------------------------------------------------
# Data: image sources and their labels, per split
# ----------------------------------------------------------------------------------------------
def check_data_given(training_args, data_args):
    """Each phase asked for has its images: a folder, a file or a dataset (not a folder and a file)."""
    for split, (phase, file_flag) in SPLIT_FLAGS.items():
        folder, file = getattr(data_args, SPLIT_DIRS[split]), getattr(data_args, file_flag[2:])
        if folder and file:
            raise UsageError(f"--{SPLIT_DIRS[split]} and {file_flag} both give {split} images: pass one")
        if getattr(training_args, phase) and not (folder or file or data_args.dataset_name):
            raise UsageError(f"--{phase} needs {split} images: pass --{SPLIT_DIRS[split]} (root/<class>/<image>), "
                             f"{file_flag} or --dataset_name")

def folder_split(data_args, split):
    """(image paths, class name of each or None, display names) of a split's folder."""
    root = getattr(data_args, SPLIT_DIRS[split])
    if split == "test":
        paths = images.scan_images(root, SPLIT_DIRS[split])
        names = None
    else:
        paths, names, _ = images.scan_folder(root, SPLIT_DIRS[split])
    return paths, names, [os.path.relpath(path, root) for path in paths]

def dataset_columns(data_args, columns, split):
    """(image column, label column or None) of a dataset split's `columns`."""
    image = data_args.image_column_name or next((c for c in ("image", "img") if c in columns), None)
    if image is None:
        raise UsageError(f"the {split} data has no 'image' or 'img' column (its columns: {', '.join(columns)}): "
                         "name it with --image_column_name")
    file_formats.require_columns({split: columns}, [("image_column_name", image)])
    if split == "test":
        return image, None
    label = data_args.label_column_name or next((c for c in ("label", "labels") if c in columns), None)
    if label is None:
        raise UsageError(f"the {split} data has no 'label' or 'labels' column (its columns: {', '.join(columns)}): "
                         "name it with --label_column_name")
    file_formats.require_columns({split: columns}, [("label_column_name", label)])
    return image, label

def dataset_split(data_args, dataset, split, file):
    """(image sources, label name of each or None, display names) of a `datasets` split."""
    image_column, label_column = dataset_columns(data_args, dataset.column_names, split)
    base = os.path.dirname(os.path.abspath(file)) if file else None
    sources = images.DatasetImages(dataset, image_column, base)
    names = None
    if label_column is not None:
        feature = dataset.features[label_column]
        values = list(dataset[label_column])
        if hasattr(feature, "int2str"):
            names = [feature.int2str(int(v)) for v in values]
        else:
            classification.label_list(values)  # missing or mixed labels fail here
            names = [str(v) for v in values]
    return sources, names, [sources.name(i) for i in range(len(sources))]

def load_image_splits(data_args, training_args, cache_dir):
    """{split: (sources, label names or None, display names)} of the phases asked for."""
    splits = [split for split, (phase, _) in SPLIT_FLAGS.items() if getattr(training_args, phase)]
    files = {split: getattr(data_args, SPLIT_FLAGS[split][1][2:]) for split in splits}
    from_datasets = [split for split in splits if not getattr(data_args, SPLIT_DIRS[split])]
    raw = {}
    if from_datasets:
        raw = dataset_loading.load_splits(data_args, {s: files[s] for s in from_datasets}, cache_dir, allowed=("json", "csv"))
    loaded = {}
    for split in splits:
        if split not in from_datasets:
            loaded[split] = folder_split(data_args, split)
            continue
        if split not in raw:
            raise UsageError(f"--{SPLIT_FLAGS[split][0]} needs a {split!r} split, but dataset "
                             f"{data_args.dataset_name!r} has only {', '.join(raw)}: pass --{SPLIT_DIRS[split]}")
        loaded[split] = dataset_split(data_args, raw[split], split, files[split])
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
              "test": data_args.max_predict_samples}
    return {split: take_subset(parts, limits[split], training_args.seed) for split, parts in loaded.items()}

def take_subset(parts, max_samples, seed):
    """(sources, label names, display names) of `max_samples` images drawn at random (seeded), in
    their order: a folder's first images would all be of its first class."""
    sources, label_names, shown = parts
    if max_samples is None or max_samples >= len(sources):
        return parts
    keep = np.sort(np.random.default_rng(seed).permutation(len(sources))[:max_samples])
    pick = (lambda values: None if values is None else [values[i] for i in keep])
    return (sources.select(keep) if hasattr(sources, "select") else pick(sources)), pick(label_names), pick(shown)

# ----------------------------------------------------------------------------------------------
# Labels, image size, normalisation
# ----------------------------------------------------------------------------------------------
def class_order(name):
    """Sort key of class names: integers by value (2 before 10), then the others as strings."""
    return (0, int(name), "") if name.lstrip("-").isdigit() else (1, 0, name)

def choose_labels(splits, config, pretrained, training):
    """The label names, by id. Training: the training classes, in the checkpoint's order when it names
    exactly those (its head keeps its meaning). Else the checkpoint's, which must name every class of
    the data."""
    saved = classification.saved_label_names(config) if pretrained else None
    if training:
        classes = sorted(set(splits["train"][1]), key=class_order)
        if len(classes) < 2:
            raise UsageError(f"the training images have one class only ({classes[0]!r}): classification needs two "
                             "or more (one folder per class)")
        return saved if saved and sorted(saved, key=class_order) == classes else classes
    if saved is None:
        raise UsageError("evaluation or prediction alone needs the label names: use a model fine-tuned by this "
                         "script (its config names them), or train it here (--do_train)")
    return saved

def label_ids(split, label_names, names):
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(label_names) - set(index))
    if unknown:
        raise UsageError(f"the {split} images have classes the model does not know: "
                         f"{', '.join(map(repr, unknown[:5]))} (its classes: {', '.join(map(repr, names[:20]))})")
    return np.array([index[name] for name in label_names], np.int32)

def load_image_processor(model_args):
    """The image processor of --image_processor_name or the pretrained model, or None (from scratch)."""
    name = model_args.image_processor_name or model_args.model_name_or_path
    if not name:
        return None
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(name, cache_dir=model_args.cache_dir, token=model_args.token)
    except (OSError, ValueError) as e:
        if model_args.image_processor_name:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UsageError(f"could not load image processor {name!r}: {first}") from e
        return None  # a checkpoint without one: the default normalisation

def fit_image_size(data_args, config, processor, pretrained):
    """The side of the model's square inputs, written into a new model's config; a size the model
    cannot take (a patch grid that does not divide it, position embeddings for another) is a UsageError."""
    config_size = getattr(config, "image_size", None)
    size = data_args.image_size or config_size or images.processor_size(processor) or DEFAULT_IMAGE_SIZE
    if config_size is not None and size != config_size:
        if pretrained and config.model_type not in RESIZABLE_POSITIONS:
            raise UsageError(f"--image_size {size} differs from the {config_size} the pretrained "
                             f"{config.model_type} model's position embeddings are for: use --image_size {config_size}")
        config.image_size = size
    patch = getattr(config, "patch_size", None)
    if isinstance(patch, int) and size % patch:
        raise UsageError(f"--image_size {size} is not a multiple of the model's patch_size {patch}: use "
                         f"{max(patch, size // patch * patch)} or {(size // patch + 1) * patch}")
    if getattr(config, "num_channels", 3) != 3:
        raise UsageError(f"the model takes {config.num_channels}-channel images; this script feeds RGB: set "
                         "num_channels=3")
    return size

def patch_tokens(config, size):
    """Positions a transformer attends over (patches + [CLS]); 1 for a convolutional network."""
    patch = getattr(config, "patch_size", None)
    return (size // patch) ** 2 + 1 if isinstance(patch, int) else 1

# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def classification_sums(logits, labels, example_weight=None, label_smoothing=0.0, top_k=None):
    """(loss sum, {"loss", "accuracy", ["top5_accuracy"], "tokens"}): cross-entropy and correct
    predictions summed over the images, "tokens" counting them (each weighted by `example_weight`:
    0 for padded rows), so their means are exact over every image."""
    weights = jnp.ones(labels.shape, jnp.float32) if example_weight is None else example_weight
    loss, count = cross_entropy_sums(logits, labels, weights, label_smoothing)
    sums = {"loss": loss, "accuracy": ((logits.argmax(-1) == labels) * weights).sum(), "tokens": count}
    if top_k:
        # Ranks by logit: a label is in the top k when fewer than k classes score above it.
        label_logit = jnp.take_along_axis(logits, labels[:, None], axis=-1)
        in_top = (logits > label_logit).sum(-1) < top_k
        sums[f"top{top_k}_accuracy"] = (in_top * weights).sum()
    return loss, sums

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ImageModelArguments, ImageDataArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    check_data_given(training_args, data_args)
    # Folders are checked below; `check_before_work` checks the data files (and the rest).
    files = {split: getattr(data_args, flag[2:]) for split, (_, flag) in SPLIT_FLAGS.items()
             if not getattr(data_args, SPLIT_DIRS[split])}
    preflight = check_before_work(training_args, data_args, TASK, files, allowed=("json", "csv"), model_args=model_args)
    for split, (phase, _) in SPLIT_FLAGS.items():
        folder = getattr(data_args, SPLIT_DIRS[split])
        if folder and getattr(training_args, phase):
            (images.scan_images if split == "test" else images.scan_folder)(folder, SPLIT_DIRS[split])  # fails now
    logger, is_main = set_up(training_args)
    layout = make_layout(training_args.sharding, training_args.fsdp_size, training_args.compile_only)

    # ------------------------------------------------------------------------------------------
    # Config, images, labels, transforms
    # ------------------------------------------------------------------------------------------
    pretrained = bool(model_args.model_name_or_path)
    config = load_config(model_args, task="image-classification")
    splits = load_image_splits(data_args, training_args, model_args.cache_dir)
    workers = data_args.preprocessing_num_workers or images.default_workers()
    for split, (sources, _, shown) in splits.items():
        images.check_readable(sources, workers, names=shown)  # a corrupt image stops the run here, named
        logger.info("%s: %d images", split, len(sources))
    names = choose_labels(splits, config, pretrained, training_args.do_train)
    labels = {split: label_ids(split, parts[1], names) for split, parts in splits.items() if parts[1] is not None}
    config.num_labels = len(names)
    config.label2id, config.id2label = classification.config_label_maps(names)
    config.problem_type = "single_label_classification"
    processor = load_image_processor(model_args)
    image_size = fit_image_size(data_args, config, processor, pretrained)
    if processor is None:
        processor = images.eval_processor(image_size, DEFAULT_MEAN, DEFAULT_STD)
    transforms = images.Transforms(image_size, images.Normalisation(processor), data_args.min_crop_scale,
                                   data_args.random_flip)
    train_data = None
    if training_args.do_train:
        train_data = images.ImageData(splits["train"][0], labels["train"], transforms, workers)
    eval_arrays = {split: {"pixel_values": images.ImageColumn(splits[split][0], transforms, workers),
                           **({"labels": labels[split]} if split in labels else {})}
                   for split in splits if split != "train"}
    plan = training_plan(training_args, train_data.size if train_data else None)

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForImageClassification, model_args, config,
                               training_args.seed, layout,
                               new_head_if_mismatched=True)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------
    top_k = TOP_K if len(names) > TOP_K else None
    # ResNet / RegNet take no dropout key; their batch norm always runs on its saved statistics
    # (train=False), which training leaves as they are (no gradient: the statistics are used, hence
    # differentiable): frozen batch norm, the same in train and eval.
    takes_dropout = "dropout_rng" in inspect.signature(model.__call__).parameters

    def logits_of(params, batch, dropout_rng=None, train=False):
        if takes_dropout:
            return model(batch["pixel_values"], params=params, dropout_rng=dropout_rng, train=train)[0]
        frozen = {**params, "batch_stats": jax.lax.stop_gradient(params["batch_stats"])}
        return model(batch["pixel_values"], params=frozen, train=False)[0]

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        return classification_sums(logits_of(params, batch, dropout_rng, train), batch["labels"],
                                   batch.get("example_weight"), label_smoothing, top_k)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)
    p_predict_step = layout.compile_step("predict_step", lambda params, batch: logits_of(params, batch).argmax(-1))

    def evaluate(params, split):
        """Mean loss, accuracy (and top-5 accuracy) over every image of `split` (padded rows left out)."""
        means, _ = steps.evaluate(params, eval_arrays[split], len(splits[split][0]))
        means["samples"] = means.pop("tokens")
        return means

    def predict(params, split):
        """"<image>\t<predicted class>" per image, in the order of the split."""
        predicted = []
        pixels = {"pixel_values": eval_arrays[split]["pixel_values"]}
        for batch, valid in steps.eval_batches(pixels, len(splits[split][0])):
            predicted.extend(layout.rows_to_host(p_predict_step(params, batch))[:valid])
        return [f"{shown}\t{names[class_id]}" for shown, class_id in zip(splits[split][2], predicted)]

    # --compile_only: the TPU plan of each step this run calls, on its first batch; the run ends there.
    validation, test = eval_arrays.get("validation"), eval_arrays.get("test")
    steps.report_plan(training_args, state, eval_step=validation and (validation, len(splits["validation"][0])),
                      predict_step=test and ({"pixel_values": test["pixel_values"]}, len(splits["test"][0])))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, processor)  # the processor is saved with the model

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(patch_tokens(config, image_size)):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                run.report("eval", evaluate(state.params, "validation"))
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        run.report("eval", evaluate(state.params, "validation"))
    if training_args.do_predict:
        run.write_text("predict_results.txt", ["image\tprediction", *predict(state.params, "test")],
                       collapse_whitespace=False)
        run.dir.add_results(predict_samples=len(splits["test"][0]))
    run.finish()

if __name__ == "__main__":
    sys.exit(run_main(main))
