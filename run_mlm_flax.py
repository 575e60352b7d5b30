#!/usr/bin/env python
"""Train or fine-tune a Flax masked language model (BERT, RoBERTa, DistilBERT, ELECTRA, ...) on a text corpus.

    python run_mlm_flax.py configs/mlm_tiny.json
    python run_mlm_flax.py config.json --line_by_line   # flags override the file

The text is tokenized and cut into `max_seq_length` blocks (or kept one example per line); each
batch is masked BERT-style on the host, each example by its own seeded random numbers, and the model
learns to restore the selected tokens. One train / eval loop, each step defined once for both layouts
(`--sharding dp`, jax.pmap over the local devices, the default; `--sharding fsdp`, the model split
over all devices); everything mechanical (layouts, schedules, checkpoints, metrics, logging) lives
in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.perf.seconds_since_start)

import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import jax
from transformers import FlaxAutoModelForMaskedLM

from utils import devices, lm, stream
from utils.args import ModelArguments, TrainingArguments, parse_args
from utils.errors import UsageError, run_main
from utils.layout import make_layout
from utils.logging import throughput_meter
from utils.loop import TrainLoop, eval_batches, host_means
from utils.metrics import perplexity
from utils.models import (enable_gradient_checkpointing, fit_config_to_tokenizer, load_config, load_model,
                          load_tokenizer)
from utils.optim import create_optimizer, learning_rate_schedule
from utils.resume import resume_or_start, run_fingerprint
from utils.run import set_up, training_plan
from utils.rundir import RunDirectory
from utils.saving import Saver
from utils.steps import cross_entropy_sums, token_weighted_grads


@dataclass
class DataTrainingArguments(lm.LMDataArguments):
    max_seq_length: Optional[int] = field(
        default=None, metadata={"help": "Tokens per example (default: min(512, the tokenizer's max length); at most "
                                        "the model's positions). Longer lines are truncated with --line_by_line."}
    )
    mlm_probability: float = field(
        default=0.15, metadata={"help": "Share of the ordinary (non-special) tokens to predict: 80% of them are "
                                        "masked, 10% replaced by a random token, 10% left as they are."}
    )
    line_by_line: bool = field(
        default=False, metadata={"help": "One example per non-blank line instead of concatenated blocks."}
    )
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Kept for compatibility: --line_by_line examples are always padded to "
                                         "max_seq_length, so every batch has one shape and nothing recompiles."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.max_seq_length is not None and self.max_seq_length <= 0:
            raise UsageError(f"--max_seq_length must be positive, got {self.max_seq_length}")
        if not 0 < self.mlm_probability < 1:
            raise UsageError(f"--mlm_probability must be between 0 and 1, got {self.mlm_probability}")


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def masked_token_loss(logits, labels, label_weights, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "accuracy", "tokens"}) over the tokens the masking selected.

    Only tokens with `label_weights` 1 count, for the loss and for the accuracy: the others are
    visible in the input, and predicting them would be copying. `example_weight` (eval: 0 for
    padded rows) scales a row's tokens.
    """
    weights = label_weights
    if example_weight is not None:
        weights = weights * example_weight[:, None]
    loss, tokens = cross_entropy_sums(logits, labels, weights, label_smoothing)
    correct = ((logits.argmax(-1) == labels) * weights).sum()
    return loss, {"loss": loss, "accuracy": correct, "tokens": tokens}


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = lm.check_before_work(training_args, data_args, model_args)
    logger, is_main = set_up(training_args)
    layout = make_layout(training_args)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data
    # ------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="masked-lm"), tokenizer, model_args)
    # Each example is masked by its own random numbers: the same masks on any number of devices and hosts.
    train_masking = lm.masking(tokenizer, data_args.mlm_probability, training_args.seed, lm.TRAIN_STREAM)
    eval_masking = lm.masking(tokenizer, data_args.mlm_probability, training_args.seed, lm.EVAL_STREAM)
    seq_length = lm.sequence_length(data_args.max_seq_length, 512, tokenizer, config, "max_seq_length", logger)

    # ------------------------------------------------------------------------------------------
    # Data: blocks (or padded lines) read into memory, or streamed (--streaming); the model comes
    # after, so too little data fails first
    # ------------------------------------------------------------------------------------------
    if data_args.streaming:
        encoder = (stream.Lines(tokenizer, seq_length) if data_args.line_by_line
                   else stream.Blocks(tokenizer, seq_length))
        train_data = stream.StreamedData(data_args, training_args, encoder, model_args.cache_dir)
        eval_arrays = train_data.eval_arrays
    else:
        # Blocks are all real tokens; padded lines also need their attention mask.
        tokenize, columns = ((lm.tokenize_lines, ("input_ids", "attention_mask")) if data_args.line_by_line
                             else (lm.tokenize_and_group, ("input_ids",)))
        train_data, eval_arrays = lm.read_into_memory(
            data_args, training_args, model_args.cache_dir,
            lambda raw, text_column: tokenize(raw, tokenizer, text_column, seq_length, data_args), columns,
            lambda split: f"the {split} data has no text (or, in blocks, fewer than --max_seq_length {seq_length} "
                          "tokens): add text, lower --max_seq_length or use --line_by_line")
    eval_size = len(eval_arrays["input_ids"]) if eval_arrays is not None else 0
    train_batch_size, steps_per_epoch, total_steps = (
        training_plan(training_args, train_data.size) if training_args.do_train else (0, 0, 0))

    model, params = load_model(FlaxAutoModelForMaskedLM, model_args, config, devices.to_dtype(model_args.dtype),
                               training_args.seed, layout)
    if training_args.gradient_checkpointing:
        enable_gradient_checkpointing(model)

    # ------------------------------------------------------------------------------------------
    # Optimizer, state, steps (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------
    eval_batch_size = devices.global_batch_size(training_args.per_device_eval_batch_size)
    schedule = learning_rate_schedule(training_args.lr_scheduler_type, training_args.learning_rate,
                                      training_args.warmup_steps, max(total_steps, 1))
    state = layout.create_state(model.__call__, params, create_optimizer(training_args, schedule), training_args.seed)
    accumulation, label_smoothing = training_args.gradient_accumulation_steps, training_args.label_smoothing_factor

    def loss_fn(params, batch, dropout_rng, train):
        logits = state.apply_fn(batch["input_ids"], attention_mask=batch.get("attention_mask"), params=params,
                                dropout_rng=dropout_rng, train=train)[0]
        return masked_token_loss(logits, batch["labels"], batch["label_weights"], batch.get("example_weight"),
                                 label_smoothing if train else 0.0)

    def train_step(state, batch):
        dropout_rng, state = state.next_dropout_rng()
        grads, sums = token_weighted_grads(partial(loss_fn, train=True), state.params, batch, dropout_rng,
                                           accumulation, layout)
        return state.apply_gradients(grads=grads), sums

    def eval_step(params, batch):
        _, sums = loss_fn(params, batch, None, train=False)
        return layout.batch_sum(sums)

    if training_args.do_train:  # compiled now: its device memory is known (and checked) before anything is written
        p_train_step = layout.compile_train_step(
            train_step, state, train_data.example_batch(train_batch_size, train_masking), accumulation)
    p_eval_step = layout.compile_step("eval_step", eval_step)

    # ------------------------------------------------------------------------------------------
    # Resume, run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    fingerprint = run_fingerprint(config, training_args, layout, train_data and (train_data.size or "streamed"))
    state, start_step = resume_or_start(preflight.resume, fingerprint, state, total_steps, layout,  # the last check
                                        train_data)
    # Nothing has been written so far: a run that stops on a check leaves --output_dir as it was.
    run_dir = RunDirectory(training_args, (model_args, data_args, training_args), model, tokenizer, is_main,
                           total_steps, preflight.resume, layout.train_step_memory)
    if training_args.do_train:
        saver = Saver(training_args, run_dir, layout, train_data, fingerprint, steps_per_epoch, total_steps, start_step,
                      is_main)

    def evaluate():
        """Token-weighted loss and accuracy over the masked validation tokens (same masks every time), and
        how many tokens the masking selected."""
        sums = [p_eval_step(state.params, batch) for batch, _ in
                eval_batches(eval_arrays, eval_size, eval_batch_size, layout, transform=eval_masking)]
        metrics = host_means(sums, keep_tokens=True)
        return {**metrics, "perplexity": perplexity(metrics["loss"]), "samples": eval_size}

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    last_eval_step = None
    if training_args.do_train:
        logger.info("training: %d steps (%d per epoch), global batch %d = %d per device x %d devices x %d",
                    total_steps, steps_per_epoch, train_batch_size, training_args.per_device_train_batch_size,
                    jax.device_count(), accumulation)
        loop = TrainLoop(training_args, steps_per_epoch, total_steps, start_step, schedule, run_dir,
                         throughput_meter(config, seq_length), tokens_per_step=train_batch_size * seq_length,
                         examples_per_step=train_batch_size)
        batches = train_data.batches(train_batch_size, training_args.seed, steps_per_epoch, start_step, total_steps,
                                     layout, transform=train_masking)
        train_start = time.time()
        for step, batch in enumerate(batches, start=start_step + 1):
            state, sums = p_train_step(state, batch)
            loop.after_step(step, sums)
            if loop.eval_due(step):
                run_dir.report("eval", evaluate(), step)
                last_eval_step = step
            reason = loop.save_reason(step)
            if reason:
                saver.save(step, state, reason)
        saver.save_if_the_data_ran_out(loop.step, state)  # --max_stream_passes may end a stream early
        # A stream has no size: its examples are the steps'.
        run_dir.add_results(train_runtime=round(time.time() - train_start, 2),
                            train_samples=train_data.size or loop.examples_trained)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, result files
    # ------------------------------------------------------------------------------------------
    final_step = loop.step if training_args.do_train else start_step
    if training_args.do_eval and last_eval_step != final_step:
        run_dir.report("eval", evaluate(), final_step)
    if training_args.do_train:
        saver.close()  # the last checkpoint is complete before the results say the run is done
    run_dir.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
