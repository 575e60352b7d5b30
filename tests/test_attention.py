"""The splash attention route (utils/attention.py), run by Pallas' interpreter on the CPU: the kernel
against softmax attention written here in numpy, and GPT-2 / Llama models with and without the route."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import BertConfig, FlaxBertForMaskedLM, FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, GPT2Config, \
    LlamaConfig

from utils import attention, compat
from utils.errors import UsageError

LENGTH = 128  # one kernel block
compat.apply()  # as every script does: its Llama attention is the one routed


def numpy_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d)) v over the keys that are real and not after the query."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    allowed = np.tril(np.ones(scores.shape[-2:], bool))[None, None] & (mask[:, None, None, :] > 0)
    scores = np.where(allowed, scores, -1e30)  # a padding query sees nothing: its row is left out of the checks
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)


def padding_mask():
    mask = np.ones((3, LENGTH), np.int32)
    mask[0, 100:] = 0  # padded on the right
    mask[1, :40] = 0  # padded on the left (as generation pads prompts)
    return mask


def test_the_kernel_is_masked_softmax_attention_on_every_real_token():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(3, LENGTH, 2, 16)).astype(np.float32) for _ in range(3))
    mask = padding_mask()
    out = np.asarray(attention.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask),
                                                interpret=True))
    real = mask > 0
    np.testing.assert_allclose(out[real], numpy_attention(q, k, v, mask)[real], atol=2e-5)
    no_padding = np.asarray(attention.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None,
                                                       interpret=True))
    np.testing.assert_allclose(no_padding, numpy_attention(q, k, v, np.ones_like(mask)), atol=2e-5)


def tiny_gpt2(**overrides):
    config = GPT2Config(vocab_size=64, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, **overrides)
    return FlaxGPT2LMHeadModel(config, seed=0)


def tiny_llama(**overrides):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                         rope_theta=500000.0, **overrides)
    return FlaxLlamaForCausalLM(config, seed=0)


def loss_and_grads(model, ids, mask, **call):
    """Mean cross-entropy of the next real token, and its gradient."""
    def loss(params):
        logits = model(ids, attention_mask=mask, params=params, **call).logits[:, :-1]
        targets, weights = ids[:, 1:], (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return -(picked * weights).sum() / weights.sum()
    return jax.value_and_grad(loss)(model.params)


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_a_model_computes_the_same_loss_and_gradients_through_the_kernel(make_model):
    model = make_model()
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(3, LENGTH)), jnp.int32)
    mask = jnp.asarray(padding_mask())
    stock = loss_and_grads(model, ids, mask)
    attention.use_splash_attention(model, interpret=True)
    routed = loss_and_grads(model, ids, mask)
    np.testing.assert_allclose(float(routed[0]), float(stock[0]), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(routed[1]), jax.tree_util.tree_leaves(stock[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_attention_dropout_while_training_keeps_the_stock_attention():
    """The kernel has no dropout: a training call with attention dropout runs the stock attention, same masks."""
    model = tiny_gpt2(attn_pdrop=0.5)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(2, LENGTH)), jnp.int32)
    mask, rng = jnp.ones((2, LENGTH), jnp.int32), jax.random.PRNGKey(3)
    stock = loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0]
    attention.use_splash_attention(model, interpret=True)
    assert float(loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0]) == float(stock)


def test_choose_routes_only_where_the_kernel_runs_and_names_why_not():
    gpt2 = tiny_gpt2()
    assert attention.choose("auto", gpt2, "tpu", "dp")
    assert not attention.choose("auto", gpt2, "cpu", "dp")
    assert not attention.choose("auto", gpt2, "tpu", "fsdp")
    assert not attention.choose("xla", gpt2, "tpu", "dp")
    assert attention.choose("splash", gpt2, "cpu", "dp")
    assert not attention.choose("auto", gpt2, "tpu", "dp", checkpointing=True)
    with pytest.raises(UsageError, match="--gradient_checkpointing"):
        attention.choose("splash", gpt2, "tpu", "dp", checkpointing=True)
    with pytest.raises(UsageError, match="--sharding dp"):
        attention.choose("splash", gpt2, "tpu", "fsdp")
    bert = FlaxBertForMaskedLM(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=16), seed=0)
    assert not attention.choose("auto", bert, "tpu", "dp")
    with pytest.raises(UsageError, match="not bert's"):
        attention.choose("splash", bert, "tpu", "dp")
