"""utils/models/decoders.py and hub_checkpoint.py: the project's own decoder family against PyTorch
transformers 5 (tests/references/family_logits.json, made by make_family_logits.py): logits, greedy
continuations (one prompt, and a left-padded batch through the KV cache), configs read in the older
and the newer config.json forms alike, checkpoints read and written back; what it cannot compute is
refused by name; and each feature, dropped, moves the logits well past the tolerance."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.references.decoder_cases import numpy_weights
from tests.references.family_cases import CASES, EXPORTED, hub_config
from tests.script_runner import ROOT
from utils.base.errors import UsageError
from utils.models import decoders, hub_checkpoint

with open(os.path.join(ROOT, "tests", "references", "family_logits.json"), encoding="utf-8") as f:
    STORED = json.load(f)
REFERENCE = STORED["cases"]
# PyTorch's logits are stored to 5 decimals; float32 in two libraries differ by a few 1e-5 on logits of size ~5.
TOLERANCE = 1e-4


def pytorch_checkpoint(name, folder):
    """A checkpoint folder as the hub holds one: the case's config.json as transformers 5 saved it and
    its numpy weights under their PyTorch names."""
    case = REFERENCE[name]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(case["config"], f)
    save_file(numpy_weights([(key, tuple(shape)) for key, shape in case["parameters"]], case["seed"]),
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def load(name, tmp_path):
    """(model, params) of a case read from its checkpoint folder."""
    _, model, params = decoders.load_checkpoint(pytorch_checkpoint(name, str(tmp_path / name)))
    return model, params


def logits_of(model, params, ids, dtype=jnp.float32):
    model = model.clone(dtype=dtype)
    return np.asarray(jax.jit(lambda params, ids: decoders.forward(model, params, ids))(params, np.array(ids)))


def largest_difference(model, params, name):
    return max(float(np.abs(logits_of(model, params, ids) - np.array(want)).max())
               for ids, want in zip(REFERENCE[name]["inputs"], REFERENCE[name]["logits"]))


# ----------------------------------------------------------------------------------------------
# Against PyTorch transformers 5
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_logits_match_pytorch(name, tmp_path):
    model, params = load(name, tmp_path)
    assert largest_difference(model, params, name) < TOLERANCE


@pytest.mark.parametrize("name", CASES)
def test_greedy_continuations_match_pytorch(name, tmp_path):
    """The prompt PyTorch continued alone, and the two it continued left-padded to one width, in one
    batch (one program): the prompts into the KV cache, then one token a call (windows sliding past the
    prompt, Phi-3's longrope switching to its long factors)."""
    model, params = load(name, tmp_path)
    case = REFERENCE[name]
    ids = np.array([case["prompt"]] + case["padded_prompts"])
    mask = np.array([[1] * len(case["prompt"])] + case["padded_mask"])
    generate = jax.jit(lambda params, ids, mask: decoders.greedy_generate(model, params, ids, mask,
                                                                          len(case["generated"])))
    generated = generate(params, ids, mask)
    assert np.asarray(generated).tolist() == [case["generated"]] + case["padded_generated"]


@pytest.mark.parametrize("name", CASES)
def test_an_older_config_json_reads_as_the_one_transformers_5_saves(name):
    """rope_theta / rope_scaling / rope_local_base_freq / sliding_window_pattern / use_sliding_window
    against rope_parameters and layer_types."""
    assert decoders.config_from_hub(hub_config(name)) == decoders.config_from_hub(REFERENCE[name]["config"])


@pytest.mark.parametrize("name", ["llama_biases_tied", "mistral_window", "qwen2_window_layers", "qwen3_qk_norm", "gemma",
                                  "gemma2_capped", "gemma3_local_global", "phi3_partial_longrope"])
def test_bfloat16_logits_stay_as_near_pytorch_float32_as_pytorch_bfloat16_does(name, tmp_path):
    """Computed in bfloat16 (float32 params), within 1.5 times the distance of PyTorch's own bfloat16 model
    (saved and loaded in bfloat16) from its float32 logits, plus 0.05; the same next token nearly everywhere."""
    model, params = load(name, tmp_path)
    case = REFERENCE[name]
    want = np.array(case["logits"][0])
    got = logits_of(model, params, case["inputs"][0], jnp.bfloat16)
    assert np.abs(got - want).max() < 1.5 * case["bfloat16_error"] + 0.05
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_left_padding_leaves_the_real_tokens_logits_alone(tmp_path):
    """Positions come from the attention mask: a row padded on the left computes, on its real tokens,
    what it computes unpadded (windows and local/global layers included)."""
    model, params = load("gemma3_local_global", tmp_path)
    ids = np.array(REFERENCE["gemma3_local_global"]["inputs"][0][:1])
    padded = np.concatenate([np.zeros((1, 3), ids.dtype), ids], axis=1)
    mask = (np.arange(padded.shape[1]) >= 3).astype(np.int32)[None]
    forward = jax.jit(lambda params, ids, mask: decoders.forward(model, params, ids, mask))
    np.testing.assert_allclose(np.asarray(forward(params, padded, mask))[:, 3:], logits_of(model, params, ids),
                               atol=1e-5, rtol=0)


def test_pytorch_transformers_5_loads_the_exports_as_its_own():
    """Recorded by make_family_logits.py --exports (torch is not a dependency): for each exported case in
    float32 and bfloat16, transformers 5's AutoModelForCausalLM loads the export with the tensors its
    save_pretrained writes, bitwise the same weights, and the same logits."""
    exports = STORED["exports"]
    assert sorted(exports) == sorted(f"{name}/{dtype}" for name in EXPORTED for dtype in ("float32", "bfloat16"))
    for result in exports.values():
        assert result["loaded"] and result["tensors_as_save_pretrained"] and result["weights_equal"]
        assert result["max_abs_logit_difference"] == 0.0
    assert all(exports[f"{name}/float32"]["max_abs_difference_from_reference_logits"] < TOLERANCE for name in EXPORTED)


# ----------------------------------------------------------------------------------------------
# Checkpoints: read -> write -> read
# ----------------------------------------------------------------------------------------------
def listing(folder):
    found = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), framework="flax") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    found[key] = (tuple(tensor.shape), str(tensor.dtype), np.asarray(tensor))
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_survives_read_write_read(dtype, tmp_path):
    """Sharded on the way out (an index and three shards), every PyTorch name, shape, dtype and value
    back as it came in, and the config.json as read."""
    name = "phi3_partial_longrope"  # fused projections and tied embeddings
    source = pytorch_checkpoint(name, str(tmp_path / "source"))
    hub, config = decoders.read_config(source)
    shapes = decoders.param_shapes(decoders.DecoderLM(config))
    params = jax.tree_util.tree_map(lambda leaf: np.asarray(jnp.asarray(leaf, dtype)),
                                    hub_checkpoint.read_checkpoint(source, shapes))
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    size = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    hub_checkpoint.write_checkpoint(params, first, hub, max_shard_bytes=size // 3 + 1)
    assert os.path.isfile(os.path.join(first, hub_checkpoint.INDEX))
    again = hub_checkpoint.read_checkpoint(first, shapes)
    hub_checkpoint.write_checkpoint(again, second, hub)
    written = listing(first)
    assert {key: list(shape) for key, (shape, _, _) in written.items()} == dict(REFERENCE[name]["parameters"])
    assert {value[1] for value in written.values()} == {dtype}
    assert flatten_dict(again).keys() == flatten_dict(params).keys()
    for path, leaf in flatten_dict(params).items():
        assert flatten_dict(again)[path].dtype == leaf.dtype
        np.testing.assert_array_equal(flatten_dict(again)[path], leaf)
    for key, (shape, kind, values) in listing(second).items():
        assert (shape, kind) == written[key][:2]
        np.testing.assert_array_equal(values, written[key][2])
    with open(os.path.join(second, "config.json"), encoding="utf-8") as f:
        assert json.load(f) == hub


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    source = pytorch_checkpoint("qwen3_qk_norm", str(tmp_path / "qwen3"))
    _, config = decoders.read_config(source)
    untied = decoders.param_shapes(decoders.DecoderLM(dataclasses.replace(config, tie_word_embeddings=False)))
    with pytest.raises(UsageError, match="lacks lm_head.weight"):
        hub_checkpoint.read_checkpoint(source, untied)
    wider = decoders.param_shapes(decoders.DecoderLM(dataclasses.replace(config, intermediate_size=96)))
    with pytest.raises(UsageError, match=r"model.layers.0.mlp.down_proj.weight has shape \[32, 64\] where the "
                                         r"config makes \[32, 96\]"):
        hub_checkpoint.read_checkpoint(source, wider)
    without_norms = decoders.param_shapes(decoders.DecoderLM(dataclasses.replace(config, qk_norm=False)))
    with pytest.raises(UsageError, match="holds weights the config's model does not have "
                                         r"\(model.layers.0.self_attn.k_norm.weight"):
        hub_checkpoint.read_checkpoint(source, without_norms)
    with pytest.raises(UsageError, match="holds neither model.safetensors"):
        hub_checkpoint.read_checkpoint(str(tmp_path), untied)


# ----------------------------------------------------------------------------------------------
# What the family does not compute stops before any weights are read
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, named", [
    (dict(model_type="qwen3_moe"), "model_type 'qwen3_moe' is not in this project's decoder family"),
    (dict(model_type="gpt2"), "model_type 'gpt2'"),
    (dict(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "rope_type 'mrope'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks low_freq_factor, high_freq_factor"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(hidden_act="relu2"), "activation 'relu2'"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types chunked_attention"),
    (dict(num_key_value_heads=3), "4 attention heads, not a multiple of its 3 key/value heads"),
])
def test_what_the_family_does_not_compute_is_named(changes, named):
    with pytest.raises(UsageError, match=named):
        decoders.config_from_hub({**hub_config("llama3_rope"), **changes})


@pytest.mark.parametrize("model_type, settings, windows", [
    ("mistral", dict(), (4096, 4096)),  # transformers 5's default window where config.json has none
    ("mistral", dict(sliding_window=None), (None, None)),  # Mistral v0.2+: no window at all
    ("mistral", dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"]), (8, 8)),
    ("llama", dict(sliding_window=8), (None, None)),  # Llama's layers ignore the key
    ("qwen2", dict(sliding_window=8, max_window_layers=1), (None, None)),  # without use_sliding_window
    ("qwen2", dict(sliding_window=8, layer_types=["sliding_attention"] * 2), (None, None)),
    ("qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1), (None, 8)),
    ("gemma2", dict(sliding_window=8), (8, None)),
])
def test_each_layer_gets_the_window_pytorch_gives_it(model_type, settings, windows):
    hub = dict(model_type=model_type, vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, **settings)
    assert decoders.config_from_hub(hub).layer_windows == windows


@pytest.mark.parametrize("model_type, settings, biases", [
    ("llama", dict(attention_bias=True, mlp_bias=True), (True, True, True)),
    ("qwen2", dict(attention_bias=False), (True, False, False)),  # q, k, v always; never o
    ("qwen3", dict(attention_bias=True), (True, True, False)),
    ("mistral", dict(attention_bias=True, mlp_bias=True), (False, False, False)),  # Mistral's layers have none
    ("phi3", dict(attention_bias=True), (False, False, False)),
    ("gemma2", dict(attention_bias=True, mlp_bias=True), (True, True, False)),
])
def test_each_projection_has_the_biases_pytorch_gives_it(model_type, settings, biases):
    hub = dict(model_type=model_type, vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, **settings)
    config = decoders.config_from_hub(hub)
    assert (config.qkv_bias, config.output_bias, config.mlp_bias) == biases


def test_a_phi3_longrope_of_the_wrong_length_is_named():
    settings = hub_config("phi3_partial_longrope")
    settings["rope_scaling"] = {**settings["rope_scaling"], "long_factor": [1.0] * 8}
    with pytest.raises(UsageError, match="long_factor has 8 values where its rotated 12 dimensions of a head "
                                         "need 6"):
        decoders.config_from_hub(settings)


# ----------------------------------------------------------------------------------------------
# Negative controls: each feature, dropped, moves the logits far past the tolerance
# ----------------------------------------------------------------------------------------------
def _wrong_local_base(config):
    ropes = tuple(dataclasses.replace(rope, theta=1e6) if rope.theta == 1e4 else rope for rope in config.ropes)
    return dict(ropes=ropes)


CONTROLS = {
    "qwen3 without q/k norm": ("qwen3_qk_norm", lambda config: dict(qk_norm=False)),
    "gemma2 without attention soft-capping": ("gemma2_capped", lambda config: dict(attn_logit_softcapping=None)),
    "gemma2 without final soft-capping": ("gemma2_capped", lambda config: dict(final_logit_softcapping=None)),
    "gemma2 scaled by head_dim, not query_pre_attn_scalar": ("gemma2_capped",
                                                             lambda config: dict(query_scale=config.head_dim ** -0.5)),
    "gemma2 without its sandwich norms": ("gemma2_capped", lambda config: dict(sandwich_norms=False)),
    "gemma3 with the global rope base on local layers": ("gemma3_local_global", _wrong_local_base),
    "gemma3 every layer global": ("gemma3_local_global",
                                  lambda config: dict(layer_windows=(None,) * config.num_layers)),
    "mistral without its window": ("mistral_window", lambda config: dict(layer_windows=(None,) * config.num_layers)),
    "mistral with a window one wider": ("mistral_window", lambda config: dict(layer_windows=(5,) * config.num_layers)),
    "qwen2 window on every layer": ("qwen2_window_layers", lambda config: dict(layer_windows=(4,) * config.num_layers)),
    "gemma without (1 + w) norms": ("gemma", lambda config: dict(norm_plus_one=False)),
    "gemma without scaled embeddings": ("gemma", lambda config: dict(scale_embeddings=False)),
    "phi3 without its longrope attention factor": (
        "phi3_partial_longrope",
        lambda config: dict(ropes=tuple(dataclasses.replace(rope, attention_factor=1.0) for rope in config.ropes))),
    "llama3 rope read as default": (
        "llama3_rope", lambda config: dict(ropes=tuple(dataclasses.replace(rope, kind="default")
                                                       for rope in config.ropes))),
}


@pytest.mark.parametrize("control", CONTROLS)
def test_dropping_a_feature_fails_the_comparison(control, tmp_path):
    name, change = CONTROLS[control]
    model, params = load(name, tmp_path)
    model = decoders.DecoderLM(dataclasses.replace(model.config, **change(model.config)))
    assert largest_difference(model, params, name) > 100 * TOLERANCE
