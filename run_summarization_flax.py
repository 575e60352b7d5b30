#!/usr/bin/env python
"""Fine-tune a Flax sequence-to-sequence model (T5, BART, Pegasus, ...) for summarization.

    python run_summarization_flax.py configs/summarization_tiny.json
    python run_summarization_flax.py config.json --learning_rate 1e-4   # flags override the file

One `jax.pmap` train / eval / generate loop over all local devices; everything mechanical
(sharding, schedules, checkpoints, metrics, logging) lives in `utils/`.
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from utils import compat, data, sharding
from utils.args import (BaseDataArguments, ModelArguments, TrainingArguments, check_output_dir, check_phases,
                        parse_args, public_args, save_args)
from utils.checkpoint import Checkpointer, HubPusher, export_pretrained, find_checkpoint_dir
from utils.errors import RunError, UsageError, run_main
from utils.logging import MetricsLogger, Throughput, flops_per_token, peak_flops_per_device, setup_logging
from utils.metrics import rouge, token_weighted_means
from utils.models import load_config, load_model, load_tokenizer
from utils.optim import create_optimizer, learning_rate_schedule
from utils.state import create_train_state
from utils.steps import cross_entropy_sums, token_weighted_grads

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
    test_file: Optional[str] = field(default=None, metadata={"help": "Local test file (json, jsonl or csv)."})
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
def resolve_columns(data_args, column_names):
    """Document and summary columns: explicit, the dataset's known pair, or the first two."""
    known = SUMMARIZATION_COLUMNS.get(os.path.basename(data_args.dataset_name or ""))
    defaults = known or tuple(column_names[:2])
    text = data_args.text_column or defaults[0]
    summary = data_args.summary_column or (defaults[1] if len(defaults) > 1 else None)
    for flag, name in (("text_column", text), ("summary_column", summary)):
        if name not in column_names:
            raise UsageError(f"--{flag} {name!r} is not a column of the data; columns: {', '.join(column_names)}")
    return text, summary


def preprocess(dataset, tokenizer, config, data_args, text_column, summary_column, max_target_length, model_module):
    """Tokenize to fixed lengths; labels are the summary, decoder inputs the labels shifted right."""

    def tokenize(examples):
        inputs = [data_args.source_prefix + text for text in examples[text_column]]
        model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, padding="max_length",
                                 truncation=True, return_tensors="np")
        labels = tokenizer(text_target=examples[summary_column], max_length=max_target_length,
                           padding="max_length", truncation=True, return_tensors="np")
        model_inputs["labels"] = labels["input_ids"]
        model_inputs["decoder_input_ids"] = model_module.shift_tokens_right(
            labels["input_ids"], config.pad_token_id, config.decoder_start_token_id
        )
        model_inputs["decoder_attention_mask"] = labels["attention_mask"]
        return model_inputs

    # Empty documents or summaries teach nothing and break ROUGE: drop them and say how many.
    def usable(example):
        return bool(str(example[text_column] or "").strip()) and bool(str(example[summary_column] or "").strip())

    kept = dataset.filter(usable, num_proc=data_args.preprocessing_num_workers,
                          load_from_cache_file=not data_args.overwrite_cache, desc="dropping empty examples")
    dropped = len(dataset) - len(kept)
    return kept.map(tokenize, batched=True, num_proc=data_args.preprocessing_num_workers,
                    remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                    desc="tokenizing"), dropped


MODEL_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
INPUT_COLUMNS = MODEL_INPUTS + ("labels",)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (ModelArguments, DataTrainingArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    check_phases(training_args)
    checkpoint_dir = find_checkpoint_dir(training_args.output_dir)
    check_output_dir(training_args, has_checkpoint=os.path.isdir(checkpoint_dir))
    if training_args.push_to_hub and not training_args.hub_token:
        raise UsageError("--push_to_hub needs --hub_token (or run `huggingface-cli login` and pass the token)")
    needed = {"train": training_args.do_train, "validation": training_args.do_eval, "test": training_args.do_predict}
    for split, flag in (("validation", "do_eval"), ("test", "do_predict"), ("train", "do_train")):
        files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
        if needed[split] and not data_args.dataset_name and not files[split]:
            option = {"train": "--train_file", "validation": "--validation_file", "test": "--test_file"}[split]
            raise UsageError(f"--{flag} needs {split} data: pass {option} or --dataset_name")
        if files[split]:
            data.file_builder(files[split], allowed=("json", "csv"))

    # ------------------------------------------------------------------------------------------
    # Devices, logging
    # ------------------------------------------------------------------------------------------
    compat.apply()
    sharding.enable_compilation_cache(training_args.compilation_cache_dir)
    is_main = jax.process_index() == 0
    logger = setup_logging(is_main, debug=training_args.debug)
    logger.info("devices: %d local of %d total, %s", jax.local_device_count(), jax.device_count(),
                jax.devices()[0].device_kind)

    # ------------------------------------------------------------------------------------------
    # Tokenizer, model, data
    # ------------------------------------------------------------------------------------------
    from transformers import FlaxAutoModelForSeq2SeqLM

    config = load_config(model_args, task="seq2seq")
    if config.decoder_start_token_id is None:
        raise UsageError(f"the {config.model_type} config has no decoder_start_token_id: set it in the config")
    tokenizer = load_tokenizer(model_args)
    raw = data.load_splits(
        data_args,
        {"train": data_args.train_file if needed["train"] else None,
         "validation": data_args.validation_file if needed["validation"] else None,
         "test": data_args.test_file if needed["test"] else None},
        cache_dir=model_args.cache_dir,
        allowed=("json", "csv"),
    )
    for split, wanted in needed.items():
        if wanted and split not in raw:
            raise UsageError(f"the dataset has no {split!r} split (it has: {', '.join(raw)})")
    column_names = next(iter(raw[s] for s in needed if needed[s])).column_names
    text_column, summary_column = resolve_columns(data_args, column_names)
    max_samples = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
                   "test": data_args.max_predict_samples}

    model = load_model(FlaxAutoModelForSeq2SeqLM, model_args, config,
                       dtype=sharding.to_dtype(model_args.dtype), seed=training_args.seed)
    if training_args.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model_module = sys.modules[model.__module__]

    arrays, sizes = {}, {}
    for split in (s for s in needed if needed[s]):
        target_length = data_args.max_target_length if split == "train" else data_args.val_max_target_length
        dataset, dropped = preprocess(data.take(raw[split], max_samples[split]), tokenizer, config, data_args,
                                      text_column, summary_column, target_length, model_module)
        if dropped:
            logger.warning("%s: dropped %d examples with an empty document or summary", split, dropped)
        if len(dataset) == 0:
            raise UsageError(f"the {split} data has no usable examples (all documents or summaries are empty)")
        arrays[split], sizes[split] = data.to_arrays(dataset, INPUT_COLUMNS), len(dataset)
        logger.info("%s: %d examples", split, len(dataset))

    # ------------------------------------------------------------------------------------------
    # Schedule, optimizer, state, steps
    # ------------------------------------------------------------------------------------------
    accumulation = training_args.gradient_accumulation_steps
    train_batch_size = sharding.global_batch_size(training_args.per_device_train_batch_size, accumulation)
    eval_batch_size = sharding.global_batch_size(training_args.per_device_eval_batch_size)
    steps_per_epoch = total_steps = 0
    if training_args.do_train:
        steps_per_epoch = data.steps_per_epoch(sizes["train"], train_batch_size)
        if steps_per_epoch == 0:
            raise UsageError(
                f"{sizes['train']} training examples are fewer than one global batch of {train_batch_size} "
                f"(per_device_train_batch_size x {jax.device_count()} devices x accumulation): lower the batch size"
            )
        total_steps = (training_args.max_steps if training_args.max_steps > 0
                       else int(np.ceil(training_args.num_train_epochs * steps_per_epoch)))
    schedule = learning_rate_schedule(training_args.lr_scheduler_type, training_args.learning_rate,
                                      training_args.warmup_steps, max(total_steps, 1))
    optimizer = create_optimizer(training_args, schedule)
    state = create_train_state(model.__call__, model.params, optimizer, training_args.seed)
    label_smoothing = training_args.label_smoothing_factor

    def loss_fn(params, batch, dropout_rng, train):
        inputs = {k: batch[k] for k in MODEL_INPUTS}
        logits = state.apply_fn(**inputs, params=params, dropout_rng=dropout_rng, train=train)[0]
        weights = batch["decoder_attention_mask"]
        if "example_weight" in batch:  # eval/predict: padded rows weigh 0
            weights = weights * batch["example_weight"][:, None]
        loss, tokens = cross_entropy_sums(logits, batch["labels"], weights, label_smoothing if train else 0.0)
        return loss, {"loss": loss, "tokens": tokens}

    def train_step(state, batch):
        dropout_rng, state = state.next_dropout_rng()
        grads, sums = token_weighted_grads(partial(loss_fn, train=True), state.params, batch, dropout_rng,
                                           accumulation)
        return state.apply_gradients(grads=grads), sums

    def eval_step(params, batch):
        _, sums = loss_fn(params, batch, None, train=False)
        return jax.lax.psum(sums, sharding.AXIS)

    max_length = data_args.val_max_target_length
    num_beams = data_args.num_beams if data_args.num_beams is not None else model.config.num_beams

    def generate_step(params, batch):
        output = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], params=params,
                                max_length=max_length, num_beams=num_beams)
        return output.sequences

    p_train_step = jax.pmap(train_step, sharding.AXIS, donate_argnums=(0,))
    p_eval_step = jax.pmap(eval_step, sharding.AXIS)
    p_generate_step = jax.pmap(generate_step, sharding.AXIS)

    # ------------------------------------------------------------------------------------------
    # Output dir, checkpoints, resume
    # ------------------------------------------------------------------------------------------
    os.makedirs(training_args.output_dir, exist_ok=True)
    if is_main:
        save_args(training_args.output_dir, model_args, data_args, training_args)
    checkpointer = Checkpointer(checkpoint_dir, max_to_keep=training_args.save_total_limit, is_main_process=is_main)
    pusher = None
    if training_args.push_to_hub and is_main:
        repo_id = training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir))
        pusher = HubPusher(repo_id, training_args.hub_token, training_args.output_dir)
    start_step = 0
    if training_args.resume_from_checkpoint:
        step = None if training_args.resume_from_checkpoint == "latest" else int(training_args.resume_from_checkpoint)
        state, meta = checkpointer.restore(step, state)
        start_step = int(meta["step"])
        logger.info("resumed from the checkpoint of step %d", start_step)
    state = sharding.replicate_state(state)

    writer = MetricsLogger(training_args.output_dir, is_main_process=is_main, total_steps=total_steps)
    writer.hparams(public_args(model_args, data_args, training_args))

    def save(step):
        checkpointer.save(step, state, {"step": step, "epoch": step / max(steps_per_epoch, 1)})
        export_pretrained(model, state.params, tokenizer, training_args.output_dir, is_main_process=is_main)
        if pusher:
            pusher.push(f"step {step}")

    # ------------------------------------------------------------------------------------------
    # Evaluation and prediction (pad-shard-unpad: every example counted exactly once)
    # ------------------------------------------------------------------------------------------
    eval_rows = sharding.process_slice(eval_batch_size)

    def evaluate(split):
        sums, predictions = [], []
        for start, stop in data.eval_batch_ranges(sizes[split], eval_batch_size):
            batch, valid = sharding.pad_to(data.gather(arrays[split], np.arange(start, stop)), eval_batch_size)
            batch["example_weight"] = sharding.example_mask(valid, eval_batch_size)
            batch = sharding.shard({k: v[eval_rows] for k, v in batch.items()})
            sums.append(p_eval_step(state.params, batch))
            if data_args.predict_with_generate:
                ids = sharding.gather_from_processes(sharding.unshard(p_generate_step(state.params, batch)))
                predictions.extend(ids[:valid])
        metrics = token_weighted_means(jax.device_get([{k: v[0] for k, v in s.items()} for s in sums]))
        if data_args.predict_with_generate:
            texts = tokenizer.batch_decode(predictions, skip_special_tokens=True)
            references = tokenizer.batch_decode(arrays[split]["labels"], skip_special_tokens=True)
            metrics.update(rouge(texts, references))
            metrics["gen_len"] = float(np.mean([np.count_nonzero(p != config.pad_token_id) for p in predictions]))
            return metrics, texts
        return metrics, None

    def write_results(split_prefix, metrics, step):
        results = {f"{split_prefix}_{k}": round(v, 4) for k, v in metrics.items()}
        writer.log(step, metrics, split=split_prefix)
        if is_main:
            with open(os.path.join(training_args.output_dir, f"{split_prefix}_results.json"), "w") as f:
                json.dump(results, f, indent=2)
        logger.info("%s: %s", split_prefix, results)
        return results

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    all_results, last_eval_step = {}, None
    if training_args.do_train:
        logger.info("training: %d steps (%d per epoch), global batch %d = %d per device x %d devices x %d",
                    total_steps, steps_per_epoch, train_batch_size, training_args.per_device_train_batch_size,
                    jax.device_count(), accumulation)
        tokens_per_step = train_batch_size * (data_args.max_source_length + data_args.max_target_length)
        peak = peak_flops_per_device(jax.devices()[0])
        throughput = Throughput(flops_per_token(config, data_args.max_source_length, data_args.max_target_length),
                                peak * jax.device_count() if peak else None)
        rows = sharding.process_slice(train_batch_size)
        batches = sharding.prefetch(
            data.gather(arrays["train"], data.train_batch_indices(sizes["train"], train_batch_size, training_args.seed,
                                                                  *divmod(step, steps_per_epoch), rows=rows))
            for step in range(start_step, total_steps)
        )
        window, train_start = [], time.time()
        for step, batch in enumerate(batches, start=start_step + 1):
            state, sums = p_train_step(state, batch)
            window.append(sums)
            if step == start_step + 1:
                jax.block_until_ready(sums)
                throughput.start()
            else:
                throughput.update(tokens_per_step, train_batch_size)
            writer.advance(step)
            if step % training_args.logging_steps == 0 or step == total_steps:
                metrics = token_weighted_means(jax.device_get([{k: v[0] for k, v in s.items()} for s in window]))
                if not np.isfinite(metrics["loss"]):
                    raise RunError(f"non-finite training loss at step {step}: lower --learning_rate or use "
                                   "float32; the last good checkpoint is kept")
                metrics["learning_rate"] = float(schedule(step - 1))
                metrics.update(throughput.rates() if step > start_step + 1 else {})
                writer.log(step, metrics)
                window = []
            eval_due = (step % training_args.eval_steps == 0 if training_args.eval_steps
                        else step % steps_per_epoch == 0)
            if training_args.do_eval and (eval_due or step == total_steps):
                metrics, _ = evaluate("validation")
                all_results.update(write_results("eval", metrics, step))
                last_eval_step = step
            if step % training_args.save_steps == 0 or step == total_steps:
                save(step)
        all_results["train_runtime"] = round(time.time() - train_start, 2)
        checkpointer.wait()

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    final_step = int(jax.device_get(state.step[0]))
    if training_args.do_eval and last_eval_step != final_step:
        metrics, _ = evaluate("validation")
        all_results.update(write_results("eval", metrics, final_step))
    if training_args.do_predict:
        metrics, texts = evaluate("test")
        all_results.update(write_results("test", metrics, final_step))
        if texts is not None and is_main:
            with open(os.path.join(training_args.output_dir, "generated_predictions.txt"), "w") as f:
                f.writelines(" ".join(text.split()) + "\n" for text in texts)
    if is_main:
        with open(os.path.join(training_args.output_dir, "all_results.json"), "w") as f:
            json.dump(all_results, f, indent=2)
    writer.close()
    checkpointer.close()
    if pusher:
        pusher.push("end of training")
        pusher.wait()


if __name__ == "__main__":
    sys.exit(run_main(main))
