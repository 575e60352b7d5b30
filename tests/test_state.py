"""utils/state.py: TrainState with its dropout key."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from utils.state import TrainState


def apply_fn(params, x):
    return x @ params["w"]


def make_state(seed=0):
    return TrainState.create(apply_fn=apply_fn, params={"w": jnp.ones((3, 2))}, tx=optax.sgd(0.5),
                             dropout_rng=jax.random.PRNGKey(seed))


def test_create():
    state = make_state(seed=5)
    assert isinstance(state, TrainState) and int(state.step) == 0
    np.testing.assert_array_equal(state.dropout_rng, jax.random.PRNGKey(5))
    assert state.apply_fn is apply_fn and state.params["w"].shape == (3, 2)


def test_next_dropout_rng_advances():
    state = make_state()
    key1, state1 = state.next_dropout_rng()
    key2, state2 = state1.next_dropout_rng()
    keys = [np.asarray(k).tobytes() for k in (state.dropout_rng, key1, state1.dropout_rng, key2, state2.dropout_rng)]
    assert len(set(keys)) == 5
    np.testing.assert_array_equal(key1, jax.random.split(state.dropout_rng)[0])
    np.testing.assert_array_equal(state1.dropout_rng, jax.random.split(state.dropout_rng)[1])
    assert int(state1.step) == 0  # only the key moves
    again, _ = make_state().next_dropout_rng()
    np.testing.assert_array_equal(again, key1)  # deterministic


def test_apply_gradients_keeps_key_and_counts_steps():
    state = make_state()
    _, state = state.next_dropout_rng()
    new = state.apply_gradients(grads={"w": jnp.ones((3, 2))})
    assert int(new.step) == 1
    np.testing.assert_allclose(new.params["w"], 0.5)  # 1 - 0.5 x 1 is exact in float32: default rtol 1e-7
    np.testing.assert_array_equal(new.dropout_rng, state.dropout_rng)
