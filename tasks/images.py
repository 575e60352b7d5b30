"""The image room every image task shares (classification, dual encoders, captioning): finding, checking,
decoding and transforming images, and batching them. Pure NumPy and Pillow (no torch, no torchvision).

- find: `scan_folder` reads the ImageFolder layout (`root/<class>/<image>`, the class folders name the
  labels); `scan_images` takes every image under a folder, classes or not (prediction needs no labels);
  `DatasetImages` are the images of a `datasets` column (paths or the images themselves). Bad layouts (no
  class folders, an empty class folder) are UsageErrors naming the folder.
- check: `check_readable` decodes every image once, before anything is written, so a corrupt file stops
  the run at its start with its name, not at step 5,000.
- decode: `open_rgb` gives RGB whatever the file holds (grey, grey + alpha, palette, RGBA, CMYK).
- transform (`Transforms`): training takes a random-resized crop (the classic Inception-style one: area
  8%-100%, aspect 3/4-4/3) resized to `size` and flips it horizontally half of the time; evaluation
  resizes the shorter side to `size` and takes the center `size` x `size`. Both are bilinear. The random
  numbers of an image come from a generator seeded by (seed, epoch, example index) only: a resumed run
  crops every example exactly as the uninterrupted run did, whichever thread or process decodes it.
  Pixels are then normalised as the image processor does it (`(x * rescale_factor - mean) / std`),
  channels first: what transformers' Flax vision models take. `fit_image_size` chooses `size`, one the
  model can take.
- batch: `ImageData` is a run's training images on `utils.run.threaded_feed`'s threads, each step's batch
  decoded and transformed several steps ahead of the step that needs it; `ImageColumn` is a column of
  transformed images for `utils.run.loop.eval_batches`, each batch decoded by the same kind of pool.
- captions: `captions_of` reads the caption (or list of captions) of an image-text row.
"""

import io
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, UnidentifiedImageError

from tasks.demo import BadInput
from utils.base.errors import UsageError
from utils.data import loaders
from utils.run.preflight import SPLIT_FLAGS
from utils.run.run_directory import one_line
from utils.run.threaded_feed import ThreadedData, default_workers


SPLIT_DIRS = {"train": "train_dir", "validation": "validation_dir", "test": "test_dir"}  # split -> its folder flag
# Normalisation of a model trained from scratch: transformers' IMAGENET_STANDARD_MEAN / _STD (ViT's).
DEFAULT_MEAN, DEFAULT_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
DEFAULT_IMAGE_SIZE = 224
# Families whose position embeddings are interpolated to any input size (the others need their config's).
RESIZABLE_POSITIONS = ("dinov2",)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".jfif")
CROP_RATIO = (3 / 4, 4 / 3)  # aspect ratios of the random crop, as the classic (torchvision's defaults)
CROP_TRIES = 10


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


def data_files(data_args):
    """{split: data file or None} of the splits that come from no folder (a file or a dataset)."""
    return {split: getattr(data_args, flag[2:]) for split, (_, flag) in SPLIT_FLAGS.items()
            if not getattr(data_args, SPLIT_DIRS[split])}


def check_images_given(dataset, column, split):
    """Every row of `column` gives an image, a path or the image itself: a UsageError names the first
    row without one, or holding something else (a number among paths, which `datasets` keeps as a
    `Json` column); read from the Arrow table, nothing decoded unless the column is such a mix."""
    import pyarrow.compute as pc

    missing = pc.index(pc.is_null(dataset.with_format("arrow")[column]), True).as_py()
    if missing >= 0:
        raise UsageError(f"row {missing} of the {split} data has no image in column {column!r}: give it one (a path "
                         "or the image), or drop the row")
    if loaders.holds_mixed_values(dataset.features[column]):
        row, value = next((row, value) for row, value in enumerate(dataset[column]) if not isinstance(value, str))
        raise UsageError(f"row {row} of the {split} data holds {str(value)[:60]} in column {column!r}, not a path to "
                         "an image file: fix the row")


def class_order(name):
    """Sort key of class names: integers by value (2 before 10), then the others as strings."""
    return (0, int(name), "") if name.lstrip("-").isdigit() else (1, 0, name)


def captions_of(value, row, column, split):
    """The captions of a row's `column` value: one caption or a list of them, each text; blank ones
    are dropped, and a row left with none, or holding anything but text, is a UsageError."""
    captions = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(captions, list) or not all(isinstance(c, str) for c in captions):
        raise UsageError(f"row {row} of the {split} data holds {one_line(repr(value))[:60]} in column {column!r}, not "
                         "a caption or a list of captions: fix the row")
    captions = [c.strip() for c in captions if c.strip()]
    if not captions:
        raise UsageError(f"row {row} of the {split} data has no caption in column {column!r}: give it one, or drop "
                         "the row")
    return captions


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


class ImageColumn:
    """A column of eval-transformed images: `column[indices]` decodes those images (on a pool of
    `workers` threads) into float32 [len(indices), 3, size, size]. What `utils.data.batch_order.gather` reads."""

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


class ImageData(ThreadedData):
    """The training images of a run, for `utils.run.spine`, batched by `utils.run.threaded_feed`'s threads:
    example i of epoch e is transformed with `Transforms.generator(seed, e, i)`."""

    def __init__(self, sources, labels, transforms, workers=None):
        super().__init__(len(sources), workers)
        self.sources, self.labels, self.transforms = sources, np.asarray(labels, np.int32), transforms

    def host_batch(self, indices, seed, epoch):
        """{"pixel_values", "labels"} of the examples `indices` as epoch `epoch` transforms them."""
        pixels = [self.transforms.train(self.sources[int(i)], seed, epoch, int(i)) for i in indices]
        return {"pixel_values": np.stack(pixels), "labels": self.labels[np.asarray(indices, np.int64)]}


# ----------------------------------------------------------------------------------------------
# An uploaded image, as the demo pages take it
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
