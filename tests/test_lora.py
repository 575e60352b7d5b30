"""utils/models/lora.py and LoRA through the spine (`--lora_rank`): the layers the default rule adapts in each
family, the adapted layer against a numpy merge, a frozen base (only adapters and heads move, the
optimizer keeps state for them alone) in both layouts, with accumulation and checkpointing, the PEFT
export against a listing made with PEFT itself, bad inputs; and a GLUE run end to end (checkpoints of
the adapters alone, an exact resume after kill -9, the merged export evaluating as the adapted model)."""

import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax.traverse_util import flatten_dict, unflatten_dict

import script_launcher
from script_runner import ROOT, read_json, script_env
from utils.base.arguments import ModelArguments, TrainingArguments
from utils.base.errors import UsageError
from utils.checkpoints.store import Checkpointer, checkpoint_steps
from utils.layout.layouts import DataParallel, FullySharded
from utils.models import compat, lora
from utils.models.loading import load_composed_model, load_model
from utils.run import run_directory
from utils.run.loop import InMemoryData
from utils.run.setup import training_plan
from utils.run.spine import make_steps
from utils.scoring.losses import cross_entropy_sums

REFERENCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "references")
sys.path.insert(0, REFERENCES)
from lora_cases import ALPHA, CASES, RANK  # noqa: E402

compat.apply()  # T5 on current JAX


def tiny_model(name, **lora_flags):
    """(model, Adapters, params with adapters whose B is random, not zero) of a case of lora_cases.py."""
    model_type, settings, suffix, _, _ = CASES[name]
    auto_class = getattr(transformers, f"FlaxAutoModelFor{suffix}")
    model = auto_class.from_config(transformers.AutoConfig.for_model(model_type, **settings), _do_init=False)
    adapters = lora.plan(model, ModelArguments(lora_rank=RANK, lora_alpha=ALPHA, **lora_flags), auto_class.__name__)
    params = model.init_weights(jax.random.PRNGKey(0), model.input_shape)
    new = flatten_dict(lora.new_weights(adapters, seed=0))
    rng = np.random.default_rng(1)
    new = {path: rng.normal(size=value.shape).astype(np.float32) if path[-1] == "lora_B" else value
           for path, value in new.items()}
    return model, adapters, lora.join(unflatten_dict(new), params)


def paths(adapters):
    return sorted(".".join(path) for path in adapters.targets)


# ---------------------------------------------------------------------------------------------------------
# The layers adapted by default
# ---------------------------------------------------------------------------------------------------------
FAMILY_LAYERS = {  # model type, config, Auto class, the adapted layers of layer 0 (the default rule)
    "bart": ("bart", dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8, vocab_size=50),
             "FlaxAutoModelForSequenceClassification",
             {f"model.{side}.layers.0.{attention}.{proj}" for side, attentions in
              (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn")))
              for attention in attentions for proj in ("q_proj", "k_proj", "v_proj", "out_proj")}),
    "vit": ("vit", dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                        image_size=8, patch_size=4), "FlaxAutoModelForImageClassification",
            {f"vit.encoder.layer.0.attention.{name}" for name in
             ("attention.query", "attention.key", "attention.value", "output.dense")}),
    "distilbert": ("distilbert", dict(dim=16, n_layers=1, n_heads=2, hidden_dim=8, vocab_size=50),
                   "FlaxAutoModelForTokenClassification",
                   {f"distilbert.transformer.layer.0.attention.{name}" for name in ("q_lin", "k_lin", "v_lin", "out_lin")}),
}


@pytest.mark.parametrize("family", sorted(FAMILY_LAYERS))
def test_the_default_rule_adapts_each_familys_attention_projections_and_no_head(family):
    model_type, settings, auto_name, expected = FAMILY_LAYERS[family]
    model = getattr(transformers, auto_name).from_config(transformers.AutoConfig.for_model(model_type, **settings),
                                                          _do_init=False)
    adapters = lora.plan(model, ModelArguments(lora_rank=2), auto_name)
    assert set(paths(adapters)) == expected
    assert adapters.alpha == 4.0  # the default: 2 x rank
    # every dense layer but the head: the MLPs too, never the classifier (trained in full instead)
    everything = lora.plan(model, ModelArguments(lora_rank=2, lora_target="all-linear"), auto_name)
    assert set(paths(everything)) > expected
    assert not any(path[0] in everything.heads for path in everything.targets) and everything.heads


# ---------------------------------------------------------------------------------------------------------
# The adapted layer, the merge, step 0
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", "bert"])  # GPT-2's Conv1D keeps its kernel out x in
def test_adapted_model_equals_the_numpy_merge_and_starts_as_the_base(name):
    model, adapters, params = tiny_model(name)
    ids = np.random.default_rng(2).integers(0, 99, size=(2, 7)).astype(np.int32)
    forward = jax.jit(lambda params: model(ids, params=params)[0])
    plain = forward(params)  # no adapters attached yet: the base model
    flat = flatten_dict(params)
    merged = {path: np.asarray(value) for path, value in flat.items() if path[-1] not in lora.ADAPTER_LEAVES}
    for path in adapters.targets:
        delta = (ALPHA / RANK) * np.asarray(flat[path + ("lora_A",)]) @ np.asarray(flat[path + ("lora_B",)])
        kernel = merged[path + ("kernel",)]
        merged[path + ("kernel",)] = kernel + (delta.T if kernel.shape == delta.T.shape and name == "gpt2" else delta)
    merged = unflatten_dict(merged)
    lora.attach(model, adapters)
    forward = jax.jit(lambda params: model(ids, params=params)[0])
    adapted = forward(params)
    np.testing.assert_allclose(adapted, forward(merged), atol=2e-5)
    assert np.abs(np.asarray(adapted) - np.asarray(plain)).max() > 1e-3  # the adapters do change the output
    for path, value in flatten_dict(lora.merged(params, adapters)).items():  # the export's merge
        np.testing.assert_allclose(value, flatten_dict(merged)[path], atol=1e-6)
    zero_b = unflatten_dict({path: np.zeros_like(value) if path[-1] == "lora_B" else value for path, value in flat.items()})
    np.testing.assert_array_equal(forward(zero_b), plain)  # B = 0: exactly the base model


# ---------------------------------------------------------------------------------------------------------
# The scripts whose models are no stock Auto model, or have a head beside it
# ---------------------------------------------------------------------------------------------------------
VIT = dict(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
TEXT = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, vocab_size=50,
            max_position_embeddings=16)
ENCODER_DECODER = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8, vocab_size=50)


def captioning_model(model_args):  # run_image_captioning_flax.py: ViT encoder, GPT-2 decoder with cross-attention
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        transformers.ViTConfig(**VIT), transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                                               vocab_size=50, add_cross_attention=True, is_decoder=True))
    model, params = load_composed_model(transformers.FlaxVisionEncoderDecoderModel, config, model_args, {}, 0,
                                        DataParallel())
    ids = np.arange(8, dtype=np.int32)[None] % 50
    return model, params, lambda params: model(PIXELS, decoder_input_ids=ids, params=params).logits


def dual_encoder_model(model_args):  # run_hybrid_clip.py from two towers: BERT text, ViT vision
    from run_hybrid_clip import DualEncoderModelArguments
    from tasks import image_text

    config = transformers.VisionTextDualEncoderConfig.from_vision_text_configs(
        transformers.ViTConfig(**VIT), transformers.BertConfig(**TEXT), projection_dim=8)
    args = DualEncoderModelArguments(**{k: getattr(model_args, k) for k in ("lora_rank", "lora_alpha")})
    model, params = image_text.load_dual_encoder(args, config, 0, DataParallel())
    embeddings_of = image_text.embeddings_fn(model)
    batch = {"input_ids": np.arange(16, dtype=np.int32).reshape(2, 8), "attention_mask": np.ones((2, 8), np.int32),
             "pixel_values": np.concatenate([PIXELS, PIXELS[..., ::-1]])}
    return model, params, lambda params: jnp.concatenate(embeddings_of(params, batch)[:2], axis=-1)


def long_qa_model(model_args):  # run_qa.py --answer_categories: the category head beside the stock QA model
    from tasks import long_qa

    config = transformers.BertConfig(**TEXT, num_labels=2)
    model, params = load_model(transformers.FlaxAutoModelForQuestionAnswering, model_args, config, 0, DataParallel(),
                               added_groups=(long_qa.HEAD,))
    params = long_qa.add_category_head(params, model, model_args, config, 0, DataParallel())
    ids = np.arange(8, dtype=np.int32)[None]
    return model, params, lambda params: model(ids, params=long_qa.model_params(params)).start_logits


def seq2seq_model(auto_class, model_type, inputs, **settings):  # Whisper (speech recognition), BART (denoising)
    def build(model_args):
        config = transformers.AutoConfig.for_model(model_type, **ENCODER_DECODER, **settings)
        model, params = load_model(auto_class, model_args, config, 0, DataParallel())
        ids = np.arange(6, dtype=np.int32)[None] + 4
        return model, params, lambda params: model(inputs, decoder_input_ids=ids, params=params).logits
    return build


PIXELS = np.random.default_rng(4).normal(size=(1, 3, 16, 16)).astype(np.float32)
SCRIPT_MODELS = {  # the model, the layers of its layer 0 adapted by default, the groups trained in full
    "image_captioning": (captioning_model, {
        *(f"encoder/encoder/layer/0/attention/{name}" for name in
          ("attention/query", "attention/key", "attention/value", "output/dense")),
        *(f"decoder/transformer/h/0/{name}" for name in
          ("attn/c_attn", "attn/c_proj", "crossattention/c_attn", "crossattention/q_attn", "crossattention/c_proj"))},
        ()),
    "hybrid_clip": (dual_encoder_model, {
        *(f"text_model/encoder/layer/0/attention/{name}" for name in
          ("self/query", "self/key", "self/value", "output/dense")),
        *(f"vision_model/encoder/layer/0/attention/{name}" for name in
          ("attention/query", "attention/key", "attention/value", "output/dense"))},
        ("logit_scale", "text_projection", "visual_projection")),
    "long_qa": (long_qa_model, {f"bert/encoder/layer/0/attention/{name}" for name in
                                ("self/query", "self/key", "self/value", "output/dense")},
                ("answer_category_head", "qa_outputs")),
    "speech_recognition": (seq2seq_model(
        transformers.FlaxAutoModelForSpeechSeq2Seq, "whisper",
        np.random.default_rng(5).normal(size=(1, 8, 16)).astype(np.float32), num_mel_bins=8,
        max_source_positions=8, max_target_positions=16), {
        f"model/{side}/layers/0/{attention}/{proj}" for side, attentions in
        (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn")))
        for attention in attentions for proj in ("q_proj", "k_proj", "v_proj", "out_proj")}, ()),
    "bart_dlm": (seq2seq_model(transformers.FlaxAutoModelForSeq2SeqLM, "bart", np.arange(8, dtype=np.int32)[None] + 4,
                               max_position_embeddings=16), {
        f"model/{side}/layers/0/{attention}/{proj}" for side, attentions in
        (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn")))
        for attention in attentions for proj in ("q_proj", "k_proj", "v_proj", "out_proj")}, ()),
}


@pytest.mark.parametrize("name", sorted(SCRIPT_MODELS))
def test_each_scripts_model_gets_adapters_its_heads_train_and_the_export_merges_them(name):
    build, expected_layers, heads = SCRIPT_MODELS[name]
    model, params, forward = build(ModelArguments(lora_rank=RANK, lora_alpha=ALPHA))
    adapters = lora.adapters_of(model)
    assert {"/".join(path) for path in adapters.targets} == expected_layers  # one layer each: all of them
    assert adapters.heads == heads
    flat = flatten_dict(params)
    assert set(lora.trainable_paths(params, adapters)) == {
        path for path in flat if path[-1] in lora.ADAPTER_LEAVES or path[0] in heads}
    forward = jax.jit(forward)
    base = {path: value for path, value in flat.items() if path[-1] not in lora.ADAPTER_LEAVES}
    np.testing.assert_array_equal(forward(params), forward(unflatten_dict(base)))  # step 0: the base exactly
    # Trained adapters (B random): the export's kernels are W + (alpha / R) A B (torch's out x in for
    # GPT-2's Conv1D), and the merged model computes what the adapted one does
    rng = np.random.default_rng(6)
    flat = {path: rng.normal(size=value.shape).astype(np.float32) if path[-1] == "lora_B" else value
            for path, value in flat.items()}
    merged = flatten_dict(lora.merged(unflatten_dict(flat), adapters))
    assert set(merged) == set(base)  # the heads (the category head too) saved, no adapter leaf
    for path in adapters.targets:
        delta = (ALPHA / RANK) * np.asarray(flat[path + ("lora_A",)]) @ np.asarray(flat[path + ("lora_B",)])
        kernel = np.asarray(base[path + ("kernel",)], np.float32)
        transposed = kernel.shape != delta.shape or "transformer" in path  # GPT-2's Conv1D (square ones too)
        np.testing.assert_allclose(merged[path + ("kernel",)], kernel + (delta.T if transposed else delta), atol=1e-6)
    adapted = np.asarray(forward(unflatten_dict(flat)))
    np.testing.assert_allclose(adapted, forward(unflatten_dict(merged)), atol=5e-5)
    assert np.abs(adapted - np.asarray(forward(unflatten_dict(base)))).max() > 1e-3  # the adapters are applied


# ---------------------------------------------------------------------------------------------------------
# A frozen base through make_steps, in both layouts
# ---------------------------------------------------------------------------------------------------------
BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=99,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ROWS, LENGTH = 32, 16


def trained_state(tmp_path, layout, accumulation=1, checkpointing=False, steps=2):
    """(state at the start on the host, state after `steps` steps on the host, the state's trainable paths)."""
    config = transformers.AutoConfig.for_model("bert", **BERT)
    # No dropout: "dp" draws a mask per device, "fsdp" one for the global batch
    model_args = ModelArguments(model_type="bert", lora_rank=RANK)
    model, params = load_model(transformers.FlaxAutoModelForSequenceClassification, model_args, config, 0, layout)
    args = TrainingArguments(output_dir=str(tmp_path), do_train=True, learning_rate=0.05, max_steps=steps,
                             total_train_batch_size=ROWS, gradient_accumulation_steps=accumulation,
                             gradient_checkpointing=checkpointing, weight_decay=0.01, sharding=layout.name)
    rng = np.random.default_rng(3)
    arrays = {"input_ids": rng.integers(0, 99, size=(ROWS * steps, LENGTH)).astype(np.int32),
              "labels": rng.integers(0, 3, size=ROWS * steps).astype(np.int32)}
    data = InMemoryData(arrays, ROWS * steps)
    plan = training_plan(args, ROWS * steps)

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        logits = model(batch["input_ids"], params=params, dropout_rng=dropout_rng, train=train)[0]
        loss, tokens = cross_entropy_sums(logits, batch["labels"], jnp.ones(len(logits)), label_smoothing)
        return loss, {"loss": loss, "tokens": tokens}

    state, steps_ = make_steps(loss_fn, model, params, layout, args, plan, data)
    to_host = lambda s: jax.tree_util.tree_map(np.asarray, layout.checkpoint_tree(s))  # noqa: E731
    start = to_host(state)
    for _, batch in zip(range(steps), data.batches(ROWS, 0, plan.steps_per_epoch, 0, steps, layout)):
        state, _ = steps_.train(state, batch)
    return start, to_host(state), state.trainable


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    return trained_state(tmp_path_factory.mktemp("dp"), DataParallel())


def changed_leaves(start, end):
    before, after = flatten_dict(start.params), flatten_dict(end.params)
    return {path for path in before if not np.array_equal(before[path], after[path])}


def test_only_adapters_and_the_head_train_and_the_optimizer_keeps_state_for_them_alone(dp_run):
    start, end, trainable = dp_run
    assert set(trainable) == {path for path in flatten_dict(start.params)
                              if path[-1] in lora.ADAPTER_LEAVES or path[0] == "classifier"}
    assert changed_leaves(start, end) == set(trainable)  # every trained leaf moved (B from zero), no base one
    moments = [leaf for leaf in jax.tree_util.tree_leaves(end.opt_state) if leaf.ndim > 0]
    expected = [np.asarray(value).shape for path, value in sorted(flatten_dict(start.params).items()) if path in set(trainable)]
    assert sorted(leaf.shape for leaf in moments) == sorted(expected * 2)  # AdamW's mu and nu, nothing else


def test_fsdp_with_accumulation_and_checkpointing_trains_as_dp(tmp_path, dp_run):
    _, dp_end, _ = dp_run
    _, end, _ = trained_state(tmp_path, FullySharded(8), accumulation=2, checkpointing=True)
    for path, value in flatten_dict(dp_end.params).items():
        np.testing.assert_allclose(flatten_dict(end.params)[path], value, atol=2e-5, err_msg="/".join(path))


def test_the_base_can_be_held_in_bfloat16_beside_float32_adapters(tmp_path):
    config = transformers.AutoConfig.for_model("bert", **BERT)
    model_args = ModelArguments(model_type="bert", lora_rank=RANK, lora_base_dtype="bfloat16")
    _, params = load_model(transformers.FlaxAutoModelForSequenceClassification, model_args, config, 0, DataParallel())
    dtypes = {path: value.dtype for path, value in flatten_dict(params).items()}
    assert {dtypes[path] for path in dtypes if path[-1] in lora.ADAPTER_LEAVES or path[0] == "classifier"} == {
        np.dtype("float32")}
    assert {dtypes[path] for path in dtypes if path[-1] not in lora.ADAPTER_LEAVES and path[0] != "classifier"} == {
        jnp.dtype("bfloat16")}


# ---------------------------------------------------------------------------------------------------------
# The PEFT export against PEFT's own files
# ---------------------------------------------------------------------------------------------------------
with open(os.path.join(REFERENCES, "lora_peft_listing.json"), encoding="utf-8") as f:
    PEFT_LISTING = json.load(f)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_peft_export_has_peft_keys_shapes_and_config(name):
    model, adapters, params = tiny_model(name)
    config, tensors = lora.peft_files(params, adapters)
    reference = PEFT_LISTING["cases"][name]
    assert {key: list(value.shape) for key, value in tensors.items()} == reference["tensors"]
    for field in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora",
                  "use_dora", "init_lora_weights", "inference_mode", "base_model_name_or_path"):
        assert config[field] == reference["config"][field], field
    assert set(config["modules_to_save"] or ()) <= set(reference["config"]["modules_to_save"] or ())
    assert json.loads(json.dumps(config)) == config  # writable as adapter_config.json
    # A = the layer's lora_A transposed ([rank, in], PyTorch's Linear orientation)
    path = sorted(adapters.targets)[0]
    np.testing.assert_array_equal(tensors[f"base_model.model.{'.'.join(path)}.lora_A.weight"],
                                  np.asarray(flatten_dict(params)[path + ("lora_A",)]).T)


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: one clear error before any work
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (dict(lora_rank=-1), "--lora_rank must be positive"),
    (dict(lora_alpha=16.0), "--lora_alpha applies to LoRA only"),
    (dict(lora_target="q_proj"), "--lora_target applies to LoRA only"),
    (dict(lora_rank=4, lora_dropout=1.0), "--lora_dropout must be in [0, 1)"),
    (dict(lora_rank=4, lora_base_dtype="int8"), "--lora_base_dtype 'int8' is not supported"),
    # Not a number a run could train with: the loss would be nan from step 1, after the output dir was replaced
    (dict(lora_rank=4, lora_alpha=float("nan")), "--lora_alpha must be a positive number, got nan"),
    (dict(lora_rank=4, lora_alpha=float("inf")), "--lora_alpha must be a positive number, got inf"),
    (dict(lora_rank=4, lora_target=""), "--lora_target is empty"),  # an empty regex would adapt every layer
    (dict(lora_rank=4, lora_target="(attn"), "--lora_target '(attn' is not a valid regular expression"),
])
def test_bad_lora_flags(flags, words):
    with pytest.raises(UsageError, match=None) as error:
        ModelArguments(**flags)
    assert words in str(error.value)


def adapter_dir(directory, config=None, weights=b""):
    """A PEFT adapter directory: adapter_config.json (`config` over a valid one) and `weights` as
    adapter_model.safetensors (None: no such file)."""
    os.makedirs(directory, exist_ok=True)
    settings = {"peft_type": "LORA", "base_model_name_or_path": "some/base", "r": 4, "lora_alpha": 8}
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump({**settings, **(config or {})}, f)
    if weights is not None:
        with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
            f.write(weights)
    return str(directory)


def safetensors_bytes():
    import safetensors.numpy

    return safetensors.numpy.save({"base_model.model.a.lora_A.weight": np.zeros((4, 8), np.float32)})


@pytest.mark.parametrize("rank, config, weights, words", [
    (0, None, "valid", "is a PEFT adapter of rank 4: continue it with --lora_rank 4"),
    (4, dict(r="4"), "valid", "gives r '4' and lora_alpha 8: a LoRA adapter's rank is a positive integer"),
    (4, dict(lora_alpha=None), "valid", "gives r 4 and lora_alpha None"),
    (4, None, None, "cannot read {dir}/adapter_model.safetensors (No such file or directory"),
    (4, None, b"not a safetensors file", "cannot read {dir}/adapter_model.safetensors (Error while deserializing"),
    # safetensors' own words for it differ by version ("incomplete metadata", 0.4.3's "MetadataIncompleteBuffer")
    (4, None, "truncated", "cannot read {dir}/adapter_model.safetensors (Error while deserializing header: "),
])
def test_a_bad_peft_adapter_is_named_before_any_work(tmp_path, rank, config, weights, words):
    """Checked with the arguments, before the base model is read: its config and its weights' header."""
    weights = {"valid": safetensors_bytes(), "truncated": safetensors_bytes()[:-10]}.get(weights, weights)
    directory = adapter_dir(tmp_path / "adapter", config, weights)
    with pytest.raises(UsageError) as error:
        ModelArguments(model_name_or_path=directory, lora_rank=rank)
    assert words.format(dir=directory) in str(error.value)


@pytest.mark.parametrize("flags, words", [
    (dict(lora_rank=4, lora_target="no_such_layer"), "matches no layer of this gpt2 model"),
    (dict(lora_rank=40), "--lora_rank 40 is larger than layer transformer/h/0/attn/c_attn (32 -> 96)"),
])
def test_bad_targets_and_ranks_are_named(flags, words):
    model_type, settings, _, _, _ = CASES["gpt2"]
    model = transformers.FlaxAutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **settings),
                                                              _do_init=False)
    with pytest.raises(UsageError) as error:
        lora.plan(model, ModelArguments(**flags), "FlaxAutoModelForCausalLM")
    assert words in str(error.value)


# ---------------------------------------------------------------------------------------------------------
# End to end: run_flax_glue.py with LoRA (one run shared by the checks), killed and resumed, its export
# ---------------------------------------------------------------------------------------------------------
GLUE = ["--model_type", "bert", "--tokenizer_name", "data/glue/tokenizer", "--config_overrides",
        "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,max_position_embeddings=16",
        "--max_seq_length", "16", "--task_name", "cola", "--train_file", "data/glue/cola/train.csv",
        "--validation_file", "data/glue/cola/validation.csv", "--max_eval_samples", "64"]
TRAIN = ["--do_train", "--do_eval", "--max_steps", "8", "--save_steps", "4", "--total_train_batch_size", "32",
         "--learning_rate", "1e-2", "--logging_steps", "4", "--lora_rank", "4", "--lora_dropout", "0.1"]


def glue_command(output_dir, cache, *extra):
    return [os.path.join(ROOT, "run_flax_glue.py"), *GLUE, "--output_dir", output_dir, "--compilation_cache_dir",
            cache, *extra]


def run_command(argv, wrapper=()):
    return script_launcher.run([sys.executable, *wrapper, *map(str, argv)], ROOT, script_env(), timeout=600)


@pytest.fixture(scope="module")
def glue_lora(tmp_path_factory):
    cache, out = str(tmp_path_factory.mktemp("cache")), str(tmp_path_factory.mktemp("glue_lora"))
    result = run_command(glue_command(out, cache, *TRAIN, "--overwrite_output_dir"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, cache, result


@pytest.mark.slow
def test_a_lora_run_reports_its_counts_and_checkpoints_the_adapters_and_head_alone(glue_lora):
    out, _, result = glue_lora
    results = read_json(os.path.join(out, "all_results.json"))
    # 2 layers x 4 projections x (64 x 4 + 4 x 64) adapters + the 64 x 2 + 2 classifier
    assert results["trainable_parameters"] == 2 * 4 * (64 * 4 + 4 * 64) + 64 * 2 + 2
    assert results["total_parameters"] > 20 * results["trainable_parameters"]
    assert f"parameters: {results['trainable_parameters']:,} trained of {results['total_parameters']:,}" in result.stderr
    saved = Checkpointer(os.path.join(out, "checkpoints"), read_only=True).saved_shapes(8)
    params = [path for path in saved if path.startswith("params/")]
    assert params and all(path.split("/")[-1] in lora.ADAPTER_LEAVES or path.startswith("params/classifier/")
                          for path in params)


@pytest.mark.slow
def test_a_lora_run_killed_during_a_save_resumes_exactly(glue_lora, tmp_path):
    reference, cache, _ = glue_lora
    out = str(tmp_path / "run")
    killed = run_command(glue_command(out, cache, *TRAIN), wrapper=[os.path.join(ROOT, "tests", "interrupted_run.py"),
                                                                   "sigkill-during-save", "8"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert checkpoint_steps(os.path.join(out, "checkpoints")) == [4]
    resumed = run_command(glue_command(out, cache, *TRAIN, "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the checkpoint of step 4" in resumed.stderr
    for name in ("flax_model.msgpack", run_directory.PEFT_WEIGHTS):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(reference, name), "rb") as b:
            assert a.read() == b.read(), name


@pytest.mark.slow
def test_the_merged_export_loads_as_a_plain_model_and_evaluates_as_the_adapted_one(glue_lora, tmp_path):
    trained, cache, _ = glue_lora
    out = str(tmp_path / "eval")
    result = run_command(glue_command(out, cache, "--do_eval", "--model_name_or_path", trained))
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_json(os.path.join(out, "eval_results.json")) == read_json(os.path.join(trained, "eval_results.json"))
    with open(os.path.join(trained, run_directory.PEFT_CONFIG), encoding="utf-8") as f:
        assert json.load(f)["r"] == 4
    params = flatten_dict(transformers.FlaxAutoModelForSequenceClassification.from_pretrained(trained).params)
    assert not any(path[-1] in lora.ADAPTER_LEAVES for path in params)


# ---------------------------------------------------------------------------------------------------------
# Continuing a PEFT adapter
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    """(adapter dir, its tensors): a BERT classifier's adapter (random B, a trained head) in PEFT's
    layout, naming a saved base model."""
    model, adapters, params = tiny_model("bert")
    base = str(tmp_path_factory.mktemp("base"))
    model.save_pretrained(base, params=lora.split(params, lora.trainable_paths(params, adapters))[1])
    directory = str(tmp_path_factory.mktemp("adapter"))
    run_directory.write_peft_adapter(directory, params, adapters)
    with open(os.path.join(directory, run_directory.PEFT_CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(directory, run_directory.PEFT_CONFIG), "w", encoding="utf-8") as f:
        json.dump({**config, "base_model_name_or_path": base}, f)
    return directory, lora.peft_files(params, adapters)[1]


def load_adapter(directory, **flags):
    model_args = ModelArguments(model_name_or_path=directory, lora_rank=RANK, **flags)
    config = transformers.AutoConfig.from_pretrained(model_args.model_name_or_path)
    return load_model(transformers.FlaxAutoModelForSequenceClassification, model_args, config, 0, DataParallel())


def test_a_peft_adapter_directory_continues_from_its_weights_on_its_base(peft_adapter):
    directory, tensors = peft_adapter
    _, params = load_adapter(directory)
    flat = flatten_dict(params)
    for key, value in tensors.items():
        module, _, name = key.removeprefix("base_model.model.").rpartition(".")  # name: weight or bias
        path = tuple(module.split("."))
        leaf = flat[path if module.endswith(lora.ADAPTER_LEAVES) else path + ({"weight": "kernel"}.get(name, name),)]
        np.testing.assert_array_equal(np.asarray(leaf).T if np.ndim(leaf) == 2 else leaf, value, err_msg=key)


def test_an_adapter_for_other_layers_or_another_rank_is_refused(peft_adapter):
    directory, _ = peft_adapter
    with pytest.raises(UsageError) as error:
        load_adapter(directory, lora_target="attention/self/(query|key)$")
    assert f"the adapter in {directory} does not match this base model: it holds" in str(error.value)
    with pytest.raises(UsageError) as error:
        ModelArguments(model_name_or_path=directory, lora_rank=RANK * 2)
    assert f"the adapter in {directory} has rank {RANK}, this run --lora_rank {RANK * 2}" in str(error.value)


# ---------------------------------------------------------------------------------------------------------
# docs/lora.md's figures are the benchmarks' JSON
# ---------------------------------------------------------------------------------------------------------
def read_doc():
    with open(os.path.join(ROOT, "docs", "lora.md"), encoding="utf-8") as f:
        return f.read()


def test_the_cpu_table_is_lora_cpu_json():
    rows = read_json(os.path.join(ROOT, "benchmarks", "lora_cpu.json"))["rows"]
    for config in ("glue_tiny", "chat_tiny"):
        full, adapted = rows[f"{config} full"], rows[f"{config} lora"]
        line = (f"| `{config}` | {full['steps_per_second']} | {adapted['steps_per_second']} | "
                f"{rows[config + ' lora/full steps per second']} | {full['trainable_parameters']:,} | "
                f"{adapted['trainable_parameters']:,} of {adapted['total_parameters']:,} | "
                f"{full['train_step_device_bytes'] / 2**20:.1f} MiB | {adapted['train_step_device_bytes'] / 2**20:.1f} MiB |")
        assert line in read_doc()


def test_a_resume_with_other_lora_settings_is_named():
    from utils.checkpoints.resume import fingerprint_difference, run_fingerprint

    _, adapters, _ = tiny_model("gpt2")
    config = transformers.AutoConfig.for_model("gpt2", **CASES["gpt2"][1])
    saved = run_fingerprint(config, 64, 8, 1, adapters=adapters)
    assert fingerprint_difference(saved, run_fingerprint(config, 64, 8, 1, adapters=adapters)) is None
    difference = fingerprint_difference(saved, run_fingerprint(config, 64, 8, 1))
    assert difference.startswith("adapters is {'rank': 4, 'alpha': 8.0") and "(set by --lora_rank" in difference


GIB = 2**30


def test_the_tpu_plan_tables_are_memory_tpu_lora_json():
    lora_plan = read_json(os.path.join(ROOT, "benchmarks", "memory_tpu_lora.json"))
    full_plan = read_json(os.path.join(ROOT, "benchmarks", "memory_tpu.json"))
    doc = read_doc()
    for row in lora_plan["sizes"]:
        full = next(r for r in full_plan["sizes"] if r["model"] == row["model"] and r["layout"] == "fsdp"
                    and r["gradient_checkpointing"])
        line = (f"| {row['model']} | {row['parameters'] / 1e6:,.0f}M | {full['bytes'] / GIB:.2f} GiB | "
                f"{row['bytes'] / GIB:.2f} GiB | {row['bytes'] / full['bytes']:.2f} |")
        assert line in doc
    for row in lora_plan["largest"]["llama fsdp remat on adamw"]["tried"]:
        shape = " x ".join(map(str, row["shape"][:2]))
        assert (f"| {shape} | {row['parameters'] / 1e9:.1f}B | {row['bytes'] / GIB:.2f} GiB | "
                f"{row['bytes_per_layer'] / 2**20:.1f} MiB | {'yes' if row['fits'] else 'no'} |") in doc
