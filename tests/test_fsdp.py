"""`--sharding fsdp` end to end, 8 virtual CPU devices: every script gives the numbers `dp` gives,
writes its train step's memory, moves checkpoints between layouts, and stops before training when
its step cannot fit the device.

Each script runs once per layout on the same tiny config and seed, dropout off (dp draws one
dropout key per device, fsdp one for the global batch: with dropout on they would differ by design).
"""

import json
import os
import re

import jax
import numpy as np
import pytest

import run_clm_flax as clm
from script_runner import ROOT, directory_state, read_json, read_metrics, run_script
from test_multihost import run_processes
from utils import layout
from utils.errors import run_main

pytestmark = pytest.mark.slow

COMMON = ["--do_train", "--do_eval", "--max_steps", 10, "--logging_steps", 1, "--save_steps", 5,
          "--learning_rate", 3e-3, "--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 2,
          "--compilation_cache_dir", "none"]
SCRIPTS = {
    "summarization": ("run_summarization_flax.py", [
        "--model_type", "t5", "--tokenizer_name", "data/summarization/tokenizer", "--config_overrides",
        "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.0",
        "--train_file", "data/summarization/train.jsonl", "--validation_file", "data/summarization/validation.jsonl",
        "--test_file", "data/summarization/test.jsonl", "--max_train_samples", 160, "--max_eval_samples", 21,
        "--max_predict_samples", 21, "--max_source_length", 48, "--max_target_length", 12, "--do_predict",
        "--predict_with_generate", "--num_beams", 2]),
    "clm": ("run_clm_flax.py", [
        "--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
        "n_embd=64,n_layer=2,n_head=4,n_positions=32,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
        "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--block_size", 32,
        "--max_train_samples", 640, "--max_eval_samples", 40]),
    "mlm": ("run_mlm_flax.py", [
        "--model_type", "roberta", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,max_position_embeddings=34,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--max_seq_length", 32,
        "--max_train_samples", 640, "--max_eval_samples", 40]),
    # d_model 128: the 405-token shared embedding is then large enough to split (utils/layout.py).
    "t5 mlm": ("run_t5_mlm_flax.py", [
        "--model_type", "t5", "--tokenizer_name", "data/lm/t5_tokenizer", "--config_overrides",
        "d_model=128,d_ff=32,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.0",
        "--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--max_seq_length", 32,
        "--max_train_samples", 320, "--max_eval_samples", 40]),
    # intermediate_size 256: the 64 x 256 feed-forward kernels are large enough to split as well.
    "glue": ("run_flax_glue.py", [
        "--model_type", "bert", "--tokenizer_name", "data/glue/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=256,max_position_embeddings=16,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--task_name", "cola", "--train_file", "data/glue/cola/train.csv", "--validation_file",
        "data/glue/cola/validation.csv", "--test_file", "data/glue/cola/test.csv", "--max_seq_length", 16,
        "--max_train_samples", 160, "--max_eval_samples", 40, "--max_predict_samples", 21, "--do_predict"]),
    "ner": ("run_flax_ner.py", [
        "--model_type", "bert", "--tokenizer_name", "data/ner/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=128,max_position_embeddings=32,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_file", "data/ner/train.jsonl", "--validation_file", "data/ner/validation.jsonl",
        "--test_file", "data/ner/test.jsonl", "--max_seq_length", 32, "--max_train_samples", 160,
        "--max_eval_samples", 37, "--max_predict_samples", 21, "--do_predict"]),
    # SQuAD v2.0: windows of 64 tokens, every example's answer picked over all of its windows.
    "qa": ("run_qa.py", [
        "--model_type", "bert", "--tokenizer_name", "data/qa/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=1,num_attention_heads=2,intermediate_size=256,max_position_embeddings=64,"
        "hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        "--train_file", "data/qa/train_v2.json.gz", "--validation_file", "data/qa/validation_v2.json",
        "--test_file", "data/qa/test.jsonl", "--version_2_with_negative", "--max_seq_length", 64, "--doc_stride", 16,
        "--max_train_samples", 60, "--max_eval_samples", 21, "--max_predict_samples", 13, "--do_predict"]),
}
# What each script predicts, one line per example: the same lines in both layouts.
PREDICTIONS = {"summarization": "generated_predictions.txt", "glue": "predict_results_cola.txt",
               "ner": "predictions.txt", "qa": "predict_predictions.json"}


def command(name, output_dir, *extra):
    script, args = SCRIPTS[name]
    return [os.path.join(ROOT, script), *map(str, args + COMMON + ["--output_dir", output_dir, *extra])]


class LayoutRuns(dict):
    """{(script, layout): output dir}, each script's pair run when first asked for, so that `-k` runs
    only the scripts it selects: both layouts side by side (two cores, two runs)."""

    def __init__(self, tmp):
        super().__init__()
        self.tmp = tmp

    def __missing__(self, key):
        import sys

        from script_runner import script_env

        pair = {(key[0], sharding): self.tmp / f"{key[0]}_{sharding}" for sharding in ("dp", "fsdp")}
        run_processes([[sys.executable, *command(name, str(out), "--sharding", sharding)]
                       for (name, sharding), out in pair.items()],
                      [out.parent / f"{out.name}.log" for out in pair.values()], [script_env()] * 2)
        self.update(pair)  # only once both ran: a failed pair fails again in each test that asks for it
        return self[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return LayoutRuns(tmp_path_factory.mktemp("fsdp"))


def losses(out):
    return [(row["step"], row["loss"]) for row in read_metrics(out)]


@pytest.mark.parametrize("name", SCRIPTS)
def test_fsdp_trains_and_evaluates_as_dp_does(runs, name):
    dp, fsdp = runs[(name, "dp")], runs[(name, "fsdp")]
    assert [step for step, _ in losses(fsdp)] == [step for step, _ in losses(dp)] == list(range(1, 11))
    # Mean losses over >= 500 tokens summed in another order (per device vs the global array): ~sqrt(N)
    # x eps32 = 3e-6 relative; 10 steps of lr-sized updates add parameter differences as small.
    assert [loss for _, loss in losses(fsdp)] == pytest.approx([loss for _, loss in losses(dp)], rel=1e-5)
    dp_results, fsdp_results = read_json(dp / "all_results.json"), read_json(fsdp / "all_results.json")
    for key, value in dp_results.items():
        if key in ("train_runtime", "train_step_device_bytes"):
            continue
        # Counts alike; losses and ROUGE of a float32 run differ in the last digits at most: the results
        # round to 4 decimals (abs 1e-3 covers that with the float32 sums), rel 1e-4 a ROUGE near 10-50.
        assert fsdp_results[key] == pytest.approx(value, rel=1e-4, abs=1e-3), key
    if name in PREDICTIONS:
        assert (fsdp / PREDICTIONS[name]).read_text() == (dp / PREDICTIONS[name]).read_text()
    # The exported models are the same model.
    with open(fsdp / "config.json") as a, open(dp / "config.json") as b:
        assert json.load(a) == json.load(b)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_train_step_memory_is_written(runs, name):
    for sharding in ("dp", "fsdp"):
        out = runs[(name, sharding)]
        memory = read_metrics(out, "memory")
        assert len(memory) == 1 and memory[0]["step"] == 0
        written = read_json(out / "all_results.json")["train_step_device_bytes"]
        assert written == memory[0]["train_step_device_bytes"] > 0
        assert {"train_step_device_bytes_arguments", "train_step_device_bytes_temporaries"} <= set(memory[0])
    dp, fsdp = (read_metrics(runs[(name, sharding)], "memory")[0] for sharding in ("dp", "fsdp"))
    # Tiny models: most leaves are below the size worth splitting (utils/layout.py), yet the state shrinks.
    assert fsdp["train_step_device_bytes_arguments"] < 0.7 * dp["train_step_device_bytes_arguments"]


def test_fsdp_needs_less_memory_for_a_model_that_dominates_its_step(runs):
    """The clm model (GPT-2 n_embd 64, ~900-token vocabulary) outweighs its 2 x 32-token batch."""
    dp, fsdp = (read_json(runs[("clm", sharding)] / "all_results.json")["train_step_device_bytes"]
                for sharding in ("dp", "fsdp"))
    assert fsdp < dp


def test_the_log_says_how_the_state_is_split(runs):
    log = (runs[("clm", "fsdp")].parent / "clm_fsdp.log").read_text()
    assert re.search(r"fsdp: parameters and optimizer state take \S+ \w+ per device split 8 ways \+ \S+ \w+ whole",
                     log)
    assert re.search(r"train step \(fsdp\): \S+ \w+ per device \(arguments ", log)


@pytest.mark.parametrize("saved, resumed", [("dp", "fsdp"), ("fsdp", "dp")])
def test_a_checkpoint_moves_to_the_other_layout(runs, tmp_path, saved, resumed):
    """The run of one layout goes on in the other from its step-5 checkpoint: the weights and optimizer
    state continue exactly (tests/test_layout.py compares them); the log says the dropout keys are
    new, and the continued run reaches the original's losses."""
    import shutil

    out = tmp_path / "moved"
    shutil.copytree(runs[("clm", saved)], out)
    result = run_script("run_clm_flax.py", command("clm", str(out), "--sharding", resumed,
                                                   "--resume_from_checkpoint", "5")[1:])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"saved by a {saved} run on 8 devices, this is a {resumed} run on 8" in result.stderr
    assert "resumed from the checkpoint of step 5" in result.stderr
    # Dropout is off: new keys change nothing, so the continuation is the original one, but summed in
    # the other layout's order (rel 1e-5 as above).
    assert [loss for _, loss in losses(out)] == pytest.approx([loss for _, loss in losses(runs[("clm", saved)])],
                                                               rel=1e-5)


def test_fsdp_with_accumulation_bf16_and_gradient_checkpointing(tmp_path):
    out = tmp_path / "out"  # RoBERTa: GPT-2's Flax code has no gradient checkpointing
    result = run_script("run_mlm_flax.py", command("mlm", str(out), "--sharding", "fsdp", "--fsdp_size", 4,
                                                   "--gradient_accumulation_steps", 2, "--dtype", "bfloat16",
                                                   "--param_dtype", "bfloat16", "--gradient_checkpointing",
                                                   "--learning_rate", 1e-2, "--do_eval", "false")[1:])
    assert result.returncode == 0, result.stderr[-3000:]
    train = [loss for _, loss in losses(out)]
    assert np.all(np.isfinite(train)) and train[-1] < 0.9 * train[0]
    assert "2 x 4 (data x fsdp) mesh" in result.stderr
    from flax import serialization

    with open(out / "flax_model.msgpack", "rb") as f:
        exported = serialization.msgpack_restore(f.read())
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(exported)} == {np.dtype(jax.numpy.bfloat16)}


def test_a_step_too_big_for_the_device_stops_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """A device that reports a memory limit (TPU, GPU): faked here at 64 KiB."""
    monkeypatch.setattr(layout, "device_memory_limit", lambda: 64 * 2**10)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    before = directory_state(out)
    argv = [str(a) for a in command("clm", str(out), "--overwrite_output_dir")[1:]]
    assert run_main(lambda: clm.main(argv), argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"error: the train step needs \S+ \w+ per device but a device has 64\.0 KiB: use --sharding "
                        r"fsdp, a smaller --per_device_train_batch_size with more --gradient_accumulation_steps "
                        r"\(now 1\), --dtype bfloat16, or --gradient_checkpointing", last), last
    assert directory_state(out) == before
