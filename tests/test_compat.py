"""utils/models/compat.py: the `jnp.clip(a_min=, a_max=)` shim and a Flax T5 forward on current JAX, and the
encoder-decoder's `encode`."""

import jax
import jax.numpy as jnp
import numpy as np
from transformers import (BertConfig, EncoderDecoderConfig, FlaxEncoderDecoderModel, FlaxT5ForConditionalGeneration,
                          GPT2Config, T5Config)

from utils.models import compat


def test_clip_old_keywords_match_new():
    compat.apply()
    x = jnp.linspace(-3.0, 3.0, 13)
    np.testing.assert_array_equal(jnp.clip(x, a_min=-1.0, a_max=2.0), jnp.clip(x, min=-1.0, max=2.0))
    np.testing.assert_array_equal(jnp.clip(x, a_max=0.5), np.minimum(np.asarray(x), 0.5))
    np.testing.assert_array_equal(jnp.clip(x, a_min=0.5), np.maximum(np.asarray(x), 0.5))
    np.testing.assert_array_equal(jnp.clip(x, -1.0, 2.0), np.clip(np.asarray(x), -1.0, 2.0))


def test_apply_is_idempotent():
    compat.apply()
    clip = jnp.clip
    compat.apply()
    assert jnp.clip is clip
    assert float(jnp.clip(jnp.float32(5.0), a_max=1.0)) == 1.0


def test_tiny_t5_forward():
    compat.apply()
    config = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      relative_attention_num_buckets=8, decoder_start_token_id=0)
    model = FlaxT5ForConditionalGeneration(config, _do_init=False)
    # jit: eager op-by-op init and forward are several times slower on CPU
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 6))
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) % 32
    forward = jax.jit(lambda params, ids: model(input_ids=ids, decoder_input_ids=ids[:, :4], params=params).logits)
    logits = forward(params, ids)
    assert logits.shape == (2, 4, 32)
    assert np.isfinite(np.asarray(logits)).all()


def test_encoder_decoder_encode_matches_its_forward():
    """`generate` encodes through `encode`: it must see what the forward pass's encoder sees (without the
    shim, a BERT encoder took the position ids for token types and returned NaN)."""
    compat.apply()
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
        GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_inner=32))
    model = FlaxEncoderDecoderModel(config)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) + 3
    encoded = np.asarray(model.encode(ids).last_hidden_state)
    assert np.isfinite(encoded).all()
    forward = model(ids, decoder_input_ids=ids[:, :2]).encoder_last_hidden_state
    # One encoder computed by two programs that XLA may fuse differently: a few float32 roundings of
    # layer-normed values (|x| < 4, ulp 4.8e-7) per op, ~10 ops. The bug this guards gave NaN.
    np.testing.assert_allclose(encoded, np.asarray(forward), rtol=0, atol=1e-5)
