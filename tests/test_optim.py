"""utils/run/optim.py: learning-rate schedules, weight-decay masks over real Flax param trees, the optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from transformers import (BartConfig, BeitConfig, BertConfig, Dinov2Config, FlaxBartForConditionalGeneration,
                          FlaxBeitForImageClassification, FlaxBertForMaskedLM, FlaxDinov2ForImageClassification,
                          FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM, FlaxResNetForImageClassification,
                          FlaxT5ForConditionalGeneration, FlaxViTForImageClassification, GPT2Config, LlamaConfig,
                          ResNetConfig, T5Config, ViTConfig)

from utils.base.errors import UsageError
from utils.models import compat
from utils.run.optim import create_optimizer, decay_mask, learning_rate_schedule


# Schedules compute in float32 (a division, a cosine) on values <= 2: a few ulps (2.4e-7 at 2) off
# the exact numbers; 1e-6 absolute (or relative, for the small constant) covers that, a wrong step
# count or warmup is off by 1e-2 or more. Values that are exact in float32 use approx's defaults.
def values(schedule, steps):
    return [float(schedule(s)) for s in steps]


def test_linear_with_warmup():
    s = learning_rate_schedule("linear", 1.0, warmup_steps=10, total_steps=110)
    np.testing.assert_allclose(values(s, [0, 5, 10, 60, 110]), [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
    assert float(s(200)) == pytest.approx(0.0, abs=1e-6)


def test_cosine_with_warmup():
    s = learning_rate_schedule("cosine", 2.0, warmup_steps=4, total_steps=24)
    np.testing.assert_allclose(values(s, [0, 2, 4, 14, 24]), [0.0, 1.0, 2.0, 1.0, 0.0], atol=1e-6)
    # cosine stays above linear in the first half of the decay (float32 cosine vs float64: a few ulps)
    assert float(s(9)) == pytest.approx(2.0 * 0.5 * (1 + np.cos(np.pi * 5 / 20)), rel=1e-5)


def test_constant_with_warmup():
    s = learning_rate_schedule("constant", 3e-4, warmup_steps=3, total_steps=100)
    np.testing.assert_allclose(values(s, [0, 3, 50, 100]), [0.0, 3e-4, 3e-4, 3e-4], rtol=1e-6)


@pytest.mark.parametrize("kind, mid", [("linear", 0.5), ("cosine", 0.5), ("constant", 1.0)])
def test_no_warmup_starts_at_peak(kind, mid):
    s = learning_rate_schedule(kind, 1.0, warmup_steps=0, total_steps=10)
    assert float(s(0)) == pytest.approx(1.0)
    assert float(s(5)) == pytest.approx(mid, abs=1e-6)
    assert float(s(10)) == pytest.approx(0.0 if kind != "constant" else 1.0, abs=1e-6)


def test_warmup_longer_than_run_is_clamped():
    s = learning_rate_schedule("linear", 1.0, warmup_steps=50, total_steps=10)
    assert float(s(5)) == pytest.approx(0.5) and float(s(10)) == pytest.approx(1.0)


def test_unknown_schedule():
    with pytest.raises(UsageError, match="'exp'"):
        learning_rate_schedule("exp", 1.0, 0, 10)


TINY = {
    "t5": (FlaxT5ForConditionalGeneration,
           T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)),
    "bart": (FlaxBartForConditionalGeneration,
             BartConfig(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_position_embeddings=32)),
    "gpt2": (FlaxGPT2LMHeadModel, GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=32)),
    "bert": (FlaxBertForMaskedLM, BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, max_position_embeddings=32)),
    "llama": (FlaxLlamaForCausalLM, LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                                                max_position_embeddings=32)),
    # Vision: learned tokens, position tables and layer scales do not decay; nor batch-norm statistics.
    "vit": (FlaxViTForImageClassification, ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32)),
    "beit": (FlaxBeitForImageClassification, BeitConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                                        num_attention_heads=2, intermediate_size=32,
                                                        use_relative_position_bias=True, layer_scale_init_value=0.1)),
    "dinov2": (FlaxDinov2ForImageClassification, Dinov2Config(image_size=8, patch_size=4, hidden_size=16,
                                                              num_hidden_layers=1, num_attention_heads=2)),
    "resnet": (FlaxResNetForImageClassification, ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1],
                                                              layer_type="basic")),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_decay_mask_on_real_param_trees(name):
    compat.apply()  # T5's shape-only init goes through jnp.clip(a_max=...)
    cls, config = TINY[name]
    shapes = cls(config, _do_init=False).params_shape_tree  # shapes only: nothing is initialised
    mask = traverse_util.flatten_dict(decay_mask(shapes))
    assert mask.keys() == traverse_util.flatten_dict(shapes).keys()
    # Exactly the matrices decay: kernels and embeddings; biases and norm scales/weights never do.
    wrong = {"/".join(path): decays for path, decays in mask.items() if decays != (path[-1] in ("kernel", "embedding"))}
    assert not wrong
    assert sum(mask.values()) >= 5
    norms = [path for path in mask if "norm" in "/".join(path).lower() or path[-2:-1] in (("ln_1",), ("ln_f",))]
    assert norms and not any(mask[path] for path in norms)


def test_bart_final_logits_bias_not_decayed():
    cls, config = TINY["bart"]
    mask = decay_mask(cls(config, _do_init=False).params_shape_tree)
    assert mask["final_logits_bias"] is False


def _state_types(tree):
    found = set()

    def walk(node):
        found.add(type(node))
        if isinstance(node, (tuple, list)):
            for child in node:
                walk(child)
        elif isinstance(node, dict):
            for child in node.values():
                walk(child)

    walk(tree)
    return found


def test_adamw_applies_masked_weight_decay():
    params = {"dense": {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full((2,), 2.0)},
              "LayerNorm": {"scale": jnp.full((2,), 2.0)}}
    tx = create_optimizer(optax.constant_schedule(1.0), False, 0.9, 0.999, 1e-8, weight_decay=0.1)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    # -lr * wd * param; float32 0.1 x 2 is within 1.5e-8 relative of 0.2: the default rtol 1e-7 holds.
    np.testing.assert_allclose(updates["dense"]["kernel"], -0.2)
    np.testing.assert_allclose(updates["dense"]["bias"], 0.0)  # masked: exactly 0
    np.testing.assert_allclose(updates["LayerNorm"]["scale"], 0.0)


def test_adafactor_flag_selects_adafactor():
    params = {"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.ones((3,))}}
    adamw = create_optimizer(optax.constant_schedule(1e-3), False, 0.9, 0.999, 1e-8, 0.0).init(params)
    adafactor = create_optimizer(optax.constant_schedule(1e-3), True, 0.9, 0.999, 1e-8, 0.0).init(params)
    adamw_types, adafactor_types = _state_types(adamw), _state_types(adafactor)
    assert optax.ScaleByAdamState in adamw_types and optax.ScaleByAdamState not in adafactor_types
    assert any("Factored" in t.__name__ for t in adafactor_types)
