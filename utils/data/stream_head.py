"""A stream's first examples read whole, in order: the held-out eval set of a streamed run, and the
check, before the run writes anything, that a pass of the training data gives a batch.

`read_examples(source, encoder, limit=None, start=None)` -> (arrays, position after them).
`eval_set(train_source, encoder, held_out, validation_source=None, max_examples=None)`
  -> (arrays for `loop.eval_batches`, `start` for the training Stream or None).
`check_one_batch(train_source, encoder, local_batch_size, start, global_batch_size)`: UsageError
  unless every process's part of a pass gives a batch.
The held-out eval set is the first ceil(N / P) rows of each process's stream, gathered in process
order: the same on every process, but it depends on P.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils

from utils.base.errors import UsageError
from utils.data.text_sources import groups_of_texts


def gather_processes(rows):
    """Every process's `rows` concatenated in process order (the identity alone)."""
    if jax.process_count() == 1:
        return rows
    return np.asarray(multihost_utils.process_allgather(rows, tiled=True))


def read_examples(source, encoder, limit=None, start=None):
    """(arrays, position after them) of the first `limit` rows (None: all) from `start` on, in order.

    A position is {"source": the source position of a group of texts, "taken": its rows already
    read}: what `Stream(start=...)` continues from.
    """
    position, taken = (start["source"], start["taken"]) if start else (source.start(), 0)
    parts, count, skip = {name: [] for name in encoder.columns}, 0, taken
    for group_position, texts in groups_of_texts(source.open(position), encoder):
        rows = encoder(texts)
        available = len(rows[encoder.columns[0]])
        stop = available if limit is None else min(available, skip + limit - count)
        for name in encoder.columns:
            parts[name].append(rows[name][skip:stop])
        count += max(stop - skip, 0)
        position, taken, skip = group_position, stop, 0
        if limit is not None and count >= limit:
            break
    arrays = {name: np.concatenate(parts[name]) if parts[name] else np.zeros((0, encoder.width), np.int32)
              for name in encoder.columns}
    return arrays, {"source": position, "taken": taken}


def eval_set(train_source, encoder, held_out, validation_source=None, max_examples=None, gather=gather_processes):
    """(eval arrays, training start) for a streamed run: the validation source's first `max_examples`
    rows (None: all) and start None when there is one; else the first `held_out` rows of the training
    stream, which the training Stream skips when made with `start=` the returned start.

    Every process gets the same eval arrays. Held out: each process takes the first
    ceil(held_out / processes) rows of its own part, gathered in process order (`gather`).
    """
    if validation_source is not None:
        arrays, _ = read_examples(validation_source, encoder, max_examples)
        if not len(arrays["input_ids"]):
            raise UsageError("the validation data gives no examples (no text, or fewer tokens than one block)")
        return arrays, None
    local = -(-held_out // train_source.process_count)
    arrays, start = read_examples(train_source, encoder, local)
    if len(arrays["input_ids"]) < local:
        raise UsageError(f"the training data of process {train_source.process_index} gives only "
                         f"{len(arrays['input_ids'])} examples, fewer than the {local} to hold out for evaluation: "
                         "hold out fewer, pass --validation_file, or add data")
    return {name: gather(rows) for name, rows in arrays.items()}, start


def check_one_batch(train_source, encoder, local_batch_size, start, global_batch_size, gather=gather_processes):
    """UsageError, on every process, unless each process's part of a pass (from `start`, after the
    held-out rows) gives one batch: else no pass could ever give a step (checked before the run
    writes anything, by reading at most the first group of texts)."""
    arrays, _ = read_examples(train_source, encoder, local_batch_size, start)
    counts = gather(np.array([len(arrays["input_ids"])]))
    if counts.min() >= local_batch_size:
        return
    if len(counts) == 1:
        where, need = "", f"one global batch of {global_batch_size}"
    else:
        where = f" in process {int(counts.argmin())}'s part"
        need = f"its {local_batch_size} rows of a global batch of {global_batch_size}"
    held_out = " after the rows held out for evaluation" if start else ""
    raise UsageError(f"the training data gives {int(counts.min())} examples{where}{held_out}, fewer than {need} "
                     "(per_device_train_batch_size x devices x gradient_accumulation_steps): lower the batch size, "
                     f"add data{' or hold out fewer (--max_eval_samples)' if start else ''}")
