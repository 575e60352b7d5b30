"""utils/models/decoder_positions.py: the rotary decoders (Llama, Mistral, Gemma) compute the positions their
configs define. Their rotary angles against plain numpy formulas written here, their logits and
greedy continuations against numbers PyTorch transformers produced (tests/references/), and a
config with a setting they cannot compute stops with one line."""

import json
import math
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from transformers import AutoConfig, FlaxAutoModelForCausalLM, GemmaConfig, LlamaConfig, MistralConfig

from tests.references.decoder_cases import CASES, config_settings, numpy_weights
from tests.script_runner import ROOT, run_script
from utils.base.errors import UsageError
from utils.models import compat, decoder_positions, weights

with open(os.path.join(ROOT, "tests", "references", "decoder_logits.json"), encoding="utf-8") as f:
    REFERENCE = json.load(f)["cases"]


# ----------------------------------------------------------------------------------------------
# Rotary angles against numpy
# ----------------------------------------------------------------------------------------------
def numpy_frequencies(theta, dim):
    return np.array([theta ** (-i / dim) for i in range(0, dim, 2)])


def numpy_llama3(theta, dim, factor, low_factor, high_factor, context):
    """Llama 3.1's rule as its release describes it: wavelengths longer than context / low_factor are
    divided by `factor`, those shorter than context / high_factor kept, the ones between blended."""
    out = []
    for f in numpy_frequencies(theta, dim):
        wavelength = 2 * math.pi / f
        if wavelength < context / high_factor:
            out.append(f)
        elif wavelength > context / low_factor:
            out.append(f / factor)
        else:
            smooth = (context / wavelength - low_factor) / (high_factor - low_factor)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out), 1.0


def numpy_yarn(theta, dim, factor, context, beta_fast=32, beta_slow=1, attention=None, truncate=True):
    """YaRN (Peng et al. 2023): dimension d turns context * f_d / (2 pi) times over the pretrained
    context; those turning more than beta_fast times keep their frequency, fewer than beta_slow are
    divided by `factor`, a linear ramp between; cos/sin scaled by 0.1 ln(factor) + 1."""
    def dimension_turning(times):
        return dim * math.log(context / (times * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    out = []
    for i, f in enumerate(numpy_frequencies(theta, dim)):
        interpolated_share = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(interpolated_share * f / factor + (1 - interpolated_share) * f)
    return np.array(out), attention if attention is not None else 0.1 * math.log(factor) + 1


def numpy_cos_sin(frequencies, scale, positions):
    angles = np.outer(positions, frequencies)
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles) * scale, np.sin(angles) * scale


def llama(**settings):
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, **settings)


POSITIONS = np.arange(40)
ANGLE_CASES = {
    "theta": (llama(rope_theta=500000.0), numpy_frequencies(500000.0, 16), 1.0),
    "head_dim": (llama(rope_theta=1e6, head_dim=32), numpy_frequencies(1e6, 32), 1.0),
    "linear": (llama(rope_theta=20000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
               numpy_frequencies(20000.0, 16) / 4, 1.0),
    "linear_old_key": (llama(rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0}),
                       numpy_frequencies(20000.0, 16) / 2, 1.0),
    "llama3": (llama(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 512}),
               *numpy_llama3(500000.0, 16, 8.0, 1.0, 4.0, 512)),
    "yarn": (llama(rope_theta=20000.0, max_position_embeddings=64,
                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
             *numpy_yarn(20000.0, 16, 4.0, 16)),
    "yarn_betas": (llama(rope_theta=20000.0, max_position_embeddings=64,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 2.0,
                                       "attention_factor": 1.5, "truncate": False}),
                   *numpy_yarn(20000.0, 16, 4.0, 64, 8.0, 2.0, 1.5, truncate=False)),
    "gemma": (GemmaConfig(head_dim=16, rope_theta=100000.0), numpy_frequencies(100000.0, 16), 1.0),
    "mistral": (MistralConfig(hidden_size=64, num_attention_heads=4, rope_theta=1e6), numpy_frequencies(1e6, 16), 1.0),
}


@pytest.mark.parametrize("name", ANGLE_CASES)
def test_rotary_angles_follow_the_config(name):
    config, frequencies, scale = ANGLE_CASES[name]
    cos, sin = decoder_positions.rotary_cos_sin(config, POSITIONS[None])
    want_cos, want_sin = numpy_cos_sin(frequencies, scale, POSITIONS)
    # float32 angles up to 39 rad: ~4e-6 of rounding
    np.testing.assert_allclose(np.asarray(cos[0]), want_cos, atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin[0]), want_sin, atol=2e-5)


def test_dynamic_ntk_grows_the_base_past_the_pretrained_positions():
    """Within max_position_embeddings, rope_theta's angles; a call reaching position L - 1 > max uses
    base theta * (factor L / max - (factor - 1)) ^ (d / (d - 2)) for all its positions."""
    config = llama(rope_theta=20000.0, max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    short = np.arange(16)
    cos, _ = decoder_positions.rotary_cos_sin(config, short[None])
    np.testing.assert_allclose(np.asarray(cos[0]), numpy_cos_sin(numpy_frequencies(20000.0, 16), 1.0, short)[0],
                               atol=2e-5)
    longer = np.arange(40)
    base = 20000.0 * (2.0 * 40 / 16 - 1.0) ** (16 / 14)
    cos, sin = decoder_positions.rotary_cos_sin(config, longer[None])
    want_cos, want_sin = numpy_cos_sin(numpy_frequencies(base, 16), 1.0, longer)
    np.testing.assert_allclose(np.asarray(cos[0]), want_cos, atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin[0]), want_sin, atol=2e-5)


def test_longrope_takes_the_long_factors_past_the_pretrained_positions():
    config = llama(rope_theta=30000.0, max_position_embeddings=32, original_max_position_embeddings=8,
                   rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0, 1, 1, 1, 1],
                                 "long_factor": [1.0, 2.0, 4.0, 8.0, 8, 8, 8, 8]})
    scale = math.sqrt(1 + math.log(32 / 8) / math.log(8))
    for positions, factors in ((np.arange(8), config.rope_scaling["short_factor"]),
                               (np.arange(9), config.rope_scaling["long_factor"])):
        cos, sin = decoder_positions.rotary_cos_sin(config, positions[None])
        want_cos, want_sin = numpy_cos_sin(numpy_frequencies(30000.0, 16) / np.array(factors), scale, positions)
        np.testing.assert_allclose(np.asarray(cos[0]), want_cos, atol=2e-5)
        np.testing.assert_allclose(np.asarray(sin[0]), want_sin, atol=2e-5)


def test_mistral_window_holds_the_last_sliding_window_keys():
    mask = np.asarray(decoder_positions.causal_window_mask(MistralConfig(max_position_embeddings=6, sliding_window=3)))
    want = np.array([[max(0, query - 2) <= key <= query for key in range(6)] for query in range(6)])
    np.testing.assert_array_equal(mask[0, 0], want)
    whole = np.asarray(decoder_positions.causal_window_mask(MistralConfig(max_position_embeddings=6,
                                                                          sliding_window=None)))
    np.testing.assert_array_equal(whole[0, 0], np.tril(np.ones((6, 6), bool)))


# ----------------------------------------------------------------------------------------------
# Logits and greedy continuations against PyTorch transformers
# ----------------------------------------------------------------------------------------------
def load_reference_model(name, tmp_path):
    """The Flax model of a reference case with the weights PyTorch used, read through the project's
    own PyTorch-checkpoint path (a `model.safetensors` of PyTorch names)."""
    compat.apply()
    model_type, settings = config_settings(name)
    config = AutoConfig.for_model(model_type, **settings)
    config.save_pretrained(tmp_path)
    case = REFERENCE[name]
    save_file(numpy_weights([(key, tuple(shape)) for key, shape in case["parameters"]], case["seed"]),
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    decoder_positions.check(config)
    model = FlaxAutoModelForCausalLM.from_config(config, _do_init=False)
    params = weights.read_converted(model, str(tmp_path), "model.safetensors", str(tmp_path / "model.safetensors"))
    return model, params, config


@pytest.mark.parametrize("name", CASES)
def test_logits_match_pytorch(name, tmp_path):
    model, params, _ = load_reference_model(name, tmp_path)
    forward = jax.jit(lambda params, ids: model(ids, params=params).logits)
    for ids, want in zip(REFERENCE[name]["inputs"], REFERENCE[name]["logits"]):
        # stored to 5 decimals; float32 in two libraries: a few 1e-6 on logits of size ~5
        np.testing.assert_allclose(np.asarray(forward(params, np.array(ids, np.int32))), np.array(want),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[3]])
def test_greedy_continuation_matches_pytorch(name, tmp_path):
    """Generation runs the cached path (one position at a time, the window sliding past the prompt)."""
    model, params, config = load_reference_model(name, tmp_path)
    prompt = np.array([REFERENCE[name]["prompt"]], np.int32)
    want = REFERENCE[name]["generated"]
    sequences = model.generate(prompt, params=params, max_new_tokens=len(want), do_sample=False,
                               pad_token_id=config.pad_token_id).sequences
    assert np.asarray(sequences)[0, prompt.shape[1]:].tolist() == want


# ----------------------------------------------------------------------------------------------
# What cannot be computed stops before any work
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, named", [
    (llama(rope_scaling={"rope_type": "su", "factor": 2.0}), "rope_type 'su'"),
    (MistralConfig(rope_scaling={"rope_type": "yarn"}), "lacks factor"),
    (llama(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (llama(mlp_bias=True), "mlp_bias=true"),
    (llama(rope_theta=1e4, original_max_position_embeddings=None, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}), "neither factor"),
    (llama(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 8, "factor": 2.0}),
     "short_factor has 3 values"),
])
def test_settings_that_cannot_be_computed_are_named(config, named):
    with pytest.raises(UsageError, match=named):
        decoder_positions.check(config)


def test_settings_that_can_be_computed_pass():
    for config, _, _ in ANGLE_CASES.values():
        decoder_positions.check(config)


@pytest.mark.slow
def test_the_script_stops_on_such_a_checkpoint_before_any_work(tmp_path):
    checkpoint, out = tmp_path / "llama", tmp_path / "out"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                rope_scaling={"rope_type": "su", "factor": 2.0}).save_pretrained(checkpoint)
    result = run_script("run_clm_flax.py", [
        "--model_name_or_path", checkpoint, "--tokenizer_name", "data/lm/tokenizer", "--train_file",
        "data/lm/train.txt", "--do_train", "--output_dir", out])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the llama config's rope_scaling has rope_type 'su', which this project does not compute (it computes "
        "default, linear, dynamic, yarn, longrope, llama3): use a checkpoint without it, or train with PyTorch")
    assert not out.exists()
