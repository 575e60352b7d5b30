"""End to end: run_bart_dlm_flax.py on a tiny BART over 8 virtual devices, streamed, as a user would run it.

In memory, under dp and fsdp, on 2 processes and killed then resumed: the "bart dlm" layout runs
(tests/layout_runs.py, tests/test_fsdp.py, tests/test_multihost.py, tests/test_resume.py)."""

import os

import jax
import numpy as np
import pytest

from tests.script_runner import ROOT, read_json, read_metrics, run_script
from tasks import denoising, lm

SCRIPT = "run_bart_dlm_flax.py"
MAX_STEPS = 40
SEQ_LENGTH = 32
# 45 eval examples in global batches of 16: the last one is padded with 3 rows that must not count.
EVAL_SAMPLES = 45
# Calibrated: this run ends near perplexity 73 (accuracy 0.19: the frequent tokens, not yet copying); the untrained
# model scores about 900 (accuracy 0.001).
PERPLEXITY_THRESHOLD = 150
MODEL = ["--model_type", "bart", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
         "d_model=64,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
         "encoder_ffn_dim=128,decoder_ffn_dim=128,max_position_embeddings=32,dropout=0.0,attention_dropout=0.0"]
DATA = ["--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt",
        "--max_seq_length", SEQ_LENGTH, "--max_eval_samples", EVAL_SAMPLES, "--per_device_eval_batch_size", 2,
        "--random_token_ratio", 0.1]
TRAIN = ["--streaming", "--shuffle_buffer_size", 256, "--per_device_train_batch_size", 4, "--learning_rate", 3e-3,
         "--warmup_steps", 5, "--logging_steps", 5, "--eval_steps", 20, "--save_steps", 20]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


def run(args, cache_dir):
    result = run_script(SCRIPT, args + ["--compilation_cache_dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    out = str(tmp_path_factory.mktemp("bart_dlm"))
    run(MODEL + DATA + TRAIN + ["--do_train", "--do_eval", "--output_dir", out, "--max_steps", MAX_STEPS], cache_dir)
    return out


@pytest.mark.slow
def test_streamed_training_learns_and_the_results(trained):
    train = read_metrics(trained)
    assert [row["step"] for row in train] == list(range(5, MAX_STEPS + 1, 5))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert [row["step"] for row in read_metrics(trained, "eval")] == [20, 40]
    results = read_json(os.path.join(trained, "eval_results.json"))
    assert set(results) == {"eval_loss", "eval_accuracy", "eval_perplexity", "eval_tokens", "eval_samples"}
    # Every token of every real example (BOS, sentences, separators, EOS), none of the padded rows'.
    assert results["eval_tokens"] == EVAL_SAMPLES * SEQ_LENGTH and results["eval_samples"] == EVAL_SAMPLES
    assert results["eval_perplexity"] < PERPLEXITY_THRESHOLD and 0.1 < results["eval_accuracy"] <= 1
    run_args = read_json(os.path.join(trained, "run_args.json"))
    assert run_args["poisson_lambda"] == 3.0 and run_args["random_token_ratio"] == 0.1
    assert read_json(os.path.join(trained, "config.json"))["model_type"] == "bart"
    assert sorted(os.listdir(os.path.join(trained, "checkpoints"))) == ["20", "40"]


def noised_eval_set(tokenizer, config, seed=42):
    """The eval examples as the script noises them with DATA's settings, rebuilt here: the validation
    file's sentences in blocks (its first EVAL_SAMPLES), noised all at once by the eval stream."""
    with open(os.path.join(ROOT, "data", "lm", "validation.txt"), encoding="utf-8") as f:
        texts = f.read().splitlines(keepends=True)
    args = dict(max_seq_length=SEQ_LENGTH, sentence_separator=None, mlm_probability=0.3, permute_sentence_ratio=1.0,
                poisson_lambda=3.0, random_token_ratio=0.1)
    plan = denoising.plan_denoising(tokenizer, config, type("Args", (), args))
    bodies = denoising.SentenceBlocks(tokenizer, plan.body_length, plan.separator_id)(texts)["input_ids"]
    return denoising.denoising(plan, config.decoder_start_token_id, seed, lm.EVAL_STREAM)(
        {"input_ids": bodies[:EVAL_SAMPLES]}, 0, np.arange(EVAL_SAMPLES))


@pytest.mark.slow
def test_eval_scores_the_exported_model_on_every_token(trained):
    """The eval loss and accuracy are the exported model's over every label token, with the decoder
    inputs built here (the labels after BART's start token, EOS): a script that fed the decoder or
    the encoder anything else, or scored other tokens, would disagree."""
    from transformers import AutoTokenizer, FlaxAutoModelForSeq2SeqLM

    model, params = FlaxAutoModelForSeq2SeqLM.from_pretrained(trained, _do_init=False)
    assert model.config.decoder_start_token_id == model.config.eos_token_id
    batch = noised_eval_set(AutoTokenizer.from_pretrained(trained), model.config)
    labels = batch["labels"]
    decoder_inputs = np.concatenate([np.full((len(labels), 1), model.config.eos_token_id), labels[:, :-1]], axis=1)
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_inputs,
                   params=params).logits
    log_probs = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), labels[..., None], -1)[..., 0]
    results = read_json(os.path.join(trained, "eval_results.json"))
    # 4 decimals in the file; 1440 float32 token losses summed in another order: 2e-4.
    assert results["eval_loss"] == pytest.approx(-log_probs.mean(), abs=2e-4)
    assert results["eval_accuracy"] == pytest.approx((np.asarray(logits.argmax(-1)) == labels).mean(), abs=2e-4)


@pytest.mark.slow
def test_eval_only_from_the_saved_model(trained, tmp_path, cache_dir):
    run(["--model_name_or_path", trained, "--do_eval", "--output_dir", str(tmp_path)] + DATA, cache_dir)
    again, before = (read_json(os.path.join(d, "eval_results.json")) for d in (tmp_path, trained))
    # The eval noise is fixed too, so the saved model scores what it scored at the end of training.
    assert again["eval_loss"] == pytest.approx(before["eval_loss"], abs=2e-4)
    assert again["eval_accuracy"] == pytest.approx(before["eval_accuracy"], abs=2e-4)
    assert again["eval_tokens"] == before["eval_tokens"]
