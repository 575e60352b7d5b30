"""Image classification: each phase's images and their labels, the loss and its top-k accuracy, the prediction
file, the demo predictor. Finding, decoding, transforming and batching the images is the image room's
(`tasks.images`).

- find: `load_splits` gives each phase's `ImageSplit` from a folder or a `datasets` split (a data file or a
  hub dataset); `take_subset` draws --max_*_samples of them at random.
- label: `choose_labels` names the classes (the training ones, in the checkpoint's order when it names
  exactly those), `label_ids` maps each image's class to its id.
- score and predict: `classification_sums` (loss, accuracy and top-5 accuracy summed over the real
  images), `eval_metrics`, and `prediction_lines`, the lines of predict_results.txt.
"""

import inspect
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task, classification
from tasks.demo import Answer, Predictor, escape_markdown, show_answer
from tasks.images import (SPLIT_DIRS, DatasetImages, ImageColumn, Normalisation, Transforms, check_images_given,
                          class_order, data_files, processor_size, scan_folder, scan_images, uploaded_pixels)
from utils.base.errors import UsageError
from utils.data import file_formats, loaders
from utils.run.preflight import SPLIT_FLAGS, check_splits, needed_splits
from utils.scoring.losses import cross_entropy_sums


FILE_FORMATS = ("json", "csv")
TOP_K = 5  # the top-k accuracy reported beside the accuracy, with more classes than this


class ImageSplit(NamedTuple):
    """The images of a split: `sources` (paths, or `DatasetImages`), the class name of each (None
    for unlabelled images) and the name each is shown by (predictions, errors)."""
    sources: object
    label_names: list
    shown: list


def check_data_given(model_args, data_args, training_args):
    """Each phase asked for has its images: a folder, a file or a dataset (not a folder and a file)."""
    for split, (phase, file_flag) in SPLIT_FLAGS.items():
        folder, file = getattr(data_args, SPLIT_DIRS[split]), getattr(data_args, file_flag[2:])
        if folder and file:
            raise UsageError(f"--{SPLIT_DIRS[split]} and {file_flag} both give {split} images: pass one")
        if getattr(training_args, phase) and not (folder or file or data_args.dataset_name):
            raise UsageError(f"--{phase} needs {split} images: pass --{SPLIT_DIRS[split]} (root/<class>/<image>), "
                             f"{file_flag} or --dataset_name")


def check_folders(columns, model_args, data_args, training_args):
    """Scan the folder of each phase asked for: a bad layout fails before any work."""
    for split in needed_splits(training_args):
        folder = getattr(data_args, SPLIT_DIRS[split])
        if folder:
            (scan_images if split == "test" else scan_folder)(folder, SPLIT_DIRS[split])


# Images from folders, files or a dataset: the files' own checks are the engine's, the folders' these.
TASK = Task("image-classification", "image-classification", outputs=("predict_results.txt",),
            file_formats=FILE_FORMATS, data_files=data_files, check_arguments=check_data_given,
            check_data=check_folders)


def folder_split(data_args, split):
    """The `ImageSplit` of a split's folder, its images shown by their paths under the folder."""
    root = getattr(data_args, SPLIT_DIRS[split])
    if split == "test":
        paths = scan_images(root, SPLIT_DIRS[split])
        names = None
    else:
        paths, names, _ = scan_folder(root, SPLIT_DIRS[split])
    return ImageSplit(paths, names, [os.path.relpath(path, root) for path in paths])


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
    """The `ImageSplit` of a `datasets` split (read from `file`, or a hub dataset when None)."""
    image_column, label_column = dataset_columns(data_args, dataset.column_names, split)
    check_images_given(dataset, image_column, split)
    base = os.path.dirname(os.path.abspath(file)) if file else None
    sources = DatasetImages(dataset, image_column, base)
    names = None
    if label_column is not None:
        feature = dataset.features[label_column]
        values = list(dataset[label_column])
        if hasattr(feature, "int2str"):
            names = [feature.int2str(int(v)) for v in values]
        else:
            classification.label_list(values, split)  # missing or mixed labels fail here
            names = [str(v) for v in values]
    return ImageSplit(sources, names, [sources.name(i) for i in range(len(sources))])


def load_splits(data_args, training_args, cache_dir):
    """{split: ImageSplit} of the phases asked for, each from its folder, data file or the dataset."""
    splits = needed_splits(training_args)
    files = data_files(data_args)
    from_datasets = [split for split in splits if split in files]
    raw = {}
    if from_datasets:
        raw = loaders.load_splits(data_args, {s: files[s] for s in from_datasets}, cache_dir,
                                          allowed=FILE_FORMATS)
    loaded = {}
    for split in splits:
        if split not in from_datasets:
            loaded[split] = folder_split(data_args, split)
            continue
        check_splits(raw, {split: split}, data_args.dataset_name, fix=f"pass --{SPLIT_DIRS[split]}")
        loaded[split] = dataset_split(data_args, raw[split], split, files[split])
    return loaded


def take_subset(images, max_samples, seed):
    """The `ImageSplit` of `max_samples` of `images` drawn at random (seeded), in their order: a
    folder's first images would all be of its first class."""
    if max_samples is None or max_samples >= len(images.sources):
        return images
    keep = np.sort(np.random.default_rng(seed).permutation(len(images.sources))[:max_samples])
    pick = (lambda values: None if values is None else [values[i] for i in keep])
    sources = images.sources.select(keep) if hasattr(images.sources, "select") else pick(images.sources)
    return ImageSplit(sources, pick(images.label_names), pick(images.shown))


def choose_labels(splits, config, pretrained, training):
    """The label names, by id. Training: the training classes, in the checkpoint's order when it names
    exactly those (its head keeps its meaning). Else the checkpoint's, which must name every class of
    the data."""
    saved = classification.saved_label_names(config) if pretrained else None
    if training:
        classes = sorted(set(splits["train"].label_names), key=class_order)
        if len(classes) < 2:
            raise UsageError(f"the train data has one class only ({classes[0]!r}): classification needs two or more "
                             "(one folder per class, or two labels or more in the label column)")
        return saved if saved and sorted(saved, key=class_order) == classes else classes
    if saved is None:
        raise UsageError("evaluation or prediction alone needs the label names: use a model fine-tuned by this "
                         "script (its config names them), or train it here (--do_train)")
    return saved


def label_ids(split, label_names, names):
    """The ids of a split's class names `label_names` among the model's `names`; unknown ones fail."""
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(label_names) - set(index))
    if unknown:
        raise UsageError(f"the {split} images have classes the model does not know: "
                         f"{', '.join(map(repr, unknown[:5]))} (its classes: {', '.join(map(repr, names[:20]))})")
    return np.array([index[name] for name in label_names], np.int32)


def set_labels(config, names):
    """The model config's head: one logit per class, named `names` (saved with the model)."""
    config.num_labels = len(names)
    config.label2id, config.id2label = classification.config_label_maps(names)
    config.problem_type = "single_label_classification"


def eval_columns(splits, labels, transforms, workers=None):
    """{split: {"pixel_values": ImageColumn, ["labels"]}} of the splits evaluated or predicted (all but
    "train"): what `utils.run.loop.eval_batches` reads; "labels" where `labels` has the split's ids."""
    return {split: {"pixel_values": ImageColumn(images.sources, transforms, workers),
                    **({"labels": labels[split]} if split in labels else {})}
            for split, images in splits.items() if split != "train"}


# ----------------------------------------------------------------------------------------------
# The model's logits, the loss and the metrics
# ----------------------------------------------------------------------------------------------
def logits_fn(model):
    """`logits_of(params, batch, dropout_rng=None, train=False)` of a vision model on batch["pixel_values"].

    ResNet / RegNet take no dropout key; their batch norm always runs on its saved statistics
    (train=False), which training leaves as they are (no gradient: the statistics are used, hence
    differentiable): frozen batch norm, the same in train and eval."""
    takes_dropout = "dropout_rng" in inspect.signature(model.__call__).parameters

    def logits_of(params, batch, dropout_rng=None, train=False):
        if takes_dropout:
            return model(batch["pixel_values"], params=params, dropout_rng=dropout_rng, train=train)[0]
        frozen = {**params, "batch_stats": jax.lax.stop_gradient(params["batch_stats"])}
        return model(batch["pixel_values"], params=frozen, train=False)[0]

    return logits_of


def top_k_for(num_labels):
    """The k of the top-k accuracy a run reports with `num_labels` classes (None: accuracy alone)."""
    return TOP_K if num_labels > TOP_K else None


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


def eval_metrics(means):
    """A split's results from the eval step's means: loss, accuracy, [top5_accuracy], and "samples",
    the images counted."""
    return {**{name: value for name, value in means.items() if name != "tokens"}, "samples": means["tokens"]}


# ----------------------------------------------------------------------------------------------
# Prediction file
# ----------------------------------------------------------------------------------------------
def prediction_lines(shown, class_ids, names):
    """The lines of predict_results.txt: a header, then "<image>\t<predicted class>" per image, in order."""
    return ["image\tprediction", *(f"{image}\t{names[class_id]}" for image, class_id in zip(shown, class_ids))]


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class ImageClassifier(Predictor):
    """run_image_classification.py's model on one uploaded image, transformed as the script's
    evaluation and prediction transform it (`tasks.images.Transforms.eval` with the image
    processor saved beside the model): the `TOP_LABELS` best labels with their probabilities."""

    auto_class = "FlaxAutoModelForImageClassification"
    TOP_LABELS = 5

    def __init__(self, output_dir, run_args):
        from transformers import AutoImageProcessor

        super().__init__(output_dir, run_args)
        processor = AutoImageProcessor.from_pretrained(output_dir)
        # The size the run trained at, as `fit_image_size` found it (and wrote into the config).
        size = run_args.get("image_size") or getattr(self.config, "image_size", None) or processor_size(
            processor)
        self.transforms = Transforms(size, Normalisation(processor))
        top = min(self.TOP_LABELS, self.config.num_labels)
        self._top = jax.jit(lambda params, pixels: jax.lax.top_k(jax.nn.softmax(
            self.model(pixels, params=params, train=False)[0].astype(jnp.float32), axis=-1), top))

    def load_tokenizer(self):
        return None  # images need none: the transform is read from the saved image processor

    def predict(self, image_bytes):
        pixels = uploaded_pixels(self.transforms, image_bytes)
        probabilities, label_ids = (np.asarray(x)[0] for x in self._top(self.params, pixels[None]))
        answer = Answer(details=[(self.config.id2label[int(i)], float(p)) for i, p in zip(label_ids, probabilities)])
        answer.text = answer.details[0][0]
        return answer

    def warm_up(self):
        side = self.transforms.size
        jax.block_until_ready(self._top(self.params, np.zeros((1, 3, side, side), np.float32)))


PREDICTOR = ImageClassifier


def demo_form(st, predictor):
    with st.form("request"):
        upload = st.file_uploader("Image", key="image")
        submitted = st.form_submit_button("Classify")
    if submitted:
        def show():
            answer = predictor(upload.getvalue() if upload is not None else b"")
            st.image(upload.getvalue(), width=224)
            show_answer(st, answer)
            st.table({"label": [escape_markdown(label) for label, _ in answer.details],
                      "probability": [f"{p:.3f}" for _, p in answer.details]})
        return show
