"""utils/run.py: the fingerprint a resumed run is checked against; what Outputs.save refuses and when it stops."""

import os
import signal
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from transformers import T5Config

from utils import compat, preemption, sharding
from utils.args import TrainingArguments
from utils.errors import RunError, Stopped
from utils.run import Outputs, fingerprint_difference, run_fingerprint
from utils.state import create_train_state


def fingerprint(train_examples=160, config=None, **training):
    args = TrainingArguments(output_dir="out", do_train=True, **{"per_device_train_batch_size": 2, **training})
    return run_fingerprint(config or T5Config(d_model=32, num_layers=1), args, train_examples)


def test_fingerprint_names_what_fixes_the_run():
    saved = fingerprint()
    assert saved["global batch size"] == 16 and saved["training examples"] == 160  # 2 x 8 devices
    assert saved["seed"] == 42 and saved["optimizer"] == "adamw" and saved["devices"] == 8
    assert saved["model config"]["d_model"] == 32 and "transformers_version" not in saved["model config"]


def test_compatible_changes_are_no_difference():
    saved = fingerprint()
    assert fingerprint_difference(saved, fingerprint(num_train_epochs=9, max_steps=50, logging_steps=3, eval_steps=7,
                                                     save_steps=11, learning_rate=1e-3)) is None
    same_batch = fingerprint(per_device_train_batch_size=1, gradient_accumulation_steps=2)
    assert fingerprint_difference(saved, same_batch) is None
    config = T5Config(d_model=32, num_layers=1, name_or_path="elsewhere")  # where a config came from is no matter
    assert fingerprint_difference(saved, fingerprint(config=config)) is None


def test_each_incompatible_change_is_named():
    saved = fingerprint()
    cases = [
        (fingerprint(per_device_train_batch_size=4),
         "global batch size is 16 in the checkpoint but 32 in this run (set by per_device_train_batch_size x devices"),
        (fingerprint(train_examples=150), "training examples is 160 in the checkpoint but 150 in this run"),
        (fingerprint(seed=1), "seed is 42 in the checkpoint but 1 in this run (set by --seed)"),
        (fingerprint(adafactor=True), "optimizer is 'adamw' in the checkpoint but 'adafactor' in this run"),
        (fingerprint(config=T5Config(d_model=64, num_layers=1)),
         "model config 'd_model' is 32 in the checkpoint but 64 in this run (set by the model config"),
    ]
    for current, message in cases:
        assert fingerprint_difference(saved, current).startswith(message)


def test_eval_only_runs_compare_the_model_config_only():
    args = TrainingArguments(output_dir="out", do_eval=True)
    current = run_fingerprint(T5Config(d_model=32, num_layers=1), args)
    assert set(current) == {"model config"}
    assert fingerprint_difference(fingerprint(), current) is None


# ---------------------------------------------------------------------------------------------
# Outputs.save: never a non-finite state; on a stop request, the checkpoint only, then Stopped
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def outputs(tmp_path, monkeypatch):
    from transformers import FlaxT5ForConditionalGeneration

    from utils import run

    monkeypatch.setattr(run, "at_exit", lambda callback: None)  # run_main's list, which nothing here drains
    compat.apply()
    model = FlaxT5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                    num_heads=2), seed=0)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True, per_device_train_batch_size=1)
    outputs = Outputs(args, (args,), model, None, total_steps=4, is_main=True, train_examples=16)
    state = create_train_state(model.__call__, model.params, optax.adamw(1e-3), seed=0)
    yield outputs, sharding.replicate_state(state)
    outputs.close()


def test_save_stores_the_data_position_and_fingerprint(outputs):
    outputs, state = outputs
    outputs.save(3, state)
    outputs.close()
    meta = outputs.checkpointer.read_meta(3)
    assert (meta["step"], meta["epoch"], meta["step_in_epoch"]) == (3, 1, 1)  # 2 steps per epoch
    assert meta["fingerprint"] == outputs.fingerprint
    assert os.path.exists(os.path.join(outputs.args.output_dir, "flax_model.msgpack"))


def test_save_refuses_a_non_finite_state(outputs):
    outputs, state = outputs
    broken = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
    with pytest.raises(RunError, match="the parameters became non-finite in step 3"):
        outputs.save(3, broken)
    outputs.close()
    assert outputs.checkpointer.all_steps() == []


def test_save_after_a_stop_request_writes_the_checkpoint_only_and_stops(outputs, monkeypatch):
    outputs, state = outputs
    monkeypatch.setattr(preemption, "_received", signal.SIGINT)
    monkeypatch.setattr(sys, "argv", ["run_summarization_flax.py", "cfg.json"])
    with pytest.raises(Stopped, match=r"^SIGINT received: saved the checkpoint of step 3 in .*/out/checkpoints\. To "
                                      r"resume, .*: python run_summarization_flax.py cfg.json "
                                      r"--resume_from_checkpoint latest$") as stop:
        outputs.save(3, state)
    assert stop.value.exit_code == 130
    assert outputs.checkpointer.all_steps() == [3]  # already written: Stopped comes after the wait
    assert not os.path.exists(os.path.join(outputs.args.output_dir, "flax_model.msgpack"))
