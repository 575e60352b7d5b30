"""Fingerprints of what every shipped config's run writes, to show that a change which only moves code changes
no output: each `configs/*.json` runs for a few steps into a folder of its own, and every file it writes is
hashed (SHA-256): results, predictions, logs of losses, the exported weights, config and tokenizer. Figures
that measure the machine (run times, throughputs, memory) are left out of the JSON files' and the model card's
hashes, and so are
the files that are all timing or bookkeeping (TensorBoard's event files, the checkpoints' own folders, whose
weights the export repeats).

    python benchmarks/fingerprints.py --output /tmp/before.json        # at the commit before the change
    python benchmarks/fingerprints.py --output /tmp/after.json         # after it
    python benchmarks/fingerprints.py --compare /tmp/before.json /tmp/after.json

Runs on the CPU's 8 virtual devices, as the tests do (about 10 minutes on 2 cores for the 17 configs).
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {
    "bart_dlm_tiny": "run_bart_dlm_flax.py", "chat_tiny": "run_clm_flax.py", "clm_tiny": "run_clm_flax.py",
    "glue_tiny": "run_flax_glue.py", "hybrid_clip_tiny": "run_hybrid_clip.py",
    "image_captioning_tiny": "run_image_captioning_flax.py", "image_tiny": "run_image_classification.py",
    "long_qa_tiny": "run_qa.py", "mlm_tiny": "run_mlm_flax.py", "ner_tiny": "run_flax_ner.py", "qa_tiny": "run_qa.py",
    "qa_v2_tiny": "run_qa.py", "speech_encoder_decoder_tiny": "run_speech_recognition_seq2seq.py",
    "speech_recognition_tiny": "run_speech_recognition_seq2seq.py", "summarization_tiny": "run_summarization_flax.py",
    "t5_mlm_tiny": "run_t5_mlm_flax.py", "wav2vec2_pretrain_tiny": "run_wav2vec2_pretrain_flax.py",
}
# Keys of a JSON record that measure the machine, not the run.
MACHINE_KEYS = ("runtime", "per_second", "seconds", "device_bytes", "memory", "peak", "time", "date")
SKIPPED = ("events.out.tfevents", "checkpoints")


def machine_free(value):
    if isinstance(value, dict):
        return {key: machine_free(item) for key, item in value.items()
                if not any(word in key for word in MACHINE_KEYS)}
    if isinstance(value, list):
        return [machine_free(item) for item in value]
    return value


def file_hash(path, work):
    """The file's SHA-256, figures of the machine left out, and the --workdir its run wrote under named alike
    (run_args.json and the model card's command hold the output dir): two fingerprints may use two workdirs."""
    with open(path, "rb") as f:
        data = f.read().replace(os.path.abspath(work).encode(), b"<workdir>")
    if path.endswith(".json"):
        data = json.dumps(machine_free(json.loads(data)), sort_keys=True).encode()
    elif path.endswith(".jsonl"):
        data = b"\n".join(json.dumps(machine_free(json.loads(line)), sort_keys=True).encode()
                          for line in data.splitlines() if line.strip())
    elif path.endswith(".md"):  # the model card: its results table's rows of timings left out
        data = b"\n".join(line for line in data.splitlines()
                          if not (line.startswith(b"|") and any(word.encode() in line.split(b"|")[1]
                                                                for word in MACHINE_KEYS)))
    return hashlib.sha256(data).hexdigest()


def fingerprint(output_dir, work):
    """{relative path: sha256} of every file of a run (under `work`) but the skipped ones."""
    hashes = {}
    for root, dirs, files in os.walk(output_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith(SKIPPED))
        for name in sorted(files):
            if not name.startswith(SKIPPED):
                path = os.path.join(root, name)
                hashes[os.path.relpath(path, output_dir)] = file_hash(path, work)
    return hashes


def run_configs(configs, steps, work):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    results = {}
    for config in configs:
        out = os.path.join(os.path.abspath(work), config)
        # An empty datasets cache for each run: every run does the same work whatever ran before it, so two
        # fingerprints compare like with like (a tokenizer.json once differed between a map read from the cache
        # and one computed).
        shutil.rmtree(os.path.join(work, "datasets-cache"), ignore_errors=True)
        env["HF_DATASETS_CACHE"] = os.path.join(work, "datasets-cache")
        command = [sys.executable, SCRIPTS[config], os.path.join("configs", f"{config}.json"), "--max_steps",
                   str(steps), "--output_dir", out, "--overwrite_output_dir", "--compilation_cache_dir", "none"]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"error: {config} failed:\n{done.stderr[-3000:]}")
        results[config] = fingerprint(out, work)
        shutil.rmtree(out)
        print(f"{config}: {len(results[config])} files", flush=True)
    shutil.rmtree(os.path.join(work, "datasets-cache"), ignore_errors=True)
    return results


def compare(before, after):
    """The lines that say what differs; none when nothing does."""
    lines = []
    for config in sorted(set(before) | set(after)):
        old, new = before.get(config, {}), after.get(config, {})
        for path in sorted(set(old) | set(new)):
            if old.get(path) != new.get(path):
                what = "only before" if path not in new else "only after" if path not in old else "differs"
                lines.append(f"{config}: {path} {what}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", help="Where to write the fingerprints (JSON).")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="Two fingerprint files to compare.")
    parser.add_argument("--configs", nargs="+", choices=sorted(SCRIPTS), default=sorted(SCRIPTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", default="/tmp/flaxtune-fingerprints",
                        help="Where each run writes (a folder per config, removed once hashed): the same path each "
                             "time, as the files name it.")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.load(open(path)) for path in args.compare)
        differences = compare(before, after)
        print("\n".join(differences) or f"identical: {sum(map(len, before.values()))} files of {len(before)} runs")
        sys.exit(1 if differences else 0)
    if not args.output:
        parser.error("give --output (to run the configs) or --compare BEFORE AFTER")
    results = run_configs(args.configs, args.steps, args.workdir)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
