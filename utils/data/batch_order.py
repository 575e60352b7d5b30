"""Which examples make each batch, as a pure function of (seed, epoch, step).

The order of an epoch is a seeded permutation, so a resumed run sees exactly the remaining batches
of the uninterrupted one, and every process of a pod derives the same order and loads only its own
slice. `TrainOrder` computes each epoch's permutation once, so a batch costs O(batch) on the host
whatever the dataset's size. The random numbers of a row (`row_uniforms`: masks, noise) are a pure
function of (seed, step, row) too.
"""

import numpy as np


def steps_per_epoch(num_examples, global_batch_size):
    return num_examples // global_batch_size


def epoch_order(num_examples, seed, epoch):
    """The permutation of example indices for one epoch: same on every process and every resume."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def train_batch_indices(num_examples, global_batch_size, seed, epoch, step_in_epoch, rows=None):
    """Indices of one training batch (the incomplete last batch of an epoch is never used).

    `rows` selects this process's part of the global batch (`devices.process_slice`). This computes
    the epoch's permutation anew: a loop over batches uses `TrainOrder`, which keeps it.
    """
    return _batch_of(epoch_order(num_examples, seed, epoch), global_batch_size, step_in_epoch, rows)


def _batch_of(order, global_batch_size, step_in_epoch, rows):
    start = step_in_epoch * global_batch_size
    indices = order[start: start + global_batch_size]
    return indices[rows] if rows is not None else indices


def row_uniforms(key, row_ids, shape, count=1):
    """`count` arrays of uniform [0, 1) numbers of `shape` ([rows, ...]); row i comes from its own
    generator, seeded with (*key, row_ids[i]), so it does not depend on the other rows of its batch."""
    rows = [np.random.default_rng([*key, int(row)]).random((count, *shape[1:])) for row in row_ids]
    return np.stack(rows, axis=1) if rows else np.zeros((count, *shape))


class TrainOrder:
    """`train_batch_indices` of every step, with each epoch's permutation computed once (when the
    step after an epoch's last is asked for, or the first step of a resumed run)."""

    def __init__(self, num_examples, global_batch_size, seed, steps_per_epoch):
        self.num_examples, self.global_batch_size, self.seed = num_examples, global_batch_size, seed
        self.steps_per_epoch = steps_per_epoch
        self._epoch, self._order = None, None

    def batch_indices(self, step, rows=None):
        """Indices of the batch of (0-based) `step`; `rows` as in `train_batch_indices`."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.num_examples, self.seed, epoch)
        return _batch_of(self._order, self.global_batch_size, step_in_epoch, rows)


def gather(arrays, indices):
    return {name: column[indices] for name, column in arrays.items()}


def eval_batch_ranges(num_examples, global_batch_size):
    """(start, stop) of each eval batch, in order; the last may be short and is padded by the caller."""
    return [(start, min(start + global_batch_size, num_examples)) for start in range(0, num_examples, global_batch_size)]
