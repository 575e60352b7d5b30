"""utils/compat.py: the `jnp.clip(a_min=, a_max=)` shim and a Flax T5 forward on current JAX."""

import jax
import jax.numpy as jnp
import numpy as np
from transformers import FlaxT5ForConditionalGeneration, T5Config

from utils import compat


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
