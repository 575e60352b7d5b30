"""`--compile_only TPU`: the TPU compiler's plan of a run's steps, on this CPU machine (`utils.layout.tpu_plan`).

The compiles need libtpu (requirements-test.txt); without it those tests skip, and the one-line
error a user without it gets is tested on its own.
"""

import importlib.metadata
import importlib.util
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from transformers import FlaxGPT2LMHeadModel, GPT2Config

from script_runner import run_script
from utils.base.errors import Done, RunError, UsageError
from utils.layout import tpu_plan
from utils.layout.gradients import token_weighted_grads
from utils.layout.layouts import DataParallel, FullySharded, leaf_spec
from utils.models.loading import cast_floats
from utils.run.compile_plan import end_with_plan, plan_report
from utils.scoring.losses import cross_entropy_sums

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is "
                                  "not installed: pip install -r requirements-tpu.txt")


def test_a_missing_libtpu_is_one_line_saying_what_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(tpu_plan.importlib.metadata, "version", not_installed)
    with pytest.raises(UsageError, match=r"^--compile_only needs the TPU compiler, which is not installed: pip install "
                                         r"-r requirements-tpu.txt \(or pip install 'libtpu==[^']+', the TPU compiler "
                                         r"jax \S+ pins\)$"):
        tpu_plan.check_libtpu()


def test_a_libtpu_of_another_version_is_refused(monkeypatch):
    monkeypatch.setattr(tpu_plan.importlib.metadata, "version", lambda name: "0.0.1")
    pin = tpu_plan.pinned_libtpu()
    assert pin and pin.startswith("libtpu==")  # what jax's own `tpu` extra asks for
    with pytest.raises(UsageError, match=rf"libtpu 0.0.1 is installed but jax \S+ needs {pin.replace('.', '[.]')}"):
        tpu_plan.check_libtpu()


# -- the plan itself (libtpu) ---------------------------------------------------------------------
def report_plan(args, layout, state, batches=None):
    """What a --compile_only run does at its start (`utils.run.spine.TrainingRun.start`): the report, then its end."""
    end_with_plan(plan_report(args, layout, state, batches), args.output_dir)


WIDTH, LAYERS, VOCAB, SEQUENCE = 256, 2, 1024, 64


def _train_step_memory(layout, rows=8):
    """The compiled train step of a small GPT-2 (float32 AdamW, bf16 compute) under `layout`, planned;
    (its memory, the parameter shapes, the state's placed shapes). The model's eval step is in
    `layout.planned_steps`."""
    model = FlaxGPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4, vocab_size=VOCAB,
                                           n_positions=SEQUENCE), dtype=jnp.bfloat16, _do_init=False)

    def loss_fn(params, batch, rng, train=True):
        logits = model(batch["input_ids"], params=params, dropout_rng=rng, train=train).logits
        loss, tokens = cross_entropy_sums(logits, batch["input_ids"], jnp.ones(batch["input_ids"].shape))
        return loss, {"loss": loss, "tokens": tokens}

    def train_step(state, batch):
        rng = layout.dropout_key(0, state.step)
        grads, sums = token_weighted_grads(loss_fn, state.params, batch, rng, 1, layout)
        return state.apply_gradients(grads=grads), sums

    params = layout.init_params(lambda: cast_floats(model.init_weights(jax.random.PRNGKey(0), (1, 8)), jnp.float32))
    state = layout.create_state(model.__call__, params, optax.adamw(1e-3))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(state))  # nothing allocated
    batch = {"input_ids": np.broadcast_to(np.int32(1), (rows, SEQUENCE))}  # shapes only: no rows allocated
    assert layout.compile_train_step(train_step, state, batch, 1) is None
    assert layout.compile_step("eval_step", lambda params, batch: loss_fn(params, batch, None, False)[1]) is None
    return layout.train_step_memory, params, state


@pytest.fixture(scope="module")
def v3():
    return tpu_plan.load("v3-8")


@pytest.fixture(scope="module")
def fsdp_plan(v3):
    """(layout, train step memory, parameter shapes, state shapes) of the small GPT-2 under fsdp on a v3-8."""
    layout = FullySharded(8, v3)
    return (layout, *_train_step_memory(layout))


@needs_libtpu
def test_fsdp_splits_the_state_eight_ways_on_the_tpu_plan(v3, fsdp_plan):
    dp, params, _ = _train_step_memory(DataParallel(v3))
    _, fsdp, _, _ = fsdp_plan
    # The arguments are the state: float32 parameters and AdamW's two moments, 12 bytes a parameter,
    # whole on every device under dp, and under fsdp the split leaves' 1/8 plus the small whole ones.
    leaves = [math.prod(x.shape) for x in jax.tree_util.tree_leaves(params)]
    split = [math.prod(x.shape) for x in jax.tree_util.tree_leaves(params) if any(leaf_spec(x.shape, 8))]
    whole_state, split_state = 12 * sum(leaves), 12 * (sum(leaves) - sum(split) + sum(split) / 8)
    # Besides the state, the arguments hold the step counters and the batch, and the TPU
    # pads each leaf to its (8, 128) tiles of float32: up to a 4 KiB tile a leaf (parameters and both
    # moments) beyond the state itself (here 90 KiB under dp, 110 KiB under fsdp).
    slack = 3 * len(leaves) * 4096
    assert dp["arguments"] == pytest.approx(whole_state, abs=slack)
    assert fsdp["arguments"] == pytest.approx(split_state, abs=slack)
    # The whole step: fsdp needs well under half of dp (the CPU plan says 0.7 for this model).
    assert fsdp["total"] / dp["total"] < 0.45, (fsdp, dp)


@needs_libtpu
def test_fits_or_not_against_the_slices_memory(v3, fsdp_plan, tmp_path, capsys):
    layout, memory, _, state = fsdp_plan
    args = type("Args", (), {"output_dir": str(tmp_path), "gradient_accumulation_steps": 2,
                             "gradient_checkpointing": False})()
    layout.plan = v3._replace(device_bytes=memory["total"])  # just enough
    found = plan_report(args, layout, state)  # a value: nothing printed or written until the run ends with it
    assert found.fits and found.problem is None and found.figures["train_step_device_bytes"] == memory["total"]
    assert not os.listdir(tmp_path) and not capsys.readouterr().out
    with pytest.raises(Done):
        report_plan(args, layout, state)
    assert "fits" in capsys.readouterr().out
    layout.plan = v3._replace(device_bytes=memory["total"] - 1)  # a byte short
    with pytest.raises(RunError, match=r"^the train step needs [\d.]+ MiB per device but a TPU v3-8 device has [\d.]+ "
                                       r"MiB: use a smaller --per_device_train_batch_size with more "
                                       r"--gradient_accumulation_steps \(now 2\), --dtype bfloat16, or "
                                       r"--gradient_checkpointing$"):
        report_plan(args, layout, state)
    results = json.load(open(tmp_path / "all_results.json"))
    assert results["fits"] is False and results["device_bytes"] == memory["total"] - 1
    assert results["train_step_device_bytes"] == memory["total"]


@needs_libtpu
def test_an_eval_step_counts_the_training_state_it_runs_beside(v3, fsdp_plan, tmp_path, capsys):
    """The eval step's need is its own plan plus what stays on the device while it runs: AdamW's two
    float32 moments of this device's share of the parameters (and a few counters)."""
    layout, train, params, state = fsdp_plan
    args = type("Args", (), {"output_dir": str(tmp_path), "gradient_accumulation_steps": 1,
                             "gradient_checkpointing": False, "per_device_eval_batch_size": 16})()
    # 128 rows of 64 tokens: float32 logits over 1024 tokens, 4 MiB a device, more than the train step's.
    batches = {"eval_step": {"input_ids": np.ones((128, SEQUENCE), np.int32)}}
    layout.plan = v3
    with pytest.raises(Done):
        report_plan(args, layout, state, batches)
    results = json.load(open(tmp_path / "all_results.json"))
    share = sum(4 * math.prod(x.shape) // (8 if any(leaf_spec(x.shape, 8)) else 1)
                for x in jax.tree_util.tree_leaves(params))
    assert results["training_state_kept_device_bytes"] == pytest.approx(2 * share, abs=64)
    own = sum(results[f"eval_step_device_bytes_{part}"] for part in ("arguments", "outputs", "temporaries"))
    assert results["eval_step_device_bytes"] == own - results["eval_step_device_bytes_aliased"] + \
        results["training_state_kept_device_bytes"]
    need = results["eval_step_device_bytes"]
    assert need > train["total"] and results["fits"] is True
    assert "--sharding fsdp: the eval step needs" in capsys.readouterr().out
    layout.plan = v3._replace(device_bytes=need - 1)  # the train step fits, the eval step does not
    with pytest.raises(RunError, match=r"^the eval step needs [\d.]+ MiB per device but a TPU v3-8 device has [\d.]+ "
                                       r"MiB: use a smaller --per_device_eval_batch_size \(now 16\) or --dtype "
                                       r"bfloat16$"):
        report_plan(args, layout, state, batches)
    assert json.load(open(tmp_path / "all_results.json"))["fits"] is False


# The TPU compiler does not compile a step whose temporaries alone exceed the HBM ("Ran out of memory
# on HBM, the total memory required for HLO temporaries (52.14G) exceeds available HBM (15.48G)"):
# 2^20 rows of 64 tokens make the small GPT-2's eval step need 52 GiB a v3 core, 2^18 rows its train
# step 33 GiB (refused in seconds; 2^17 rows compile, 14.2 GiB).
HUGE_BATCH = {"input_ids": np.broadcast_to(np.int32(1), (2**20, SEQUENCE))}
REFUSED = r"Ran out of memory on HBM, the total memory required for HLO temporaries \([\d.]+G\) exceeds available HBM"


@needs_libtpu
def test_a_train_step_the_tpu_compiler_refuses_does_not_fit(v3, tmp_path, capsys):
    layout = FullySharded(8, v3)
    memory, _, state = _train_step_memory(layout, rows=2**18)
    assert memory is None and re.fullmatch(REFUSED + r" \([\d.]+G\)", layout.train_step_refused)
    args = type("Args", (), {"output_dir": str(tmp_path), "gradient_accumulation_steps": 1,
                             "gradient_checkpointing": True, "gradient_checkpointing_policy": "kernels",
                             "per_device_eval_batch_size": 8})()
    with pytest.raises(RunError, match=r"^the train step does not fit a TPU v3-8 device \(the TPU compiler: "
                                       + REFUSED + r".*\): use a smaller --per_device_train_batch_size with more "
                                       r"--gradient_accumulation_steps \(now 1\), --dtype bfloat16, or "
                                       r"--gradient_checkpointing_policy nothing \(each layer keeps its kernels' "
                                       r"outputs now\)$"):
        report_plan(args, layout, state, {"eval_step": {"input_ids": np.ones((8, SEQUENCE), np.int32)}})
    assert "--sharding fsdp: the train step does not fit: the TPU compiler refuses it (" in capsys.readouterr().out
    results = json.load(open(tmp_path / "all_results.json"))
    assert results["fits"] is False and re.match(REFUSED, results["train_step_refused"])
    assert "train_step_device_bytes" not in results and "eval_step_device_bytes" not in results


@needs_libtpu
def test_an_eval_step_the_tpu_compiler_refuses_does_not_fit(v3, fsdp_plan, tmp_path):
    layout, _, _, state = fsdp_plan
    layout.plan = v3
    args = type("Args", (), {"output_dir": str(tmp_path), "gradient_accumulation_steps": 1,
                             "gradient_checkpointing": False, "per_device_eval_batch_size": 2**17})()
    with pytest.raises(RunError, match=r"^the eval step does not fit a TPU v3-8 device \(the TPU compiler: "
                                       + REFUSED + r".*\): use a smaller --per_device_eval_batch_size "
                                       r"\(now 131072\) or --dtype bfloat16$"):
        report_plan(args, layout, state, {"eval_step": HUGE_BATCH})
    results = json.load(open(tmp_path / "all_results.json"))
    assert results["fits"] is False and results["train_step_device_bytes"] > 0
    assert re.match(REFUSED, results["eval_step_refused"]) and "eval_step_device_bytes" not in results


# script, its tiny config with a smaller model, the sharding, and the steps the config's run would call
COMPILE_ONLY_RUNS = {
    "clm fsdp": ("run_clm_flax.py", "configs/clm_tiny.json", "n_embd=32,n_layer=1,n_head=2,n_positions=128", "fsdp",
                 ["train_step", "eval_step"]),
    "summarization dp": ("run_summarization_flax.py", "configs/summarization_tiny.json",
                         "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16", "dp",
                         ["train_step", "eval_step", "generate_step"]),
}


@needs_libtpu
@pytest.mark.parametrize("name", COMPILE_ONLY_RUNS)
def test_a_compile_only_run_plans_each_step_it_would_call_and_trains_nothing(tmp_path, name):
    script, config, overrides, sharding, steps = COMPILE_ONLY_RUNS[name]
    out = tmp_path / "plan"
    result = run_script(script, [config, "--config_overrides", overrides, "--output_dir", out, "--compile_only",
                                 "v3-8", "--sharding", sharding, "--gradient_checkpointing", "true",
                                 "--compilation_cache_dir", "none"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    prefix = f"TPU v3-8 (8 x TPU v3, 16 GiB HBM each), --sharding {sharding}: the "
    assert [line[len(prefix):].split(" needs")[0] for line in lines] == [step.replace("_", " ") for step in steps]
    assert all(line.startswith(prefix) and line.endswith(": fits") for line in lines), lines
    assert sorted(os.listdir(out)) == ["all_results.json", "metrics.jsonl"]  # no checkpoint, no model, no run args
    results = json.load(open(out / "all_results.json"))
    assert results["compile_only"] == "v3-8" and results["fits"] is True
    assert results["device_bytes"] == 16 * 2**30
    for step in steps:
        assert 0 < results[f"{step}_device_bytes"] < 2**30, step
    assert 0 < results["training_state_kept_device_bytes"] < results["train_step_device_bytes_arguments"]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["split"] for row in rows] == ["memory"]  # not a single train step
    assert {key: rows[0][key] for key in results if key in rows[0]} == {
        key: value for key, value in results.items() if key not in ("compile_only", "fits")}


@needs_libtpu
def test_a_dual_encoder_of_two_towers_with_lora_is_planned_from_shapes_alone(v3):
    # run_hybrid_clip.py --compile_only --lora_rank: its fresh dual encoder was once sent to the compile-only
    # devices, which hold no array ("MakeArraysFromHostBufferShards not available with compile-only client")
    from transformers import BertConfig, VisionTextDualEncoderConfig, ViTConfig

    from run_hybrid_clip import DualEncoderModelArguments
    from tasks import image_text

    tower = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    config = VisionTextDualEncoderConfig.from_vision_text_configs(
        ViTConfig(image_size=16, patch_size=8, **tower), BertConfig(vocab_size=50, **tower), projection_dim=8)
    _, params = image_text.load_dual_encoder(DualEncoderModelArguments(lora_rank=4), config, 0, FullySharded(8, v3))
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for _, leaf in leaves)  # nothing allocated
    names = {str(path[-1].key) for path, _ in leaves}
    assert {"lora_A", "lora_B"} <= names
