"""Checkpoint save/restore of a train state as global arrays, and finding checkpoints on disk.

The states here are "dp" ones (utils/layout/layouts.py: replicated over the 8 devices); tests/test_layout.py
restores them under "fsdp" and back.
"""

import os
import threading
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training.train_state import TrainState

from utils.base.errors import UsageError
from utils.checkpoints.store import (Checkpointer, WRITES_HOST_ARRAYS_IN_PLACE, all_finite, checkpoint_steps,
                                     find_checkpoint_dir, locate_checkpoint)
from utils.layout.layouts import DataParallel
from utils.run import perf

N_DEVICES = 8
META = {"epoch": 1, "step_in_epoch": 3, "fingerprint": "abc123"}
DP = DataParallel()


class MLP(nn.Module):
    hidden: int = 8

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(2)(x)


def fresh_state(hidden: int = 8):
    """The placed state a script builds before resuming (same seed every time)."""
    model = MLP(hidden)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 4)), train=False)["params"]
    return DP.create_state(model.apply, params, optax.adamw(1e-2))


def train_step(state, x, y):
    step_rng = DP.dropout_key(0, state.step)

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, x, rngs={"dropout": step_rng})
        return jnp.mean((pred - y) ** 2)

    grads = jax.lax.pmean(jax.grad(loss_fn)(state.params), "batch")
    return state.apply_gradients(grads=grads)


@pytest.fixture(scope="module")
def trained_state():
    """A dp state after 3 pmap'd adamw steps with dropout: non-trivial mu/nu/count."""
    p_step = jax.pmap(train_step, axis_name="batch")
    state = fresh_state()
    x = jax.random.normal(jax.random.PRNGKey(1), (N_DEVICES, 2, 4))
    y = jax.random.normal(jax.random.PRNGKey(2), (N_DEVICES, 2, 2))
    for _ in range(3):
        state = p_step(state, x, y)
    return state


def assert_bitwise_equal(a, b):
    """Same leaf paths, dtypes, shapes and bytes (static fields such as apply_fn are not compared)."""
    a, b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [path for path, _ in a] == [path for path, _ in b]
    for (_, x), (_, y) in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def save(ckpt, step, state, meta=META):
    return ckpt.save(step, DP.checkpoint_tree(state), meta)


def test_save_restore_is_bitwise_exact(tmp_path, trained_state):
    assert jax.local_device_count() == N_DEVICES
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    assert save(ckpt, 3, trained_state)
    state, meta = ckpt.restore(None, DP.checkpoint_target(fresh_state()))

    expected = jax.device_get(trained_state)
    assert meta == META
    assert int(state.step) == 3
    assert_bitwise_equal(state.params, jax.tree.map(lambda x: x[0], expected.params))
    assert_bitwise_equal(state.opt_state, jax.tree.map(lambda x: x[0], expected.opt_state))
    assert int(state.opt_state[0].count) == 3
    ckpt.close()


def test_restored_state_resumes_like_the_original(tmp_path, trained_state):
    """One more step from the restored state equals one more step from the original: dropout included,
    its keys derived from the step the state holds."""
    p_step = jax.pmap(train_step, axis_name="batch")
    x = jnp.ones((N_DEVICES, 2, 4))
    y = jnp.zeros((N_DEVICES, 2, 2))
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    save(ckpt, 3, trained_state)
    restored, _ = ckpt.restore(3, DP.checkpoint_target(fresh_state()))
    resumed = DP.from_checkpoint(restored)
    assert_bitwise_equal(jax.device_get(p_step(resumed, x, y)), jax.device_get(p_step(trained_state, x, y)))
    ckpt.close()


def test_async_save_then_wait(tmp_path, trained_state):
    ckpt = Checkpointer(str(tmp_path), async_save=True)
    assert save(ckpt, 1, trained_state)
    ckpt.wait()
    assert ckpt.all_steps() == [1]
    assert os.path.isdir(tmp_path / "1")
    assert not save(ckpt, 1, trained_state)  # the step is already saved
    ckpt.close()


@pytest.mark.skipif(not WRITES_HOST_ARRAYS_IN_PLACE, reason="orbax-checkpoint < 0.12.5 always copies host arrays")
def test_host_state_is_written_without_a_copy(tmp_path):
    """The state's host arrays (dp's `checkpoint_tree`: already copies of the device's) are written as they are:
    orbax's own copy of them, made by default, held a second host copy of the state while it was written
    (5.1 GiB for the Llama row on a TPU host). numpy reports its allocations to tracemalloc."""
    tree = {"a": np.ones((4, 1 << 20), np.float32), "b": np.ones((2, 1 << 20), np.float32)}  # 24 MiB
    ckpt = Checkpointer(str(tmp_path), async_save=True)
    tracemalloc.start()
    try:
        assert ckpt.save(1, tree, {"step": 1})
        ckpt.wait()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak / 2**20:.1f} MiB allocated while writing a 24 MiB state"
    restored, _ = ckpt.restore(1, jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree))
    assert_bitwise_equal(restored, tree)
    ckpt.close()


def test_host_state_is_written_uncompressed_without_holding_it_again(tmp_path):
    """tensorstore holds a compressed write's chunks until it is done: compressed, this 256 MiB state of random
    floats (which shrink little, as trained weights do) took ~200 MiB more memory while written; the Llama row
    3.7 GiB on a TPU host."""
    rng = np.random.default_rng(0)
    tree = {f"w{i}": rng.standard_normal((16, 1 << 20), dtype=np.float32) for i in range(4)}  # 256 MiB
    ckpt = Checkpointer(str(tmp_path), async_save=True)
    assert ckpt.save(1, {"w0": tree["w0"][:1]}, {"step": 1})  # what a first write sets up, before measuring
    ckpt.wait()
    before, peak, writing = perf.current_host_memory(), [0], threading.Event()

    def sample():
        while not writing.is_set():
            peak[0] = max(peak[0], perf.current_host_memory())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        assert ckpt.save(2, tree, {"step": 2})
        ckpt.wait()
    finally:
        writing.set()
        sampler.join()
    copied = 0 if WRITES_HOST_ARRAYS_IN_PLACE else 256 << 20  # an older orbax's own copy of the state
    assert peak[0] - before < copied + (64 << 20), f"{(peak[0] - before) / 2**20:.0f} MiB held while writing 256 MiB"
    ckpt.close()


def test_max_to_keep_prunes_old_steps(tmp_path, trained_state):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3):
        assert save(ckpt, step, trained_state, {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    assert ckpt.latest_step() == 3
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]
    ckpt.close()


def test_partial_save_is_ignored(tmp_path, trained_state):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    save(ckpt, 2, trained_state, {"step": 2})
    ckpt.close()
    # What a kill -9 during the save of step 5 leaves behind.
    partial = tmp_path / "5.orbax-checkpoint-tmp-1234567" / "state"
    partial.mkdir(parents=True)
    (partial / "garbage").write_bytes(b"\0" * 16)

    ckpt = Checkpointer(str(tmp_path))
    assert ckpt.latest_step() == 2
    assert ckpt.all_steps() == [2]
    _, meta = ckpt.restore(None, DP.checkpoint_target(fresh_state()))
    assert meta == {"step": 2}
    ckpt.close()


def test_changed_model_shape_names_the_parameter(tmp_path, trained_state):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    save(ckpt, 3, trained_state)
    with pytest.raises(ValueError, match=r"step 3 has shape \(8,\) for params/Dense_0/bias, model has \(16,\)"):
        ckpt.restore(None, DP.checkpoint_target(fresh_state(hidden=16)))
    ckpt.close()


def test_changed_tree_structure_names_the_entry(tmp_path, trained_state):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    save(ckpt, 3, trained_state)
    target = DP.checkpoint_target(fresh_state())
    grown = target.replace(params={**target.params, "Extra": {"kernel": jax.ShapeDtypeStruct((2, 2), np.float32)}})
    with pytest.raises(ValueError, match="has no params/Extra/kernel"):
        ckpt.restore(None, grown)
    ckpt.close()


class StateWithKeys(TrainState):
    """The train state as checkpoints written before the dropout keys were derived from (seed, step)
    hold it: one saved key per device."""

    dropout_rng: jax.Array


def test_an_older_checkpoints_dropout_keys_are_ignored(tmp_path, trained_state):
    tree = DP.checkpoint_tree(trained_state)
    older = StateWithKeys(step=tree.step, apply_fn=tree.apply_fn, params=tree.params, tx=tree.tx,
                          opt_state=tree.opt_state, dropout_rng=np.zeros((N_DEVICES, 2), np.uint32))
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(3, older, META)
    assert "dropout_rng" in ckpt.saved_shapes(3)
    state, meta = ckpt.restore(None, DP.checkpoint_target(fresh_state()))
    assert meta == META and not hasattr(state, "dropout_rng")
    assert_bitwise_equal(state, tree)
    ckpt.close()


def test_missing_checkpoint_raises_file_not_found(tmp_path):
    ckpt = Checkpointer(str(tmp_path / "empty"))
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        ckpt.restore(None, DP.checkpoint_target(fresh_state()))
    ckpt.close()


def test_unknown_step_raises_file_not_found(tmp_path, trained_state):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    save(ckpt, 3, trained_state)
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 7"):
        ckpt.restore(7, DP.checkpoint_target(fresh_state()))
    ckpt.close()


def test_non_main_process_writes_nothing_but_can_read(tmp_path, trained_state):
    directory = tmp_path / "ckpt"
    reader = Checkpointer(str(directory), is_main_process=False)
    assert not save(reader, 1, trained_state)
    reader.wait()
    assert not directory.exists()

    writer = Checkpointer(str(directory), async_save=False)
    save(writer, 1, trained_state)
    writer.close()
    _, meta = Checkpointer(str(directory), is_main_process=False).restore(None, DP.checkpoint_target(fresh_state()))
    assert meta == META


def test_read_meta_and_delete_after(tmp_path, trained_state):
    ckpt = Checkpointer(str(tmp_path), max_to_keep=None, async_save=False)
    for step in (2, 4, 6):
        save(ckpt, step, trained_state, {"step": step})
    assert ckpt.read_meta(None) == {"step": 6} and ckpt.read_meta(4) == {"step": 4}
    assert ckpt.delete_after(2) == [4, 6]
    assert ckpt.all_steps() == [2] and checkpoint_steps(str(tmp_path)) == [2]
    ckpt.close()


def test_checkpoint_steps_skips_partial_saves(tmp_path):
    for name in ("3", "12", "15.orbax-checkpoint-tmp-99", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "7").write_text("a file, not a step directory")
    assert checkpoint_steps(str(tmp_path)) == [3, 12]
    assert checkpoint_steps(str(tmp_path / "missing")) == []


def test_locate_checkpoint_accepts_every_form(tmp_path):
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    for name in ("4", "8", "12.orbax-checkpoint-tmp"):
        (checkpoints / name).mkdir(parents=True)
    here = str(checkpoints)
    assert locate_checkpoint("latest", str(out)) == (here, None)
    assert locate_checkpoint("8", str(out)) == (here, 8)
    assert locate_checkpoint(str(checkpoints / "4"), "elsewhere") == (here, 4)
    assert locate_checkpoint(here, "elsewhere") == (here, None)
    assert locate_checkpoint(str(out), "elsewhere") == (here, None)
    with pytest.raises(UsageError, match="is an incomplete checkpoint"):
        locate_checkpoint(str(checkpoints / "12.orbax-checkpoint-tmp"), "elsewhere")
    with pytest.raises(UsageError, match="no complete checkpoint there; if it is the output directory of a run"):
        locate_checkpoint(str(tmp_path), "elsewhere")
    with pytest.raises(UsageError, match="missing not found: pass 'latest', a step number, a step directory"):
        locate_checkpoint(str(tmp_path / "missing"), "elsewhere")


def test_all_finite(trained_state):
    assert all_finite((trained_state.params, trained_state.opt_state))
    broken = jax.tree.map(lambda x: x.at[0].set(jnp.nan) if x.ndim > 1 else x, trained_state.params)
    assert not all_finite(broken)
    assert all_finite({"count": jnp.zeros((), jnp.int32)})


def test_find_checkpoint_dir():
    assert find_checkpoint_dir("/runs/t5") == os.path.join("/runs/t5", "checkpoints")
