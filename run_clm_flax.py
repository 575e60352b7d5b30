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
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForCausalLM

from tasks import causal_lm, lm
from tasks.causal_lm import TASK
from utils.args import ModelArguments, TrainingArguments, parse_args
from utils.errors import UsageError, run_main
from utils.layout import make_layout
from utils.models import fit_config_to_tokenizer, load_config, load_model, load_tokenizer
from utils.run import set_up, training_plan
from utils.training import TrainingRun, make_steps


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
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = lm.check_before_work(training_args, data_args, TASK, model_args)
    _, is_main = set_up(training_args)
    layout = make_layout(training_args.sharding, training_args.fsdp_size, training_args.compile_only)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data
    # ------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="causal-lm"), tokenizer, model_args)
    block_size = causal_lm.fit_block_size(data_args, tokenizer, config)

    # ------------------------------------------------------------------------------------------
    # Data: blocks read into memory, or streamed (--streaming); the model comes after, so too
    # little data fails first
    # ------------------------------------------------------------------------------------------
    train_data, eval_arrays = causal_lm.read_blocks(data_args, training_args, tokenizer, block_size,
                                                    model_args.cache_dir)
    plan = training_plan(training_args, train_data and train_data.size)

    model, params = load_model(FlaxAutoModelForCausalLM, model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        logits = model(batch["input_ids"], params=params, dropout_rng=dropout_rng, train=train)[0]
        return causal_lm.next_token_loss(logits, batch["input_ids"], batch.get("example_weight"), label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)

    def evaluate(params):
        """Token-weighted next-token loss over the validation blocks, its perplexity and the tokens scored."""
        return lm.evaluate(steps, params, eval_arrays)

    # --compile_only: the TPU plan of each step this run calls, on its first batch; the run ends there.
    steps.report_plan(training_args, state, eval_step=(eval_arrays, lm.num_examples(eval_arrays)))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(block_size):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                run.report("eval", evaluate(state.params))
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        run.report("eval", evaluate(state.params))
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
