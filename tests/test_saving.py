"""utils/checkpoints/saving.py: when a step is saved and why; what a save writes, refuses, and when it stops the run."""

import os
import signal
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from transformers import T5Config

from tasks.summarization import TASK
from utils.base.arguments import TrainingArguments
from utils.base.errors import RunError, Stopped
from utils.checkpoints import preemption
from utils.checkpoints.saving import STOP, SavePolicy, Saver
from utils.layout.layouts import DataParallel
from utils.models import compat
from utils.run.loop import InMemoryData
from utils.run.run_directory import RunDirectory


def policy(total=10, per_epoch=4, **args):
    args = {"save_steps": 3, "save_on_epoch_end": False, **args}
    return SavePolicy(args["save_steps"], args["save_on_epoch_end"], per_epoch, total)


def test_policy_reasons():
    assert {step: policy().reason(step) for step in range(1, 11) if policy().reason(step)} == {
        3: "save_steps", 6: "save_steps", 9: "save_steps", 10: "last step"}
    on_epochs = policy(save_steps=100, save_on_epoch_end=True)
    assert [on_epochs.reason(step) for step in (4, 8, 10)] == ["end of epoch", "end of epoch", "last step"]


def test_policy_stop_request_comes_first(monkeypatch):
    monkeypatch.setattr(preemption, "stop_due", lambda step: step in (5, 6))
    assert [policy().reason(step) for step in (4, 5, 6)] == [None, STOP, STOP]


def test_policy_asks_for_a_stop_once_per_step(monkeypatch):
    """On several hosts every process must reach the preemption sync point exactly once per step."""
    asked = []
    monkeypatch.setattr(preemption, "stop_due", lambda step: asked.append(step) or False)
    for step in range(1, 11):
        policy().reason(step)
    assert asked == list(range(1, 11))


@pytest.fixture
def saver(tmp_path, monkeypatch):
    from transformers import FlaxT5ForConditionalGeneration

    from utils.checkpoints import saving
    from utils.run import run_directory

    for module in (run_directory, saving):  # run_main's list, which nothing here drains
        monkeypatch.setattr(module, "at_exit", lambda callback: None)
    compat.apply()
    model = FlaxT5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                    num_heads=2), seed=0)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True, per_device_train_batch_size=1)
    run_dir = RunDirectory(args, (args,), TASK, model, None, is_main=True, total_steps=4)
    layout = DataParallel()
    saver = Saver(args.output_dir, args.save_total_limit, run_dir, layout, InMemoryData({}, 16), {"seed": 42},
                  steps_per_epoch=2, total_steps=4, start_step=0, is_main=True)
    yield saver, layout.create_state(model.__call__, model.params, optax.adamw(1e-3))
    saver.close()
    run_dir.close()


def test_save_stores_the_data_position_and_fingerprint(saver):
    saver, state = saver
    saver.save(3, state, "save_steps")
    saver.close()
    meta = saver.checkpointer.read_meta(3)
    assert (meta["step"], meta["epoch"], meta["step_in_epoch"]) == (3, 1, 1)  # 2 steps per epoch
    assert meta["fingerprint"] == {"seed": 42}
    assert os.path.exists(os.path.join(saver.output_dir, "flax_model.msgpack"))


def test_save_refuses_a_non_finite_state(saver):
    saver, state = saver
    broken = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
    with pytest.raises(RunError, match="the parameters became non-finite in step 3"):
        saver.save(3, broken, "save_steps")
    saver.close()
    assert saver.checkpointer.all_steps() == []


def test_save_after_a_stop_request_writes_the_checkpoint_only_and_stops(saver, monkeypatch):
    saver, state = saver
    monkeypatch.setattr(preemption, "_received", signal.SIGINT)
    monkeypatch.setattr(sys, "argv", ["run_summarization_flax.py", "cfg.json"])
    with pytest.raises(Stopped, match=r"^SIGINT received: saved the checkpoint of step 3 in .*/out/checkpoints\. To "
                                      r"resume, .*: python run_summarization_flax.py cfg.json "
                                      r"--resume_from_checkpoint latest$") as stop:
        saver.save(3, state, STOP)
    assert stop.value.exit_code == 130
    assert saver.checkpointer.all_steps() == [3]  # already written: Stopped comes after the wait
    assert not os.path.exists(os.path.join(saver.output_dir, "flax_model.msgpack"))


def test_resumed_saver_drops_the_later_checkpoints(saver, tmp_path):
    saver, state = saver
    for step in (2, 4):
        saver.save(step, state, "save_steps")
    saver.close()
    again = Saver(saver.output_dir, 2, saver.run_dir, saver.layout, saver.train_data, {}, steps_per_epoch=2,
                  total_steps=4, start_step=2, is_main=True)
    assert again.checkpointer.all_steps() == [2]
    again.close()
