"""Train state: params, optimizer state, step, and the dropout RNG that travels with them."""

from typing import Callable

import jax
from flax.training import train_state


class TrainState(train_state.TrainState):
    """`flax` TrainState plus the dropout key, so a checkpoint restores randomness exactly.

    Inside a pmap each device holds its own key (replicated state with per-device keys).
    """

    dropout_rng: jax.Array

    def next_dropout_rng(self):
        """Split the key: returns (key for this step, state carrying the next key)."""
        step_rng, next_rng = jax.random.split(self.dropout_rng)
        return step_rng, self.replace(dropout_rng=next_rng)


def create_train_state(apply_fn: Callable, params, tx, seed: int) -> TrainState:
    """A fresh state on the host; `sharding.replicate_state` puts it on the devices."""
    return TrainState.create(apply_fn=apply_fn, params=params, tx=tx, dropout_rng=jax.random.PRNGKey(seed))
