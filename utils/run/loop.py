"""The mechanical parts of a training loop that every script shares.

The scripts keep the loop itself (`for step, batch in ...: state, sums = steps.train(...)`);
`TrainLoop` (driven by `utils.run.spine.TrainingRun`) decides *when* to log, evaluate and save
(asking `SavePolicy`) and does the bookkeeping in between, and `eval_batches` feeds eval/predict
with fixed shapes so no example is dropped or counted twice.
"""

import logging
import time

import jax
import numpy as np

from utils.base.errors import RunError
from utils.data import batch_order
from utils.layout import devices
from utils.run import perf
from utils.scoring.metrics import token_weighted_means

logger = logging.getLogger(__name__)


def host_means(device_sums, keep_tokens=False):
    """Token-weighted means of a list of per-step sums over the global batch (under "dp" every device
    holds a copy: the first is taken).

    With `keep_tokens` also "tokens", how many target tokens were scored: evaluations report it,
    so that a wrong loss mask shows as a wrong count.
    """
    # Fetched whole, indexed on the host: indexing a device array would compile a gather.
    host = devices.fetch_replicated(device_sums)
    return token_weighted_means([{k: np.asarray(v).reshape(-1)[0] for k, v in sums.items()} for sums in host],
                                keep_weight=keep_tokens)


def train_batches(arrays, num_examples, global_batch_size, seed, steps_per_epoch, start_step, total_steps, layout,
                  transform=None):
    """This process's rows of each training batch from `start_step` on, placed on the devices by
    `layout` ahead of the step that needs them.

    `transform(batch, step, row_ids)` runs on the host before sharding (e.g. MLM masking), with the
    rows' indices in the global batch; it must be a pure function of its arguments so that a resumed
    run sees the same batches.
    """
    rows = devices.process_slice(global_batch_size)
    return layout.prefetch(host_train_batches(arrays, num_examples, global_batch_size, seed, steps_per_epoch,
                                              start_step, total_steps, rows, transform))


def host_train_batches(arrays, num_examples, global_batch_size, seed, steps_per_epoch, start_step, total_steps,
                       rows=None, transform=None):
    """`train_batches` on the host: the numpy rows `rows` (None: all) of each global batch, transformed.

    The host work per batch is O(batch): the epoch's order is computed once per epoch.
    """
    order = batch_order.TrainOrder(num_examples, global_batch_size, seed, steps_per_epoch)
    row_ids = np.arange(global_batch_size)[rows if rows is not None else slice(None)]
    for step in range(start_step, total_steps):
        batch = batch_order.gather(arrays, order.batch_indices(step, rows))
        yield transform(batch, step, row_ids) if transform else batch


def example_batch(arrays, global_batch_size, transform=None):
    """This process's rows of one batch shaped as every training batch is (the train step compiles
    ahead of time for it)."""
    row_ids = np.arange(global_batch_size)[devices.process_slice(global_batch_size)]
    batch = batch_order.gather(arrays, row_ids)
    return transform(batch, 0, row_ids) if transform else batch


def eval_batches(arrays, num_examples, global_batch_size, layout, transform=None):
    """(batch placed by `layout`, valid rows) for every eval batch in order; the last one is padded.

    Each batch carries `example_weight` (1 for real rows, 0 for padding) for the loss.
    """
    for batch, valid in host_eval_batches(arrays, num_examples, global_batch_size, transform):
        yield layout.place_batch(batch), valid


def host_eval_batches(arrays, num_examples, global_batch_size, transform=None):
    """`eval_batches` on the host: this process's rows of each batch, and the valid rows."""
    rows = devices.process_slice(global_batch_size)
    for start, stop in batch_order.eval_batch_ranges(num_examples, global_batch_size):
        batch = batch_order.gather(arrays, np.arange(start, stop))
        if transform:
            batch = transform(batch, 0, np.arange(start, stop))  # every evaluation alike: step 0, rows by example
        batch, valid = devices.pad_to(batch, global_batch_size)
        batch["example_weight"] = devices.example_mask(valid, global_batch_size)
        yield {k: v[rows] for k, v in batch.items()}, valid


class InMemoryData:
    """The training examples of a run, in arrays (read in place from the `datasets` cache): batches in
    a seeded order per epoch (`batch_order.TrainOrder`), so a checkpoint needs only the step to resume.
    `utils.run.stream_feed.StreamedData` is the streamed counterpart, with the same methods."""

    def __init__(self, arrays, size):
        self.arrays, self.size = arrays, size

    def example_batch(self, global_batch_size, transform=None):
        return example_batch(self.arrays, global_batch_size, transform)

    def batches(self, global_batch_size, seed, steps_per_epoch, start_step, total_steps, layout, transform=None):
        return train_batches(self.arrays, self.size, global_batch_size, seed, steps_per_epoch, start_step, total_steps,
                             layout, transform)

    def state_template(self):
        return None  # nothing to save beyond the step

    def state_after(self, step):
        return None


class TrainLoop:
    """When to log / evaluate / save, plus the metrics window and throughput between logs.

    `writer` takes the logged metrics (`log(step, metrics)`), moves the progress bar (`advance(step)`)
    and shows progress between logs (`progress(step, metrics)`): a `RunDirectory`. It logs every
    `logging_steps`, evaluates (`evaluates`) every `eval_steps` or, when that is None, at each epoch's
    end, and saves as `save_policy` says. Between logs, a step that ends `progress_seconds` or more
    after the last log or progress line (by `clock`) shows the metrics so far: a run with a large
    --logging_steps is not silent for minutes where no live bar shows it moving.
    `kept_checkpoints()` says what a failed run leaves to resume from (`Saver.kept`).
    """

    def __init__(self, steps_per_epoch, total_steps, start_step, schedule, writer, throughput, tokens_per_step,
                 examples_per_step, logging_steps, save_policy, evaluates=False, eval_steps=None,
                 progress_seconds=30.0, kept_checkpoints=lambda: "no checkpoint was saved", clock=time.monotonic):
        self.logging_steps, self.evaluates, self.eval_steps = logging_steps, evaluates, eval_steps
        self.steps_per_epoch, self.total_steps, self.start_step = steps_per_epoch, total_steps, start_step
        self.writer, self.throughput = writer, throughput
        # All learning rates at once, on the host's CPU: calling the schedule at each log would compile its
        # ops mid-run, and on an accelerator each of its ops is one more program before the first step.
        with jax.default_device(devices.host_cpu()):
            self.learning_rates = np.asarray(schedule(np.arange(max(total_steps, 1))), np.float64)
        self.tokens_per_step, self.examples_per_step = tokens_per_step, examples_per_step
        self.window = []
        self.step = start_step  # the last step finished
        self.save_policy = save_policy
        self.progress_seconds, self.kept_checkpoints, self.clock = progress_seconds, kept_checkpoints, clock
        self._last_shown = clock()  # when the last log or progress line was written

    @property
    def examples_trained(self):
        """Examples this run trained on (a resumed run: since it resumed), from the steps it took."""
        return (self.step - self.start_step) * self.examples_per_step

    def after_step(self, step, sums):
        """Record one finished step; logs every `logging_steps` and at the last step."""
        self.step = step
        self.window.append(sums)
        if step == self.start_step + 1:
            # The first step includes compilation: time only what follows it.
            jax.block_until_ready(sums)
            self.throughput.start()
            logger.info("first step done %.1f s after start (compilation included)", perf.seconds_since_start())
            self._last_shown = self.clock()  # that line says where the run is: the progress interval starts here
        else:
            self.throughput.update(self.tokens_per_step, self.examples_per_step)
        self.writer.advance(step)
        if step % self.logging_steps == 0 or step == self.total_steps:
            self.log(step)
        elif self.clock() - self._last_shown >= self.progress_seconds:
            self.writer.progress(step, self._metrics_so_far(step))
            self._last_shown = self.clock()

    def _finite_window(self, step):
        """The window's per-step sums on the host; RunError naming the first step whose loss is not finite.

        Fetching the window is the only host sync of the loop (besides saves).
        """
        window = devices.fetch_replicated(self.window)
        first = step - len(window) + 1
        for offset, sums in enumerate(window):
            loss = np.asarray(sums["loss"]).reshape(-1)[0]
            if not np.isfinite(loss):
                raise RunError(f"the training loss became {loss} at step {first + offset}: lower --learning_rate or "
                               f"use --dtype float32; {self.kept_checkpoints()}")
        return window

    def _metrics_so_far(self, step):
        """The window's mean loss, the learning rate of `step` and, past the first step, the throughput
        since the last log or progress line (fetching the window waited for the device)."""
        metrics = host_means(self._finite_window(step))
        metrics["learning_rate"] = float(self.learning_rates[step - 1])
        if step > self.start_step + 1:
            metrics.update(self.throughput.rates())
        return metrics

    def log(self, step):
        metrics = self._metrics_so_far(step)
        self.window = []
        self.writer.log(step, metrics)
        self._last_shown = self.clock()
        return metrics

    def epoch_end(self, step):
        return step % self.steps_per_epoch == 0

    def eval_due(self, step):
        if not self.evaluates:
            return False
        due = step % self.eval_steps == 0 if self.eval_steps else self.epoch_end(step)
        return due or step == self.total_steps

    def save_reason(self, step):
        """Why `step` is to be saved (`SavePolicy.reason`), or None. Call it once after every step.

        A save checks the losses since the last log first: a state reached through a non-finite loss
        is never saved."""
        reason = self.save_policy.reason(step)
        if reason:
            self._finite_window(step)
        return reason
