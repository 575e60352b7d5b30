#!/usr/bin/env python
"""Train or fine-tune a Flax causal language model (GPT-2, GPT-Neo, OPT, Llama, ...) on a text corpus.

    python run_clm_flax.py configs/clm_tiny.json
    python run_clm_flax.py config.json --block_size 256   # flags override the file

The text is tokenized, concatenated and cut into `block_size` blocks; the model learns to predict
each next token. One train / eval loop, each step defined once for both layouts (`--sharding dp`,
jax.pmap over the local devices, the default; `--sharding fsdp`, the model split over all devices);
everything mechanical (layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.perf.seconds_since_start)

import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from transformers import FlaxAutoModelForCausalLM

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
    block_size: Optional[int] = field(
        default=None, metadata={"help": "Tokens per training block (default: min(1024, the tokenizer's max length); "
                                        "at most the model's positions)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.block_size is not None and self.block_size <= 1:
            raise UsageError(f"--block_size must be at least 2 (a token and its successor), got {self.block_size}")


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def next_token_loss(logits, input_ids, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) of predicting each next token of a block.

    The labels are the inputs shifted by one: position t predicts token t + 1, the last position
    nothing, so a block of n tokens scores n - 1. `example_weight` (eval: 0 for padded rows) scales
    a row's tokens.
    """
    labels = input_ids[:, 1:]
    weights = jnp.ones(labels.shape, jnp.float32)
    if example_weight is not None:
        weights = weights * example_weight[:, None]
    loss, tokens = cross_entropy_sums(logits[:, :-1], labels, weights, label_smoothing)
    return loss, {"loss": loss, "tokens": tokens}


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
    config = fit_config_to_tokenizer(load_config(model_args, task="causal-lm"), tokenizer, model_args)
    block_size = lm.sequence_length(data_args.block_size, 1024, tokenizer, config, "block_size", logger)

    # ------------------------------------------------------------------------------------------
    # Data: blocks read into memory, or streamed (--streaming); the model comes after, so too
    # little data fails first
    # ------------------------------------------------------------------------------------------
    if data_args.streaming:
        train_data = stream.StreamedData(data_args, training_args, stream.Blocks(tokenizer, block_size),
                                         model_args.cache_dir)
        eval_arrays = train_data.eval_arrays
    else:
        train_data, eval_arrays = lm.read_into_memory(
            data_args, training_args, model_args.cache_dir,
            lambda raw, text_column: lm.tokenize_and_group(raw, tokenizer, text_column, block_size, data_args),
            ("input_ids",),
            lambda split: f"the {split} data has fewer than --block_size {block_size} tokens: lower --block_size or "
                          "add text")
    eval_size = len(eval_arrays["input_ids"]) if eval_arrays is not None else 0
    train_batch_size, steps_per_epoch, total_steps = (
        training_plan(training_args, train_data.size) if training_args.do_train else (0, 0, 0))

    model, params = load_model(FlaxAutoModelForCausalLM, model_args, config, devices.to_dtype(model_args.dtype),
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
        logits = state.apply_fn(batch["input_ids"], params=params, dropout_rng=dropout_rng, train=train)[0]
        return next_token_loss(logits, batch["input_ids"], batch.get("example_weight"),
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
        p_train_step = layout.compile_train_step(train_step, state, train_data.example_batch(train_batch_size),
                                                 accumulation)
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
        """Token-weighted next-token loss over the validation blocks, its perplexity and the tokens scored."""
        sums = [p_eval_step(state.params, batch)
                for batch, _ in eval_batches(eval_arrays, eval_size, eval_batch_size, layout)]
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
                         throughput_meter(config, block_size), tokens_per_step=train_batch_size * block_size,
                         examples_per_step=train_batch_size)
        batches = train_data.batches(train_batch_size, training_args.seed, steps_per_epoch, start_step, total_steps,
                                     layout)
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
