#!/usr/bin/env python
"""Pretrain (or go on pretraining) a Flax T5, mT5 or LongT5 with T5's span-corruption objective on a text corpus.

    python run_t5_mlm_flax.py configs/t5_mlm_tiny.json
    python run_t5_mlm_flax.py config.json --max_seq_length 256   # flags override the file

The text is tokenized, concatenated and cut into raw blocks just long enough that, once random
spans (`--mlm_probability` of the tokens, `--mean_noise_span_length` long on average) are each
replaced by one sentinel token, the encoder input is exactly `--max_seq_length` tokens; the decoder
learns to write the dropped spans, each after its sentinel. Every example is corrupted on the host
by its own seeded random numbers. One train / eval loop, each step defined once for both layouts
(`--sharding dp`, jax.pmap over the local devices, the default; `--sharding fsdp`, the model split
over all devices); everything mechanical (layouts, schedules, checkpoints, metrics, logging) lives
in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field

from transformers import FlaxAutoModelForSeq2SeqLM

from tasks import lm, span_corruption
from tasks.span_corruption import TASK
from utils.base.arguments import ModelArguments, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import fit_config_to_tokenizer, load_config, load_model, load_tokenizer
from utils.run.preflight import check_before_work
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class DataTrainingArguments(lm.LMDataArguments):
    max_seq_length: int = field(
        default=512, metadata={"help": "Encoder input tokens per example, exactly (sentinels and the final EOS "
                                       "included); the raw blocks and the targets get the lengths this implies. At "
                                       "most the model's positions (the T5 family has relative positions: no limit)."}
    )
    mlm_probability: float = field(
        default=0.15, metadata={"help": "Noise density: the share of each raw block's tokens dropped from the input "
                                        "(in spans, each replaced by one sentinel) for the decoder to write."}
    )
    mean_noise_span_length: float = field(
        default=3.0, metadata={"help": "Mean length of a dropped span, in tokens (at least 1)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.max_seq_length <= 0:
            raise UsageError(f"--max_seq_length must be positive, got {self.max_seq_length}")
        # The densities, span lengths and input lengths that cannot work are refused before anything else.
        span_corruption.span_corruption_lengths(self.max_seq_length, self.mlm_probability, self.mean_noise_span_length)

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
    # Config, tokenizer, the span-corruption plan (lengths, EOS and enough sentinels, checked before
    # the data is read)
    # ------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="seq2seq", model_types=span_corruption.MODEL_TYPES),
                                     tokenizer, model_args)
    spans = span_corruption.fit_plan(data_args, tokenizer, config)
    # Each example is corrupted by its own random numbers: the same on any number of devices and hosts.
    train_corruption, eval_corruption = span_corruption.train_eval_corruption(spans, config.decoder_start_token_id,
                                                                              training_args.seed)

    # ------------------------------------------------------------------------------------------
    # Data: raw blocks read into memory, or streamed (--streaming); the model comes after, so too
    # little data fails first
    # ------------------------------------------------------------------------------------------
    train_data, eval_arrays = span_corruption.read_raw_blocks(data_args, training_args, tokenizer, spans,
                                                              model_args.cache_dir)
    plan = training_plan(training_args, train_data and train_data.size)

    model, params = load_model(FlaxAutoModelForSeq2SeqLM, model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        # No attention masks: inputs and targets are all real tokens, of fixed lengths.
        logits = model(batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"], params=params,
                       dropout_rng=dropout_rng, train=train)[0]
        return span_corruption.span_target_loss(logits, batch["labels"], batch.get("example_weight"), label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, train_corruption)

    def evaluate(params):
        """Token-weighted loss and accuracy over every target token of the corrupted validation blocks
        (the same corruption every time), their perplexity, and how many target tokens that is."""
        return lm.evaluate(steps, params, eval_arrays, eval_corruption)

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    other_steps = dict(eval_step=(eval_arrays, lm.num_examples(eval_arrays), eval_corruption))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(spans.lengths.input_length, spans.lengths.target_length,
                                             transform=train_corruption):
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
