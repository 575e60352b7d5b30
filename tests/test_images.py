"""tasks/images.py and tasks/image_classification.py on their own: folders, splits and subsets, labels, decoding,
transforms, normalisation, batches, the step's sums.

References are independent: Pillow's own conversions, transformers' image processors, plain NumPy.
"""

import os

import numpy as np
import pytest
from PIL import Image

from tasks import image_classification, images
from utils.base.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(ROOT, "data", "images")


def rgb_image(width, height, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def save(image, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    image.save(path)
    return path


def plain_transforms(size, **kwargs):
    return images.Transforms(size, images.Normalisation(images.eval_processor(size, (0.5,) * 3, (0.5,) * 3)), **kwargs)


# ---------------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------------


def test_scan_folder_labels_by_class_folder(tmp_path):
    for cls, names in {"dog": ["b.png", "a.jpg"], "cat": ["x.png", "sub/y.png"]}.items():
        for name in names:
            save(rgb_image(4, 4), str(tmp_path / cls / name))
    (tmp_path / "cat" / "notes.txt").write_text("not an image")
    (tmp_path / "cat" / ".hidden.png").write_bytes(b"")
    paths, names, classes = images.scan_folder(str(tmp_path), "train_dir")
    assert classes == ["cat", "dog"]
    assert [os.path.relpath(p, tmp_path) for p in paths] == ["cat/x.png", "cat/sub/y.png", "dog/a.jpg", "dog/b.png"]
    assert names == ["cat", "cat", "dog", "dog"]


@pytest.mark.parametrize("layout, message", [
    ("loose", "holds 2 images but no class folders"),
    ("empty class", "class folder .*cat holds no images"),
    ("missing", "not found"),
])
def test_scan_folder_bad_layouts(tmp_path, layout, message):
    if layout == "loose":
        save(rgb_image(4, 4), str(tmp_path / "a.png"))
        save(rgb_image(4, 4), str(tmp_path / "b.png"))
    elif layout == "empty class":
        save(rgb_image(4, 4), str(tmp_path / "dog" / "a.png"))
        (tmp_path / "cat").mkdir()
    root = str(tmp_path / "nothing") if layout == "missing" else str(tmp_path)
    with pytest.raises(UsageError, match=message):
        images.scan_folder(root, "train_dir")


def test_digits_data_is_the_sklearn_set():
    """data/make_image_data.py wrote the bundled digits: 1,437 + 360 images, 10 classes, pixels exact."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    train, train_names, classes = images.scan_folder(os.path.join(DIGITS, "train"), "train_dir")
    validation, validation_names, _ = images.scan_folder(os.path.join(DIGITS, "validation"), "validation_dir")
    assert (len(train), len(validation), classes) == (1437, 360, [str(d) for d in range(10)])
    for path, name in list(zip(validation, validation_names))[::37]:
        n = int(os.path.basename(path)[:-4])
        assert int(name) == digits.target[n]
        pixels = np.asarray(Image.open(path))
        np.testing.assert_array_equal(pixels, np.round(digits.images[n] * 255 / 16).astype(np.uint8))


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def test_open_rgb_converts_every_mode(tmp_path):
    rgb = np.asarray(rgb_image(5, 3))
    grey = rgb[..., 0]
    cases = {
        "grey.png": (Image.fromarray(grey), np.repeat(grey[..., None], 3, axis=2)),
        "grey_alpha.png": (Image.fromarray(np.stack([grey, grey], -1), mode="LA"), np.repeat(grey[..., None], 3, 2)),
        "rgba.png": (Image.fromarray(np.dstack([rgb, np.full(grey.shape, 7, np.uint8)])), rgb),
        "grey16.png": (Image.fromarray(grey.astype(np.uint16) * 257), np.repeat(grey[..., None], 3, axis=2)),
    }
    bits = grey > 127
    cases["one_bit.png"] = (Image.fromarray(bits), np.repeat(bits[..., None] * np.uint8(255), 3, axis=2))
    # Lossless CMYK (TIFF) of the colours' complements, no black: RGB = 255 - CMY
    cases["cmyk.tif"] = (Image.fromarray(np.dstack([255 - rgb, np.zeros(grey.shape, np.uint8)]), mode="CMYK"), rgb)
    # Float grey in [0, 1] (scientific TIFFs): scaled to 0..255, not rounded to black
    cases["float.tif"] = (Image.fromarray(grey.astype(np.float32) / 255), np.repeat(grey[..., None], 3, axis=2))
    palette = Image.fromarray(rgb).quantize(8)
    cases["palette.png"] = (palette, np.asarray(palette.convert("RGB")))
    transparent = palette.copy()
    transparent.info["transparency"] = 0
    cases["palette_transparent.png"] = (transparent, np.asarray(palette.convert("RGB")))
    for name, (image, expected) in cases.items():
        path = save(image, str(tmp_path / name))
        decoded = images.open_rgb(path)
        assert decoded.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(decoded), expected, err_msg=name)
    with open(tmp_path / "rgba.png", "rb") as f:  # encoded bytes, as a dataset's Image column holds them
        np.testing.assert_array_equal(np.asarray(images.open_rgb(f.read())), rgb)


def test_unreadable_image_is_named(tmp_path):
    good = save(rgb_image(8, 8), str(tmp_path / "good.png"))
    truncated = str(tmp_path / "truncated.png")
    with open(good, "rb") as f:
        content = f.read()
    with open(truncated, "wb") as f:
        f.write(content[: len(content) // 2])
    garbage = str(tmp_path / "garbage.jpg")
    with open(garbage, "wb") as f:
        f.write(b"this is no image")
    images.check_readable([good])
    for bad in (truncated, garbage):
        with pytest.raises(UsageError, match=f"image {bad} cannot be read"):
            images.check_readable([good, bad, good], workers=2)


# ---------------------------------------------------------------------------------------------
# Transforms
# ---------------------------------------------------------------------------------------------


def test_random_crop_statistics():
    """Areas within [min_scale, 1] of the image, aspects within 3/4..4/3 (up to rounding), crops
    spread around the center, flips half of the time."""
    width, height, min_scale = 60, 40, 0.08
    rng = np.random.default_rng(0)
    boxes = np.array([images.random_crop_box(width, height, rng, min_scale) for _ in range(3000)])
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2] <= width).all() and (boxes[:, 3] <= height).all()
    area = w * h / (width * height)
    # Rounding a side to whole pixels moves the area by up to about one pixel row or column.
    assert area.min() >= min_scale - 0.03 and area.max() <= 1
    assert (w / h >= 3 / 4 - 0.1).all() and (w / h <= 4 / 3 + 0.1).all()
    # Uniform areas that fit: the mean lies well inside (0.08, 1); a crop always at full size would fail.
    assert 0.35 < area.mean() < 0.6
    centers = (boxes[:, 0] + boxes[:, 2]) / 2 / width
    assert abs(centers.mean() - 0.5) < 0.02  # 3000 draws: the standard error is ~0.003
    assert centers.std() > 0.1

    transforms, no_flip = plain_transforms(8), plain_transforms(8, flip=False)
    ramp = Image.fromarray(np.tile((np.arange(64, dtype=np.uint8) * 4)[None, :, None], (64, 1, 3)))  # rises to the right

    def flipped(transforms, i):
        row = transforms.train_pixels(ramp, np.random.default_rng([0, 0, i]))[0, :, 0].astype(int)
        assert row[0] != row[-1]
        return row[0] > row[-1]

    # 2000 draws: the share's standard deviation is ~0.011.
    assert 0.45 < np.mean([flipped(transforms, i) for i in range(2000)]) < 0.55
    assert not any(flipped(no_flip, i) for i in range(200))


def test_fallback_crop_for_extreme_aspect():
    """An image too wide for any crop of ratio 3/4..4/3 and enough area: the largest center crop of ratio 4/3."""
    rng = np.random.default_rng(0)
    assert images.random_crop_box(100, 3, rng, min_scale=0.9) == (48, 0, 52, 3)


def test_train_transform_is_a_function_of_seed_epoch_and_example(tmp_path):
    path = save(rgb_image(20, 14), str(tmp_path / "a.png"))
    transforms = plain_transforms(8)
    first = transforms.train(path, 42, 3, 17)
    np.testing.assert_array_equal(first, transforms.train(path, 42, 3, 17))
    for other in [(43, 3, 17), (42, 4, 17), (42, 3, 18)]:
        assert not np.array_equal(first, transforms.train(path, *other)), other


def test_eval_transform_equals_the_saved_image_processor(tmp_path):
    """The eval transform is what the saved processor computes, after a save and a reload with
    AutoImageProcessor (non-square images, both orientations); deterministic, and never flipped."""
    from transformers import AutoImageProcessor

    size, mean, std = 12, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    processor = images.eval_processor(size, mean, std)
    processor.save_pretrained(str(tmp_path / "saved"))
    reloaded = AutoImageProcessor.from_pretrained(str(tmp_path / "saved"))
    transforms = images.Transforms(size, images.Normalisation(reloaded))
    for i, (width, height) in enumerate([(31, 17), (17, 31), (12, 12), (9, 5)]):
        path = save(rgb_image(width, height, seed=i), str(tmp_path / f"{i}.png"))
        ours = transforms.eval(path)
        reference = reloaded(Image.open(path), return_tensors="np")["pixel_values"][0]
        assert ours.shape == reference.shape == (3, size, size)
        # float32 rounding of (x / 255 - mean) / std, computed in another order by transformers.
        np.testing.assert_allclose(ours, reference, atol=1e-5)
        np.testing.assert_array_equal(ours, transforms.eval(path))
        # The negative control: an eval flip would be caught by the comparison above.
        assert np.abs(ours[..., ::-1] - reference).max() > 0.1


def test_normalisation_equals_a_pretrained_processor_class():
    """Normalisation as ViTImageProcessor (another class, other settings) normalises the same pixels."""
    from transformers import ViTImageProcessor

    processor = ViTImageProcessor(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], do_resize=False)
    pixels = np.asarray(rgb_image(7, 5))
    reference = processor(Image.fromarray(pixels), return_tensors="np")["pixel_values"][0]
    # float32 rounding; values reach about 2.6 in magnitude.
    np.testing.assert_allclose(images.Normalisation(processor)(pixels), reference, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


class HostLayout:
    """`prefetch` only: the batches stay on the host."""

    @staticmethod
    def prefetch(batches):
        return batches


def small_set(tmp_path, count=10):
    paths = [save(rgb_image(10 + i, 9, seed=i), str(tmp_path / f"{i}.png")) for i in range(count)]
    return paths, np.arange(count) % 3


def test_resumed_batches_are_the_uninterrupted_ones(tmp_path):
    """Batches from step 5 on (a resume) equal those of a run from step 0, whatever the number of
    threads; across epochs (steps per epoch 3) every example is recropped."""
    paths, labels = small_set(tmp_path)
    transforms = plain_transforms(6)
    run = list(images.ImageData(paths, labels, transforms, workers=1).host_batches(3, 7, 3, 0, 9))
    resumed = list(images.ImageData(paths, labels, transforms, workers=4).host_batches(3, 7, 3, 5, 9))
    assert len(run) == 9 and len(resumed) == 4
    for a, b in zip(run[5:], resumed):
        np.testing.assert_array_equal(a["pixel_values"], b["pixel_values"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    # Each row is its example's own transform: the example found by its label and epoch-3 crop.
    from utils.data.batch_order import TrainOrder

    order = TrainOrder(10, 3, 7, 3)
    for step in (0, 4, 8):
        for row, index in enumerate(order.batch_indices(step)):
            expected = transforms.train(paths[index], 7, step // 3, index)
            np.testing.assert_array_equal(run[step]["pixel_values"][row], expected)
            assert run[step]["labels"][row] == labels[index]


def test_eval_column_gathers_in_order(tmp_path):
    paths, _ = small_set(tmp_path, 5)
    transforms = plain_transforms(6)
    column = images.ImageColumn(paths, transforms, workers=3)
    assert column.shape == (5, 3, 6, 6)
    np.testing.assert_array_equal(column[np.array([3, 1])], np.stack([transforms.eval(paths[3]), transforms.eval(paths[1])]))


def test_labels_stay_with_their_images():
    """A nearest-centroid classifier on the eval pixels of the digits (a plain NumPy reference): far
    above chance with the folder labels; at chance once the labels are shuffled against the images
    (the negative control: a pairing bug would look like the latter)."""
    def pixels_and_labels(split):
        paths, names, _ = images.scan_folder(os.path.join(DIGITS, split), "train_dir")
        column = images.ImageColumn(paths, plain_transforms(8))
        return column[np.arange(len(paths))].reshape(len(paths), -1), np.array(names, int)

    train_x, train_y = pixels_and_labels("train")
    valid_x, valid_y = pixels_and_labels("validation")

    def accuracy(labels):
        centroids = np.stack([train_x[labels == c].mean(0) for c in range(10)])
        distances = ((valid_x[:, None, :] - centroids[None]) ** 2).sum(-1)
        return np.mean(distances.argmin(1) == valid_y)

    assert accuracy(train_y) > 0.85
    assert accuracy(np.random.default_rng(0).permutation(train_y)) < 0.3


def test_dataset_images_give_bytes_or_paths(tmp_path):
    """A `datasets` Image column (encoded bytes, or files) and a column of paths relative to the data file."""
    import datasets

    paths, _ = small_set(tmp_path, 3)
    with open(paths[1], "rb") as f:
        encoded = f.read()
    features = datasets.Features({"image": datasets.Image()})
    stored = datasets.Dataset.from_dict({"image": [{"bytes": encoded, "path": None}, paths[2]]}, features=features)
    column = images.DatasetImages(stored, "image")
    assert column[0] == encoded and column[1] == paths[2]
    assert column.name(0) == "row 0" and column.name(1) == paths[2]
    expected = np.asarray(Image.open(paths[1]).convert("RGB"))
    np.testing.assert_array_equal(np.asarray(images.open_rgb(column[0])), expected)
    relative = datasets.Dataset.from_dict({"file": [os.path.basename(p) for p in paths]})
    column = images.DatasetImages(relative, "file", base=str(tmp_path))
    assert [column[i] for i in range(3)] == paths and column.select([2, 0])[0] == paths[2]
    with pytest.raises(UsageError, match="neither images nor paths"):
        images.DatasetImages(datasets.Dataset.from_dict({"file": [1, 2]}), "file")


# ---------------------------------------------------------------------------------------------
# Splits, subsets, labels
# ---------------------------------------------------------------------------------------------


def test_subset_is_a_seeded_draw_in_order_with_each_image_its_label():
    """--max_*_samples images drawn at random by the seed (not a folder's first class), kept in
    their order, each still with its own class and name; all of them when the limit is not below."""
    paths = [f"{cls}/{i}.png" for cls in ("a", "b", "c") for i in range(10)]
    split = image_classification.ImageSplit(paths, [path.split("/")[0] for path in paths], [f"shown {path}" for path in paths])
    subset = image_classification.take_subset(split, 8, seed=3)
    assert len(subset.sources) == 8 and subset.sources == sorted(subset.sources, key=paths.index)
    assert len({path.split("/")[0] for path in subset.sources}) > 1
    assert subset.label_names == [path.split("/")[0] for path in subset.sources]
    assert subset.shown == [f"shown {path}" for path in subset.sources]
    assert image_classification.take_subset(split, 8, seed=3) == subset and image_classification.take_subset(split, 8, seed=4) != subset
    assert image_classification.take_subset(split, 30, seed=3) is split and image_classification.take_subset(split, None, seed=3) is split
    assert image_classification.take_subset(image_classification.ImageSplit(paths, None, paths), 8, 3).label_names is None


def test_labels_in_class_order_or_the_checkpoints():
    """Training names its classes in class order (integers by value), or in the checkpoint's order
    when it names exactly those; without training the checkpoint must name them."""
    from types import SimpleNamespace

    train = {"train": image_classification.ImageSplit(None, ["10", "2", "b", "a", "2"], None)}
    placeholder = SimpleNamespace(id2label={0: "LABEL_0", 1: "LABEL_1"}, num_labels=2)
    assert image_classification.choose_labels(train, placeholder, True, True) == ["2", "10", "a", "b"]
    named = SimpleNamespace(id2label={0: "b", 1: "10", 2: "a", 3: "2"}, num_labels=4)
    assert image_classification.choose_labels(train, named, True, True) == ["b", "10", "a", "2"]
    assert image_classification.choose_labels(train, named, False, True) == ["2", "10", "a", "b"]  # from scratch: no checkpoint
    assert image_classification.choose_labels({}, named, True, False) == ["b", "10", "a", "2"]
    with pytest.raises(UsageError, match="evaluation or prediction alone needs the label names"):
        image_classification.choose_labels({}, placeholder, True, False)
    assert image_classification.label_ids("validation", ["a", "2"], ["2", "10", "a", "b"]).tolist() == [2, 0]
    with pytest.raises(UsageError, match=r"the validation images have classes the model does not know: 'z'"):
        image_classification.label_ids("validation", ["a", "z"], ["2", "10", "a", "b"])


def test_a_dataset_without_the_phase_split_names_the_folder_flag(tmp_path):
    """A dataset (here a local dataset folder) lacking a phase's split: drop the phase or give its folder."""
    from types import SimpleNamespace

    from run_image_classification import ImageDataArguments

    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "train.jsonl").write_text('{"image": "0.png", "label": "a"}\n')
    data_args = ImageDataArguments(dataset_name=str(tmp_path / "set"))
    phases = SimpleNamespace(do_train=True, do_eval=True, do_predict=False)
    with pytest.raises(UsageError, match=r"--do_eval needs a 'validation' split, but dataset .*set' has only train: "
                                         r"pass --validation_dir$"):
        image_classification.load_splits(data_args, phases, str(tmp_path / "cache"))
    loaded = image_classification.load_splits(data_args, SimpleNamespace(do_train=True, do_eval=False, do_predict=False),
                                str(tmp_path / "cache"))
    assert list(loaded) == ["train"] and loaded["train"].label_names == ["a"] and loaded["train"].shown == ["0.png"]


# ---------------------------------------------------------------------------------------------
# The step's sums and the prediction file
# ---------------------------------------------------------------------------------------------


def test_step_sums_weigh_out_padded_rows():
    """The step's sums against plain NumPy: padded rows (weight 0) add nothing to the loss, the
    correct counts or the image count; top-5 counts a label scored among the five highest."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(12, 10)).astype(np.float32)
    labels = rng.integers(0, 10, 12).astype(np.int32)
    weights = np.array([1.0] * 9 + [0.0] * 3, np.float32)
    _, sums = image_classification.classification_sums(logits, labels, weights, top_k=5)
    real = slice(0, 9)
    log_probs = logits[real] - np.log(np.exp(logits[real]).sum(-1, keepdims=True))
    expected_loss = -log_probs[np.arange(9), labels[real]].sum()
    top5 = np.argsort(-logits[real], axis=-1)[:, :5]
    # float32 log-softmax of 9 rows, summed: a few ulps of ~20.
    assert float(sums["loss"]) == pytest.approx(expected_loss, rel=1e-5)
    assert float(sums["accuracy"]) == np.sum(logits[real].argmax(-1) == labels[real])
    assert float(sums["top5_accuracy"]) == np.sum([label in row for label, row in zip(labels[real], top5)])
    assert float(sums["tokens"]) == 9


def test_prediction_lines_name_each_image_and_its_class():
    assert image_classification.prediction_lines(["a/0.png", "b/1.png"], [1, 0], ["cat", "dog"]) == [
        "image\tprediction", "a/0.png\tdog", "b/1.png\tcat"]
