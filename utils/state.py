"""Train state: params, optimizer state, step, and the dropout RNG that travels with them."""

import jax
from flax.training import train_state


class TrainState(train_state.TrainState):
    """`flax` TrainState plus the dropout key, so a checkpoint restores randomness exactly.

    Made by `utils.layout` (`Layout.create_state`): under "dp" each device holds its own key, under
    "fsdp" one key serves the whole global batch.
    """

    dropout_rng: jax.Array

    def next_dropout_rng(self):
        """Split the key: returns (key for this step, state carrying the next key)."""
        step_rng, next_rng = jax.random.split(self.dropout_rng)
        return step_rng, self.replace(dropout_rng=next_rng)
