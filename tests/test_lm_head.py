"""--chunked_loss (utils/kernels/lm_head.py): the next-token loss and its gradients from the LM head's inputs,
chunk by chunk, against the loss of the whole logits (numpy's log-softmax, optax's cross-entropy), and
the memory the compiled step plans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import (BertConfig, FlaxGemmaForCausalLM, FlaxGPT2LMHeadModel,
                          FlaxLlamaForCausalLM, GemmaConfig, GPT2Config, LlamaConfig)

from tasks.causal_lm import next_token_loss
from tests.script_runner import read_json, read_metrics, run_script
from utils.base.errors import UsageError
from utils.kernels import lm_head
from utils.models import compat

compat.apply()
VOCAB, LENGTH = 96, 24


def gpt2():  # the head tied to the embeddings
    return FlaxGPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2), seed=0)


def llama():  # a head of its own
    return FlaxLlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=LENGTH), seed=0)


def gemma():  # tied, through the head's `apply` with the embedding's transpose
    return FlaxGemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                            max_position_embeddings=LENGTH), seed=0)


def loss(model, chunked, ids, answer_mask, label_smoothing):
    def total(params):
        with lm_head.head_inputs(chunked):
            logits = model(ids, params=params)[0]
        assert isinstance(logits, lm_head.HeadInputs) == chunked
        summed, sums = next_token_loss(logits, ids, answer_mask=answer_mask, label_smoothing=label_smoothing)
        return summed / sums["tokens"]
    return jax.value_and_grad(total)(model.params)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("make_model", [gpt2, llama, gemma], ids=["gpt2", "llama", "gemma"])
def test_the_chunked_loss_is_the_whole_logits_loss(monkeypatch, make_model, label_smoothing):
    monkeypatch.setattr(lm_head, "CHUNK", 16)  # 3 x 23 scored positions: four chunks, the last one padded
    model = make_model()
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, VOCAB, size=(3, LENGTH)), jnp.int32)
    answer_mask = jnp.asarray(rng.random((3, LENGTH)) < 0.7, jnp.int32)
    with jax.default_matmul_precision("highest"):
        whole, whole_grads = loss(model, False, ids, answer_mask, label_smoothing)
        chunked, chunked_grads = loss(model, True, ids, answer_mask, label_smoothing)
        logits = np.asarray(model(ids).logits, np.float64)[:, :-1]
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    targets = np.full(log_probs.shape, label_smoothing / (VOCAB - 1))
    np.put_along_axis(targets, np.asarray(ids)[:, 1:, None], 1 - label_smoothing, -1)
    entropy = -(targets * np.log(targets + (targets == 0))).sum(-1)
    weights = np.asarray(answer_mask)[:, 1:]
    expected = (((-(targets * log_probs).sum(-1)) - entropy) * weights).sum() / weights.sum()
    np.testing.assert_allclose(float(chunked), expected, rtol=1e-5)
    np.testing.assert_allclose(float(whole), expected, rtol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(chunked_grads), jax.tree_util.tree_leaves(whole_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_only_one_chunk_of_logits_is_planned(monkeypatch):
    """The compiled gradient's temporaries: the whole logits (and their gradient) without chunking, a
    chunk's (128 of 2,044 positions) with it."""
    monkeypatch.setattr(lm_head, "CHUNK", 128)
    vocab = 65536
    model = FlaxLlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=512), seed=0, _do_init=False)
    params = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), (1, 8)))
    ids = jax.ShapeDtypeStruct((4, 512), jnp.int32)

    def temporaries(chunked):
        def total(params, ids):
            with lm_head.head_inputs(chunked):
                logits = model(ids, params=params)[0]
            return next_token_loss(logits, ids)[0]
        return jax.jit(jax.grad(total)).lower(params, ids).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 4 * 511 * vocab * 4
    whole, chunked = temporaries(False), temporaries(True)
    assert whole > logits_bytes and chunked < logits_bytes / 4, (whole, chunked, logits_bytes)


def test_a_head_it_does_not_know_is_refused():
    assert lm_head.choose(True, GPT2Config()) and not lm_head.choose(False, GPT2Config())
    with pytest.raises(UsageError, match="not bert's: drop --chunked_loss"):
        lm_head.choose(True, BertConfig())


@pytest.mark.slow
def test_the_script_trains_and_evaluates_the_same_with_the_chunked_loss(tmp_path):
    metrics = {}
    for chunked in ("true", "false"):
        out = str(tmp_path / chunked)
        result = run_script("run_clm_flax.py", [
            "--model_type", "llama", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
            "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=1,"
            "max_position_embeddings=64", "--train_file", "data/lm/train.txt", "--validation_file",
            "data/lm/validation.txt", "--block_size", 64, "--max_train_samples", 64, "--max_eval_samples", 16,
            "--per_device_train_batch_size", 1, "--per_device_eval_batch_size", 1, "--do_train", "--do_eval",
            "--max_steps", 3, "--logging_steps", 1, "--chunked_loss", chunked, "--output_dir", out,
            "--compilation_cache_dir", "none"])
        assert result.returncode == 0, result.stderr[-3000:]
        metrics[chunked] = ([row["loss"] for row in read_metrics(out)], read_json(f"{out}/eval_results.json"))
        assert ("logits formed 1024 positions at a time" in result.stderr) == (chunked == "true")
    np.testing.assert_allclose(metrics["true"][0], metrics["false"][0], rtol=1e-5)
    np.testing.assert_allclose(metrics["true"][1]["eval_loss"], metrics["false"][1]["eval_loss"], rtol=1e-5)
