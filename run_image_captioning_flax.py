#!/usr/bin/env python
"""Fine-tune a Flax vision encoder-decoder (ViT + GPT-2, ViT + BART's decoder, ...) to caption images, without torch.

    python run_image_captioning_flax.py configs/image_captioning_tiny.json
    python run_image_captioning_flax.py --encoder_model_name_or_path google/vit-base-patch16-224-in21k \\
        --decoder_model_name_or_path gpt2 --train_file coco/train_dataset.json \\
        --validation_file coco/valid_dataset.json --do_train --do_eval --predict_with_generate \\
        --output_dir runs/coco

The model (`FlaxVisionEncoderDecoderModel`) is built here from a vision encoder and a decoder that
takes cross-attention, each pretrained (any checkpoint format) or from its config, or loaded whole
from a saved captioning model (--model_name_or_path). Data rows hold an image (a path relative to
the data file, or the image) and its captions (one, or a list); rows of one image file are one image
with all their captions. Training takes every (image, caption) pair; evaluation scores the loss over
every pair and generates one caption per image, scored (ROUGE, BLEU) against all its captions.
The task's knowledge lives in `tasks/image_captioning.py` (images through
`tasks/image_classification.py`'s transforms, generation through `tasks/summarization.py`'s). One
train / eval / generate loop, each step defined once for both layouts (`--sharding dp`, jax.pmap
over the local devices, the default; `--sharding fsdp`, the model split over all devices);
everything mechanical (layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModel, FlaxAutoModelForCausalLM, FlaxVisionEncoderDecoderModel

from tasks import image_captioning as captioning
from tasks import images
from tasks.image_captioning import TASK
from tasks.summarization import set_generation
from utils.base.arguments import BaseDataArguments, EncoderDecoderModelArguments, READS, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import load_composed_model, load_tokenizer
from utils.run.preflight import check_before_work
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class CaptioningModelArguments(EncoderDecoderModelArguments):
    image_processor_name: Optional[str] = field(
        default=None, metadata={"help": "Image processor (name or path) whose normalisation the images get "
                                        "(default: the model's or the encoder's; from scratch: mean 0.5, std 0.5).",
                                READS: "its image processor"})


@dataclass
class DataTrainingArguments(BaseDataArguments):
    data_dir: Optional[str] = field(default=None, metadata={"help": "The data directory of a hub dataset."})
    image_column: Optional[str] = field(
        default=None, metadata={"help": "Column with the images, or their paths relative to the data file (default: "
                                        "'image_path', 'image', 'img' or 'file_name'; of two columns, the first)."})
    caption_column: Optional[str] = field(
        default=None, metadata={"help": "Column with the captions: one per row, or a list (default: 'captions', "
                                        "'caption', 'text' or 'sentences'; of two columns, the second)."})
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file (json, jsonl or csv), also compressed; its captions, if "
                                        "any, are scored."})
    max_target_length: int = field(default=128, metadata={"help": "Max caption tokens for training (longer are "
                                                                  "truncated)."})
    val_max_target_length: Optional[int] = field(
        default=None, metadata={"help": "Max caption tokens for eval/predict and generate (default: "
                                        "max_target_length)."})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the test set."})
    image_size: Optional[int] = field(
        default=None, metadata={"help": "Side of the square images the encoder sees (default: its config's "
                                        "image_size, else the image processor's crop size, else 224)."})
    predict_with_generate: bool = field(default=False, metadata={"help": "Generate captions and compute ROUGE and "
                                                                         "BLEU."})
    num_beams: Optional[int] = field(default=None, metadata={"help": "Beams for generate (default: model config)."})

    def __post_init__(self):
        super().__post_init__()
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length
        for name in ("max_target_length", "val_max_target_length"):  # a caption token and the end token
            if getattr(self, name) < 2:
                raise UsageError(f"--{name} must be at least 2, got {getattr(self, name)}")
        for name in ("num_beams", "image_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be positive, got {value}")

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (CaptioningModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    _, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Tokenizer, config, images and captions, transforms
    # ------------------------------------------------------------------------------------------
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    tokenizer = load_tokenizer(captioning.arguments_of(model_args, "decoder"))
    config = captioning.load_captioning_config(model_args, tokenizer)
    lengths = captioning.fit_lengths(data_args, config)
    workers = data_args.preprocessing_num_workers or images.default_workers()
    # Every image decoded once here: a missing or broken one stops the run before anything is written.
    found = captioning.load_splits(data_args, training_args, files, model_args.cache_dir, workers)
    encoder_args = captioning.arguments_of(model_args, "encoder")
    processor = images.load_image_processor(encoder_args)
    image_size = images.fit_image_size(data_args, config.encoder, processor, bool(encoder_args.model_name_or_path))
    if processor is None:  # from scratch: one that does what the eval transform does, saved with the model
        processor = images.eval_processor(image_size)
    transforms = images.Transforms(image_size, images.Normalisation(processor))
    pairs = {split: captioning.caption_pairs(images_of, tokenizer,
                                             lengths.target if split == "train" else lengths.eval_target, config)
             for split, images_of in found.items() if images_of.captions is not None}
    train_data = None
    if training_args.do_train:
        train_data = captioning.CaptionData(found["train"], pairs["train"], transforms, workers)
    eval_arrays = {split: captioning.eval_columns(found[split], pairs.get(split), transforms, workers)
                   for split in found if split != "train"}
    plan = training_plan(training_args, train_data.size if train_data else None)

    # ------------------------------------------------------------------------------------------
    # Model: a saved captioning model, or the encoder and the decoder joined here
    # ------------------------------------------------------------------------------------------
    parts = {"encoder": (FlaxAutoModel, captioning.pretrained_part(model_args, "encoder")),
             "decoder": (FlaxAutoModelForCausalLM, captioning.pretrained_part(model_args, "decoder"))}
    model, params = load_composed_model(FlaxVisionEncoderDecoderModel, config, model_args, parts,
                                        training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        logits = model(batch["pixel_values"], decoder_input_ids=batch["decoder_input_ids"],
                       decoder_attention_mask=batch["decoder_attention_mask"], params=params,
                       dropout_rng=dropout_rng, train=train)[0]
        return captioning.caption_loss(logits, batch, label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)
    # Saved with the model (generation_config.json): the demo generates as this predict path does.
    set_generation(model, max_length=lengths.eval_target,
                              num_beams=data_args.num_beams or model.generation_config.num_beams)

    def generate_step(params, batch):
        return captioning.generate_ids(model, params, batch["pixel_values"])

    p_generate_step = layout.compile_step("generate_step", generate_step)

    def evaluate(params, split):
        """Token-weighted loss over every (image, caption) pair, the caption tokens scored, and with
        `predict_with_generate` one caption per image, its ROUGE, BLEU and gen_len, and the texts."""
        pair_columns, image_columns = eval_arrays[split]
        metrics = {"samples": len(found[split].sources)}
        if pair_columns is not None:
            means, _ = steps.evaluate(params, pair_columns, len(pairs[split].image_of))
            metrics.update(means)
        if not data_args.predict_with_generate:
            return metrics, None
        predictions = []
        for batch, valid in steps.eval_batches(image_columns, len(found[split].sources)):
            predictions.extend(layout.rows_to_host(p_generate_step(params, batch))[:valid])
        scores, texts = captioning.caption_metrics(tokenizer, predictions, found[split].captions,
                                                   config.pad_token_id)
        return {**metrics, **scores}, texts

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    evaluated = "validation" if "validation" in eval_arrays else "test"
    pair_columns, image_columns = eval_arrays.get(evaluated, (None, None))
    other_steps = dict(eval_step=pair_columns and (pair_columns, len(pairs[evaluated].image_of)),
                       generate_step=(image_columns, len(found[evaluated].sources))
                       if data_args.predict_with_generate and image_columns else None)

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    # The tokenizer and the image processor are saved with the model.
    state = run.start(state, preflight.resume, config, model, captioning.SavedWithModel(tokenizer, processor),
                      other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        # Throughput counts the encoder's patch tokens; the decoder's work is charged to them.
        for step, batch in run.train_batches(images.patch_tokens(config.encoder, image_size), lengths.target):
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
        metrics, texts = evaluate(state.params, "test")
        run.report("test", metrics)
        if texts is not None:
            run.write_text(captioning.PREDICTIONS_FILE, texts)
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
