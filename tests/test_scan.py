"""Scanned layer stacks (utils/models/layer_scan.py, `--scan_layers`): the scanned call against transformers' loop
over the layers, for every family it knows: loss and gradients of the unchanged parameter tree, with
checkpointed layers, through the attention kernels (Pallas' interpreter), with LoRA adapters; each layer's
own dropout masks; the calls that keep the loop (generation, hidden states, layers that differ); and
run_clm_flax.py with and without the scan."""

from collections import Counter
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers import (BertConfig, FlaxBertForMaskedLM, FlaxGemmaForCausalLM, FlaxGPT2LMHeadModel,
                          FlaxLlamaForCausalLM, FlaxMistralForCausalLM, GemmaConfig, GPT2Config, LlamaConfig,
                          MistralConfig)

from tests.fresh_draws import fresh_model
from tests.jaxprs import equations
from tests.script_runner import read_metrics, run_script
from utils.base.arguments import ModelArguments
from utils.base.errors import UsageError
from utils.kernels import model_attention
from utils.layout.layouts import make_layout
from utils.models import compat, layer_scan, lora, remat

compat.apply()  # as every script does
LAYERS = 3
LLAMA_LIKE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)


def gpt2(**overrides):
    config = dict(vocab_size=64, n_positions=128, n_embd=32, n_layer=LAYERS, n_head=2, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return fresh_model(FlaxGPT2LMHeadModel, GPT2Config(**{**config, **overrides}))


FAMILIES = {
    "gpt2": gpt2,
    "llama": lambda: fresh_model(FlaxLlamaForCausalLM, LlamaConfig(**LLAMA_LIKE)),
    "mistral": lambda: fresh_model(FlaxMistralForCausalLM, MistralConfig(**LLAMA_LIKE, sliding_window=8)),
    "gemma": lambda: fresh_model(FlaxGemmaForCausalLM, GemmaConfig(**LLAMA_LIKE, head_dim=8)),
}


def batch(length=16, rows=2, seed=1):
    ids = jnp.asarray(np.random.default_rng(seed).integers(3, 64, size=(rows, length)), jnp.int32)
    mask = np.ones((rows, length), np.int32)
    mask[0, length - 3:] = 0  # padding: the mask goes into every layer
    return ids, jnp.asarray(mask)


def loss_fn(model, ids, mask, **call):
    def loss(params):
        logits = model(ids, attention_mask=mask, params=params, **call).logits[:, :-1].astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
        return -(picked * mask[:, 1:]).sum() / mask[:, 1:].sum()
    return loss


def loss_and_grads(model, ids, mask, params=None, train=False, **arrays):
    """The loss and its gradients, as one compiled program (the tests' models would run op by op)."""
    def loss(params, arrays):
        return loss_fn(model, ids, mask, train=train, **arrays)(params)
    return jax.jit(jax.value_and_grad(loss))(model.params if params is None else params, arrays)


def assert_same(got, want, atol=1e-5):
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    assert jax.tree_util.tree_structure(got[1]) == jax.tree_util.tree_structure(want[1])
    for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol)


def nesting(fun, *args):
    """Where the scans, checkpoints and Pallas kernels sit in `fun`'s jaxpr: 'scan', 'scan/checkpoint', ..."""
    return ["/".join(where + (name,)) for where, name in equations(jax.make_jaxpr(fun)(*args).jaxpr)
            if name.startswith(("scan", "checkpoint", "pallas_call"))]


def scan_lengths(fun, *args):
    """The lengths of the scans in `fun`'s jaxpr."""
    return [eqn.params["length"] for eqn in jax.make_jaxpr(fun)(*args).jaxpr.eqns if eqn.primitive.name == "scan"]


@pytest.mark.parametrize("checkpointed", [False, "nothing", "kernels"], ids=["plain", "checkpointed", "kernels"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_scanned_stack_computes_the_loops_loss_and_gradients(family, checkpointed):
    """With --gradient_checkpointing as the spine applies it: utils.models.remat's per-layer checkpoint first, then the
    scan, whose body alone is checkpointed (the loop's layers, each under its own checkpoint, are not called);
    it keeps nothing, or what its policy keeps."""
    model = FAMILIES[family]()
    ids, mask = batch()
    stock = loss_and_grads(model, ids, mask)
    if checkpointed:
        remat.remat_layers(model, checkpointed)
        layer = "checkpoint" if checkpointed == "nothing" else "checkpoint[policy]"
        assert nesting(loss_fn(model, ids, mask), model.params) == [layer] * LAYERS
    layer_scan.scan_layers(model, checkpointed=checkpointed)
    body = "scan/checkpoint" if checkpointed == "nothing" else "scan/checkpoint[policy]"
    assert nesting(loss_fn(model, ids, mask), model.params) == ["scan", body]
    assert scan_lengths(loss_fn(model, ids, mask), model.params) == [LAYERS]
    assert_same(loss_and_grads(model, ids, mask), stock)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_attention_kernels_run_inside_the_scan(family):
    """utils.kernels.model_attention's interceptor, active around the model's call, routes the scanned layer's
    attention."""
    model = FAMILIES[family]()
    ids, mask = batch(length=model_attention.BLOCK)  # one kernel block
    stock = loss_and_grads(model, ids, mask)
    model_attention.use_attention_kernels(model, interpret=True)
    layer_scan.scan_layers(model)
    assert nesting(loss_fn(model, ids, mask), model.params) == ["scan", "scan/checkpoint[policy]",
                                                                 "scan/checkpoint[policy]/pallas_call"]
    assert_same(loss_and_grads(model, ids, mask), stock, atol=2e-5)


@pytest.mark.parametrize("checkpointed", [False, "nothing", "kernels"], ids=["plain", "checkpointed", "kernels"])
def test_the_backward_pass_runs_products_and_kernels_again_only_when_checkpointed(checkpointed):
    """Each product of a layer's forward pass has two in the backward one (the gradients of its operands), the
    dropout kernel its backward kernel; with --gradient_checkpointing the forward pass runs again there too
    (its products but the last, whose output no gradient needs), and its kernel unless the policy keeps the
    kernels' outputs (`kernels`)."""
    model = gpt2(attn_pdrop=0.1)
    ids, mask = batch(length=model_attention.BLOCK)
    model_attention.use_attention_kernels(model, interpret=True)
    layer_scan.scan_layers(model, checkpointed=checkpointed)
    grad = jax.grad(loss_fn(model, ids, mask, train=True, dropout_rng=jax.random.PRNGKey(0)))
    scans = [eqn for eqn in jax.make_jaxpr(grad)(model.params).jaxpr.eqns if eqn.primitive.name == "scan"]
    forward, backward = (Counter(name for _, name in equations(eqn.params["jaxpr"].jaxpr)) for eqn in scans)
    again = forward["dot_general"] - 1 if checkpointed else 0
    assert forward["dot_general"] > 0 and backward["dot_general"] == 2 * forward["dot_general"] + again
    assert (forward["pallas_call"], backward["pallas_call"]) == (1, 2 if checkpointed == "nothing" else 1)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_backward_pass_gets_the_attention_kernels_row_statistics_as_one_float_each(family):
    """The forward scan hands the backward one each layer's logsumexp per (row, head, position), not the
    forward kernel's 128 lanes of each: those stacked for every layer were 1.1 GiB of a GPT-2-small step.
    GPT-2 with attention dropout runs the flash kernel, Llama splash."""
    model = gpt2(attn_pdrop=0.1) if family == "gpt2" else FAMILIES[family]()
    ids, mask = batch(length=model_attention.BLOCK)
    model_attention.use_attention_kernels(model, interpret=True)
    layer_scan.scan_layers(model)
    grad = jax.grad(loss_fn(model, ids, mask, train=True, dropout_rng=jax.random.PRNGKey(0)))
    forward = next(eqn for eqn in jax.make_jaxpr(grad)(model.params).jaxpr.eqns if eqn.primitive.name == "scan")
    handed = [var.aval.shape for var in forward.outvars[1:]]  # after the carried hidden states
    rows, length = ids.shape
    heads = model.config.num_attention_heads
    assert (LAYERS, rows, heads, length) in handed
    assert (LAYERS, rows, heads, length, 128) not in handed


def with_adapters(model, target):
    """LoRA adapters on `model`'s layers that `target` names, their B random (not the zero of a new run)."""
    adapters = lora.plan(model, ModelArguments(lora_rank=2, lora_alpha=4.0, lora_target=target),
                         "FlaxAutoModelForCausalLM")
    rng = np.random.default_rng(2)
    new = {path: rng.normal(size=value.shape).astype(np.float32) if path[-1] == "lora_B" else value
           for path, value in flatten_dict(lora.new_weights(adapters, seed=0)).items()}
    lora.attach(model, adapters)
    return lora.join(unflatten_dict(new), model.params), lora.trainable_paths(model.params, adapters)


@pytest.mark.parametrize("target, scanned", [("attention", True), (r"h/0/attn/c_attn", False)],
                         ids=["every-layer", "layer-0-only"])
def test_lora_adapters_are_scanned_with_their_layers(target, scanned):
    """Adapters on every layer are stacked with it; on some layers only, the layers differ: the loop runs."""
    model = gpt2()
    ids, mask = batch()
    params, trainable = with_adapters(model, target)
    adapters, frozen = lora.split(params, trainable)

    def adapter_loss(adapters):  # the gradient of the adapters alone, the base frozen, as the spine takes it
        return loss_fn(model, ids, mask)(lora.join(adapters, frozen))

    stock = jax.jit(jax.value_and_grad(adapter_loss))(adapters)
    layer_scan.scan_layers(model)
    assert scan_lengths(adapter_loss, adapters) == ([LAYERS] if scanned else [])
    assert_same(jax.jit(jax.value_and_grad(adapter_loss))(adapters), stock)


def dropout_masks(model, ids, mask, rng):
    """{path of an `nn.Dropout` inside a layer: [its mask in each layer, in any order]} of a training call."""
    masks = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if isinstance(context.module, nn.Dropout):
            path = "/".join(context.module.path)
            jax.debug.callback(lambda dropped: masks.setdefault(path, []).append(np.asarray(dropped)), out == 0)
        return out

    with nn.intercept_methods(record):
        jax.block_until_ready(model(ids, attention_mask=mask, train=True, dropout_rng=rng).logits)
    return masks


def test_each_layer_draws_its_own_dropout_masks_from_the_step_key():
    """Layer i masks with the stack's key folded with i: no two layers share a mask. The same key gives the
    same loss again, another key another loss (keys of rbg, the generator TPUs draw dropout masks with)."""
    model = gpt2(resid_pdrop=0.5, attn_pdrop=0.5, embd_pdrop=0.0)
    ids, mask = batch()
    layer_scan.scan_layers(model)
    masks = dropout_masks(model, ids, mask, jax.random.PRNGKey(0))
    inside = ("attn/resid_dropout", "mlp/dropout")  # paths in the scanned layer (the loop's: transformer/h/0/...)
    for drawn in (masks[path] for path in inside):
        assert len(drawn) == LAYERS
        assert len({m.tobytes() for m in drawn}) == LAYERS
    train = partial(loss_and_grads, model, ids, mask, train=True)
    key = partial(jax.random.key, impl="rbg")
    first, again = train(dropout_rng=key(0)), train(dropout_rng=key(0))
    assert_same(again, first, atol=0)
    assert float(train(dropout_rng=key(1))[0]) != float(first[0])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generation_and_hidden_states_run_the_loop(family):
    """A generation cache or every layer's hidden states: the stock loop runs, with the stock results (each
    call one compiled program, as the scripts run them)."""
    model, stock = FAMILIES[family](), FAMILIES[family]()
    ids, mask = batch(length=8)
    layer_scan.scan_layers(model)

    def generated(model):
        return jax.jit(lambda ids, mask: model.generate(ids, attention_mask=mask, max_new_tokens=4,
                                                        do_sample=False).sequences)(ids, mask)

    def hidden_states(model):
        return jax.jit(lambda ids, mask: model(ids, attention_mask=mask, output_hidden_states=True).hidden_states)(
            ids, mask)

    np.testing.assert_array_equal(generated(model), generated(stock))
    states, want = hidden_states(model), hidden_states(stock)
    assert len(states) == LAYERS + 1
    for got, expected in zip(states, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-6)


def test_choose_scans_only_where_it_applies_and_names_why_not():
    model = gpt2()
    assert layer_scan.choose("auto", model, "tpu", "dp") and layer_scan.choose("yes", model, "cpu", "dp")
    assert not layer_scan.choose("auto", model, "cpu", "dp") and not layer_scan.choose("no", model, "tpu", "dp")
    assert not layer_scan.choose("auto", model, "tpu", "fsdp")
    with pytest.raises(UsageError, match="--scan_layers yes runs under --sharding dp"):
        layer_scan.choose("yes", model, "tpu", "fsdp")
    bert = FlaxBertForMaskedLM(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=16), seed=0)
    assert not layer_scan.choose("auto", bert, "tpu", "dp")
    with pytest.raises(UsageError, match="not bert's"):
        layer_scan.choose("yes", bert, "tpu", "dp")


def test_auto_scans_when_planning_for_a_tpu():
    """--compile_only places the layout on a TPU slice's devices: "auto" plans the step the TPU would run."""
    pytest.importorskip("libtpu", reason="libtpu (the TPU compiler) is not installed")
    layout = make_layout("dp", compile_only="v5e-4")
    assert layer_scan.choose("auto", gpt2(), layout.platform, layout.name)


CLM = ["run_clm_flax.py", "--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
       "n_embd=32,n_layer=3,n_head=2,n_positions=32,attn_pdrop=0,resid_pdrop=0,embd_pdrop=0",
       "--train_file", "data/lm/train.txt", "--block_size", 32, "--max_train_samples", 64,
       "--per_device_train_batch_size", 1, "--do_train", "--logging_steps", 1, "--compilation_cache_dir", "none"]


@pytest.mark.slow
def test_the_script_trains_the_same_with_scanned_layers(tmp_path):
    """Without dropout the per-step losses are the loop's; the log says the scan is on."""
    losses, logs = {}, {}
    for choice in ("yes", "no"):
        out = str(tmp_path / choice)
        result = run_script(CLM[0], CLM[1:] + ["--max_steps", 3, "--scan_layers", choice, "--output_dir", out])
        assert result.returncode == 0, result.stderr[-3000:]
        losses[choice], logs[choice] = [row["loss"] for row in read_metrics(out)], result.stdout + result.stderr
    assert "layers: the 3 layers run under jax.lax.scan" in logs["yes"]
    assert "jax.lax.scan" not in logs["no"]
    assert len(losses["yes"]) == 3
    np.testing.assert_allclose(losses["yes"], losses["no"], rtol=1e-5)


@pytest.mark.slow
def test_scan_layers_yes_under_fsdp_is_refused_before_anything_is_written(tmp_path):
    """fsdp splits each layer's gradients as the loop calls it (utils.layout.layouts): refused, one line, no output
    dir."""
    out = tmp_path / "out"
    result = run_script(CLM[0], CLM[1:] + ["--max_steps", 1, "--sharding", "fsdp", "--scan_layers", "yes",
                                           "--output_dir", out])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --scan_layers yes runs under --sharding dp: use --scan_layers auto or no with fsdp")
    assert not out.exists()
