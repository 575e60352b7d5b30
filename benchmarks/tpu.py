#!/usr/bin/env python
"""Speed on a real TPU: tokens/s, MFU, start-up and memory of the LM and summarization scripts.

    python benchmarks/tpu.py                                   # every row, on a TPU VM (~15 min on one v5e chip)
    python benchmarks/tpu.py --rows gpt2_small --steps 60      # one row
    python benchmarks/tpu.py --classic DIR                     # also the classic examples/flax scripts in DIR
    python benchmarks/tpu.py --classic DIR --classic_only      # only them, beside the rows already measured

Each row trains from scratch in bf16 on text this file makes (data/make_lm_corpus.py, ~2.7 MB; the
summarization rows on data/summarization), in fresh processes:
  speed     the script's steady-state tokens/s and MFU from its metrics.jsonl (the first step left out),
            the memory it planned for the train step against the device's peak, peak host memory; then
            the train step alone in a tight loop (benchmarks/measure.py): the speed limit of the loop
  cold      the plain script with an empty compilation cache: first step (s after start, compilation
            included)
  warm      the same run again, the compilation cache filled by the cold one: first step
  classic   with --classic DIR (a folder holding the classic run_clm_flax.py, run_mlm_flax.py and
            run_summarization_flax.py): the classic script on the same data, model and batch, its train step
            timed call by call (benchmarks/classic_timer.py); steady-state tokens/s. With --classic_only, this
            alone, added to the row already in --output (ours take most of a row's device time)
Refuses to run without TPU chips. Writes --output (JSON) after each row and prints a table.
"""

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.run import (FIRST_STEP, environment, format_table, save_records,  # noqa: E402
                            script_tokens_per_second)

# Model shapes by config overrides; each row trains with the flags after it. Global batches.
ROWS = {
    "gpt2_small": ("clm", "gpt2", "n_embd=768,n_layer=12,n_head=12,n_positions=1024",
                   ["--block_size", "1024", "--total_train_batch_size", "16"]),
    "llama_0.6b": ("clm", "llama", "hidden_size=1536,intermediate_size=4096,num_hidden_layers=16,num_attention_heads=12,"
                   "num_key_value_heads=12,max_position_embeddings=1024",
                   ["--block_size", "1024", "--total_train_batch_size", "8"]),
    # The project's own decoder family (utils/models/decoders.py), shaped as Qwen3-0.6B and Gemma-3-1B (the
    # corpus tokenizer's vocabulary, not theirs).
    "qwen3_0.6b": ("clm", "qwen3", "hidden_size=1024,intermediate_size=3072,num_hidden_layers=28,num_attention_heads=16,"
                   "num_key_value_heads=8,head_dim=128,max_position_embeddings=1024,tie_word_embeddings=true",
                   ["--block_size", "1024", "--total_train_batch_size", "8", "--gradient_checkpointing"]),
    "gemma3_1b": ("clm", "gemma3_text", "hidden_size=1152,intermediate_size=6912,num_hidden_layers=26,"
                  "num_attention_heads=4,num_key_value_heads=1,head_dim=256,sliding_window=512,"
                  "max_position_embeddings=1024",
                  ["--block_size", "1024", "--total_train_batch_size", "8", "--gradient_checkpointing"]),
    "t5_small": ("summarization", "t5", "d_model=512,d_ff=2048,num_layers=6,num_decoder_layers=6,num_heads=8,d_kv=64",
                 ["--max_source_length", "256", "--max_target_length", "64", "--total_train_batch_size", "32"]),
    "bert_base": ("mlm", "roberta", "hidden_size=768,num_hidden_layers=12,num_attention_heads=12,intermediate_size=3072,"
                  "max_position_embeddings=514",
                  ["--max_seq_length", "512", "--total_train_batch_size", "32"]),
}
SCRIPTS = {"clm": "run_clm_flax.py", "summarization": "run_summarization_flax.py", "mlm": "run_mlm_flax.py"}
PLANNED = re.compile(r"train step \(\w+\): ([0-9.]+) (GiB|MiB) per device")
PARAMETERS = re.compile(r"parameters: ([0-9,]+) trained")
HELD_FROM_START = re.compile(r"\(([0-9.]+) GiB of it held from the start")


def on_tpu():
    """Whether this machine has TPU chips (asked without opening them: the runs need them free)."""
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0


def make_data(work, lines, block_size=1024):
    """The LM corpus (`lines` lines: 40,000 make ~2.7 MB) and its tokenizer, which says it takes `block_size` tokens:
    the classic scripts cut --block_size / --max_seq_length to the tokenizer's model_max_length."""
    from transformers import AutoTokenizer

    corpus = os.path.join(work, "lm")
    subprocess.run([sys.executable, "data/make_lm_corpus.py", "--output_dir", corpus, "--train_lines", str(lines)],
                   cwd=ROOT, check=True, capture_output=True)
    tokenizer = AutoTokenizer.from_pretrained(f"{corpus}/tokenizer")
    tokenizer.model_max_length = block_size
    tokenizer.save_pretrained(f"{corpus}/tokenizer")
    summaries = []
    for split in ("train", "validation"):  # as .json: the classic script takes no .jsonl
        summaries += [f"--{split}_file", shutil.copy(f"{ROOT}/data/summarization/{split}.jsonl", f"{work}/{split}.json")]
    lm = ["--tokenizer_name", f"{corpus}/tokenizer", "--train_file", f"{corpus}/train.txt",
          "--validation_file", f"{corpus}/validation.txt"]
    return {"clm": lm, "mlm": lm,
            "summarization": ["--tokenizer_name", f"{ROOT}/data/summarization/tokenizer", *summaries]}


def config_dir(work, name, model_type, overrides, tokenizer):
    """A config.json both our script and the classic one read (the classic ones take no overrides)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.for_model(model_type)
    config.update_from_string(overrides)
    if getattr(config, "layer_types", None):  # made for the default depth: derived again for this one
        config = type(config)(**{key: value for key, value in config.to_dict().items() if key != "layer_types"})
    tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    config.vocab_size = len(tokenizer)
    if config.is_encoder_decoder and config.decoder_start_token_id is None:  # T5's: decoding starts at the pad
        config.decoder_start_token_id = tokenizer.pad_token_id
    path = os.path.join(work, f"config-{name}")
    config.save_pretrained(path)
    return path


def classic_environment(env):
    """The classic summarization script refuses offline mode when NLTK's punkt is missing (it would
    download it; without a network that fails quietly): it runs without the offline switches."""
    return {name: value for name, value in env.items() if name not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


class RunFailed(Exception):
    """A run ended with an error; the message holds the command, its exit status and its log's tail."""


# A traceback's last line naming what was raised: `jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: ...`.
RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b[^ ]*:")


def last_line(failure):
    """The exit status and what the run died of: the last exception and its message (up to a `---` line, where
    JAX appends a note on its traceback), else the log's last line (a progress bar's, when it was killed)."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(failure)).replace("\r", "\n")  # no terminal codes
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    status = re.search(r"\(exit -?[0-9]+\)", lines[0])
    raised = [i for i, line in enumerate(lines) if RAISED.match(line)]
    what = lines[-1:]
    if raised:
        what = list(itertools.takewhile(lambda line: not line.startswith("---"), lines[raised[-1]:]))
    return f"{status.group(0) if status else ''} {' '.join(what)}"[:300].strip()


def run(command, env, log_path, cwd=ROOT):
    """The command's log (stdout and stderr, also written to `log_path`); raises RunFailed if it fails."""
    with open(log_path, "w", encoding="utf-8") as log:
        result = subprocess.run(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    with open(log_path, encoding="utf-8") as log:
        text = log.read()
    if result.returncode:
        raise RunFailed(f"{' '.join(command[:3])} failed (exit {result.returncode}), log {log_path}:\n{text[-3000:]}")
    return text


def gib(value, unit):
    return float(value) / (1024 if unit == "MiB" else 1)


def planned_gib(log_text):
    """The train step's planned device memory in GiB from a script's log (its plan line), or None."""
    planned = PLANNED.search(log_text)
    return gib(*planned.groups()) if planned else None


def measure_row(name, work, data, steps, logs, classic, save):
    """The row's figures, `save`d as soon as ours are in (the classic's take minutes more)."""
    task, model_type, overrides, flags = ROWS[name]
    config = config_dir(work, name, model_type, overrides, data[task][1])
    cache = os.path.join(work, f"jax-cache-{name}")
    out = os.path.join(work, f"out-{name}")
    common = ["--config_name", config, *data[task], *flags, "--dtype", "bfloat16", "--do_train", "--do_eval", "false",
              "--output_dir", out, "--overwrite_output_dir", "--num_train_epochs", "1000", "--save_steps", "1000000",
              "--seed", "42"]
    record = {"row": name, "script": SCRIPTS[task], "overrides": overrides, "flags": flags}
    env = environment(os.path.join(work, "datasets"))

    # Throughput, the step's speed limit and memory: the script under benchmarks/measure.py, whose step
    # recorder wraps the steps (so its programs are not the plain script's: it gets no compilation cache).
    measured_json = os.path.join(work, f"measure-{name}.json")
    text = run([sys.executable, "benchmarks/measure.py", "--repeats", "20", measured_json, "--", SCRIPTS[task],
                   *common, "--max_steps", str(steps), "--logging_steps", str(max(steps // 6, 1))],
                  env, os.path.join(logs, f"{name}-throughput.log"))
    with open(measured_json, encoding="utf-8") as f:
        measured = json.load(f)
    train = measured["steps"]["train_step"]
    rate, mfu, timed = script_tokens_per_second(os.path.join(out, "metrics.jsonl"))
    record.update(device_kind=measured["device_kind"], device_count=measured["device_count"],
                  tokens_per_step=train["tokens_per_call"], script_tokens_per_second=rate, script_mfu=mfu,
                  script_timed_steps=timed,
                  limit_tokens_per_second=train["tokens_per_call"] / train["seconds_per_call"],
                  peak_host_memory_gib=measured["peak_host_memory"] / 2**30,
                  peak_device_memory_gib=(measured["peak_device_memory"] or 0) / 2**30)
    held = HELD_FROM_START.search(text)
    record["host_memory_held_from_start_gib"] = float(held.group(1)) if held else None
    record["planned_device_memory_gib"] = planned_gib(text)
    parameters = PARAMETERS.search(text)
    record["parameters"] = int(parameters.group(1).replace(",", "")) if parameters else None

    # Start-up: the plain script twice on one compilation cache, empty (cold), then filled by the first (warm).
    for state in ("cold", "warm"):
        text = run([sys.executable, SCRIPTS[task], *common, "--max_steps", "2", "--logging_steps", "1",
                       "--compilation_cache_dir", cache], env, os.path.join(logs, f"{name}-{state}.log"))
        record[f"first_step_{state}_seconds"] = float(FIRST_STEP.search(text).group(1))
    save(record)

    if classic:
        add_classic(record, name, work, data, steps, logs, classic)
    return record


def add_classic(record, name, work, data, steps, logs, classic):
    """The classic script's figures added to the row's `record` (which holds ours): its latest attempt's."""
    task, model_type, overrides, _ = ROWS[name]
    config = config_dir(work, name, model_type, overrides, data[task][1])
    env = environment(os.path.join(work, "datasets"))
    for key in ("classic_tokens_per_second", "vs_classic", "classic_failed"):
        record.pop(key, None)
    record["classic_date"] = time.strftime("%Y-%m-%d")
    try:
        record.update(classic_speed(name, work, data, steps, logs, classic, config, env, record["tokens_per_step"]))
        record["vs_classic"] = record["script_tokens_per_second"] / record["classic_tokens_per_second"]
    except RunFailed as failure:  # e.g. out of memory: the row keeps ours, and says why the classic has none
        record["classic_failed"] = last_line(failure)


def classic_speed(name, work, data, steps, logs, classic, config, env, tokens_per_step):
    """The classic script's steady-state tokens/s on the row's data, model and batch."""
    task, _, _, flags = ROWS[name]
    timings = os.path.join(work, f"classic-{name}.json")
    classic_flags = [flag for flag in flags if flag != "--gradient_checkpointing"]
    batch = classic_flags.index("--total_train_batch_size")
    classic_flags[batch:batch + 2] = ["--per_device_train_batch_size", classic_flags[batch + 1]]
    # In the work dir: the classic summarization script leaves a lock file where it runs.
    run([sys.executable, os.path.join(ROOT, "benchmarks", "classic_timer.py"), timings, str(steps), "--",
         os.path.abspath(os.path.join(classic, SCRIPTS[task])), "--config_name", config, *data[task], *classic_flags,
         # --do_eval: the classic summarization script reads its eval set whatever it is told
         "--dtype", "bfloat16", "--do_train", "--do_eval", "--output_dir", os.path.join(work, f"classic-out-{name}"),
         "--overwrite_output_dir", "--num_train_epochs", "1000", "--logging_steps", "1000000",
         "--save_steps", "1000000", "--eval_steps", "1000000"],
        classic_environment(env), os.path.join(logs, f"{name}-classic.log"),
        cwd=work)
    with open(timings, encoding="utf-8") as f:
        seconds = json.load(f)["seconds_per_step"]
    steady = sorted(seconds[2:])[len(seconds[2:]) // 2]  # the median after compiling
    return {"classic_tokens_per_second": tokens_per_step / steady}


def rows_measured(path):
    """{row: record} of the rows already in the results file at `path`."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return {record["row"]: record for record in json.load(f)}


def table(records):
    return format_table(records, [
        ("row", "row", "{}"), ("tok/s", "script_tokens_per_second", "{:,.0f}"), ("MFU", "script_mfu", "{:.3f}"),
        ("limit tok/s", "limit_tokens_per_second", "{:,.0f}"),
        ("classic tok/s", "classic_tokens_per_second", "{:,.0f}"), ("x classic", "vs_classic", "{:.2f}"),
        ("first cold s", "first_step_cold_seconds", "{:.1f}"), ("warm s", "first_step_warm_seconds", "{:.1f}"),
        ("plan GiB", "planned_device_memory_gib", "{:.2f}"), ("peak GiB", "peak_device_memory_gib", "{:.2f}"),
        ("host GiB", "peak_host_memory_gib", "{:.1f}"),
        ("held from start", "host_memory_held_from_start_gib", "{:.1f}")])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--steps", type=int, default=120, help="Training steps of the timed run.")
    parser.add_argument("--corpus_lines", type=int, default=40000, help="Lines of the LM corpus made for the rows.")
    parser.add_argument("--classic", help="Folder with the classic examples/flax scripts, to run beside ours.")
    parser.add_argument("--classic_only", action="store_true",
                        help="With --classic: time only the classic scripts, added to the rows already in --output.")
    parser.add_argument("--logs", help="Keep each run's log here.")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results_tpu.json"))
    args = parser.parse_args()
    if not on_tpu():
        sys.exit("error: benchmarks/tpu.py measures a TPU, and this machine has no TPU chips: run it on a TPU VM")
    if args.classic and not all(os.path.isfile(os.path.join(args.classic, SCRIPTS[ROWS[row][0]])) for row in args.rows):
        sys.exit(f"error: --classic {args.classic} lacks one of {sorted(set(SCRIPTS.values()))}: copy them there from "
                 "transformers' examples/flax")
    measured = {}
    if args.classic_only:
        if not args.classic:
            sys.exit("error: --classic_only times the classic scripts: give their folder with --classic DIR")
        measured = rows_measured(args.output)
        missing = [row for row in args.rows if "tokens_per_step" not in measured.get(row, {})]
        if missing:
            sys.exit(f"error: --classic_only adds to rows already measured, and {args.output} lacks "
                     f"{', '.join(missing)}: run benchmarks/tpu.py --rows {' '.join(missing)} first")
    work = tempfile.mkdtemp(prefix="flaxtune-tpu-")
    logs = args.logs or work
    os.makedirs(logs, exist_ok=True)
    records = []
    try:
        data = make_data(work, args.corpus_lines)
        for row in args.rows:
            print(f"{row} ...", file=sys.stderr, flush=True)

            def save(record):
                record.setdefault("date", time.strftime("%Y-%m-%d"))  # a row's date is when ours were measured
                save_records(args.output, records + [record], key=lambda record: record["row"])

            try:
                if args.classic_only:
                    record = measured[row]
                    add_classic(record, row, work, data, args.steps, logs, args.classic)
                else:
                    record = measure_row(row, work, data, args.steps, logs, args.classic, save)
            except RunFailed as failure:  # one row failing (out of memory, say) leaves the other rows to measure
                print(failure, file=sys.stderr)
                record = {"row": row, "failed": last_line(failure)}
            save(record)
            records.append(record)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(records))


if __name__ == "__main__":
    main()
