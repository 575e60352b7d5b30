#!/usr/bin/env python
"""Fine-tune a Flax vision model (ViT, BEiT, DINOv2, ResNet, RegNet) to classify images, without torch.

    python run_image_classification.py configs/image_tiny.json
    python run_image_classification.py --model_name_or_path google/vit-base-patch16-224-in21k \\
        --train_dir imagenette/train --validation_dir imagenette/val --do_train --do_eval \\
        --output_dir runs/imagenette

Images come from folders in the ImageFolder layout (`root/<class>/<image>`, the class folders name
the labels) or from a `datasets` dataset (an image and a label column). They are decoded with
Pillow and transformed in NumPy: training takes a random-resized crop flipped half of the time, a
pure function of (seed, epoch, example) so a resumed run sees the same pixels; evaluation resizes
and takes the center crop; both normalise as the model's image processor, which is saved with the
model. A pool of threads prepares the batches ahead of the step. The task's knowledge (images,
labels, transforms, loss, top-k accuracy, the prediction file) lives in
`tasks/image_classification.py`. One train /
eval loop, each step defined once for both layouts (`--sharding dp`, jax.pmap over the local
devices, the default; `--sharding fsdp`, the model split over all devices); everything mechanical
(layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForImageClassification

from tasks import image_classification, images
from tasks.image_classification import TASK
from utils.base.arguments import BaseDataArguments, ModelArguments, READS, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import load_config, load_model
from utils.run.preflight import check_before_work, sample_limit
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class ImageModelArguments(ModelArguments):
    image_processor_name: Optional[str] = field(
        default=None, metadata={"help": "Image processor (name or path) whose normalisation the images get "
                                        "(default: the model's; from scratch: mean 0.5, std 0.5).",
                                READS: "its image processor"})


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
        default=True, metadata={"help": "Flip training images horizontally half of the time (never at eval).",
                                "negated_help": "Never flip the training images."})
    max_predict_samples: Optional[int] = field(
        default=None, metadata={"help": "Predict this many test images, drawn at random (seeded by --seed)."})

    def __post_init__(self):
        super().__post_init__()
        if self.image_size is not None and self.image_size <= 0:
            raise UsageError(f"--image_size must be positive, got {self.image_size}")
        if not 0 < self.min_crop_scale <= 1:
            raise UsageError(f"--min_crop_scale must be in (0, 1], got {self.min_crop_scale}")

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ImageModelArguments, ImageDataArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    logger, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Config, images, labels, transforms
    # ------------------------------------------------------------------------------------------
    pretrained = bool(model_args.model_name_or_path)
    config = load_config(model_args, task="image-classification")
    # --max_*_samples images drawn at random (seeded): a folder's first images are all of one class.
    splits = {split: image_classification.take_subset(found, sample_limit(data_args, split), training_args.seed)
              for split, found in image_classification.load_splits(data_args, training_args, model_args.cache_dir).items()}
    workers = data_args.preprocessing_num_workers or images.default_workers()
    for split, found in splits.items():
        images.check_readable(found.sources, workers, names=found.shown)  # a corrupt image stops the run here, named
        logger.info("%s: %d images", split, len(found.sources))
    names = image_classification.choose_labels(splits, config, pretrained, training_args.do_train)
    labels = {split: image_classification.label_ids(split, found.label_names, names) for split, found in splits.items()
              if found.label_names is not None}
    image_classification.set_labels(config, names)
    processor = images.load_image_processor(model_args)
    image_size = images.fit_image_size(data_args, config, processor, pretrained)
    if processor is None:  # from scratch: one that does what the eval transform does, saved with the model
        processor = images.eval_processor(image_size)
    transforms = images.Transforms(image_size, images.Normalisation(processor), data_args.min_crop_scale,
                                   data_args.random_flip)
    train_data = None
    if training_args.do_train:
        train_data = images.ImageData(splits["train"].sources, labels["train"], transforms, workers)
    eval_arrays = image_classification.eval_columns(splits, labels, transforms, workers)
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
    top_k = image_classification.top_k_for(len(names))
    logits_of = image_classification.logits_fn(model)

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        return image_classification.classification_sums(logits_of(params, batch, dropout_rng, train), batch["labels"],
                                          batch.get("example_weight"), label_smoothing, top_k)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)
    p_predict_step = layout.compile_step("predict_step", lambda params, batch: logits_of(params, batch).argmax(-1))

    def evaluate(params, split):
        """Mean loss, accuracy (and top-5 accuracy) over every image of `split` (padded rows left out)."""
        means, _ = steps.evaluate(params, eval_arrays[split], len(splits[split].sources))
        return image_classification.eval_metrics(means)

    def predict(params, split):
        """The predicted class id of each image of `split`, in its order."""
        predicted = []
        pixels = {"pixel_values": eval_arrays[split]["pixel_values"]}
        for batch, valid in steps.eval_batches(pixels, len(splits[split].sources)):
            predicted.extend(layout.rows_to_host(p_predict_step(params, batch))[:valid])
        return predicted

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    validation, test = eval_arrays.get("validation"), eval_arrays.get("test")
    other_steps = dict(eval_step=validation and (validation, len(splits["validation"].sources)),
                       predict_step=test and ({"pixel_values": test["pixel_values"]}, len(splits["test"].sources)))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    # The image processor is saved with the model.
    state = run.start(state, preflight.resume, config, model, processor, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(images.patch_tokens(config, image_size)):
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
        lines = image_classification.prediction_lines(splits["test"].shown, predict(state.params, "test"), names)
        run.write_text("predict_results.txt", lines, collapse_whitespace=False)
        run.dir.add_results(predict_samples=len(splits["test"].sources))
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
