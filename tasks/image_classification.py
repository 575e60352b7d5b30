"""Image classification: find the images, check, decode and transform them, batch them; labels, the
loss and its top-k accuracy, the prediction file.

Pure NumPy and Pillow (no torch, no torchvision). What a run does with its images:

- find: `load_splits` gives each phase's `ImageSplit` from a folder or a `datasets` split (a data
  file or a hub dataset, `DatasetImages`); `take_subset` draws --max_*_samples of them at random.
  `scan_folder` reads the ImageFolder layout (`root/<class>/<image>`, the class folders name the
  labels); `scan_images` takes every image under a folder, classes or not (prediction needs no
  labels). Bad layouts (no class folders, an empty class folder) are UsageErrors naming the folder.
- label: `choose_labels` names the classes (the training ones, in the checkpoint's order when it
  names exactly those), `label_ids` maps each image's class to its id.
- check: `check_readable` decodes every image once, before anything is written, so a corrupt file
  stops the run at its start with its name, not at step 5,000.
- decode: `open_rgb` gives RGB whatever the file holds (grey, grey + alpha, palette, RGBA, CMYK).
- transform (`Transforms`): training takes a random-resized crop (the classic Inception-style one:
  area 8%-100%, aspect 3/4-4/3) resized to `size` and flips it horizontally half of the time;
  evaluation resizes the shorter side to `size` and takes the center `size` x `size`. Both are
  bilinear. The random numbers of an image come from a generator seeded by (seed, epoch, example
  index) only: a resumed run crops every example exactly as the uninterrupted run did, whichever
  thread or process decodes it. Pixels are then normalised as the image processor does it
  (`(x * rescale_factor - mean) / std`), channels first: what transformers' Flax vision models take.
  `fit_image_size` chooses `size`, one the model can take.
- batch: `ImageData` is the training data (the methods of `utils.loop.InMemoryData`): each step's
  batch is decoded and transformed by a pool of threads several steps ahead of the step that needs
  it (Pillow and NumPy release the GIL while they work); `ImageColumn` is a column of transformed
  images for `utils.loop.eval_batches`, each batch decoded by the same kind of pool.
- score and predict: `classification_sums` (loss, accuracy and top-5 accuracy summed over the real
  images), `eval_metrics`, and `prediction_lines`, the lines of predict_results.txt.
"""

import collections
import inspect
import io
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image, UnidentifiedImageError

from tasks import Task, classification
from tasks.demo import Answer, BadInput, Predictor, escape_markdown, show_answer
from utils import batch_order, dataset_loading, devices, file_formats
from utils.errors import UsageError
from utils.run import SPLIT_FLAGS, check_splits, needed_splits
from utils.steps import cross_entropy_sums

TASK = Task("image-classification", "image-classification", outputs=("predict_results.txt",))

FILE_FORMATS = ("json", "csv")
SPLIT_DIRS = {"train": "train_dir", "validation": "validation_dir", "test": "test_dir"}  # split -> its folder flag
# Normalisation of a model trained from scratch: transformers' IMAGENET_STANDARD_MEAN / _STD (ViT's).
DEFAULT_MEAN, DEFAULT_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
DEFAULT_IMAGE_SIZE = 224
# Families whose position embeddings are interpolated to any input size (the others need their config's).
RESIZABLE_POSITIONS = ("dinov2",)
TOP_K = 5  # the top-k accuracy reported beside the accuracy, with more classes than this

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".jfif")
CROP_RATIO = (3 / 4, 4 / 3)  # aspect ratios of the random crop, as the classic (torchvision's defaults)
CROP_TRIES = 10
BATCHES_AHEAD = 4  # training batches being prepared while the step runs


def default_workers():
    return min(8, os.cpu_count() or 1)


# ---------------------------------------------------------------------------------------------
# Finding images
# ---------------------------------------------------------------------------------------------


def _is_image(name):
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _images_under(folder):
    """Image files anywhere under `folder`, sorted by path (hidden files and folders skipped)."""
    found = []
    for parent, subfolders, names in os.walk(folder):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        found.extend(os.path.join(parent, name) for name in sorted(names) if _is_image(name))
    return found


def _check_folder(root, flag):
    if not os.path.isdir(root):
        raise UsageError(f"--{flag} {root} not found: check the path (a folder of class folders, root/<class>/<image>)")


def scan_folder(root, flag):
    """(image paths, class name of each, the class names sorted) of an ImageFolder `root`:
    every image under `root/<class>/` belongs to `<class>`."""
    _check_folder(root, flag)
    classes = sorted(name for name in os.listdir(root)
                     if not name.startswith(".") and os.path.isdir(os.path.join(root, name)))
    if not classes:
        loose = [name for name in os.listdir(root) if _is_image(name)]
        what = f"holds {len(loose)} images but no class folders" if loose else "holds no class folders"
        raise UsageError(f"--{flag} {root} {what}: put each class's images in a folder named for the class "
                         "(root/<class>/<image>)")
    paths, names = [], []
    for name in classes:
        found = _images_under(os.path.join(root, name))
        if not found:
            raise UsageError(f"class folder {os.path.join(root, name)} holds no images (looked for "
                             f"{', '.join(IMAGE_EXTENSIONS)}): add its images or remove the folder")
        paths.extend(found)
        names.extend([name] * len(found))
    return paths, names, classes


def scan_images(root, flag):
    """Every image under `root`, sorted by path (class folders or not: prediction needs no labels)."""
    _check_folder(root, flag)
    paths = _images_under(root)
    if not paths:
        raise UsageError(f"--{flag} {root} holds no images (looked for {', '.join(IMAGE_EXTENSIONS)})")
    return paths


# ---------------------------------------------------------------------------------------------
# Splits: the images of each phase, from folders or datasets
# ---------------------------------------------------------------------------------------------


class ImageSplit(NamedTuple):
    """The images of a split: `sources` (paths, or `DatasetImages`), the class name of each (None
    for unlabelled images) and the name each is shown by (predictions, errors)."""
    sources: object
    label_names: list
    shown: list


def check_data_given(training_args, data_args):
    """Each phase asked for has its images: a folder, a file or a dataset (not a folder and a file)."""
    for split, (phase, file_flag) in SPLIT_FLAGS.items():
        folder, file = getattr(data_args, SPLIT_DIRS[split]), getattr(data_args, file_flag[2:])
        if folder and file:
            raise UsageError(f"--{SPLIT_DIRS[split]} and {file_flag} both give {split} images: pass one")
        if getattr(training_args, phase) and not (folder or file or data_args.dataset_name):
            raise UsageError(f"--{phase} needs {split} images: pass --{SPLIT_DIRS[split]} (root/<class>/<image>), "
                             f"{file_flag} or --dataset_name")


def data_files(data_args):
    """{split: data file or None} of the splits that come from no folder (a file or a dataset)."""
    return {split: getattr(data_args, flag[2:]) for split, (_, flag) in SPLIT_FLAGS.items()
            if not getattr(data_args, SPLIT_DIRS[split])}


def check_folders(training_args, data_args):
    """Scan the folder of each phase asked for: a bad layout fails before any work."""
    for split in needed_splits(training_args):
        folder = getattr(data_args, SPLIT_DIRS[split])
        if folder:
            (scan_images if split == "test" else scan_folder)(folder, SPLIT_DIRS[split])


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


def check_images_given(dataset, column, split):
    """Every row of `column` gives an image, a path or the image itself: a UsageError names the first
    row without one, or holding something else (a number among paths, which `datasets` keeps as a
    `Json` column); read from the Arrow table, nothing decoded unless the column is such a mix."""
    import pyarrow.compute as pc

    missing = pc.index(pc.is_null(dataset.with_format("arrow")[column]), True).as_py()
    if missing >= 0:
        raise UsageError(f"row {missing} of the {split} data has no image in column {column!r}: give it one (a path "
                         "or the image), or drop the row")
    if dataset_loading.holds_mixed_values(dataset.features[column]):
        row, value = next((row, value) for row, value in enumerate(dataset[column]) if not isinstance(value, str))
        raise UsageError(f"row {row} of the {split} data holds {str(value)[:60]} in column {column!r}, not a path to "
                         "an image file: fix the row")


def load_splits(data_args, training_args, cache_dir):
    """{split: ImageSplit} of the phases asked for, each from its folder, data file or the dataset."""
    splits = needed_splits(training_args)
    files = data_files(data_args)
    from_datasets = [split for split in splits if split in files]
    raw = {}
    if from_datasets:
        raw = dataset_loading.load_splits(data_args, {s: files[s] for s in from_datasets}, cache_dir,
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


# ---------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------


def class_order(name):
    """Sort key of class names: integers by value (2 before 10), then the others as strings."""
    return (0, int(name), "") if name.lstrip("-").isdigit() else (1, 0, name)


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


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


class DatasetImages:
    """The images of a `datasets` column as `open_rgb` sources, without decoding them up front:
    `images[i]` is the encoded bytes of row i, or its file's path (a string column of paths is
    read relative to `base`, the data file's folder). `select(rows)` keeps those rows."""

    def __init__(self, dataset, column, base=None):
        import datasets

        feature = dataset.features[column]
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(column, datasets.Image(decode=False))
        elif not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            raise UsageError(f"column {column!r} holds {feature}, neither images nor paths to image files: name the "
                             "image column with --image_column_name")
        self.dataset, self.column, self.base = dataset, column, base

    def __len__(self):
        return len(self.dataset)

    def select(self, rows):
        return DatasetImages(self.dataset.select(rows), self.column, self.base)

    def __getitem__(self, key):
        value = self.dataset[int(key)][self.column]
        if isinstance(value, dict):  # an Image feature: {"bytes", "path"}
            if value.get("bytes") is not None:
                return value["bytes"]
            value = value["path"]
        if value is None:
            raise UsageError(f"row {key} of column {self.column!r} has no image")
        return value if self.base is None or os.path.isabs(value) else os.path.join(self.base, value)

    def name(self, i):
        """How predictions and errors name row i: its file's path where it has one, else its row number."""
        value = self.dataset[int(i)][self.column]
        path = value.get("path") if isinstance(value, dict) else value
        return path or f"row {i}"


def _opened(source):
    """`source` as Image.open takes it: a path, or the bytes of an encoded image."""
    return io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source


def open_rgb(source):
    """The image at `source` (a path or encoded bytes) as an RGB `PIL.Image`, decoded.

    Grey, palette, alpha and CMYK images are converted; alpha is dropped (as `convert("RGB")`
    does, what the classic loaders do), a palette's transparency with it.
    """
    with Image.open(_opened(source)) as image:
        if image.mode == "P" and "transparency" in image.info:
            image = image.convert("RGBA")  # Pillow warns when a palette's transparency goes straight to RGB
        elif image.mode.startswith("I;16") or image.mode in ("I", "F"):
            image = _to_8_bit(np.asarray(image))  # 16-bit / float grey: RGB conversion would clip at 255
        return image.convert("RGB")


def _to_8_bit(values):
    """Grey levels of 16 bits (or 8 held in a wider type), or floats in [0, 1], as 8-bit grey."""
    floats = np.issubdtype(values.dtype, np.floating)
    values = values.astype(np.float64)
    top = 65535.0 if values.max() > 255 else 1.0 if floats and values.max() <= 1 else 255.0
    return Image.fromarray(np.clip(np.round(values * (255.0 / top)), 0, 255).astype(np.uint8), mode="L")


def check_readable(sources, workers=None, names=None):
    """Decode every image once; a UsageError names the first that cannot be read: by its path, or
    (encoded bytes) by `names[i]`. Runs on `workers` threads."""
    def check(i):
        source = sources[i]  # a row without an image fails here, as a UsageError of its own
        try:
            open_rgb(source).load()
            return None
        except Exception as e:  # noqa: BLE001 - any decoder's error (Pillow's DecompressionBombError is no OSError)
            return i, e

    with ThreadPoolExecutor(workers or default_workers()) as pool:
        for failure in pool.map(check, range(len(sources))):
            if failure is not None:
                i, error = failure
                source = sources[i]
                name = source if isinstance(source, str) or names is None else names[i]
                if isinstance(error, Image.DecompressionBombError):
                    raise UsageError(f"image {name} is too large to decode ({error}): shrink it, or remove it")
                raise UsageError(f"image {name} cannot be read ({type(error).__name__}: {error}): replace or "
                                 "remove it")


# ---------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------


def random_crop_box(width, height, rng, min_scale=0.08, ratio=CROP_RATIO):
    """(left, top, right, bottom) of a random crop covering `min_scale` to all of the image's area
    at an aspect ratio in `ratio` (log-uniform); after `CROP_TRIES` crops that do not fit, the
    largest center crop within `ratio`."""
    area = width * height
    log_ratio = np.log(ratio)
    for _ in range(CROP_TRIES):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = np.exp(rng.uniform(*log_ratio))
        w, h = int(round(np.sqrt(target * aspect))), int(round(np.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif aspect > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def resize_shorter_side(width, height, size):
    """(width, height) with the shorter side `size` and the aspect kept (the longer side rounded down)."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


class Normalisation:
    """An image processor's pixel normalisation: `(x * rescale_factor - mean) / std` per channel,
    each step only where the processor does it (`do_rescale`, `do_normalize`)."""

    def __init__(self, processor):
        rescale = getattr(processor, "do_rescale", True)
        normalize = getattr(processor, "do_normalize", True)
        self.scale = np.float32(processor.rescale_factor if rescale else 1.0)
        self.mean = np.asarray(processor.image_mean if normalize else 0.0, np.float32).reshape(-1, 1, 1)
        self.std = np.asarray(processor.image_std if normalize else 1.0, np.float32).reshape(-1, 1, 1)

    def __call__(self, pixels):
        """uint8 [height, width, 3] -> float32 [3, height, width]."""
        channels_first = np.asarray(pixels, np.float32).transpose(2, 0, 1)
        return (channels_first * self.scale - self.mean) / self.std


class Transforms:
    """The train and eval transforms of a run: RGB image -> normalised float32 [3, size, size]."""

    def __init__(self, size, normalisation, min_crop_scale=0.08, flip=True):
        self.size, self.normalisation = size, normalisation
        self.min_crop_scale, self.flip = min_crop_scale, flip

    @staticmethod
    def generator(seed, epoch, index):
        """The random numbers of example `index` in `epoch`: nothing else decides its crop and flip."""
        return np.random.default_rng([seed, epoch, index])

    def train_pixels(self, image, rng):
        """uint8 [size, size, 3]: a random crop, resized, flipped half of the time."""
        box = random_crop_box(image.width, image.height, rng, self.min_crop_scale)
        crop = image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        if self.flip and rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(crop)

    def eval_pixels(self, image):
        """uint8 [size, size, 3]: the shorter side resized to `size`, then the center square."""
        resized = image.resize(resize_shorter_side(image.width, image.height, self.size), Image.Resampling.BILINEAR)
        left, top = (resized.width - self.size) // 2, (resized.height - self.size) // 2
        return np.asarray(resized.crop((left, top, left + self.size, top + self.size)))

    def train(self, source, seed, epoch, index):
        return self.normalisation(self.train_pixels(open_rgb(source), self.generator(seed, epoch, index)))

    def eval(self, source):
        return self.normalisation(self.eval_pixels(open_rgb(source)))


def processor_size(processor):
    """The square side an image processor crops to, or None (what a run trains on when nothing else sets it)."""
    for attribute in ("crop_size", "size"):
        size = getattr(processor, attribute, None) or {}
        side = size.get("height") or size.get("shortest_edge") if isinstance(size, dict) else None
        if side:
            return int(side)
    return None


def eval_processor(size, mean=DEFAULT_MEAN, std=DEFAULT_STD):
    """An image processor (transformers' `BitImageProcessor`) that does exactly what the eval
    transform does (shorter side to `size`, bilinear; center `size` crop; x / 255; `mean`, `std`):
    saved with a model trained from scratch, so `AutoImageProcessor` reproduces its inputs."""
    from transformers import BitImageProcessor
    from transformers.image_utils import PILImageResampling

    return BitImageProcessor(do_resize=True, size={"shortest_edge": size}, resample=PILImageResampling.BILINEAR,
                             do_center_crop=True, crop_size={"height": size, "width": size}, do_rescale=True,
                             rescale_factor=1 / 255, do_normalize=True, image_mean=list(mean), image_std=list(std),
                             do_convert_rgb=True)


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
    size = data_args.image_size or config_size or processor_size(processor) or DEFAULT_IMAGE_SIZE
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


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


class ImageColumn:
    """A column of eval-transformed images: `column[indices]` decodes those images (on a pool of
    `workers` threads) into float32 [len(indices), 3, size, size]. What `utils.batch_order.gather` reads."""

    def __init__(self, sources, transforms, workers=None):
        self.sources, self.transforms = sources, transforms
        self.workers = workers or default_workers()
        self._pool = None

    def __len__(self):
        return len(self.sources)

    @property
    def shape(self):
        return (len(self), 3, self.transforms.size, self.transforms.size)

    def __getitem__(self, indices):
        indices = np.atleast_1d(np.asarray(indices))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="eval-images")
        images = list(self._pool.map(lambda i: self.transforms.eval(self.sources[int(i)]), indices))
        return np.stack(images) if images else np.zeros((0,) + self.shape[1:], np.float32)


class ImageData:
    """The training images of a run, for `utils.training` (the methods of `utils.loop.InMemoryData`).

    Batches follow `utils.batch_order.TrainOrder` (a seeded order per epoch); example i of epoch e is
    transformed with `Transforms.generator(seed, e, i)`. So a batch is a pure function of (seed,
    step) and a checkpoint needs only the step. `workers` threads prepare the batches of the next
    `BATCHES_AHEAD` steps while the current one trains; each process decodes only its own rows.
    """

    def __init__(self, sources, labels, transforms, workers=None):
        self.sources, self.labels, self.transforms = sources, np.asarray(labels, np.int32), transforms
        self.size = len(sources)
        self.workers = workers or default_workers()

    def host_batch(self, indices, seed, epoch):
        """{"pixel_values", "labels"} of the examples `indices` as epoch `epoch` transforms them."""
        pixels = [self.transforms.train(self.sources[int(i)], seed, epoch, int(i)) for i in indices]
        return {"pixel_values": np.stack(pixels), "labels": self.labels[np.asarray(indices, np.int64)]}

    def example_batch(self, global_batch_size, transform=None):
        rows = np.arange(global_batch_size)[devices.process_slice(global_batch_size)]
        batch = self.host_batch(rows % self.size, 0, 0)
        return transform(batch, 0, rows) if transform else batch

    def host_batches(self, global_batch_size, seed, steps_per_epoch, start_step, total_steps, rows=None,
                     transform=None):
        """This process's rows `rows` (None: all) of each step's batch from `start_step` on, prepared
        `BATCHES_AHEAD` steps ahead by the thread pool."""
        order = batch_order.TrainOrder(self.size, global_batch_size, seed, steps_per_epoch)
        row_ids = np.arange(global_batch_size)[rows if rows is not None else slice(None)]

        def prepare(step, indices):
            batch = self.host_batch(indices, seed, step // steps_per_epoch)
            return transform(batch, step, row_ids) if transform else batch

        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="train-images")
        pending = collections.deque()
        try:
            for step in range(start_step, total_steps):
                # The order is read here, in one thread (`TrainOrder` keeps one epoch); the pool
                # only decodes and transforms.
                pending.append(pool.submit(prepare, step, order.batch_indices(step, rows)))
                if len(pending) > max(BATCHES_AHEAD, self.workers):
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def batches(self, global_batch_size, seed, steps_per_epoch, start_step, total_steps, layout, transform=None):
        rows = devices.process_slice(global_batch_size)
        return layout.prefetch(self.host_batches(global_batch_size, seed, steps_per_epoch, start_step, total_steps,
                                                 rows, transform))

    def state_template(self):
        return None  # nothing to save beyond the step

    def state_after(self, step):
        return None


def eval_columns(splits, labels, transforms, workers=None):
    """{split: {"pixel_values": ImageColumn, ["labels"]}} of the splits evaluated or predicted (all but
    "train"): what `utils.loop.eval_batches` reads; "labels" where `labels` has the split's ids."""
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
def uploaded_pixels(transforms, image_bytes):
    """The eval-transformed pixels of an uploaded image (its encoded bytes); `BadInput` when there is
    none, or it is no image that can be read."""
    if not image_bytes:
        raise BadInput("no image: upload a PNG, JPEG, GIF, BMP, WebP or TIFF file")
    try:
        return transforms.eval(bytes(image_bytes))
    except Image.DecompressionBombError as e:
        raise BadInput(f"the image is too large to decode ({e}): upload a smaller one") from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadInput(f"the file is not an image that can be read ({type(e).__name__}): upload a PNG, JPEG, "
                       "GIF, BMP, WebP or TIFF file") from e


class ImageClassifier(Predictor):
    """run_image_classification.py's model on one uploaded image, transformed as the script's
    evaluation and prediction transform it (`tasks.image_classification.Transforms.eval` with the image
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
