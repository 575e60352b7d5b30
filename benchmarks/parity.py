#!/usr/bin/env python
"""Learn as well as the classic scripts? Each task script and its Hugging Face `examples/flax` counterpart
on the same data, starting weights and hyper-parameters, over several seeds: mean and spread of the
eval metric for both.

    python benchmarks/parity.py --classic DIR                    # every task, seeds 42 1 2: ~25 min on 2 idle CPU cores
    python benchmarks/parity.py --classic DIR --tasks text ner --seeds 42 1 2 3 4
    python benchmarks/parity.py --merge text.json qa.json ...   # tasks run side by side, into one file

DIR (or $FLAXTUNE_CLASSIC_DIR) holds the classic scripts, which this project does not ship: their own
layout under examples/flax (text-classification/run_flax_glue.py, question-answering/run_qa.py with
utils_qa.py, token-classification/run_flax_ner.py, vision/run_image_classification.py) plus
`run_classic.py`, a launcher that puts an offline `evaluate` on the path (the scripts call
`evaluate.load`, which needs the hub) and runs the script given. The image script imports torch and
torchvision: `DIR/venv/bin/python` runs it when present (a side environment; torch stays out of
this project's), the interpreter running this file the others. docs/parity.md says how DIR was made.

Each (task, seed, side) runs in its own process on 8 virtual CPU devices. What both sides share:
- text: data/lm/word_classes (which kind of word a sentence's one corpus word is), from the export of
  `run_mlm_flax.py configs/mlm_tiny.json` (made once under --work), so the encoder is pretrained.
- qa: data/qa (SQuAD v1.1) in the classic scripts' flat {"data": [rows]} layout, which both read.
- ner: data/ner as .json lines (the classic script takes .json or .csv only).
- image: data/images (digits); the classic script's augmentation (random-resized crop at scale 0.08-1,
  horizontal flip) asked of ours with --min_crop_scale 0.08 --random_flip.
qa, ner and image start from one saved random initialisation of the tiny configs' encoder (seed 0),
the same file for both sides: this project ships no pretrained encoder for their vocabularies.
The text and NER tasks also run "classic_seeded": the classic script with its new head drawn from
--seed (SEEDED_HEAD_SIDE). Writes every run's metric, the means and the sample standard deviations
to --output (JSON), keeping the tasks it already holds that were not run.
"""

import argparse
import gzip
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSIC_SCRIPTS = {"text": "text-classification/run_flax_glue.py", "qa": "question-answering/run_qa.py",
                   "ner": "token-classification/run_flax_ner.py", "image": "vision/run_image_classification.py"}
NEEDED = [*CLASSIC_SCRIPTS.values(), "question-answering/utils_qa.py", "run_classic.py"]
OURS = {"text": "run_flax_glue.py", "qa": "run_qa.py", "ner": "run_flax_ner.py",
        "image": "run_image_classification.py"}
# The metric each side writes (the classic image script writes none: its last "Eval Accuracy" line).
METRIC = {"text": "eval_accuracy", "qa": "eval_f1", "ner": "eval_f1", "image": "eval_accuracy"}
# The classic text and NER scripts load the model without a seed: their new head is transformers' seed-0
# draw whatever --seed says. "classic_seeded" runs them with the head drawn from --seed (the launcher's
# CLASSIC_SEED_NEW_WEIGHTS), as the classic QA and image scripts and this project draw it.
SEEDED_HEAD_SIDE = {"text", "ner"}
CLASSIC_IMAGE_ACCURACY = re.compile(r"Eval Accuracy: ([0-9.]+)\)")

# Hyper-parameters both sides take under the same names (global batch = per device x 8 devices).
COMMON = {
    "text": {"max_seq_length": 16, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8,
             "learning_rate": 1e-3, "warmup_steps": 10, "num_train_epochs": 3, "weight_decay": 0.01},
    "qa": {"max_seq_length": 64, "doc_stride": 16, "max_answer_length": 8, "per_device_train_batch_size": 4,
           "per_device_eval_batch_size": 16, "learning_rate": 1e-3, "warmup_steps": 100, "num_train_epochs": 3,
           "weight_decay": 0.01},
    "ner": {"max_seq_length": 64, "per_device_train_batch_size": 4, "per_device_eval_batch_size": 16,
            "learning_rate": 2e-3, "warmup_steps": 50, "num_train_epochs": 3, "weight_decay": 0.01},
    # 45 validation images per device batch x 8 = 360, the whole validation set: the classic script drops
    # an incomplete last eval batch, and this size leaves it none to drop.
    "image": {"image_size": 16, "per_device_train_batch_size": 8, "per_device_eval_batch_size": 45,
              "learning_rate": 2e-3, "warmup_steps": 30, "num_train_epochs": 40, "weight_decay": 0.01},
}
TINY_BERT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                 max_position_embeddings=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)
TINY_VIT = dict(image_size=16, patch_size=4, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def child_env():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def check_classic(classic):
    """The classic scripts' folder, or one error line saying what is missing and how to get it."""
    if not classic:
        sys.exit("error: no classic scripts given: pass --classic DIR or set FLAXTUNE_CLASSIC_DIR "
                 "(docs/parity.md says how to fetch them; this project does not ship them)")
    missing = [name for name in NEEDED if not os.path.isfile(os.path.join(classic, name))]
    if missing:
        sys.exit(f"error: {classic} lacks the classic scripts {', '.join(missing)}: fetch them as docs/parity.md "
                 "says, or point --classic at the folder that holds them")
    return os.path.abspath(classic)


def flat_squad(source, target):
    """A SQuAD v1.1 document as the classic run_qa.py reads it: {"data": [one row per question]}."""
    opener = gzip.open if source.endswith(".gz") else open
    with opener(source, "rt", encoding="utf-8") as f:
        document = json.load(f)
    rows = []
    for article in document["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                rows.append({"id": qa["id"], "title": article.get("title", ""), "context": paragraph["context"],
                             "question": qa["question"],
                             "answers": {"text": [a["text"] for a in qa["answers"]],
                                         "answer_start": [a["answer_start"] for a in qa["answers"]]}})
    with open(target, "w", encoding="utf-8") as f:
        json.dump({"data": rows}, f)


def save_initial_model(kind, directory, tokenizer_dir=None):
    """One random initialisation (seed 0) of a tiny config's encoder, saved for both sides to start from."""
    code = f"""
import sys
from transformers import AutoTokenizer, BertConfig, FlaxBertModel, FlaxViTModel, ViTConfig
kind, directory, tokenizer_dir = {kind!r}, {directory!r}, {tokenizer_dir!r}
if kind == "bert":
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = BertConfig(vocab_size=len(tokenizer), **{TINY_BERT!r})
    tokenizer.save_pretrained(directory)
    FlaxBertModel(config, seed=0).save_pretrained(directory)
else:
    FlaxViTModel(ViTConfig(**{TINY_VIT!r}), seed=0).save_pretrained(directory)
"""
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(child_env(), XLA_FLAGS=""))


def prepare(work):
    """Data both sides read and the starting weights, made once under `work`."""
    made = os.path.join(work, "inputs")
    data = {"text": os.path.join(ROOT, "data", "lm", "word_classes"), "images": os.path.join(ROOT, "data", "images")}
    os.makedirs(made, exist_ok=True)
    for split, source in (("train", "train.json.gz"), ("validation", "validation.json")):
        data[f"qa_{split}"] = os.path.join(made, f"qa_{split}.json")
        if not os.path.exists(data[f"qa_{split}"]):
            flat_squad(os.path.join(ROOT, "data", "qa", source), data[f"qa_{split}"])
        data[f"ner_{split}"] = os.path.join(made, f"ner_{split}.json")
        shutil.copyfile(os.path.join(ROOT, "data", "ner", f"{split}.jsonl"), data[f"ner_{split}"])
    models = {"text": os.path.join(made, "mlm_export"), "qa": os.path.join(made, "init_qa"),
              "ner": os.path.join(made, "init_ner"), "image": os.path.join(made, "init_vit")}
    if not os.path.exists(os.path.join(models["text"], "flax_model.msgpack")):
        print("pretraining the text encoder: run_mlm_flax.py configs/mlm_tiny.json", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "run_mlm_flax.py"),
                        os.path.join(ROOT, "configs", "mlm_tiny.json"), "--output_dir", models["text"],
                        "--compilation_cache_dir", "none"],
                       check=True, env=child_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for task, tokenizer in (("qa", "data/qa/tokenizer"), ("ner", "data/ner/tokenizer")):
        if not os.path.exists(os.path.join(models[task], "flax_model.msgpack")):
            save_initial_model("bert", models[task], os.path.join(ROOT, tokenizer))
    if not os.path.exists(os.path.join(models["image"], "flax_model.msgpack")):
        save_initial_model("vit", models["image"])
    return data, models


def task_args(task, data, model, seed):
    """(arguments both sides take, arguments only ours takes, arguments only the classic takes)."""
    shared = ["--model_name_or_path", model, "--seed", seed, "--do_train", "--do_eval", "--logging_steps", 100000,
              "--save_steps", 100000]
    for name, value in COMMON[task].items():
        shared += [f"--{name}", value]
    ours = ["--overwrite_output_dir", "--compilation_cache_dir", "none"]
    classic = ["--eval_steps", 100000]
    if task == "text":
        shared += ["--train_file", os.path.join(data["text"], "train.csv"),
                   "--validation_file", os.path.join(data["text"], "validation.csv")]
        classic += ["--report_to", "none"]
    elif task in ("qa", "ner"):
        shared += ["--train_file", data[f"{task}_train"], "--validation_file", data[f"{task}_validation"]]
    else:
        shared += ["--train_dir", os.path.join(data["images"], "train"),
                   "--validation_dir", os.path.join(data["images"], "validation")]
        ours += ["--min_crop_scale", 0.08, "--random_flip"]
        classic = ["--overwrite_output_dir", "--preprocessing_num_workers", 1]
    return shared, ours, classic


def run_one(task, side, seed, data, models, classic, work):
    out = os.path.join(work, "runs", f"{task}_{side}_{seed}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)  # the classic QA post-processing writes into it before anything else has made it
    shared, ours, classic_only = task_args(task, data, models[task], seed)
    env = child_env()
    if side == "ours":
        command = [sys.executable, os.path.join(ROOT, OURS[task])]
        extra = ours
    else:
        if side == "classic_seeded":
            env["CLASSIC_SEED_NEW_WEIGHTS"] = "1"
        side_python = os.path.join(classic, "venv", "bin", "python")
        python = side_python if task == "image" and os.path.exists(side_python) else sys.executable
        command = [python, os.path.join(classic, "run_classic.py"), os.path.join(classic, CLASSIC_SCRIPTS[task])]
        extra = classic_only
    command += [str(a) for a in shared + extra + ["--output_dir", out]]
    start = time.monotonic()
    result = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True)
    seconds = time.monotonic() - start
    with open(os.path.join(work, "runs", f"{task}_{side}_{seed}.log"), "w") as log:
        log.write(result.stdout + result.stderr)
    if result.returncode != 0:
        sys.exit(f"error: {task} {side} seed {seed} failed (exit {result.returncode}); its log: {log.name}\n"
                 + result.stderr[-2000:])
    if side == "classic" and task == "image":
        value = float(CLASSIC_IMAGE_ACCURACY.findall(result.stdout + result.stderr)[-1])
    else:
        with open(os.path.join(out, "eval_results.json")) as f:
            value = float(json.load(f)[METRIC[task]])
    return {"seed": seed, "value": value, "seconds": round(seconds, 1)}


def summary(runs):
    values = [r["value"] for r in runs]
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": spread, "min": min(values), "max": max(values), "runs": runs}


def print_table(results):
    print(f"\n{'task':6s} {'metric':14s} {'classic mean ± std':22s} {'ours mean ± std':22s} "
          f"{'classic, head seeded':22s} seeds")
    for task, r in results.items():
        cells = [f"{r[side]['mean']:8.4f} ± {r[side]['std']:<10.4f}" if side in r else f"{'-':22s}"
                 for side in ("classic", "ours", "classic_seeded")]
        print(f"{task:6s} {r['metric']:14s} {' '.join(cells)} {len(r['seeds'])}"
              f"{'  (ours behind by more than the spread)' if r['behind_by_more_than_spread'] else ''}")


def write_results(path, results, machine):
    """`results` into the JSON at `path`, keeping the tasks it holds that were not run this time."""
    previous = {}
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f).get("tasks", {})
    with open(path, "w") as f:
        json.dump({"machine": machine, "tasks": {**previous, **results}}, f, indent=2)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classic", default=os.environ.get("FLAXTUNE_CLASSIC_DIR"),
                        help="Folder of the classic scripts (default: $FLAXTUNE_CLASSIC_DIR).")
    parser.add_argument("--tasks", nargs="+", default=list(OURS), choices=list(OURS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument("--work", default=os.path.join("/tmp", "flaxtune_parity"),
                        help="Scratch folder for inputs, runs and logs (kept: the runs' logs are evidence).")
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "parity_cpu.json"))
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="Run nothing: write the tasks of these results files (of runs side by side, each "
                             "with its own --tasks, --work and --output) into --output.")
    args = parser.parse_args()
    if args.merge:
        results, machine = {}, None
        for path in args.merge:
            with open(path) as f:
                merged = json.load(f)
            results.update(merged["tasks"])
            machine = machine or merged["machine"]
        print_table(results)
        write_results(args.output, results, machine)
        return
    classic = check_classic(args.classic)
    data, models = prepare(args.work)

    results = {}
    for task in args.tasks:
        sides = {side: [] for side in ("classic", "ours", *(["classic_seeded"] if task in SEEDED_HEAD_SIDE else []))}
        for seed in args.seeds:
            for side in sides:
                sides[side].append(run_one(task, side, seed, data, models, classic, args.work))
                print(f"{task:6s} {side:14s} seed {seed:3d}: {METRIC[task]} {sides[side][-1]['value']:.4f} "
                      f"({sides[side][-1]['seconds']} s)", flush=True)
        results[task] = {"script": OURS[task], "metric": METRIC[task], "seeds": args.seeds, "settings": COMMON[task],
                         **{side: summary(runs) for side, runs in sides.items()}}
        gap = results[task]["classic"]["mean"] - results[task]["ours"]["mean"]
        results[task]["behind_by_more_than_spread"] = gap > max(results[task]["classic"]["std"],
                                                                results[task]["ours"]["std"])
    print_table(results)
    write_results(args.output, results, {"cpus": os.cpu_count(), "platform": platform.platform(), "devices": 8})


if __name__ == "__main__":
    main()
