#!/usr/bin/env python
"""Train an image-text dual encoder (CLIP-style) contrastively on image-caption pairs, without torch.

    python run_hybrid_clip.py configs/hybrid_clip_tiny.json
    python run_hybrid_clip.py --text_model_name_or_path roberta-base \\
        --vision_model_name_or_path google/vit-base-patch16-224 --train_file coco/train_dataset.json \\
        --validation_file coco/valid_dataset.json --do_train --do_eval --output_dir runs/coco-clip

The model is transformers' own `FlaxVisionTextDualEncoderModel`, composed here from any text encoder
and any vision encoder (pretrained checkpoints in any format, or new ones from a model type), or a
saved dual encoder or CLIP model fine-tuned as it is (--model_name_or_path); the export loads in
`FlaxVisionTextDualEncoderModel` / `FlaxCLIPModel` and their PyTorch twins. Data: json lines
`{"image_path": ..., "captions": [...]}` as the classic script reads them, any json / jsonl / csv
with an image and a caption column (compressed too), an ImageFolder with captions, or a hub
dataset. The loss is the symmetric InfoNCE over the whole global batch (every device's pairs), with
the learnt temperature. Evaluation reports the loss, image->text and text->image recall@1/5/10 over
the whole validation set and, given class labels, zero-shot accuracy; prediction writes each test
image's best captions and each caption's best images. The task's knowledge lives in
`tasks/image_text.py` (images through `tasks/image_classification.py`'s transforms). One train /
eval loop, each step defined once for both layouts (`--sharding dp`, jax.pmap over the local
devices, the default; `--sharding fsdp`, the model split over all devices); everything mechanical
(layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from tasks import images
from tasks import image_text
from tasks.image_text import TASK
from utils.base.arguments import BaseDataArguments, ModelArguments, READS, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import fit_config_to_tokenizer, fit_length, load_config, load_tokenizer, max_positions
from utils.run.preflight import check_before_work
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class DualEncoderModelArguments(ModelArguments):
    text_model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "The pretrained text encoder (BERT, RoBERTa, ... or a CLIP model's text "
                                        "tower), any checkpoint format; its tokenizer is the run's.",
                                READS: "its text encoder"})
    vision_model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "The pretrained vision encoder (ViT, BEiT, ... or a CLIP model's vision "
                                        "tower), any checkpoint format; its image processor is the run's.",
                                READS: "its vision encoder"})
    text_model_type: Optional[str] = field(
        default=None, metadata={"help": "A new text encoder of this type (e.g. bert) instead of a pretrained one."})
    vision_model_type: Optional[str] = field(
        default=None, metadata={"help": "A new vision encoder of this type (e.g. vit) instead of a pretrained one."})
    text_config_overrides: Optional[str] = field(
        default=None, metadata={"help": "Overrides of a new text encoder's config, e.g. 'hidden_size=64'."})
    vision_config_overrides: Optional[str] = field(
        default=None, metadata={"help": "Overrides of a new vision encoder's config, e.g. 'image_size=32'."})
    projection_dim: int = field(
        default=512, metadata={"help": "Width of the shared embedding space both encoders project into."})
    logit_scale_init_value: float = field(
        default=2.6592, metadata={"help": "Initial log of the similarity scale (CLIP's: log(1 / 0.07))."})
    image_processor_name: Optional[str] = field(
        default=None, metadata={"help": "Image processor (name or path) whose normalisation the images get "
                                        "(default: the vision model's; a new one: mean 0.5, std 0.5).",
                                READS: "its image processor"})

    def __post_init__(self):
        super().__post_init__()
        if self.projection_dim <= 0:
            raise UsageError(f"--projection_dim must be positive, got {self.projection_dim}")


@dataclass
class ImageTextDataArguments(BaseDataArguments):
    data_dir: Optional[str] = field(
        default=None, metadata={"help": "Folder relative image paths are read from (default: the data file's)."})
    train_dir: Optional[str] = field(
        default=None, metadata={"help": "Training images as an ImageFolder with captions: the images and a "
                                        "metadata.jsonl (or .csv) naming each file_name with its captions."})
    validation_dir: Optional[str] = field(default=None, metadata={"help": "Validation images, same layout."})
    test_dir: Optional[str] = field(default=None, metadata={"help": "Test images, same layout."})
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file, as --train_file (images and captions to predict)."})
    image_column: Optional[str] = field(
        default=None, metadata={"help": "Column of the images, or of their paths (default: 'image_path', "
                                        "'image' or 'img', the first present)."})
    caption_column: Optional[str] = field(
        default=None, metadata={"help": "Column of the captions: one or a list per row; rows naming the same image "
                                        "add up (default: 'captions', 'caption' or 'text')."})
    label_column: Optional[str] = field(
        default=None, metadata={"help": "Column of class labels for zero-shot accuracy (default: 'label' or "
                                        "'labels' if present; none: no zero-shot metric)."})
    zero_shot_templates: List[str] = field(
        default_factory=lambda: ["a photo of a {}."],
        metadata={"help": "Prompts a class name is put into at '{}' for zero-shot classification; a class is "
                          "the mean of its prompts' embeddings."})
    max_seq_length: int = field(
        default=72, metadata={"help": "Caption tokens (padded and truncated to this)."})
    image_size: Optional[int] = field(
        default=None, metadata={"help": "Side of the square images the model sees (default: the vision "
                                        "config's image_size)."})
    min_crop_scale: float = field(
        default=1.0, metadata={"help": "Smallest share of an image's area the random training crop covers (1: "
                                       "the whole image, as the classic script)."})
    random_flip: bool = field(
        default=False, metadata={"help": "Flip training images horizontally half of the time (off: captions may "
                                         "say what is on the left)."})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Predict the first N test images."})
    predict_top_k: int = field(
        default=5, metadata={"help": "Captions listed per test image, and images per caption, in the prediction "
                                     "files."})

    def __post_init__(self):
        super().__post_init__()
        if self.max_seq_length <= 0:
            raise UsageError(f"--max_seq_length must be positive, got {self.max_seq_length}")
        if self.image_size is not None and self.image_size <= 0:
            raise UsageError(f"--image_size must be positive, got {self.image_size}")
        if not 0 < self.min_crop_scale <= 1:
            raise UsageError(f"--min_crop_scale must be in (0, 1], got {self.min_crop_scale}")
        if self.predict_top_k <= 0:
            raise UsageError(f"--predict_top_k must be positive, got {self.predict_top_k}")
        for template in self.zero_shot_templates:
            if template.count("{}") != 1:
                raise UsageError(f"--zero_shot_templates {template!r} must hold '{{}}' once, where the class name goes")

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (DualEncoderModelArguments, ImageTextDataArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    logger, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Configs, tokenizer, image processor
    # ------------------------------------------------------------------------------------------
    whole = bool(model_args.model_name_or_path)  # a saved dual encoder or CLIP model, else two encoders
    text_args = model_args if whole else image_text.tower_args(model_args, "text")
    vision_args = model_args if whole else image_text.tower_args(model_args, "vision")
    tokenizer = load_tokenizer(dataclasses.replace(text_args, tokenizer_name=model_args.tokenizer_name))
    if whole:
        config = load_config(model_args, task="image-text", model_types=image_text.MODEL_TYPES)
        text_config, vision_config = config.text_config, config.vision_config
    else:
        text_config, vision_config = (image_text.tower_config(model_args, side) for side in ("text", "vision"))
    fit_config_to_tokenizer(text_config, tokenizer, text_args)
    processor = images.load_image_processor(dataclasses.replace(vision_args,
                                                                image_processor_name=model_args.image_processor_name))
    image_size = images.fit_image_size(data_args, vision_config, processor, bool(vision_args.model_name_or_path))
    if processor is None:  # a new vision encoder: one that does what the eval transform does, saved with the model
        processor = images.eval_processor(image_size)
    if not whole:
        config = image_text.dual_encoder_config(model_args, text_config, vision_config)
    max_seq_length = fit_length(data_args.max_seq_length, max_positions(text_config), "max_seq_length", logger)

    # ------------------------------------------------------------------------------------------
    # Images and captions
    # ------------------------------------------------------------------------------------------
    splits = image_text.load_splits(data_args, training_args, model_args.cache_dir)
    workers = data_args.preprocessing_num_workers or images.default_workers()
    for split, found in splits.items():
        images.check_readable(found.sources, workers, names=found.shown)  # a corrupt image stops the run here, named
        logger.info("%s: %d images, %d captions", split, len(found.sources), sum(map(len, found.captions)))
    transforms = images.Transforms(image_size, images.Normalisation(processor), data_args.min_crop_scale,
                                   data_args.random_flip)
    train_data = None
    if training_args.do_train:
        captions = image_text.Captions.of(splits["train"].captions, tokenizer, max_seq_length)
        train_data = image_text.ImageTextData(splits["train"].sources, captions, transforms, workers)
    evals = {split: image_text.eval_data(found, tokenizer, max_seq_length, transforms, data_args.zero_shot_templates,
                                         workers)
             for split, found in splits.items() if split != "train"}
    plan = training_plan(training_args, train_data.size if train_data else None)

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    model, params = image_text.load_dual_encoder(model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------
    embeddings_of = image_text.embeddings_fn(model)

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        image_embeds, text_embeds, logit_scale = embeddings_of(params, batch, dropout_rng, train)
        return image_text.contrastive_sums(image_embeds, text_embeds, logit_scale, layout, batch.get("example_weight"),
                                           label_smoothing)

    # The eval step also returns each image's embedding: retrieval ranks them against every caption.
    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data,
                              predict_fn=image_text.image_embeddings_fn(model))
    p_text_step = layout.compile_step("text_step", image_text.text_embeddings_fn(model))

    def text_embeddings(params, tokens):
        """The normalised embedding of every row of `tokens`, in order."""
        rows = []
        for batch, valid in steps.eval_batches(tokens, len(tokens["input_ids"])):
            rows.extend(layout.rows_to_host(p_text_step(params, batch))[:valid])
        return np.stack(rows)

    def evaluate(params, split):
        """(metrics, image embeddings, caption embeddings) of `split`: the mean loss of its images with their
        first captions (in eval batches), recall@1/5/10 both ways over all its images and captions, and
        with labels the zero-shot accuracy."""
        data = evals[split]
        means, image_embeds = steps.evaluate(params, data.images, len(splits[split].sources))
        image_embeds = np.stack(image_embeds)
        caption_embeds = text_embeddings(params, data.captions.tokens)
        metrics = {"loss": means["loss"],
                   **image_text.retrieval_metrics(image_embeds, caption_embeds, data.captions.image)}
        if data.labels is not None:
            names, class_ids, prompts = data.labels
            classes = image_text.class_embeddings(text_embeddings(params, prompts), len(names))
            metrics["zero_shot_accuracy"] = image_text.zero_shot_accuracy(image_embeds, classes, class_ids)
        metrics["samples"] = means["tokens"]
        return metrics, image_embeds, caption_embeds

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    validation, test = evals.get("validation"), evals.get("test")
    other_steps = dict(eval_step=validation and (validation.images, len(splits["validation"].sources)),
                       text_step=(validation or test) and ((validation or test).captions.tokens,
                                       len((validation or test).captions.image)))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    # The tokenizer and the image processor are saved with the model, as one processor.
    state = run.start(state, preflight.resume, config, model, image_text.processor_of(processor, tokenizer),
                      other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(images.patch_tokens(vision_config, image_size) + max_seq_length):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                run.report("eval", evaluate(state.params, "validation")[0])
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        run.report("eval", evaluate(state.params, "validation")[0])
    if training_args.do_predict:
        metrics, image_embeds, caption_embeds = evaluate(state.params, "test")
        shown, texts = splits["test"].shown, [c for per_image in splits["test"].captions for c in per_image]
        k = data_args.predict_top_k
        # Tabs separate the columns: each line's fields are made one-line by `prediction_lines`, not here.
        run.write_text(image_text.IMAGE_TO_TEXT_FILE, image_text.prediction_lines(
            shown, texts, image_embeds, caption_embeds, k, ("image", "rank", "score", "caption")),
            collapse_whitespace=False)
        run.write_text(image_text.TEXT_TO_IMAGE_FILE, image_text.prediction_lines(
            texts, shown, caption_embeds, image_embeds, k, ("caption", "rank", "score", "image")),
            collapse_whitespace=False)
        run.report("test", metrics)
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
