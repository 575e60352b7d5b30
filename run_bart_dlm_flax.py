#!/usr/bin/env python
"""Pretrain (or go on pretraining) a Flax BART or mBART as BART was: denoising, on a text corpus.

    python run_bart_dlm_flax.py configs/bart_dlm_tiny.json
    python run_bart_dlm_flax.py config.json --max_seq_length 256   # flags override the file

The text is split into sentences (no download), each followed by a separator token the model learns
(the tokenizer's EOS unless --sentence_separator names another), tokenized, concatenated and cut into
blocks. Each example is noised on the host by its own seeded random numbers: some or all of its
sentences trade places (`--permute_sentence_ratio`), then `--mlm_probability` of its tokens fall in
spans of Poisson(`--poisson_lambda`) lengths, each span (zero-length ones are insertions) replaced by
one mask token, or a random token (`--random_token_ratio`). The model learns to write the example back
whole: the loss, accuracy and perplexity count every token. One train / eval loop, each step defined
once for both layouts (`--sharding dp`, jax.pmap over the local devices, the default; `--sharding
fsdp`, the model split over all devices); everything mechanical (layouts, schedules, checkpoints,
metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForSeq2SeqLM

from tasks import denoising, lm
from tasks.denoising import TASK
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
        default=None, metadata={"help": "Tokens per example, BOS and EOS included (default: min(512, the "
                                        "tokenizer's max length); at most the model's positions)."}
    )
    mlm_probability: float = field(
        default=0.3, metadata={"help": "Share of each example's tokens that fall in masked spans (BART and fairseq: "
                                       "0.3)."}
    )
    permute_sentence_ratio: float = field(
        default=1.0, metadata={"help": "Share of each example's sentences that trade places at random (BART and "
                                       "fairseq: 1.0)."}
    )
    poisson_lambda: float = field(
        default=3.0, metadata={"help": "Mean of the Poisson span lengths (the classic script: 3.0; BART and "
                                       "fairseq: 3.5). A span of length 0 inserts a mask token."}
    )
    random_token_ratio: float = field(
        default=0.0, metadata={"help": "Share of the spans replaced by a random ordinary token instead of the mask "
                                       "token (the classic script: none; fairseq's --mask-random: 0.1)."}
    )
    sentence_separator: Optional[str] = field(
        default=None, metadata={"help": "The token that ends every sentence, one of the tokenizer's (default: its "
                                        "EOS, as in BART's pretraining)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.max_seq_length is not None and self.max_seq_length <= 0:
            raise UsageError(f"--max_seq_length must be positive, got {self.max_seq_length}")
        denoising.check_rates(self.mlm_probability, self.permute_sentence_ratio, self.poisson_lambda,
                              self.random_token_ratio)

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
    # Config, tokenizer, the denoising plan (lengths, mask and separator tokens, checked before
    # the data is read)
    # ------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="seq2seq", model_types=denoising.MODEL_TYPES),
                                     tokenizer, model_args)
    plan = denoising.plan_denoising(tokenizer, config, data_args)
    # Each example is noised by its own random numbers: the same on any number of devices and hosts.
    train_noise, eval_noise = denoising.train_eval_noise(plan, denoising.decoder_start(config), training_args.seed)

    # ------------------------------------------------------------------------------------------
    # Data: sentences cut into blocks, read into memory or streamed (--streaming); the model comes
    # after, so too little data fails first
    # ------------------------------------------------------------------------------------------
    train_data, eval_arrays = denoising.read_bodies(data_args, training_args, tokenizer, plan, model_args.cache_dir)
    training = training_plan(training_args, train_data and train_data.size)

    model, params = load_model(FlaxAutoModelForSeq2SeqLM, model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        # The decoder reads the whole example (no padding): no decoder mask.
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                       decoder_input_ids=batch["decoder_input_ids"], params=params, dropout_rng=dropout_rng,
                       train=train)[0]
        return denoising.reconstruction_loss(logits, batch["labels"], batch.get("example_weight"), label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, training, train_data, train_noise)

    def evaluate(params):
        """Token-weighted loss and accuracy over every token of the validation examples (noised the
        same way every time), their perplexity, and how many tokens that is."""
        return lm.evaluate(steps, params, eval_arrays, eval_noise)

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    other_steps = dict(eval_step=(eval_arrays, lm.num_examples(eval_arrays), eval_noise))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, training, layout, train_data,
                      is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        for step, batch in run.train_batches(plan.seq_length, plan.seq_length, transform=train_noise):
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
