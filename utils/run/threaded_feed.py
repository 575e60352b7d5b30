"""Training batches decoded on the host by a pool of threads, several steps ahead of the step that needs them:
the feeder of the data read example by example from files (images, audio clips), where Pillow, NumPy and
SciPy release the GIL while they work.

`ThreadedData` has the methods of `utils.run.loop.InMemoryData` that the spine calls; a subclass says how the
examples `indices` of an epoch become a batch (`host_batch`). Batches follow
`utils.data.batch_order.TrainOrder` (a seeded order per epoch), and a subclass draws an example's random numbers
from (seed, epoch, example) alone, so a batch is a pure function of (seed, step) and a checkpoint needs only
the step. Each process prepares only its own rows of the global batch.
"""

import collections
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from utils.data import batch_order
from utils.layout import devices

BATCHES_AHEAD = 4  # training batches being prepared while the step runs


def default_workers():
    """Threads that decode examples on the host (training batches, eval columns, up-front checks)."""
    return min(8, os.cpu_count() or 1)


class ThreadedData:
    """`size` examples, batched by `workers` threads (default: `default_workers`) `BATCHES_AHEAD` steps (or
    `workers`, if more) ahead."""

    def __init__(self, size, workers=None):
        self.size, self.workers = size, workers or default_workers()

    def host_batch(self, indices, seed, epoch):
        """The batch (a dict of host arrays) of the examples `indices` as epoch `epoch` of a run seeded `seed`
        prepares them."""
        raise NotImplementedError

    def example_batch(self, global_batch_size, transform=None):
        rows = np.arange(global_batch_size)[devices.process_slice(global_batch_size)]
        batch = self.host_batch(rows % self.size, 0, 0)
        return transform(batch, 0, rows) if transform else batch

    def host_batches(self, global_batch_size, seed, steps_per_epoch, start_step, total_steps, rows=None,
                     transform=None):
        """This process's rows `rows` (None: all) of each step's batch from `start_step` on, prepared
        `BATCHES_AHEAD` steps ahead by the thread pool."""
        order = batch_order.TrainOrder(self.size, global_batch_size, seed, steps_per_epoch)
        row_ids = np.arange(global_batch_size)[rows if rows is not None else slice(None)]

        def prepare(step, indices):
            batch = self.host_batch(indices, seed, step // steps_per_epoch)
            return transform(batch, step, row_ids) if transform else batch

        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="train-batches")
        pending = collections.deque()
        try:
            for step in range(start_step, total_steps):
                # The order is read here, in one thread (`TrainOrder` keeps one epoch); the pool
                # only decodes and transforms.
                pending.append(pool.submit(prepare, step, order.batch_indices(step, rows)))
                if len(pending) > max(BATCHES_AHEAD, self.workers):
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def batches(self, global_batch_size, seed, steps_per_epoch, start_step, total_steps, layout, transform=None):
        rows = devices.process_slice(global_batch_size)
        return layout.prefetch(self.host_batches(global_batch_size, seed, steps_per_epoch, start_step, total_steps,
                                                 rows, transform))

    def state_template(self):
        return None  # nothing to save beyond the step

    def state_after(self, step):
        return None
