"""The attention kernels' route (utils/kernels/model_attention.py, utils/kernels/flash_attention.py), run by Pallas'
interpreter on the CPU: the kernels against softmax attention written here, and GPT-2 / Llama models
with and without the route."""

import importlib.util
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from transformers import BertConfig, DistilBertConfig, FlaxBertForMaskedLM, FlaxDistilBertForMaskedLM, \
    FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, FlaxRobertaForMaskedLM, GPT2Config, LlamaConfig, RobertaConfig

from tests.fresh_draws import fresh_model
from tests.script_runner import read_metrics, run_script
from utils.base.errors import UsageError
from utils.kernels import flash_attention, model_attention
from utils.layout import tpu_plan
from utils.layout.layouts import MESH_AXES
from utils.models import compat, remat

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
    out = np.asarray(model_attention.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask),
                                                interpret=True))
    real = mask > 0
    np.testing.assert_allclose(out[real], numpy_attention(q, k, v, mask)[real], atol=2e-5)
    no_padding = np.asarray(model_attention.causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), None,
                                                       interpret=True))
    np.testing.assert_allclose(no_padding, numpy_attention(q, k, v, np.ones_like(mask)), atol=2e-5)


def tiny_gpt2(**overrides):
    config = GPT2Config(**{"vocab_size": 64, "n_positions": LENGTH, "n_embd": 32, "n_layer": 2, "n_head": 2, **overrides})
    return fresh_model(FlaxGPT2LMHeadModel, config)


def tiny_llama(**overrides):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                         rope_theta=500000.0, **overrides)
    return fresh_model(FlaxLlamaForCausalLM, config)


def tiny_bert(family="bert", **overrides):
    """A BERT (or RoBERTa) encoder whose two heads of 64 fill a 128-lane block."""
    config_class, model_class = ((BertConfig, FlaxBertForMaskedLM) if family == "bert"
                                 else (RobertaConfig, FlaxRobertaForMaskedLM))
    config = config_class(**{"vocab_size": 64, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                             "intermediate_size": 64, "max_position_embeddings": LENGTH + 2, **overrides})
    return fresh_model(model_class, config)


def masked_lm_loss_and_grads(model, ids, mask, train=False, **arrays):
    """Mean cross-entropy of every real token's prediction, and its gradient (one compiled program)."""
    def loss(params, ids, mask, arrays):
        logits = model(ids, attention_mask=mask, params=params, train=train, **arrays).logits
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1)[..., 0]
        return -(picked * mask).sum() / mask.sum()
    return jax.jit(jax.value_and_grad(loss))(model.params, ids, mask, arrays)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_an_encoder_computes_the_same_loss_and_gradients_through_the_bidirectional_kernel(family):
    """Without dropout: the stock encoder's loss and gradients, sequences padded on either side; and with a
    head mask. With attention dropout: the kernel's masks."""
    model = tiny_bert(family, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 64, size=(3, LENGTH)), jnp.int32)
    mask = jnp.asarray(padding_mask())
    stock = masked_lm_loss_and_grads(model, ids, mask)
    stock_with_head_mask = masked_lm_loss_and_grads(model, ids, mask, head_mask=jnp.asarray([[1.0, 0.0], [0.5, 1.0]]))
    model_attention.use_attention_kernels(model, interpret=True)
    routed = masked_lm_loss_and_grads(model, ids, mask)
    np.testing.assert_allclose(float(routed[0]), float(stock[0]), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(routed[1]), jax.tree_util.tree_leaves(stock[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    head_mask = jnp.asarray([[1.0, 0.0], [0.5, 1.0]])  # a head left out, one halved
    np.testing.assert_allclose(float(masked_lm_loss_and_grads(model, ids, mask, head_mask=head_mask)[0]),
                               float(stock_with_head_mask[0]), rtol=1e-5)
    # with attention dropout, the kernel's masks (not the stock call's): the same for a key, others for another
    model = tiny_bert(family, hidden_dropout_prob=0.0)
    rng, other = jax.random.PRNGKey(3), jax.random.PRNGKey(4)
    stock_dropped = float(masked_lm_loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0])
    model_attention.use_attention_kernels(model, interpret=True)
    dropped = float(masked_lm_loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0])
    assert np.isfinite(dropped) and dropped not in (float(stock[0]), stock_dropped)
    assert float(masked_lm_loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0]) == dropped
    assert float(masked_lm_loss_and_grads(model, ids, mask, train=True, dropout_rng=other)[0]) != dropped


def loss_and_grads(model, ids, mask, train=False, **arrays):
    """Mean cross-entropy of the next real token, and its gradient (one compiled program)."""
    def loss(params, ids, mask, arrays):
        logits = model(ids, attention_mask=mask, params=params, train=train, **arrays).logits[:, :-1]
        targets, weights = ids[:, 1:], (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return -(picked * weights).sum() / weights.sum()
    return jax.jit(jax.value_and_grad(loss))(model.params, ids, mask, arrays)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("make_model", [tiny_gpt2, partial(tiny_gpt2, n_embd=128), tiny_llama],
                         ids=["gpt2", "gpt2_packed", "llama"])
def test_a_model_computes_the_same_loss_and_gradients_through_the_kernel(make_model, checkpointing):
    """Also with each layer under `nn.checkpoint`, where splash's block tables once leaked a trace's tracers.
    A GPT-2 whose heads fill 128-lane blocks runs the flash kernel on c_attn's output, the others splash."""
    model = make_model()
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(3, LENGTH)), jnp.int32)
    mask = jnp.asarray(padding_mask())
    stock = loss_and_grads(model, ids, mask)
    if checkpointing:
        remat.remat_layers(model)
    model_attention.use_attention_kernels(model, interpret=True)
    routed = loss_and_grads(model, ids, mask)
    np.testing.assert_allclose(float(routed[0]), float(stock[0]), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(routed[1]), jax.tree_util.tree_leaves(stock[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def dropped_attention(q, k, v, segments, seed, rate, key_segments=None, causal=True):
    """softmax(q k^T) over the keys before the query in its segment (`key_segments`: the keys', where they
    differ from the queries'; not `causal`: after it too), weights dropped where the interpreter's bits
    (`hashed_bits` of the seed, the number of the kernel's tile and the place in it) fall below rate * 2^31
    and the rest scaled by 1 / (1 - rate), times v; [batch, heads, length, head_dim], written with jnp to be
    differentiated."""
    batch, heads, length, _ = q.shape
    positions = jnp.arange(length)
    block = flash_attention.block_size(length)
    key_segments = segments if key_segments is None else key_segments
    allowed = ((positions[None, :] <= positions[:, None] if causal else True)
               & (segments[:, None, :, None] == key_segments[:, None, None, :]))
    scores = jnp.where(allowed, jnp.einsum("bhqd,bhkd->bhqk", q, k), -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    rows, columns = positions[:, None], positions[None, :]
    tiles = flash_attention.tile_number(jnp.arange(batch)[:, None, None, None], jnp.arange(heads)[None, :, None, None],
                                          rows // block, columns // block, heads, length // block)
    bits = flash_attention.hashed_bits(seed, tiles, rows % block, columns % block)
    kept = bits >= int(rate * 2**31)
    return jnp.einsum("bhqk,bhkd->bhqd", jnp.where(kept, weights / (1 - rate), 0.0), v), kept


def to_heads(x, heads):
    """[batch, length, heads x head_dim] -> [batch, heads, length, head_dim]."""
    batch, length, width = x.shape
    return x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3)


def from_heads(x):
    batch, heads, length, head_dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * head_dim)


def assert_kernel_is(kernel, expected, qkv, d_out, rate):
    """`kernel(q, k, v)` and its three gradients (of sum(out * d_out)) are `expected(q, k, v)`'s (whose
    second output is the kept mask, kept at 1 - `rate`)."""
    with jax.default_matmul_precision("highest"):  # each side one compiled program
        want, kept = jax.jit(expected)(*qkv)
        np.testing.assert_allclose(np.asarray(jax.jit(kernel)(*qkv)), np.asarray(want), atol=2e-5)
        grads = jax.jit(jax.grad(lambda *qkv: jnp.sum(kernel(*qkv) * d_out), argnums=(0, 1, 2)))(*qkv)
        expected_grads = jax.jit(jax.grad(lambda *qkv: jnp.sum(expected(*qkv)[0] * d_out), argnums=(0, 1, 2)))(*qkv)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
    assert abs(float(kept.mean()) - (1 - rate)) < 0.01


@pytest.mark.parametrize("rate", [0.0, 0.25])
@pytest.mark.parametrize("heads, head_dim, packed", [(2, 16, False), (4, 64, True)], ids=["narrow", "packed"])
def test_the_dropout_kernel_is_dropped_softmax_attention_with_its_gradients(rate, heads, head_dim, packed):
    """Three 128-token tiles: the causal skip, the running softmax across tiles and each tile's mask in the
    forward and the backward kernel; a sequence padded on the left and one in two segments. Two heads
    narrower than a block, and q, k, v side by side in one array with two heads to each 128-lane block."""
    length = 3 * LENGTH
    rng = np.random.default_rng(4)
    q, k, v, d_out = (jnp.asarray(rng.normal(size=(2, length, heads * head_dim)), jnp.float32) for _ in range(4))
    segments = np.ones((2, length), np.int32)
    segments[0, :150] = 0
    segments[1, 200:] = 2
    segments, seed = jnp.asarray(segments), jnp.asarray([77], jnp.int32)

    def kernel(q, k, v):
        if packed:
            qkv = jnp.concatenate([q, k, v], axis=-1)
            return flash_attention.packed_dropout_attention(qkv, segments, seed, rate, heads, interpret=True)
        return flash_attention.dropout_attention(q, k, v, segments, seed, rate, heads, interpret=True)

    def expected(q, k, v):
        scaled = to_heads(q, heads) * head_dim ** -0.5
        out, kept = dropped_attention(scaled, to_heads(k, heads), to_heads(v, heads), segments, seed[0], rate)
        return from_heads(out), kept

    assert_kernel_is(kernel, expected, (q, k, v), d_out, rate)


@pytest.mark.parametrize("rate", [0.0, 0.25])
def test_the_bidirectional_kernel_sees_every_real_key_with_its_gradients(rate):
    """An encoder's attention: each query, padding ones too, over every real key of its sequence, before and
    after it; a sequence padded on the left and one on the right."""
    heads, head_dim, length = 2, 64, 3 * LENGTH
    rng = np.random.default_rng(5)
    q, k, v, d_out = (jnp.asarray(rng.normal(size=(2, length, heads * head_dim)), jnp.float32) for _ in range(4))
    key_mask = np.ones((2, length), np.int32)
    key_mask[0, :150] = 0
    key_mask[1, 300:] = 0
    key_mask, seed = jnp.asarray(key_mask), jnp.asarray([9], jnp.int32)

    def kernel(q, k, v):
        return flash_attention.bidirectional_dropout_attention(q, k, v, key_mask, seed, rate, heads, interpret=True)

    def expected(q, k, v):
        scaled = to_heads(q, heads) * head_dim ** -0.5
        out, kept = dropped_attention(scaled, to_heads(k, heads), to_heads(v, heads), jnp.ones_like(key_mask),
                                      seed[0], rate, key_segments=key_mask, causal=False)
        return from_heads(out), kept

    assert_kernel_is(kernel, expected, (q, k, v), d_out, rate)


def test_the_forward_and_backward_kernels_drop_the_same_weights():
    """On a TPU the chip's generator draws the masks (elsewhere the interpreter's hash): the forward kernel
    shows its mask (q = k = 0 weighs the visible keys equally; v = the identity puts each key's weight in
    its own column), and the backward kernel's gradients must be those of attention with that mask."""
    interpret = jax.devices()[0].platform != "tpu"
    batch, heads, length, rate = 2, 2, 3 * LENGTH, 0.25
    segments, seed = jnp.ones((batch, length), jnp.int32), jnp.asarray([5], jnp.int32)
    zeros = jnp.zeros((batch, heads, length, length), jnp.float32)
    identity = jnp.broadcast_to(jnp.eye(length, dtype=jnp.float32), zeros.shape)
    shown = to_heads(flash_attention.dropout_attention(from_heads(zeros), from_heads(zeros), from_heads(identity),
                                                         segments, seed, rate, heads, interpret), heads)
    kept = np.asarray(shown) * np.arange(1, length + 1)[:, None] * (1 - rate) > 0.5
    causal = np.tril(np.ones((length, length), bool))
    assert abs(kept[:, :, causal].mean() - (1 - rate)) < 0.01 and not kept[:, :, ~causal].any()
    assert (kept[0, 0] != kept[0, 1])[causal].mean() > 0.2 and (kept[0, 0] != kept[1, 0])[causal].mean() > 0.2

    def masked(q, k, v):
        q, k, v = (to_heads(x, heads) for x in (q, k, v))
        scores = jnp.where(causal, jnp.einsum("bhqd,bhkd->bhqk", q * length ** -0.5, k), -jnp.inf)
        return from_heads(jnp.einsum("bhqk,bhkd->bhqd", jnp.where(kept, jax.nn.softmax(scores, -1) / (1 - rate), 0.0),
                                     v))

    rng = np.random.default_rng(6)
    q, k, v, d_out = (jnp.asarray(rng.normal(size=(batch, length, heads * length)), jnp.float32) for _ in range(4))
    with jax.default_matmul_precision("highest"):
        out = flash_attention.dropout_attention(q, k, v, segments, seed, rate, heads, interpret)
        want = np.asarray(masked(q, k, v))  # tolerances: 2% of the largest value (a TPU's float32 products)
        np.testing.assert_allclose(np.asarray(out), want, atol=0.02 * np.abs(want).max())
        grads = jax.grad(lambda *qkv: jnp.sum(flash_attention.dropout_attention(*qkv, segments, seed, rate, heads,
                                                                                  interpret) * d_out), (0, 1, 2))(q, k, v)
        expected = jax.grad(lambda *qkv: jnp.sum(masked(*qkv) * d_out), (0, 1, 2))(q, k, v)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=0.02 * np.abs(np.asarray(want)).max())


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed")
@pytest.mark.parametrize("length, head_dim, call", [(3 * LENGTH, 64, "packed"), (3 * LENGTH, 64, "bidirectional"),
                                                   (8192, 128, "causal")])
def test_the_dropout_kernels_compile_for_a_tpu(length, head_dim, call):
    """Mosaic, the TPU kernel compiler, takes what the interpreter runs (it refuses, say, a generator
    seeded with more than two numbers): the forward and the backward kernel, three tiles a row, two heads of
    64 to a block read in place beside the keys and values, and without the causal mask; and the longest
    sequence `fits` promises keeps the backward kernel's dq within a v5e's VMEM."""
    heads = 4
    assert flash_attention.fits(length, heads, head_dim)
    device = tpu_plan.load("v5e-4").devices[0]
    placed = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    packed = call == "packed"
    sources = [placed((1, length, heads * head_dim * (3 if packed else 1)), jnp.bfloat16)] * (1 if packed else 3)
    segments, seed = placed((1, length), jnp.int32), placed((1,), jnp.int32)
    attend = {"packed": flash_attention.packed_dropout_attention, "causal": flash_attention.dropout_attention,
              "bidirectional": flash_attention.bidirectional_dropout_attention}[call]

    def loss(segments, seed, *sources):
        return jnp.sum(attend(*sources, segments, seed, 0.1, heads).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, tuple(range(2, 2 + len(sources))))).lower(segments, seed, *sources).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed")
def test_under_fsdp_the_kernels_compile_for_a_tpu_slice():
    """The TPU compiler takes the kernels inside shard_map over a v5e-4's (data x fsdp) mesh, 4 rows over 4 chips:
    each chip runs the forward and backward kernel on its row, with no other chip's rows brought to it."""
    mesh = Mesh(np.array(tpu_plan.load("v5e-4").devices).reshape(1, 4), MESH_AXES)
    rows = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(MESH_AXES)))
    qkv, segments = rows((4, 2 * LENGTH, 3 * 128), jnp.bfloat16), rows((4, 2 * LENGTH), jnp.int32)
    seed = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    flash = partial(flash_attention.packed_dropout_attention, rate=0.1, heads=2)

    def loss(qkv, segments, seed):
        return jnp.sum(model_attention.on_each_device(mesh, flash, [qkv, segments], seed).astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss)).lower(qkv, segments, seed).compile()
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 2
    assert "all-gather" not in text and "bf16[1,256,384]" in text  # one row a chip


def test_the_interpreters_dropout_bits_are_uniform_and_change_with_seed_and_tile():
    positions = jnp.arange(512)
    bits = np.asarray(flash_attention.hashed_bits(jnp.int32(1), jnp.int32(0), positions[:, None], positions[None, :]))
    assert bits.min() >= 0 and abs(bits.mean() / 2**31 - 0.5) < 0.005
    assert abs((bits >= flash_attention.keep_threshold(0.1)).mean() - 0.9) < 0.005
    for changed in [(2, 0), (1, 1)]:
        other = np.asarray(flash_attention.hashed_bits(*(jnp.int32(x) for x in changed), positions[:, None],
                                                         positions[None, :]))
        assert (other == bits).mean() < 0.001, changed
    assert (bits[1:] == bits[:-1]).mean() < 0.001 and (bits[:, 1:] == bits[:, :-1]).mean() < 0.001


@pytest.mark.parametrize("make_model", [partial(tiny_gpt2, attn_pdrop=0.5, resid_pdrop=0.0, embd_pdrop=0.0),
                                        partial(tiny_gpt2, attn_pdrop=0.5, resid_pdrop=0.0, embd_pdrop=0.0, n_embd=128),
                                        partial(tiny_llama, attention_dropout=0.5)], ids=["gpt2", "gpt2_packed", "llama"])
def test_a_training_call_with_attention_dropout_runs_the_dropout_kernel(make_model):
    """The kernel's masks are not the stock attention's, so the loss differs from the stock call's with the
    same key; it is the same for the same key, and another key draws other masks. A GPT-2 whose heads fill
    128-lane blocks has the kernel read c_attn's output in place."""
    model = make_model()
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(2, LENGTH)), jnp.int32)
    mask = jnp.asarray(padding_mask()[:2])
    rng, other = jax.random.PRNGKey(3), jax.random.PRNGKey(4)
    stock = float(loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0])
    model_attention.use_attention_kernels(model, interpret=True)
    routed, grads = loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)
    assert float(routed) != stock and np.isfinite(float(routed))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
    assert float(loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0]) == float(routed)
    assert float(loss_and_grads(model, ids, mask, train=True, dropout_rng=other)[0]) != float(routed)


def test_attention_dropout_over_more_tokens_than_the_kernel_holds_runs_the_stock_attention(monkeypatch):
    """Past `dropout_attention.fits` the stock call runs, masks and all: the loss is the stock one's."""
    model = tiny_gpt2(attn_pdrop=0.5, resid_pdrop=0.0, embd_pdrop=0.0)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(2, LENGTH)), jnp.int32)
    mask, rng = jnp.asarray(padding_mask()[:2]), jax.random.PRNGKey(3)
    stock = float(loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0])
    heads = model.config.n_head
    width = flash_attention.group_width(heads, model.config.n_embd // heads)
    monkeypatch.setattr(flash_attention, "MAX_DQ_ELEMENTS", LENGTH * width - 1)
    model_attention.use_attention_kernels(model, interpret=True)
    assert float(loss_and_grads(model, ids, mask, train=True, dropout_rng=rng)[0]) == stock


def fsdp_mesh():
    """The 8 test devices as fsdp lays them out: 2 x 4 (data x fsdp), the batch split over both."""
    return Mesh(np.array(jax.devices()).reshape(2, 4), MESH_AXES)


def split_rows(mesh, *arrays):
    return [jax.device_put(x, NamedSharding(mesh, PartitionSpec(MESH_AXES))) for x in arrays]


@pytest.mark.parametrize("make_model", [partial(tiny_gpt2, n_embd=128), tiny_llama, tiny_bert],
                         ids=["gpt2_packed", "llama", "bert"])
def test_under_fsdp_each_device_runs_the_kernel_on_its_rows(make_model):
    """Under a jit over fsdp's mesh the kernels run per device (shard_map): the stock model's loss and
    gradients, 8 rows over 8 devices, sequences padded on either side. The three routes: GPT-2's flash kernel
    on c_attn's output, splash (Llama), the bidirectional flash kernel (BERT)."""
    model, mesh = make_model(), fsdp_mesh()
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(3, 64, size=(8, LENGTH)), jnp.int32)
    mask = jnp.asarray(np.concatenate([padding_mask(), np.ones((5, LENGTH), np.int32)]))
    objective = masked_lm_loss_and_grads if make_model is tiny_bert else loss_and_grads
    stock = objective(model, ids, mask)
    model_attention.use_attention_kernels(model, interpret=True, mesh=mesh)
    routed = jax.jit(partial(objective, model))(*split_rows(mesh, ids, mask))
    np.testing.assert_allclose(float(routed[0]), float(stock[0]), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(routed[1]), jax.tree_util.tree_leaves(stock[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


@pytest.mark.parametrize("make_model", [partial(tiny_gpt2, n_embd=128), partial(tiny_bert, hidden_dropout_prob=0.0)],
                         ids=["gpt2_packed", "bert"])
def test_under_fsdp_no_two_devices_drop_the_same_weights(make_model):
    """The same sequence on each of the 8 devices, attention dropout on: each device draws its own masks (the
    kernel numbers its tiles from a device's first row: without its place folded into the seed, every device
    would drop the same weights), the same ones for the same key."""
    dropout = {"attn_pdrop": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0} if make_model.func is tiny_gpt2 else \
        {"attention_probs_dropout_prob": 0.5}
    model, mesh = make_model(**dropout), fsdp_mesh()
    ids = jnp.asarray(np.tile(np.random.default_rng(2).integers(3, 64, size=(1, LENGTH)), (8, 1)), jnp.int32)
    model_attention.use_attention_kernels(model, interpret=True, mesh=mesh)

    @jax.jit
    def logits(ids, mask, key):
        return model(ids, attention_mask=mask, train=True, dropout_rng=key).logits

    rows, mask = split_rows(mesh, ids, jnp.ones_like(ids))
    first = np.asarray(logits(rows, mask, jax.random.PRNGKey(3)))
    assert len({row.tobytes() for row in first}) == 8
    np.testing.assert_array_equal(np.asarray(logits(rows, mask, jax.random.PRNGKey(3))), first)
    assert not np.array_equal(np.asarray(logits(rows, mask, jax.random.PRNGKey(4))), first)


def test_choose_routes_only_where_the_kernel_runs_and_names_why_not():
    gpt2 = tiny_gpt2()
    assert model_attention.choose("auto", gpt2, "tpu", "dp")
    assert not model_attention.choose("auto", gpt2, "cpu", "dp")
    assert model_attention.choose("auto", gpt2, "tpu", "fsdp")
    assert not model_attention.choose("auto", gpt2, "cpu", "fsdp")
    assert not model_attention.choose("xla", gpt2, "tpu", "dp")
    assert model_attention.choose("splash", gpt2, "cpu", "dp")
    assert model_attention.choose("splash", gpt2, "tpu", "fsdp")
    bert = tiny_bert()
    assert model_attention.choose("auto", bert, "tpu", "dp")
    assert not model_attention.choose("auto", bert, "cpu", "dp")
    assert model_attention.choose("splash", bert, "tpu", "dp")
    distilbert = FlaxDistilBertForMaskedLM(DistilBertConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2,
                                                            hidden_dim=16), seed=0)
    assert not model_attention.choose("auto", distilbert, "tpu", "dp")
    with pytest.raises(UsageError, match="not distilbert's"):
        model_attention.choose("splash", distilbert, "tpu", "dp")


@pytest.mark.slow
def test_the_script_trains_through_splash_with_checkpointed_layers(tmp_path):
    """The train step compiled ahead of time with checkpointed layers (splash's block tables, built in one
    trace, once made the next one fail): the losses are the stock attention's."""
    losses, logs = {}, {}
    for choice in ("splash", "xla"):
        out = str(tmp_path / choice)
        result = run_script("run_clm_flax.py", [
            "--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
            "n_embd=32,n_layer=2,n_head=2,n_positions=128,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0",
            "--train_file", "data/lm/train.txt", "--block_size", LENGTH, "--max_train_samples", 64,
            "--per_device_train_batch_size", 1, "--do_train", "--max_steps", 3, "--logging_steps", 1,
            "--gradient_checkpointing", "--attention", choice, "--output_dir", out, "--compilation_cache_dir", "none"])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[choice], logs[choice] = [row["loss"] for row in read_metrics(out)], result.stdout + result.stderr
    assert "attention: Pallas kernels (flash," in logs["splash"]
    np.testing.assert_allclose(losses["splash"], losses["xla"], rtol=1e-5)
