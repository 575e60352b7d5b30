"""Images for classification: find them, check them, decode them, transform them, batch them.

Pure NumPy and Pillow (no torch, no torchvision). What a run does with an image:

- find: `scan_folder` reads the ImageFolder layout (`root/<class>/<image>`, class folders sorted by
  name give the label ids); `scan_images` takes every image under a folder, classes or not
  (prediction needs no labels). Bad layouts (no class folders, an empty class folder) are
  UsageErrors naming the folder.
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
- batch: `ImageData` is the training data (the methods of `utils.loop.InMemoryData`): each step's
  batch is decoded and transformed by a pool of threads several steps ahead of the step that needs
  it (Pillow and NumPy release the GIL while they work); `ImageColumn` is a column of transformed
  images for `utils.loop.eval_batches`, each batch decoded by the same kind of pool.
"""

import collections
import io
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image, UnidentifiedImageError

from tasks import Task
from tasks.demo import Answer, BadInput, Predictor, escape_markdown, show_answer
from utils import batch_order, devices
from utils.errors import UsageError

TASK = Task("image-classification", "image-classification", outputs=("predict_results.txt",))

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
    values = values.astype(np.float64)
    top = 65535.0 if values.max() > 255 else 255.0
    return Image.fromarray(np.clip(np.round(values * (255.0 / top)), 0, 255).astype(np.uint8), mode="L")


def check_readable(sources, workers=None, names=None):
    """Decode every image once; a UsageError names the first that cannot be read: by its path, or
    (encoded bytes) by `names[i]`. Runs on `workers` threads."""
    def check(i):
        try:
            open_rgb(sources[i]).load()
            return None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            return i, e

    with ThreadPoolExecutor(workers or default_workers()) as pool:
        for failure in pool.map(check, range(len(sources))):
            if failure is not None:
                i, error = failure
                source = sources[i]
                name = source if isinstance(source, str) or names is None else names[i]
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


def eval_processor(size, mean, std):
    """An image processor (transformers' `BitImageProcessor`) that does exactly what the eval
    transform does (shorter side to `size`, bilinear; center `size` crop; x / 255; `mean`, `std`):
    saved with a model trained from scratch, so `AutoImageProcessor` reproduces its inputs."""
    from transformers import BitImageProcessor
    from transformers.image_utils import PILImageResampling

    return BitImageProcessor(do_resize=True, size={"shortest_edge": size}, resample=PILImageResampling.BILINEAR,
                             do_center_crop=True, crop_size={"height": size, "width": size}, do_rescale=True,
                             rescale_factor=1 / 255, do_normalize=True, image_mean=list(mean), image_std=list(std),
                             do_convert_rgb=True)


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


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
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
        # The size the run trained at, found as run_image_classification.py finds it.
        size = run_args.get("image_size") or getattr(self.config, "image_size", None) or processor_size(
            processor)
        self.transforms = Transforms(size, Normalisation(processor))
        top = min(self.TOP_LABELS, self.config.num_labels)
        self._top = jax.jit(lambda params, pixels: jax.lax.top_k(jax.nn.softmax(
            self.model(pixels, params=params, train=False)[0].astype(jnp.float32), axis=-1), top))

    def load_tokenizer(self):
        return None  # images need none: the transform is read from the saved image processor

    def predict(self, image_bytes):
        if not image_bytes:
            raise BadInput("no image: upload a PNG, JPEG, GIF, BMP, WebP or TIFF file")
        try:
            pixels = self.transforms.eval(bytes(image_bytes))
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise BadInput(f"the file is not an image that can be read ({type(e).__name__}): upload a PNG, JPEG, "
                           "GIF, BMP, WebP or TIFF file") from e
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
