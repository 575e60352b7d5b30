#!/usr/bin/env python
"""Fine-tune a Flax sequence-to-sequence model (T5, BART, Pegasus, ...) for summarization.

    python run_summarization_flax.py configs/summarization_tiny.json
    python run_summarization_flax.py config.json --learning_rate 1e-4   # flags override the file

One train / eval / generate loop, each step defined once for both layouts (`--sharding dp`, jax.pmap
over the local devices, the default; `--sharding fsdp`, the model split over all devices);
everything mechanical (layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.perf.seconds_since_start)

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from transformers import FlaxAutoModelForSeq2SeqLM

from tasks import summarization as generation
from tasks.summarization import TASK
from utils import arrow_columns, dataset_loading, file_formats
from utils.args import BaseDataArguments, ModelArguments, TrainingArguments, parse_args
from utils.errors import UsageError, run_main
from utils.layout import make_layout
from utils.loop import InMemoryData, host_means
from utils.metrics import rouge
from utils.models import (decoder_input_ids, fit_config_to_tokenizer, fit_length,
                          load_config, load_model, load_tokenizer, max_positions)
from utils.run import SPLIT_FLAGS, check_before_work, needed_splits, set_up, training_plan
from utils.steps import cross_entropy_sums
from utils.training import TrainingRun, make_steps

# (document column, summary column) of well-known hub datasets.
SUMMARIZATION_COLUMNS = {
    "amazon_reviews_multi": ("review_body", "review_title"),
    "big_patent": ("description", "abstract"),
    "cnn_dailymail": ("article", "highlights"),
    "orange_sum": ("text", "summary"),
    "pn_summary": ("article", "summary"),
    "psc": ("extract_text", "summary_text"),
    "samsum": ("dialogue", "summary"),
    "thaisum": ("body", "summary"),
    "xglue": ("news_body", "news_title"),
    "xsum": ("document", "summary"),
    "wiki_summary": ("article", "highlights"),
    "multi_news": ("document", "summary"),
}

@dataclass
class DataTrainingArguments(BaseDataArguments):
    text_column: Optional[str] = field(default=None, metadata={"help": "Column with the documents."})
    summary_column: Optional[str] = field(default=None, metadata={"help": "Column with the summaries."})
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file (json, jsonl or csv), also compressed (.gz, .bz2, .xz)."})
    max_source_length: int = field(default=1024, metadata={"help": "Max document tokens (longer are truncated)."})
    max_target_length: int = field(default=128, metadata={"help": "Max summary tokens for training."})
    val_max_target_length: Optional[int] = field(
        default=None, metadata={"help": "Max summary tokens for eval/predict and generate (default: max_target_length)."}
    )
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the test set."})
    source_prefix: Optional[str] = field(default="", metadata={"help": "Prefix for every document (e.g. 'summarize: ')."})
    predict_with_generate: bool = field(default=False, metadata={"help": "Generate summaries and compute ROUGE."})
    num_beams: Optional[int] = field(default=None, metadata={"help": "Beams for generate (default: model config)."})

    def __post_init__(self):
        super().__post_init__()
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length
        for name in ("max_source_length", "max_target_length", "val_max_target_length", "num_beams"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be positive, got {value}")

# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def resolve_columns(data_args, columns):
    """Document and summary columns: explicit, the dataset's known pair, or the first two.

    `columns` maps each split to its column names; every split must have both columns.
    """
    known = SUMMARIZATION_COLUMNS.get(os.path.basename(data_args.dataset_name or ""))
    split, names = next(iter(columns.items()))
    defaults = known or tuple(names[:2])
    text = data_args.text_column or defaults[0]
    summary = data_args.summary_column or (defaults[1] if len(defaults) > 1 else None)
    if summary is None:
        raise UsageError(f"the {split} data has only the column {names[0]!r}: summarization needs a document "
                         "column and a summary column (--text_column, --summary_column)")
    file_formats.require_columns(columns, (("text_column", text), ("summary_column", summary)))
    return text, summary

def drop_empty(dataset, text_column, summary_column, data_args):
    """(dataset, number dropped): empty documents or summaries teach nothing and break ROUGE."""

    def usable(example):
        return bool(str(example[text_column] or "").strip()) and bool(str(example[summary_column] or "").strip())

    kept = dataset.filter(usable, num_proc=data_args.preprocessing_num_workers,
                          load_from_cache_file=not data_args.overwrite_cache, desc="dropping empty examples")
    return kept, len(dataset) - len(kept)

def preprocess(dataset, tokenizer, config, data_args, text_column, summary_column, max_target_length):
    """Tokenize to fixed lengths; labels are the summary, decoder inputs the labels shifted right (by
    the family's convention)."""

    def tokenize(examples):
        model_inputs = generation.encode_sources(tokenizer, examples[text_column], data_args.source_prefix,
                                              data_args.max_source_length)
        labels = tokenizer(text_target=examples[summary_column], max_length=max_target_length,
                           padding="max_length", truncation=True, return_tensors="np")
        model_inputs["labels"] = labels["input_ids"]
        model_inputs["decoder_input_ids"] = decoder_input_ids(labels["input_ids"], config)
        model_inputs["decoder_attention_mask"] = labels["attention_mask"]
        return model_inputs

    return dataset.map(tokenize, batched=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc="tokenizing")

MODEL_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
INPUT_COLUMNS = MODEL_INPUTS + ("labels",)

# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def summary_loss(logits, labels, decoder_attention_mask, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) over the summary tokens; the padding after a summary counts nothing.

    The decoder inputs are the labels shifted right (see `preprocess`), so position t predicts
    label t. `example_weight` (eval/predict: 0 for padded rows) scales a row's tokens.
    """
    weights = decoder_attention_mask
    if example_weight is not None:
        weights = weights * example_weight[:, None]
    loss, tokens = cross_entropy_sums(logits, labels, weights, label_smoothing)
    return loss, {"loss": loss, "tokens": tokens}

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    preflight = check_before_work(training_args, data_args, TASK, files, allowed=("json", "csv"), model_args=model_args)
    splits = needed_splits(training_args)
    if not data_args.dataset_name and all(split in preflight.columns for split in splits):
        resolve_columns(data_args, {split: preflight.columns[split] for split in splits})  # a wrong column fails now
    logger, is_main = set_up(training_args)
    layout = make_layout(training_args.sharding, training_args.fsdp_size, training_args.compile_only)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data
    # ------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="seq2seq"), tokenizer, model_args)
    if config.decoder_start_token_id is None:
        raise UsageError(f"the {config.model_type} config has no decoder_start_token_id: set it in the config")
    encoder, decoder = (config.encoder, config.decoder) if config.model_type == "encoder-decoder" else (config, config)
    data_args.max_source_length = fit_length(data_args.max_source_length, max_positions(encoder),
                                             "max_source_length", logger)
    for name in ("max_target_length", "val_max_target_length"):
        setattr(data_args, name, fit_length(getattr(data_args, name), max_positions(decoder), name, logger))
    raw = dataset_loading.load_splits(data_args, {s: files[s] for s in splits}, model_args.cache_dir, allowed=("json", "csv"))
    for split in splits:
        if split not in raw:
            phase = SPLIT_FLAGS[split][0]
            raise UsageError(f"--{phase} needs a {split!r} split, but dataset {data_args.dataset_name!r} has only "
                             f"{', '.join(raw)}: drop --{phase}, or pass local files instead of --dataset_name")
    text_column, summary_column = resolve_columns(data_args, {split: raw[split].column_names for split in splits})
    max_samples = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
                   "test": data_args.max_predict_samples}
    usable = {}
    for split in splits:
        usable[split], dropped = drop_empty(dataset_loading.take(raw[split], max_samples[split]), text_column, summary_column,
                                            data_args)
        if dropped:
            logger.warning("%s: dropped %d examples with an empty document or summary", split, dropped)
        if len(usable[split]) == 0:
            raise UsageError(f"the {split} data has no usable examples (all documents or summaries are empty)")
    # Before the model: too few examples for one batch fails now.
    plan = training_plan(training_args, len(usable["train"]) if training_args.do_train else None)

    # ------------------------------------------------------------------------------------------
    # Model, preprocessing
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForSeq2SeqLM, model_args, config, training_args.seed, layout)

    arrays, sizes = {}, {}
    for split in splits:
        target_length = data_args.max_target_length if split == "train" else data_args.val_max_target_length
        dataset = preprocess(usable[split], tokenizer, config, data_args, text_column, summary_column, target_length)
        arrays[split], sizes[split] = arrow_columns.to_arrays(dataset, INPUT_COLUMNS), len(dataset)
        logger.info("%s: %d examples", split, len(dataset))
    train_data = InMemoryData(arrays["train"], sizes["train"]) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        inputs = {k: batch[k] for k in MODEL_INPUTS}
        logits = model(**inputs, params=params, dropout_rng=dropout_rng, train=train)[0]
        return summary_loss(logits, batch["labels"], batch["decoder_attention_mask"], batch.get("example_weight"),
                            label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)
    # Saved with the model (generation_config.json): the demo generates as this predict path does.
    generation.set_generation(model, max_length=data_args.val_max_target_length,
                           num_beams=data_args.num_beams or model.config.num_beams)

    def generate_step(params, batch):
        return generation.generate_ids(model, params, batch["input_ids"], batch["attention_mask"])

    p_generate_step = layout.compile_step("generate_step", generate_step)

    def evaluate(params, split):
        """Token-weighted loss, the summary tokens scored, and with `predict_with_generate` ROUGE, gen_len
        and the texts."""
        sums, predictions = [], []
        for batch, valid in steps.eval_batches(arrays[split], sizes[split]):
            sums.append(steps.eval(params, batch))
            if data_args.predict_with_generate:
                ids = layout.rows_to_host(p_generate_step(params, batch))
                predictions.extend(ids[:valid])
        metrics = {**host_means(sums, keep_tokens=True), "samples": sizes[split]}
        if not data_args.predict_with_generate:
            return metrics, None
        texts = generation.decode_texts(tokenizer, predictions)
        references = tokenizer.batch_decode(arrays[split]["labels"], skip_special_tokens=True)
        metrics.update(rouge(texts, references))
        metrics["gen_len"] = float(np.mean([np.count_nonzero(ids != config.pad_token_id) for ids in predictions]))
        return metrics, texts

    # --compile_only: the TPU plan of each step this run calls, on its first batch; the run ends there.
    evaluated = "validation" if "validation" in arrays else "test"
    first = (arrays.get(evaluated), sizes.get(evaluated))
    steps.report_plan(training_args, state, eval_step=first,
                      generate_step=first if data_args.predict_with_generate else None)

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        # Throughput counts source tokens; flops_per_token charges the decoder's work to them.
        for step, batch in run.train_batches(data_args.max_source_length, data_args.max_target_length):
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
            run.write_text("generated_predictions.txt", texts)
    run.finish()

if __name__ == "__main__":
    sys.exit(run_main(main))
