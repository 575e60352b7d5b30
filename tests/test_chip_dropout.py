"""utils/kernels/chip_dropout.py: dropout with its mask drawn inside a Pallas kernel (Pallas' interpreter on CPUs,
whose bits `hashed_bits` gives; the chip's generator on a TPU)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import FlaxGPT2LMHeadModel, GPT2Config

from utils.kernels import chip_dropout, flash_attention
from utils.layout import tpu_plan

ON_TPU = jax.devices()[0].platform == "tpu"


def hashed_mask(shape, seed, rate, itemsize):
    """The interpreter's mask of a [rows, width] input, drawn here for the whole matrix at once: each block's
    bits are the hash of (seed, block number, row in the block, column)."""
    rows, width = shape
    block = chip_dropout.block_rows(rows, width, itemsize)
    row, column = np.arange(rows)[:, None], np.arange(width)[None, :]
    bits = flash_attention.hashed_bits(jnp.int32(seed), jnp.asarray(row // block), jnp.asarray(row % block),
                                         jnp.asarray(column))
    return np.asarray(bits) >= int(round(rate * 2**31))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_is_dropout_with_its_mask_and_the_same_mask_in_its_gradient(dtype):
    """[3, 256, 256] float32 is 768 rows in three 256-row blocks: every block has its own bits."""
    rate, seed = 0.25, 9
    rng = np.random.default_rng(0)
    x, d_out = (jnp.asarray(rng.normal(size=(3, 256, 256)), dtype) for _ in range(2))
    itemsize = jnp.dtype(dtype).itemsize
    assert chip_dropout.block_rows(768, 256, itemsize) < 768
    kept = hashed_mask((768, 256), seed, rate, itemsize).reshape(x.shape)
    out, vjp = jax.vjp(lambda x: chip_dropout.dropout(x, jnp.asarray([seed]), rate, interpret=True), x)
    expected = np.where(kept, np.asarray(x, np.float32) / (1 - rate), 0.0)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    (d_x,) = vjp(d_out)
    expected = np.where(kept, np.asarray(d_out, np.float32) / (1 - rate), 0.0)
    np.testing.assert_allclose(np.asarray(d_x, np.float32), expected, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6)
    assert abs(kept.mean() - (1 - rate)) < 0.01


def test_the_mask_keeps_its_share_and_changes_with_the_seed_and_the_block():
    """On a TPU the chip's generator draws it (elsewhere the interpreter's hash): ones show the mask."""
    ones = jnp.ones((64, 64, 128), jnp.float32)

    def mask(seed):
        return np.asarray(chip_dropout.dropout(ones, jnp.asarray([seed]), 0.1, interpret=not ON_TPU)) > 0

    first = mask(1)
    assert abs(first.mean() - 0.9) < 0.01
    assert (first == mask(1)).all() and (first != mask(2)).mean() > 0.1
    blocks = first.reshape(-1, chip_dropout.block_rows(4096, 128, 4), 128)
    assert len(blocks) > 1 and (blocks[0] != blocks[1]).mean() > 0.1


def test_what_the_kernel_takes():
    assert chip_dropout.takes((16, 1024, 768), jnp.bfloat16)
    assert not chip_dropout.takes((16, 1024, 100), jnp.bfloat16)  # lanes: a multiple of 128
    assert not chip_dropout.takes((3, 128), jnp.float32)  # rows: a multiple of 16
    assert not chip_dropout.takes((128,), jnp.float32)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed")
def test_the_kernel_compiles_for_a_tpu():
    """Mosaic, the TPU kernel compiler, takes the forward and backward kernel of GPT-2 small's hidden states."""
    device = tpu_plan.load("v5e-4").devices[0]
    placed = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

    def loss(x, seed):
        return jnp.sum(chip_dropout.dropout(x, seed, 0.1).astype(jnp.float32))

    compiled = jax.jit(jax.value_and_grad(loss)).lower(placed((16, 1024, 768), jnp.bfloat16), placed((1,), jnp.int32)).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2


def gpt2(n_embd):
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=n_embd, n_layer=2, n_head=2, attn_pdrop=0.0,
                        resid_pdrop=0.3, embd_pdrop=0.3)
    return FlaxGPT2LMHeadModel(config, seed=0)


def train_loss(model, rng):
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(2, 32)), jnp.int32)
    logits = model(ids, params=model.params, dropout_rng=rng, train=rng is not None).logits
    return float(jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 0]))


def test_a_model_drops_out_through_the_kernel_where_it_takes_the_shape():
    """GPT-2's hidden states (2 x 32 rows of 128) go through the kernel: other masks than flax's with the same
    key, the same again for that key, others for another; evaluation is untouched. 2 x 32 rows of 96 it does
    not take: flax's dropout runs, masks and all."""
    rng, other = jax.random.PRNGKey(3), jax.random.PRNGKey(4)
    model = gpt2(128)
    stock, evaluation = train_loss(model, rng), train_loss(model, None)
    chip_dropout.use_chip_dropout(model, interpret=True)
    routed = train_loss(model, rng)
    assert routed != stock and routed == train_loss(model, rng) and routed != train_loss(model, other)
    assert train_loss(model, None) == evaluation

    narrow = gpt2(96)
    stock = train_loss(narrow, rng)
    chip_dropout.use_chip_dropout(narrow, interpret=True)
    assert train_loss(narrow, rng) == stock
