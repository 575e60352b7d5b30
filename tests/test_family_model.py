"""The project's decoder family wired into the engine (utils/models/family_model.py): a hub folder loaded through
`load_model` under both layouts gives PyTorch's logits; `generate_answers` on the family stops and samples as on
transformers' Flax models; run_clm_flax.py trains, evaluates, generates with and exports a tiny Qwen3, reads its
export back, and trains LoRA adapters on it with PEFT-named files; what the family cannot do is refused by name."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import load_file
from test_layout import assert_layers_hand_on_split_gradients

from tasks import causal_lm
from tests.references.decoder_cases import numpy_weights
from tests.references.family_cases import hub_config
from tests.script_runner import ROOT, read_json, read_metrics, run_script
from utils.base.arguments import ModelArguments, TrainingArguments
from utils.base.errors import UsageError
from utils.kernels import lm_head
from utils.layout.layouts import DataParallel, FullySharded, finished
from utils.models import decoders, hub_checkpoint
from utils.models.family_model import FamilyModel
from utils.models.loading import enable_gradient_checkpointing, load_config, load_model
from utils.run.spine import prepare_model

with open(os.path.join(ROOT, "tests", "references", "family_logits.json"), encoding="utf-8") as f:
    REFERENCE = json.load(f)["cases"]
TOLERANCE = 1e-4  # as tests/test_decoder_family.py: PyTorch's float32 logits, stored to 5 decimals


def transformers_config(name):
    """The case's config as transformers 4.57 builds it (its Phi3Config takes the older longrope form only)."""
    settings = hub_config(name)
    scaling = settings.get("rope_scaling")
    if settings["model_type"] == "phi3" and scaling:
        settings["rope_scaling"] = {"type": scaling["rope_type"], "short_factor": scaling["short_factor"],
                                    "long_factor": scaling["long_factor"]}
    return transformers.AutoConfig.for_model(**settings)


def case_params(name, model):
    """The case's weights (drawn by PyTorch name from its seed, as PyTorch's were) as `model`'s parameter tree."""
    case = REFERENCE[name]
    weights = numpy_weights([(key, tuple(shape)) for key, shape in case["parameters"]], case["seed"])
    names = hub_checkpoint.pytorch_names(model.params_shape_tree)
    return unflatten_dict({path: weights[key].T if transposed else weights[key]
                           for key, (path, transposed) in names.items()})


def written_folder(name, folder, dtype=np.float32):
    """A hub checkpoint folder of the case written by the project's own writer, its config.json in the older
    form transformers 4.57 reads."""
    params = case_params(name, FamilyModel(transformers_config(name)))
    cast = jax.tree_util.tree_map(lambda x: np.asarray(jnp.asarray(x, dtype)), params)
    hub_checkpoint.write_checkpoint(cast, str(folder), hub_config(name))
    return str(folder)


@pytest.mark.parametrize("layout_name", ["dp", "fsdp"])
def test_a_hub_folder_loads_through_load_model_with_pytorchs_logits(layout_name, tmp_path):
    folder = written_folder("qwen3_qk_norm", tmp_path / "qwen3")
    args = ModelArguments(model_name_or_path=folder)
    config = load_config(args, "causal-lm")
    layout = DataParallel() if layout_name == "dp" else FullySharded(8)
    model, params = load_model(transformers.FlaxAutoModelForCausalLM, args, config, 0, layout)
    assert isinstance(model, FamilyModel) and model.config.model_type == "qwen3"
    forward = jax.jit(lambda params, ids: model(ids, params=params)[0])
    case = REFERENCE["qwen3_qk_norm"]
    for ids, want in zip(case["inputs"], case["logits"]):
        assert np.abs(np.asarray(forward(finished(params), np.array(ids))) - np.array(want)).max() < TOLERANCE


def test_bfloat16_weights_load_as_written(tmp_path):
    """A bfloat16 checkpoint is read as written: the float32 master weights are exactly its values."""
    folder = written_folder("qwen3_qk_norm", tmp_path / "bf16", jnp.bfloat16)
    args = ModelArguments(model_name_or_path=folder)
    model, params = load_model(transformers.FlaxAutoModelForCausalLM, args, load_config(args, "causal-lm"), 0,
                               DataParallel())
    want = flatten_dict(case_params("qwen3_qk_norm", model))
    for path, value in flatten_dict(params).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, np.asarray(jnp.asarray(want[path], jnp.bfloat16), np.float32))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp_splits_each_family_layers_gradients_and_they_stay_exact(monkeypatch, checkpointing):
    """The family's layers are found by the engine's per-layer hooks as transformers' are: under fsdp each hands
    on its gradients split (one barrier per layer in the traced step), with --gradient_checkpointing too, and
    the gradients are those of the plain backward pass."""
    model = FamilyModel(transformers_config("qwen3_qk_norm"))
    if checkpointing:
        enable_gradient_checkpointing(model)

    def loss_fn(params, batch, rng):
        logits = model(batch["input_ids"], params=params, dropout_rng=rng, train=True)[0]
        return causal_lm.next_token_loss(logits, batch["input_ids"])

    layout = FullySharded(8)
    ids = np.random.default_rng(0).integers(3, 48, size=(8, 12)).astype(np.int32)
    params = layout.place_params(case_params("qwen3_qk_norm", model))
    batch = layout.place_batch({"input_ids": ids})
    assert_layers_hand_on_split_gradients(loss_fn, params, batch, layout, monkeypatch, layers=2, rtol=1e-5,
                                          atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Generation through generate_answers
# ----------------------------------------------------------------------------------------------
def prompts(case):
    """The case's lone prompt and its left-padded pair, one batch."""
    return {"input_ids": np.array([case["prompt"]] + case["padded_prompts"], np.int32),
            "attention_mask": np.array([[1] * len(case["prompt"])] + case["padded_mask"], np.int32)}


@pytest.mark.parametrize("name", ["qwen3_qk_norm", "phi3_partial_longrope"])
def test_generate_answers_is_greedy_generate_and_stops_each_row_at_any_end_id(name):
    """Without end ids every row runs on as `decoders.greedy_generate` (Phi-3: through its longrope recompute);
    with two end ids, each row is cut at the first of them it draws, the first end id standing there and after."""
    model = FamilyModel(transformers_config(name))
    params = case_params(name, model)
    batch, new = prompts(REFERENCE[name]), 10

    def answers(end_ids):
        return np.asarray(jax.jit(lambda params, batch: causal_lm.generate_answers(
            model, params, batch, new, causal_lm.Decoding(end_ids)))(params, batch))

    greedy = np.asarray(decoders.greedy_generate(model.module, params, batch["input_ids"], batch["attention_mask"],
                                                 new))
    np.testing.assert_array_equal(answers(()), greedy)
    # End ids each row draws partway: the 4th token of row 0 and the 3rd of row 1, as long as they come later
    ends = (int(greedy[0, 3]), int(greedy[1, 2]))
    stopped = answers(ends)
    for row in range(len(greedy)):
        cut = next((n for n, token in enumerate(greedy[row]) if token in ends), new)
        want = list(greedy[row, :cut]) + [ends[0]] * (new - cut)
        assert list(stopped[row]) == want
    assert any(next((n for n, t in enumerate(row) if t in ends), new) < new - 1 for row in greedy)


def test_sampling_and_end_ids_are_transformers_flax_generate_on_the_same_llama():
    """The family's loop and transformers' Flax generate, each given the same `NextToken` (temperature, top-k,
    top-p, each row's key, two end ids) on a Llama with the same weights, draw the same tokens."""
    config = transformers.AutoConfig.for_model("llama", vocab_size=48, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=0)
    family = FamilyModel(config)
    flax_llama = transformers.FlaxLlamaForCausalLM(config, _do_init=False)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda s: (rng.standard_normal(s.shape) * 0.5).astype(np.float32),
                                    family.params_shape_tree)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(flax_llama.params_shape_tree)
    batch = prompts(REFERENCE["llama_biases_tied"])
    batch["sample_key"] = causal_lm.sample_keys(3, len(batch["input_ids"]))
    decoding = causal_lm.Decoding((5, 7), True, 0.8, 20, 0.95)
    family_tokens, flax_tokens = (np.asarray(jax.jit(lambda params, batch, model=model: causal_lm.generate_answers(
        model, params, batch, 12, decoding))(params, batch)) for model in (family, flax_llama))
    np.testing.assert_array_equal(family_tokens, flax_tokens)
    assert len({tuple(row) for row in family_tokens}) == len(family_tokens)


# ----------------------------------------------------------------------------------------------
# What the family cannot do, refused by name
# ----------------------------------------------------------------------------------------------
TINY_QWEN3 = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2," \
             "head_dim=8,max_position_embeddings=64"


@pytest.mark.parametrize("flags, message", [
    ({"attention": "splash"}, "--attention splash: the kernels know GPT-2, Llama, BERT and RoBERTa attention, not "
                              "qwen3's: use --attention auto or xla"),
    ({"scan_layers": "yes"}, "--scan_layers yes: the scan knows the layer stacks of gpt2, llama, mistral, gemma, not "
                             "qwen3's: use --scan_layers auto or no"),
    ({"dropout_rng": "chip"}, "--dropout_rng chip draws dropout masks in a kernel, but the qwen3 model of the "
                              "project's decoder family has no dropout: use --dropout_rng auto"),
])
def test_kernels_and_scans_the_family_lacks_are_refused_by_flag(flags, message, tmp_path):
    config = load_config(ModelArguments(model_type="qwen3", config_overrides=TINY_QWEN3), "causal-lm")
    with pytest.raises(UsageError) as raised:
        prepare_model(FamilyModel(config), DataParallel(), TrainingArguments(output_dir=str(tmp_path), **flags))
    assert str(raised.value) == message


def test_auto_choices_and_gradient_checkpointing_take_the_plain_path(tmp_path):
    config = load_config(ModelArguments(model_type="qwen3", config_overrides=TINY_QWEN3), "causal-lm")
    model = FamilyModel(config)
    args = TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True)
    assert prepare_model(model, DataParallel(), args) == ("nothing", "threefry")


@pytest.mark.parametrize("args, message", [
    (dict(model_type="qwen3", config_overrides=TINY_QWEN3 + ",attention_dropout=0.1"),
     "the qwen3 config sets attention_dropout=0.1, but this project's decoder family has no dropout: set "
     "attention_dropout to 0 (in config.json, or --config_overrides attention_dropout=0 for a new model)"),
    (dict(model_type="phi3", config_overrides="resid_pdrop=0.1"), "the phi3 config sets resid_pdrop=0.1"),
    (dict(model_type="qwen3", config_overrides=TINY_QWEN3 + ",hidden_act=relu"),
     "the qwen3 config sets the activation 'relu'"),
])
def test_configs_the_family_cannot_run_are_refused_before_any_weights(args, message):
    with pytest.raises(UsageError) as raised:
        load_config(ModelArguments(**args), "causal-lm")
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


@pytest.mark.parametrize("model_type, overrides, windows", [
    ("qwen3", TINY_QWEN3 + ",use_sliding_window=true,sliding_window=4,max_window_layers=1", (None, 4)),
    # Gemma 3's class keeps the pattern as _sliding_window_pattern; the override takes its public name
    ("gemma3_text", TINY_QWEN3.replace("num_hidden_layers=2", "num_hidden_layers=3") + ",sliding_window=4,"
                    "sliding_window_pattern=3", (4, 4, None)),
])
def test_overrides_derive_the_layer_types_again(model_type, overrides, windows):
    """The config classes build layer_types from num_hidden_layers and the window settings; set after them, the
    overrides would leave 32 of them on a 2-layer Qwen3 (refused by the family), or no window where one was
    asked for."""
    config = load_config(ModelArguments(model_type=model_type, config_overrides=overrides), "causal-lm")
    assert config.layer_types == ["full_attention" if window is None else "sliding_attention" for window in windows]
    assert FamilyModel(config).module.config.layer_windows == windows


def test_the_chunked_loss_is_refused_by_flag():
    config = load_config(ModelArguments(model_type="qwen3", config_overrides=TINY_QWEN3), "causal-lm")
    with pytest.raises(UsageError, match="^--chunked_loss knows the LM heads of gpt2, llama, mistral, gemma, not "
                                         "qwen3's: drop --chunked_loss$"):
        lm_head.choose(True, config)


# ----------------------------------------------------------------------------------------------
# run_clm_flax.py end to end: a tiny Qwen3 on the shipped chat data
# ----------------------------------------------------------------------------------------------
SCRIPT = "run_clm_flax.py"
CHAT = ["configs/chat_tiny.json", "--model_type", "qwen3", "--config_overrides", TINY_QWEN3, "--logging_steps", "10"]
STEPS = 60


@pytest.fixture(scope="module")
def qwen3_trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("qwen3"))
    result = run_script(SCRIPT, CHAT + ["--output_dir", out, "--max_steps", STEPS, "--eval_steps", STEPS,
                                        "--save_steps", STEPS])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_qwen3_trains_generates_and_exports_a_hub_checkpoint(qwen3_trained, tmp_path):
    losses = [row["loss"] for row in read_metrics(qwen3_trained)]
    assert losses[-1] < 0.8 * losses[0]
    results = read_json(os.path.join(qwen3_trained, "eval_results.json"))
    assert results["eval_loss"] < 0.7 * np.log(403) and results["eval_samples"] == 200  # untrained: ~ln(vocab)
    with open(os.path.join(qwen3_trained, "generated_predictions.txt"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 200
    config = read_json(os.path.join(qwen3_trained, "config.json"))
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["dtype"] == "float32"
    assert config["num_hidden_layers"] == 2 and len(config["layer_types"]) == 2
    assert read_json(os.path.join(qwen3_trained, "generation_config.json"))["eos_token_id"] == 2
    assert not os.path.exists(os.path.join(qwen3_trained, "flax_model.msgpack"))
    tensors = load_file(os.path.join(qwen3_trained, "model.safetensors"))
    assert tensors["model.layers.1.self_attn.q_norm.weight"].shape == (8,)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # PyTorch's [out, in]
    # Read back for evaluation alone: the same loss and the same answers
    saved = ["--model_name_or_path", qwen3_trained, "--block_size", 64, "--max_new_tokens", 8,
             "--per_device_eval_batch_size", 25, "--validation_file", "data/chat/validation.jsonl", "--do_eval",
             "--predict_with_generate", "--output_dir", tmp_path / "eval"]
    result = run_script(SCRIPT, saved)
    assert result.returncode == 0, result.stderr[-3000:]
    again = read_json(tmp_path / "eval" / "eval_results.json")
    assert again["eval_loss"] == pytest.approx(results["eval_loss"], abs=2e-4)
    predicted = (tmp_path / "eval" / "generated_predictions.txt").read_text().splitlines()
    assert predicted == open(os.path.join(qwen3_trained, "generated_predictions.txt"), encoding="utf-8").read(
        ).splitlines()
    # The demo reads the export too, and answers the conversations whose prompts fit its buckets as the run did
    demo = causal_lm.TextGenerator(qwen3_trained, read_json(os.path.join(qwen3_trained, "run_args.json")))
    with open(os.path.join(ROOT, "data", "chat", "validation.jsonl"), encoding="utf-8") as f:
        asked = [row["messages"][:-1] for row in map(json.loads, f)]
    tokenizer = demo.tokenizer
    fitting = [row for row, messages in enumerate(asked) if len(tokenizer(tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"])
        <= demo.prompt_buckets[-1]][:6]
    assert fitting and [" ".join(demo.reply(asked[row], 8).text.split()) for row in fitting] == [
        predicted[row] for row in fitting]


@pytest.mark.slow
def test_lora_on_the_export_trains_the_adapters_alone_and_exports_them_in_peft_names(qwen3_trained, tmp_path):
    """fsdp, gradient checkpointing and sampled answers too: the merged export is the base plus
    (alpha / r) B A in PyTorch's orientation, every other weight the base's."""
    out = tmp_path / "lora"
    result = run_script(SCRIPT, ["configs/chat_tiny.json", "--model_type", "", "--config_overrides", "",
                                 "--tokenizer_name", "", "--model_name_or_path", qwen3_trained, "--lora_rank", 4,
                                 "--sharding", "fsdp", "--gradient_checkpointing", "--do_sample", "--logging_steps", 5,
                                 "--output_dir", out, "--max_steps", 20, "--eval_steps", 20, "--save_steps", 20])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_metrics(out)]
    assert losses[-1] < losses[0]
    adapter = read_json(out / "adapter_config.json")
    assert adapter["task_type"] == "CAUSAL_LM" and adapter["r"] == 4 and adapter["lora_alpha"] == 8.0
    assert "model.layers.1.self_attn.q_proj" in adapter["target_modules"]
    lora = load_file(out / "adapter_model.safetensors")
    assert sorted(lora) == sorted(f"base_model.model.model.layers.{layer}.self_attn.{proj}_proj.lora_{side}.weight"
                                  for layer in (0, 1) for proj in "qkvo" for side in "AB")
    base, merged = (load_file(os.path.join(folder, "model.safetensors")) for folder in (qwen3_trained, out))
    name = "model.layers.1.self_attn.q_proj"
    delta = 2.0 * lora[f"base_model.model.{name}.lora_B.weight"] @ lora[f"base_model.model.{name}.lora_A.weight"]
    assert np.abs(delta).max() > 0
    np.testing.assert_allclose(merged[name + ".weight"], base[name + ".weight"] + delta, atol=1e-6)
    untouched = [key for key in base if not any(key.startswith(f"model.layers.{layer}.self_attn.{proj}_proj")
                                                for layer in (0, 1) for proj in "qkvo")]
    assert all(np.array_equal(merged[key], base[key]) for key in untouched)
    with open(out / "generated_predictions.txt", encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 200
