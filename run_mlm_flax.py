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

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForMaskedLM

from tasks import lm, masked_lm
from tasks.masked_lm import TASK
from utils.base.arguments import ModelArguments, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import fit_config_to_tokenizer, load_config, load_model, load_tokenizer
from utils.run.preflight import check_before_work
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


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
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="masked-lm"), tokenizer, model_args)
    # Each example is masked by its own random numbers: the same masks on any number of devices and hosts.
    train_masking, eval_masking = masked_lm.train_eval_masking(tokenizer, data_args.mlm_probability,
                                                               training_args.seed)
    seq_length = masked_lm.fit_sequence_length(data_args, tokenizer, config)

    # ------------------------------------------------------------------------------------------
    # Data: blocks (or padded lines) read into memory, or streamed (--streaming); the model comes
    # after, so too little data fails first
    # ------------------------------------------------------------------------------------------
    train_data, eval_arrays = masked_lm.read_examples(data_args, training_args, tokenizer, seq_length,
                                                      model_args.cache_dir)
    plan = training_plan(training_args, train_data and train_data.size)
    if training_args.do_train:
        masked_lm.check_masking_density(data_args.mlm_probability, seq_length, plan.batch_size)

    model, params = load_model(FlaxAutoModelForMaskedLM, model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"), params=params,
                       dropout_rng=dropout_rng, train=train)[0]
        return masked_lm.masked_token_loss(logits, batch["labels"], batch["label_weights"],
                                           batch.get("example_weight"), label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, train_masking)

    def evaluate(params):
        """Token-weighted loss and accuracy over the masked validation tokens (same masks every time), and
        how many tokens the masking selected."""
        return lm.evaluate(steps, params, eval_arrays, eval_masking)

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    other_steps = dict(eval_step=(eval_arrays, lm.num_examples(eval_arrays), eval_masking))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(seq_length, transform=train_masking):
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
