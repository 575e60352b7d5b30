"""Image captioning (`run_image_captioning_flax.py`): a vision encoder and a text decoder joined by
cross-attention (`FlaxVisionEncoderDecoderModel`), the images and their captions, the loss over the
caption tokens, generation, ROUGE and BLEU, the generated captions, and the demo predictor.

- model: built from a vision encoder (ViT, BEiT, DINOv2) and a decoder that takes cross-attention
  (GPT-2, BART's decoder, XGLM: `DECODER_TYPES`), each pretrained (any checkpoint
  format, `utils.models.loading.load_composed_model`) or from its config; or a saved captioning model.
- data: rows of an image (a path relative to the data file, or the image itself) and its captions
  (one caption or a list of them). Rows of the same image are one image with several captions (a csv
  with one row per caption). Training takes every (image, caption) pair; evaluation scores the loss
  over every pair and generates one caption per image, scored against all of its captions.
- images: decoded, checked and transformed by `tasks.image_classification` (the eval transform:
  shorter side resized, center crop, the image processor's normalisation), decoded ahead of the step
  by a pool of threads; each is checked before anything is written.
- captions: the caption's tokens, then the end token (the tokenizer's eos, or sep for a BERT-style
  one), padded; the decoder starts from the tokenizer's bos (or cls).
"""

import logging
import os
from typing import NamedTuple

import jax
import numpy as np

from tasks import Task, images
from tasks.demo import Answer, Predictor, show_answer
from tasks.lm import token_sums
from utils.base.errors import UsageError
from utils.data import file_formats, loaders
# The joining of the encoder and the decoder is shared with speech recognition (`utils.models.loading`).
from utils.models.loading import (arguments_of, check_joined_arguments, decoder_input_ids, fit_length, join_configs,
                                  max_positions, pretrained_part, special_tokens)
from utils.run.preflight import column_check, needed_splits, phase_datasets
from utils.run.run_directory import one_line
from utils.run.threaded_feed import ThreadedData
from utils.scoring.metrics import bleu, rouge

PREDICTIONS_FILE = "generated_predictions.txt"
FILE_FORMATS = ("json", "csv")
logger = logging.getLogger(__name__)

# Vision encoders whose output is a sequence of patch states the decoder can attend to.
ENCODER_TYPES = ("vit", "beit", "dinov2")
# Decoders with cross-attention among transformers' Flax causal LMs that its vision encoder-decoder can
# generate with: its `decode` passes the encoder's states as the decoder's fourth positional argument,
# which BERT, RoBERTa, ELECTRA and BigBird take as token types (generation then fails on their shapes).
DECODER_TYPES = ("gpt2", "gpt-sw3", "bart", "xglm")
IMAGE_COLUMNS = ("image_path", "image", "img", "file_name")
CAPTION_COLUMNS = ("captions", "caption", "text", "sentences")
LABEL_COLUMNS = ("labels", "decoder_input_ids", "decoder_attention_mask")


# ----------------------------------------------------------------------------------------------
# Model: which checkpoints, the config of the whole, the tokenizer's special tokens
# ----------------------------------------------------------------------------------------------
def check_model_arguments(model_args, data_args, training_args):
    check_joined_arguments(model_args, "captioning model")


def load_captioning_config(model_args, tokenizer):
    """The `VisionEncoderDecoderConfig`: the saved model's, or one joining the encoder's config and
    the decoder's (made a decoder with cross-attention, fitted to the tokenizer when new), its start,
    end and pad ids the tokenizer's."""
    from transformers import VisionEncoderDecoderConfig

    return join_configs(VisionEncoderDecoderConfig, model_args, tokenizer, ENCODER_TYPES, DECODER_TYPES)


class Lengths(NamedTuple):
    target: int  # caption tokens in training
    eval_target: int  # caption tokens in eval and predict, and the most that generate writes


def fit_lengths(data_args, config):
    """--max_target_length and --val_max_target_length, each at most the decoder's positions."""
    limit = max_positions(config.decoder)
    return Lengths(*(fit_length(getattr(data_args, name), limit, name, logger)
                     for name in ("max_target_length", "val_max_target_length")))


# ----------------------------------------------------------------------------------------------
# Data: the images and their captions
# ----------------------------------------------------------------------------------------------
def _column(names, known, of_two, split, what, flag):
    """The first of the `known` column names among `names`; else, when there are two columns, `of_two`
    (the classic script's order: images, then captions); with more, which one is meant is not clear."""
    found = next((name for name in known if name in names), of_two if len(names) == 2 else None)
    if found is None:
        raise UsageError(f"the {split} data has no {what} column (its columns: {', '.join(names)}): name it with "
                         f"--{flag}")
    return found


def resolve_columns(data_args, columns):
    """(image column, caption column): explicit, a usual name (`IMAGE_COLUMNS`, `CAPTION_COLUMNS`), or
    of two columns the first and the second. `columns` maps each split to its column names; a test
    split may lack captions (captions are then only predicted)."""
    split, names = next(iter(columns.items()))
    image = data_args.image_column or _column(names, IMAGE_COLUMNS, names[0], split, "image", "image_column")
    caption = data_args.caption_column or _column(names, CAPTION_COLUMNS, names[-1], split, "caption",
                                                  "caption_column")
    file_formats.require_columns(columns, [("image_column", image)])
    file_formats.require_columns({s: names for s, names in columns.items() if s != "test"},
                                 [("caption_column", caption)])
    return image, caption


TASK = Task("image-captioning", "image-to-text", outputs=(PREDICTIONS_FILE,), file_formats=FILE_FORMATS,
            check_arguments=check_model_arguments, check_data=column_check(resolve_columns))


class CaptionedImages(NamedTuple):
    """The images of a split, one each (`tasks.image_classification` sources), the captions of each
    (None for test data without captions), and the name each is shown by."""
    sources: object
    captions: list
    shown: list


def captioned_images(dataset, columns, split, file):
    """The `CaptionedImages` of a `datasets` split: rows naming the same image file are one image with
    all their captions, in the order of its first row."""
    import datasets

    image_column, caption_column = columns
    images.check_images_given(dataset, image_column, split)
    base = os.path.dirname(os.path.abspath(file)) if file else None
    sources = images.DatasetImages(dataset, image_column, base)
    # A path names its image; an image stored in the row is its own.
    stored = isinstance(dataset.features[image_column], datasets.Image)
    keys = range(len(dataset)) if stored else list(dataset[image_column])
    texts = loaders.column_values(dataset, caption_column) if caption_column in dataset.column_names else None
    first_rows, captions, image_of = [], [], {}
    for row, key in enumerate(keys):
        if key not in image_of:
            image_of[key] = len(first_rows)
            first_rows.append(row)
            captions.append([])
        if texts is not None:
            captions[image_of[key]].extend(images.captions_of(texts[row], row, caption_column, split))
    kept = sources.select(first_rows) if len(first_rows) < len(sources) else sources
    return CaptionedImages(kept, captions if texts is not None else None, [kept.name(i) for i in range(len(kept))])


def load_splits(data_args, training_args, files, cache_dir, workers):
    """({split: CaptionedImages} of the phases asked for, (image column, caption column)); every image
    is decoded once here (`tasks.images.check_readable`): a missing or broken one stops
    the run, named, before anything is written."""
    splits = needed_splits(training_args)
    hub_options = {"data_dir": data_args.data_dir} if data_args.data_dir and data_args.dataset_name else {}
    raw = loaders.load_splits(data_args, {split: files[split] for split in splits}, cache_dir,
                                      allowed=FILE_FORMATS, **hub_options)
    raw = phase_datasets(raw, {split: split for split in splits}, data_args)
    columns = resolve_columns(data_args, {split: raw[split].column_names for split in splits})
    found = {}
    for split in splits:
        found[split] = captioned_images(raw[split], columns, split, files.get(split))
        images.check_readable(found[split].sources, workers, names=found[split].shown)
        logger.info("%s: %d images, %d captions", split, len(found[split].sources),
                    sum(map(len, found[split].captions or [])))
    return found


# ----------------------------------------------------------------------------------------------
# Captions as tokens
# ----------------------------------------------------------------------------------------------
def encode_captions(tokenizer, texts, length, config):
    """{"labels", "decoder_input_ids", "decoder_attention_mask"} [len(texts), length] of `texts`: each
    caption's tokens (at most length - 1), the end token, padding; the decoder inputs are the labels
    shifted right behind the start token."""
    tokens = special_tokens(tokenizer)
    pieces = tokenizer(list(texts), add_special_tokens=False, truncation=True, max_length=length - 1)["input_ids"]
    labels = np.full((len(pieces), length), tokens.pad, np.int32)
    mask = np.zeros((len(pieces), length), np.int32)
    for row, ids in enumerate(pieces):
        labels[row, :len(ids) + 1] = ids + [tokens.end]
        mask[row, :len(ids) + 1] = 1
    return {"labels": labels, "decoder_input_ids": decoder_input_ids(labels, config).astype(np.int32),
            "decoder_attention_mask": mask}


class Pairs(NamedTuple):
    """Every (image, caption) pair of a split: the image of each, and its caption's token arrays."""
    image_of: np.ndarray
    tokens: dict


def caption_pairs(found, tokenizer, length, config):
    """The `Pairs` of a split's `CaptionedImages`, captions to `length` tokens."""
    image_of = np.array([i for i, texts in enumerate(found.captions) for _ in texts], np.int64)
    texts = [text for captions in found.captions for text in captions]
    return Pairs(image_of, encode_captions(tokenizer, texts, length, config))


class PairImages:
    """The image of each pair, as `tasks.image_classification` sources: `pair_images[i]` is the source of
    pair i's image."""

    def __init__(self, sources, image_of):
        self.sources, self.image_of = sources, image_of

    def __len__(self):
        return len(self.image_of)

    def __getitem__(self, i):
        return self.sources[int(self.image_of[int(i)])]


class CaptionData(ThreadedData):
    """The training pairs of a run (an image and one of its captions), batched by `utils.run.threaded_feed`'s
    threads: each step's images decoded and transformed ahead of the step."""

    def __init__(self, found, pairs, transforms, workers=None):
        super().__init__(len(pairs.image_of), workers)
        self.sources, self.tokens, self.transforms = PairImages(found.sources, pairs.image_of), pairs.tokens, transforms

    def host_batch(self, indices, seed, epoch):
        """{"pixel_values", "labels", "decoder_input_ids", "decoder_attention_mask"} of pairs `indices`."""
        rows = np.asarray(indices, np.int64)
        pixels = [self.transforms.eval(self.sources[int(i)]) for i in rows]
        return {"pixel_values": np.stack(pixels), **{name: values[rows] for name, values in self.tokens.items()}}


def eval_columns(found, pairs, transforms, workers=None):
    """(the columns of every pair, for the loss: "pixel_values" and the caption's tokens; the column of
    every image once, for generation): what `utils.run.loop.eval_batches` reads; no pairs without captions."""
    image_column = {"pixel_values": images.ImageColumn(found.sources, transforms, workers)}
    if pairs is None:
        return None, image_column
    pair_column = images.ImageColumn(PairImages(found.sources, pairs.image_of), transforms, workers)
    return {"pixel_values": pair_column, **pairs.tokens}, image_column


# ----------------------------------------------------------------------------------------------
# Loss, generation, metrics
# ----------------------------------------------------------------------------------------------
def caption_loss(logits, batch, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) over the caption tokens (and its end token); padding counts nothing,
    nor do padded rows (`example_weight` 0)."""
    return token_sums(logits, batch["labels"], batch["decoder_attention_mask"], batch.get("example_weight"),
                      label_smoothing)


def generate_ids(model, params, pixel_values):
    """The generated token ids [rows, max_length] under the model's generation config (traceable);
    passed explicitly, as `tasks.summarization.generate_ids` explains."""
    return model.generate(pixel_values, params=params, generation_config=model.generation_config).sequences


def caption_metrics(tokenizer, predictions, references, pad_token_id):
    """(ROUGE and BLEU of the generated captions against each image's captions (all of them), and
    "gen_len", the mean generated tokens after the start token; the generated texts, one per line of
    `PREDICTIONS_FILE`)."""
    texts = [one_line(text) for text in tokenizer.batch_decode(predictions, skip_special_tokens=True)]
    metrics = {}
    if references is not None:
        metrics = {**rouge(texts, references), "bleu": bleu(texts, references)}
    metrics["gen_len"] = float(np.mean([np.count_nonzero(ids[1:] != pad_token_id) for ids in predictions]))
    return metrics, texts


class SavedWithModel:
    """The tokenizer and the image processor, saved beside the model (`save_pretrained`) as one: what
    the demo and `from_pretrained` read back."""

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor

    def save_pretrained(self, path):
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class Captioner(Predictor):
    """run_image_captioning_flax.py's predict path for one uploaded image: transformed as the script
    transforms it (the image processor saved beside the model), captioned with the generation settings
    it saved (generation_config.json)."""

    auto_class = "FlaxVisionEncoderDecoderModel"

    def __init__(self, output_dir, run_args):
        from transformers import AutoImageProcessor

        super().__init__(output_dir, run_args)
        processor = AutoImageProcessor.from_pretrained(output_dir)
        self.transforms = images.Transforms(self.config.encoder.image_size, images.Normalisation(processor))
        self._generate = jax.jit(lambda params, pixels: generate_ids(self.model, params, pixels))

    def predict(self, image_bytes):
        pixels = images.uploaded_pixels(self.transforms, image_bytes)
        ids = self._generate(self.params, pixels[None])
        return Answer(text=one_line(self.tokenizer.batch_decode(np.asarray(ids), skip_special_tokens=True)[0]))

    def warm_up(self):
        side = self.transforms.size
        jax.block_until_ready(self._generate(self.params, np.zeros((1, 3, side, side), np.float32)))


PREDICTOR = Captioner


def demo_form(st, predictor):
    with st.form("request"):
        upload = st.file_uploader("Image", key="image")
        submitted = st.form_submit_button("Caption")
    if submitted:
        def show():
            answer = predictor(upload.getvalue() if upload is not None else b"")
            st.image(upload.getvalue(), width=224)
            show_answer(st, answer)
        return show
