#!/usr/bin/env python
"""Fine-tune a Flax sequence-to-sequence model (T5, BART, Pegasus, ...) for summarization.

    python run_summarization_flax.py configs/summarization_tiny.json
    python run_summarization_flax.py config.json --learning_rate 1e-4   # flags override the file

One train / eval / generate loop, each step defined once for both layouts (`--sharding dp`, jax.pmap
over the local devices, the default; `--sharding fsdp`, the model split over all devices);
everything mechanical (layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForSeq2SeqLM

from tasks import summarization
from tasks.summarization import TASK
from utils.base.arguments import BaseDataArguments, ModelArguments, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.data import loaders
from utils.models.loading import fit_config_to_tokenizer, load_config, load_model, load_tokenizer
from utils.run.loop import InMemoryData, host_means
from utils.run.preflight import check_before_work, needed_splits, phase_datasets
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


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
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    _, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data
    # ------------------------------------------------------------------------------------------
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    splits = needed_splits(training_args)
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="seq2seq"), tokenizer, model_args)
    summarization.check_config(config)
    lengths = summarization.fit_lengths(data_args, config)
    raw = loaders.load_splits(data_args, {split: files[split] for split in splits}, model_args.cache_dir,
                                      allowed=summarization.FILE_FORMATS)
    raw = phase_datasets(raw, {split: split for split in splits}, data_args)
    columns = summarization.resolve_columns(data_args, {split: raw[split].column_names for split in splits})
    usable = summarization.drop_empty(raw, columns, data_args)
    # Before the model: too few examples for one batch fails now.
    plan = training_plan(training_args, len(usable["train"]) if training_args.do_train else None)

    # ------------------------------------------------------------------------------------------
    # Model, preprocessing
    # ------------------------------------------------------------------------------------------
    model, params = load_model(FlaxAutoModelForSeq2SeqLM, model_args, config, training_args.seed, layout)
    arrays, sizes = summarization.preprocess(usable, tokenizer, config, data_args, columns, lengths)
    train_data = InMemoryData(arrays["train"], sizes["train"]) if training_args.do_train else None

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        inputs = {k: batch[k] for k in summarization.MODEL_INPUTS}
        logits = model(**inputs, params=params, dropout_rng=dropout_rng, train=train)[0]
        return summarization.summary_loss(logits, batch["labels"], batch["decoder_attention_mask"],
                                          batch.get("example_weight"), label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)
    # Saved with the model (generation_config.json): the demo generates as this predict path does.
    summarization.set_generation(model, max_length=lengths.eval_target,
                                 num_beams=data_args.num_beams or model.config.num_beams)

    def generate_step(params, batch):
        return summarization.generate_ids(model, params, batch["input_ids"], batch["attention_mask"])

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
        scores, texts = summarization.generation_metrics(tokenizer, predictions, arrays[split]["labels"],
                                                         config.pad_token_id)
        return {**metrics, **scores}, texts

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    evaluated = "validation" if "validation" in arrays else "test"
    first = (arrays.get(evaluated), sizes.get(evaluated))
    other_steps = dict(eval_step=first, generate_step=first if data_args.predict_with_generate else None)

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        # Throughput counts source tokens; flops_per_token charges the decoder's work to them.
        for step, batch in run.train_batches(lengths.source, lengths.target):
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
            run.write_text(summarization.PREDICTIONS_FILE, texts)
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
