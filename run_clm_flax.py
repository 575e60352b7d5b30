#!/usr/bin/env python
"""Train or fine-tune a Flax causal language model (GPT-2, GPT-Neo, OPT, Llama, ...) on a text corpus,
or on chat and instruction data.

    python run_clm_flax.py configs/clm_tiny.json
    python run_clm_flax.py configs/chat_tiny.json
    python run_clm_flax.py config.json --block_size 256   # flags override the file

Text is tokenized, concatenated and cut into `block_size` blocks; the model learns to predict each
next token. Rows with `messages` (rendered with the tokenizer's chat template) or with `prompt` and
`completion` are one example each, the loss on the answers only; `--predict_with_generate` answers
the held-out prompts (greedily, or sampled with --do_sample), each up to its first end id, and scores
their exact match (`tasks/chat.py`). One train / eval loop,
each step defined once for both layouts (`--sharding dp`, jax.pmap over the local devices, the
default; `--sharding fsdp`, the model split over all devices);
everything mechanical (layouts, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModelForCausalLM

from tasks import causal_lm, chat, lm
from tasks.causal_lm import PREDICTIONS_FILE, TASK
from tasks.summarization import set_generation
from utils.base.arguments import ModelArguments, READS, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.kernels import lm_head
from utils.models.loading import fit_config_to_tokenizer, load_config, load_model, load_tokenizer
from utils.run.loop import InMemoryData
from utils.run.preflight import check_before_work
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class DataTrainingArguments(lm.LMDataArguments):
    block_size: Optional[int] = field(
        default=None, metadata={"help": "Tokens per training block (default: min(1024, the tokenizer's max length); "
                                        "at most the model's positions)."}
    )

    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file of chat or instruction rows (json, jsonl; also compressed) "
                                        "for --do_predict."})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the test set."})
    chat_template: Optional[str] = field(
        default=None, metadata={"help": "A Jinja chat template file to render `messages` rows with (default: the "
                                        "tokenizer's own); saved with the tokenizer.",
                                READS: "its chat template"})
    predict_with_generate: bool = field(
        default=False, metadata={"help": "Chat and instruction rows: answer each evaluated prompt (greedily unless "
                                         f"--do_sample), write {PREDICTIONS_FILE} and the exact match (whitespace "
                                         "normalised). Answers stop at every end id (chat.end_ids)."})
    max_new_tokens: int = field(default=32, metadata={"help": "With --predict_with_generate: tokens per answer."})
    do_sample: bool = field(
        default=False, metadata={"help": "With --predict_with_generate: sample the answers instead of taking the "
                                         "likeliest token, each row from its own key of --generation_seed."})
    temperature: Optional[float] = field(
        default=None, metadata={"help": "With --do_sample: divide the logits by this (> 0; default 1.0)."})
    top_k: Optional[int] = field(
        default=None, metadata={"help": "With --do_sample: draw from the k likeliest tokens only (default 0: all)."})
    top_p: Optional[float] = field(
        default=None, metadata={"help": "With --do_sample: draw from the likeliest tokens whose probabilities "
                                        "reach p (0 < p <= 1; default 1.0: all)."})
    generation_seed: Optional[int] = field(
        default=None, metadata={"help": "With --do_sample: the seed of the answers' draws (default: --seed)."})
    chunked_loss: bool = field(
        default=False, metadata={"help": "Form the LM head's logits 1024 positions at a time inside the loss, never "
                                         "the whole batch's, and again in the backward pass: less memory for large "
                                         "vocabularies, one more product of the head (GPT-2, Llama, Mistral, Gemma)."})

    def __post_init__(self):
        super().__post_init__()
        if self.block_size is not None and self.block_size <= 1:
            raise UsageError(f"--block_size must be at least 2 (a token and its successor), got {self.block_size}")
        if self.max_new_tokens < 1:
            raise UsageError(f"--max_new_tokens must be at least 1, got {self.max_new_tokens}")
        self.check_sampling()

    def check_sampling(self):
        if self.do_sample and not self.predict_with_generate:
            raise UsageError("--do_sample samples the answers of --predict_with_generate: add --predict_with_generate "
                             "or drop --do_sample")
        for flag in ("temperature", "top_k", "top_p", "generation_seed"):
            if getattr(self, flag) is not None and not self.do_sample:
                raise UsageError(f"--{flag} applies to sampled answers: add --do_sample (and --predict_with_generate) "
                                 f"or drop --{flag}")
        if self.temperature is not None and not self.temperature > 0:
            raise UsageError(f"--temperature must be above 0, got {self.temperature}: for the likeliest tokens drop "
                             "--do_sample")
        if self.top_k is not None and self.top_k < 0:
            raise UsageError(f"--top_k must be 0 (every token) or more, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UsageError(f"--top_p must be above 0 and at most 1, got {self.top_p}")

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    rows = preflight.findings  # the rows' format of local files: chat, instruction or text (None)
    _, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Config, tokenizer, data
    # ------------------------------------------------------------------------------------------
    tokenizer = load_tokenizer(model_args)
    config = fit_config_to_tokenizer(load_config(model_args, task="causal-lm"), tokenizer, model_args)
    block_size = causal_lm.fit_block_size(data_args, tokenizer, config)
    chunked_loss = lm_head.choose(data_args.chunked_loss, config)

    # ------------------------------------------------------------------------------------------
    # Data: chat or instruction rows, one example each; or text in blocks, read into memory or
    # streamed (--streaming). The model comes after, so bad or too little data fails first
    # ------------------------------------------------------------------------------------------
    raw, arrays, examples = None, {}, {}
    if rows or (data_args.dataset_name and not data_args.streaming):
        raw = causal_lm.load_row_splits(data_args, training_args, model_args.cache_dir)
        rows = rows or causal_lm.rows_format_of(raw, data_args)
    if rows:
        chat.use_template(tokenizer, data_args.chat_template)
        chat.check_template(tokenizer, rows)
        examples = causal_lm.read_rows(raw, rows, tokenizer, block_size, data_args.max_new_tokens)
        arrays = {split: examples[split].arrays for split in examples}
        train_data = InMemoryData(arrays["train"], len(arrays["train"]["input_ids"])) if "train" in arrays else None
    else:
        train_data, arrays["validation"] = causal_lm.read_blocks(data_args, training_args, tokenizer, block_size,
                                                                 model_args.cache_dir)
    plan = training_plan(training_args, train_data and train_data.size)

    model, params = load_model(FlaxAutoModelForCausalLM, model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        # With --chunked_loss the head hands back its inputs: the loss forms the logits chunk by chunk.
        with lm_head.head_inputs(chunked_loss):
            logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"), params=params,
                           dropout_rng=dropout_rng, train=train)[0]
        return causal_lm.next_token_loss(logits, batch["input_ids"], batch.get("example_weight"), label_smoothing,
                                         batch.get("answer_mask"))

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)

    # Answers stop at every end id; the export records them (and the sampling settings) in generation_config.json,
    # where the demo, transformers and serving engines find them.
    decoding = causal_lm.decoding_of(data_args, chat.end_ids(tokenizer, config, model.generation_config))
    set_generation(model, **causal_lm.exported_generation(decoding))

    def generate_step(params, batch):
        return causal_lm.generate_answers(model, params, batch, data_args.max_new_tokens, decoding)

    generates = bool(rows) and data_args.predict_with_generate
    p_generate_step = layout.compile_step("generate_step", generate_step) if generates else None
    seed = training_args.seed if data_args.generation_seed is None else data_args.generation_seed
    prompts = {split: causal_lm.generation_inputs(examples[split].prompts, decoding, seed)
               for split in examples} if generates else {}

    def evaluate(params, split="validation"):
        """(next-token loss over the split's answer tokens or blocks, weighted by token, its perplexity
        and the tokens scored; with --predict_with_generate the exact match of the generated answers, and
        their texts, else None)."""
        metrics = lm.evaluate(steps, params, arrays[split])
        if not generates:
            return metrics, None
        generated = []
        for batch, valid in steps.eval_batches(prompts[split], lm.num_examples(prompts[split])):
            generated.extend(layout.rows_to_host(p_generate_step(params, batch))[:valid])
        texts = chat.answer_texts(tokenizer, generated, decoding.end_ids)
        return {**metrics, "exact_match": chat.exact_match(texts, examples[split].references)}, texts

    def report(params, split="validation", prefix="eval"):
        """Evaluate, write `{prefix}_results.json`, and the generated answers (the latest replace earlier ones)."""
        metrics, texts = evaluate(params, split)
        run.report(prefix, metrics)
        if texts is not None:
            run.write_text(PREDICTIONS_FILE, texts)

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    evaluated = arrays.get("validation", arrays.get("test"))
    first_prompts = prompts.get("validation", prompts.get("test")) if generates else None
    other_steps = dict(eval_step=(evaluated, lm.num_examples(evaluated)),
                       generate_step=first_prompts and (first_prompts, lm.num_examples(first_prompts)))

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, tokenizer, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        width = train_data.arrays["input_ids"].shape[1] if rows else block_size
        for step, batch in run.train_batches(width):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                report(state.params)
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation and prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        report(state.params)
    if training_args.do_predict:
        report(state.params, "test", "test")
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
