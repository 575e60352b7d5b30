"""Streamed data: read, tokenize, group, shuffle and batch on the fly, resumably.

For corpora that should not be tokenized into a `datasets` cache first. Per process:

    source (this process's rows) -> tokenizer thread(s) -> fixed-length rows (blocks, or padded lines)
        -> seeded shuffle pool -> bounded queue of host batches -> the caller puts them on the devices

Interface
---------
Sources (`utils.data.text_sources`) give this process's texts; the eval set and the one-batch check
read a stream's first examples whole (`utils.data.stream_head`); `utils.run.stream_feed` puts it all
together for the training loop.
An encoder (the task's: `tasks.lm.Blocks`, `tasks.lm.Lines`) turns texts into rows of one length:
  `columns` (names), `width` (row length), `group_size` (texts encoded together: rows never span
  two groups), `keeps(text)` (whether a text is read at all: the others are skipped before grouping),
  `encoder(texts)` -> {column: int32 [rows, width]}, `copy()` (for another tokenizer thread) and
  `describe()` (JSON-able; a resume compares it with the checkpoint's).
`Stream(source, encoder, batch_size, shuffle_buffer_size=10000, seed=0, workers=1, state=None,
        start=None, transform=None, queue_size=8, agree=all_processes_have, max_passes=1)`
  Iterate it for this process's host batches ({column: int32 [batch_size, length]}), batch_size being
  this process's rows of a global batch, pass after pass over the source (each from `start`, the
  position after the held-out rows, or the source's start), `max_passes` of them (None: until the
  caller stops). `transform(batch, index)` runs in the background thread on
  batch `index` (0-based, counted from the start of training: the step, as in `loop.train_batches`).
  Reading starts when the stream is made, so the shuffle pool fills while the model compiles.
  `workers` tokenizer threads (`--preprocessing_num_workers`, default 1), each with its own copy of
  the tokenizer. `close()` (or `with Stream(...) as stream:`) stops the threads.
`all_processes_have(flag)`: True when every process passes True (a host allgather; no-op alone).

How a batch is drawn: fixed-length rows enter a pool of `shuffle_buffer_size + batch_size` rows;
once it is full, each batch takes `batch_size` distinct random rows of it (numpy Generator seeded by
(seed, process index, pass - 1): each pass is reshuffled, the same way in every run) and the next
rows of the stream take their places. When the source runs dry the pool drains in random order;
the rows left, fewer than `batch_size`, are dropped (as an in-memory epoch drops its remainder), and
the next pass starts with an empty pool. `shuffle_buffer_size=0` gives the rows in stream order.
A hub dataset is read in its own order every pass (it is not shuffled by `datasets`, so
`set_epoch` would change nothing): the pool's per-pass seed is the reshuffle.

Passes: a pass ends when one process runs out of its rows (`agree`, below); every process then
starts the next one at the same step, logging "pass N of the training stream starts at step S".
A pass that gives not one batch is a UsageError (never an endless loop of empty passes).

Grouping: the stream encodes each run of `encoder.group_size` texts that `encoder.keeps` on its own
(this process's texts); for `tasks.lm.Blocks` the rows equal the in-memory path's (see there).

Exact resume
------------
`stream.state_after(n)` -> {"meta": JSON-able dict, "arrays": {column: int32 [shuffle_buffer_size +
batch_size, length]}} is the stream after its first n batches: the source position of the group of
texts being read and how many of its rows were taken, the pool (its first meta["size"] rows count,
the rest are zeros), the RNG state, the batch count, the pass and the steps before it.
`Stream(..., state=saved)` continues exactly as the uninterrupted stream would have (shuffling and
passes included); it refuses (UsageError) a state made with other settings (source, encoder, batch
size, shuffle size, seed, process index and count, the held-out `start`). The
arrays have a shape known from the flags (`state_template()`), so they can be one more item of the
orbax checkpoint, restored into a template. Saving copies the pool (~20 MB for 10,000 blocks of 512
tokens) and nothing else.
- n may be any of the last `HISTORY` + 1 batches handed out, not only the last one: a caller that
  prefetches k batches onto the devices saves step s with `state_after(s)` although it has taken
  s + k batches (the stream undoes its later pool changes on the copy, a new pass's included: the
  pool is copied once a pass for that, while the steps before the pass can still be asked for).
- With several processes every process has its own state: each saves its own (orbax writes only
  process 0's host arrays and JSON: gather them with a host allgather, they have one shape on every
  process, or write one item per process) and resumes from its own.
- What a resume re-reads: local uncompressed files are opened at the saved byte offset (a seek: the
  consumed part is never read again), plus the one group of texts being read at the save (at most
  `encoder.group_size` texts, re-tokenized). Compressed files cannot seek: the file being read is
  decompressed from its start up to the offset (not parsed, not tokenized: 0.14 s more for 71 MB of
  gzipped text in benchmarks/data.py), the files before it are skipped. `DatasetSource` (hub data)
  resumes with datasets' `IterableDataset.load_state_dict`, which skips the shards (files) already
  read but regenerates and discards the examples before the saved one inside the current shard
  (datasets 5.0.1: `ExamplesIterable.__iter__` islices the shard's generator from its start,
  `ArrowExamplesIterable` reads and drops its tables): the consumed part of the current shard is
  downloaded and parsed again, not tokenized.
- The held-out eval rows (`stream_examples.eval_set`) are not in the state: rebuild them on resume
  (they are the first rows of the stream, cheap to read) and pass the same `start` (every later
  pass begins there).

Multi-host
----------
Each process reads its own rows (`utils.data.text_sources`) and makes its own batches; every `next()` asks
`agree(has_batch)` (default `all_processes_have`, a tiny allgather in the consumer's thread), so all
processes end a pass at the same step as soon as one runs dry, dropping the others' last batches of
it (the next pass, or the end after `max_passes`). When do 2 processes x 4 devices see the same
global batches (as sets of rows per step) as 1 x 8? (The answers hold for every pass: one process's
pass has floor(N / B) batches, and so has the process with the fewest rows.)
- One example per row (`tasks.lm.Lines`), `shuffle_buffer_size=0`, no blank rows, a `FileSource` (or a
  `DatasetSource` whose shard count is not a multiple of the process count, which datasets splits by
  examples too): yes. Process p's i-th row is global row i * P + p, so the P local batches of step s
  hold exactly global rows [s * B, (s + 1) * B) (B the global batch), as one process's batch s does;
  only their order within the global batch differs (and MLM masks, drawn per process).
- Blank rows: no (they are dropped per process after the split, so the processes' rows shift).
- Blocks: no. Each process concatenates its own texts, so a block mixes other texts.
- Shuffling: no. Each process has its own pool and RNG (seeded with its index).
- `DatasetSource` with a shard count that is a multiple of the process count: no (each process
  reads whole shards of its own).
"""

import collections
import contextlib
import copy
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.experimental import multihost_utils

from utils.base.errors import UsageError
from utils.data.text_sources import groups_of_texts

STATE_VERSION = 2  # 2: passes (the pass, its first step, the start of every pass)
# Steps before the last one handed out that `state_after` can still describe: covers a caller's prefetch.
HISTORY = 16
logger = logging.getLogger(__name__)


def all_processes_have(flag):
    """Whether every process passed a true `flag` (call it on every process at the same point)."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.all(multihost_utils.process_allgather(np.int32(bool(flag)))))


class _Batch:
    def __init__(self, pass_, event, batch):
        self.pass_, self.event, self.batch = pass_, event, batch


class _PassEnd:
    def __init__(self, pass_):
        self.pass_ = pass_


class _Failed:
    def __init__(self, error):
        self.error = error


def _first_difference(saved, current, where=""):
    """(key path, saved value, current value) of the first difference of two JSON values, or None."""
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            found = _first_difference(saved.get(key), current.get(key), f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    return None if saved == current else (where, saved, current)


# What a resume refused for a setting must change back (the settings' own flags otherwise).
_SETTING_HINTS = {"start": " (the rows held out for evaluation: --do_eval, --max_eval_samples, --validation_file)"}


class Stream:
    """This process's host batches of a streamed source, pass after pass; see the module docstring."""

    def __init__(self, source, encoder, batch_size, shuffle_buffer_size=10000, seed=0, workers=1, state=None,
                 start=None, transform=None, queue_size=8, agree=all_processes_have, max_passes=1):
        if batch_size <= 0 or shuffle_buffer_size < 0 or workers <= 0 or (max_passes is not None and max_passes < 1):
            raise ValueError(f"batch_size {batch_size}, workers {workers} and max_passes {max_passes} must be "
                             f"positive, shuffle_buffer_size {shuffle_buffer_size} not negative")
        self.source, self.encoder, self.batch_size = source, encoder, batch_size
        self.shuffle_buffer_size, self.workers = shuffle_buffer_size, workers
        self.transform, self.agree, self.max_passes = transform, agree, max_passes
        self.seed = seed
        self._start = (start["source"], start["taken"]) if start else (source.start(), 0)
        self.settings = {"source": source.describe(), "encoder": encoder.describe(), "batch_size": batch_size,
                         "shuffle_buffer_size": shuffle_buffer_size, "seed": seed, "start": start}
        capacity = shuffle_buffer_size + batch_size
        self._pool = {name: np.zeros((capacity, encoder.width), np.int32) for name in encoder.columns}
        # Producer (the pass it reads and its place in it) and consumer (steps handed out, the pass
        # all processes are in and the steps before it) start where the state says, else at pass 1.
        self._begin_pass(1)
        self._step, self._pass, self._first = 0, 1, 0
        if state is not None:
            self._load(state)
        self._meta = self._snapshot(*self._group)
        # Undo entries of the producer's events (batches drawn, passes begun), numbered from 1, and
        # the event after which each recent step's batch came: `state_after` undoes the later ones.
        self._events, self._history = 0, collections.deque()
        self._steps = collections.deque([(self._step, 0, self._first)], maxlen=HISTORY + 1)
        self._lock, self._local = threading.Lock(), threading.local()
        self._entered = threading.Condition()  # the consumer entered a pass: its first step is known
        self._queue, self._stop = queue.Queue(maxsize=queue_size), threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, name="stream", daemon=True)
        self._thread.start()

    # --- state ---------------------------------------------------------------------------------
    def state_template(self):
        """{column: (shape, dtype)} of the state's arrays (e.g. for an orbax restore template)."""
        return {name: (pool.shape, pool.dtype) for name, pool in self._pool.items()}

    def _begin_pass(self, number):
        """The producer at the start of pass `number`: an empty pool, the source at `start`, the
        pass's own RNG (a pure function of the seed, the process and the pass)."""
        self._reading, self._size, self._exhausted = number, 0, False
        self._group = self._start
        # Pass 1's RNG is [seed, process]'s (trailing zeros do not change a numpy SeedSequence).
        self._rng = np.random.default_rng([self.seed, self.source.process_index, number - 1])

    def _snapshot(self, position, taken):
        return {"version": STATE_VERSION, "settings": self.settings, "pass": self._reading, "source": position,
                "taken": taken, "size": self._size, "exhausted": self._exhausted,
                "rng": self._rng.bit_generator.state}

    def _load(self, state):
        meta, arrays = state["meta"], state["arrays"]
        if meta.get("version") != STATE_VERSION:
            raise UsageError(f"cannot resume the data stream: its state has version {meta.get('version')}, this "
                             f"code reads version {STATE_VERSION}")
        difference = _first_difference(meta["settings"], self.settings)
        if difference:
            key, saved, current = difference
            raise UsageError(f"cannot resume the data stream: {key} is {saved!r} in the checkpoint but {current!r} "
                             f"in this run{_SETTING_HINTS.get(key.split('.')[0], '')}; resume with the same data "
                             "settings")
        for name, pool in self._pool.items():
            pool[...] = arrays[name]
        self._reading, self._size, self._exhausted = meta["pass"], meta["size"], meta["exhausted"]
        self._rng.bit_generator.state = meta["rng"]
        self._group = (meta["source"], meta["taken"])
        self._step, self._pass, self._first = meta["batches"], meta["pass"], meta["first"]

    def state_after(self, batches):
        """The state after the first `batches` batches (counted from the start of training): one of
        the last `HISTORY` + 1 handed out (a caller may have taken some more ahead)."""
        with self._lock:
            found = [entry for entry in self._steps if entry[0] == batches]
            if not found:
                raise ValueError(f"the stream can describe batches {self._steps[0][0]} to {self._steps[-1][0]}, "
                                 f"not {batches}")
            _, event, first = found[0]
            meta = self._meta
            undo = [entry for entry in self._history if entry[0] > event]
            pool = {name: rows.copy() for name, rows in self._pool.items()}
        for _, meta_before, kept, rows_before in reversed(undo):
            for name in pool:
                pool[name][kept] = rows_before[name]
            meta = meta_before
        for rows in pool.values():
            rows[meta["size"]:] = 0
        return {"meta": {**copy.deepcopy(meta), "batches": batches, "first": first}, "arrays": pool}

    def _record(self, kept):
        """Log how to undo the event about to change the pool rows `kept` (call with the lock held)."""
        self._events += 1
        self._history.append((self._events, self._meta, kept,
                              {name: pool[kept].copy() for name, pool in self._pool.items()}))
        return self._events

    # --- producer (background thread) ----------------------------------------------------------
    def _encode(self, texts):
        if not hasattr(self._local, "encoder"):  # tokenizers are not safe to share between threads
            self._local.encoder = self.encoder.copy()
        return self._local.encoder(texts)

    def _encoded_groups(self):
        """(position before, rows) of each group of texts from the group being read on, tokenized by
        `workers` threads, in order (none once the source was read to its end)."""
        if self._exhausted:
            return
        reader = self.source.open(self._group[0])
        groups, pending = groups_of_texts(reader, self.encoder), collections.deque()
        with ThreadPoolExecutor(self.workers, thread_name_prefix="stream-tokenizer") as pool:
            for position, texts in groups:
                pending.append((position, pool.submit(self._encode, texts)))
                if len(pending) > self.workers:
                    position, future = pending.popleft()
                    yield position, future.result()
                if self._stop.is_set() or self._pass > self._reading:
                    return
            for position, future in pending:
                yield position, future.result()

    def _draw(self):
        """(event, batch) of each batch of the pass being read, until it drains or the consumer
        leaves it, changing the pool in place and logging how to undo it."""
        columns = self.encoder.columns
        capacity = len(self._pool[columns[0]])
        position, used = self._group
        skip = used  # rows of the first group read (the one at `position`) taken before
        rows = None
        groups = self._encoded_groups()
        try:
            while self._pass <= self._reading:  # until the consumer leaves this pass (its rest would be dropped)
                size_before = size = self._size
                while size < capacity and not self._exhausted:
                    if rows is None or used == len(rows[columns[0]]):
                        group = next(groups, None)
                        if group is None:
                            self._exhausted = True
                            break
                        (position, rows), used, skip = group, skip, 0
                        continue
                    count = min(capacity - size, len(rows[columns[0]]) - used)
                    for name in columns:
                        self._pool[name][size: size + count] = rows[name][used: used + count]
                    size, used = size + count, used + count
                if size < self.batch_size:  # the pass is over: fewer rows than a batch are left (dropped)
                    return
                if self.shuffle_buffer_size:
                    chosen = self._rng.choice(size, self.batch_size, replace=False)
                else:
                    chosen = np.arange(self.batch_size)
                batch = {name: self._pool[name][chosen] for name in columns}
                # The rows left fill the chosen places below the new size; the pool stays contiguous.
                remaining = size - self.batch_size
                holes = chosen[chosen < remaining]
                movers = np.setdiff1d(np.arange(remaining, size), chosen, assume_unique=True)
                with self._lock:
                    event = self._record(holes[holes < size_before])  # rows of the pool before this batch that change
                    for name in columns:
                        self._pool[name][holes] = self._pool[name][movers]
                    self._size = remaining
                    self._meta = self._snapshot(position, used)
                yield event, batch
        finally:
            groups.close()

    def _next_pass(self):
        """Begin the next pass. The whole pool is logged for undo: the new pass's rows overwrite rows
        that the states of the last pass still hold."""
        with self._lock:
            self._record(np.arange(len(self._pool[self.encoder.columns[0]])))
            self._begin_pass(self._reading + 1)
            self._meta = self._snapshot(*self._group)

    def _first_step_of(self, pass_):
        """The step index of pass `pass_`'s first batch, once the consumer has entered that pass
        (every process ended the one before at the same step); None when the stream stops."""
        with self._entered:
            while self._pass < pass_ and not self._stop.is_set():
                self._entered.wait(0.1)
            return self._first if self._pass == pass_ else None

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self):
        index = self._step  # of the next batch, for `transform`; None until the consumer enters a new pass
        try:
            while True:
                with contextlib.closing(self._draw()) as draws:  # closing it stops the tokenizer threads
                    for event, batch in draws:
                        if index is None:
                            index = self._first_step_of(self._reading)
                            if index is None:
                                return
                        if self.transform:
                            batch = self.transform(batch, index)
                        if not self._put(_Batch(self._reading, event, batch)):
                            return
                        index += 1
                if not self._put(_PassEnd(self._reading)) or self._reading == self.max_passes:
                    return
                self._next_pass()
                index = None
        except BaseException as error:  # raised again in the consumer's thread
            self._put(_Failed(error))

    # --- consumer ------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        while not self._finished:
            item = self._queue.get()
            if isinstance(item, _Failed):
                self.close()
                raise item.error
            if item.pass_ < self._pass:
                continue  # the rest of a pass that another process's end of data ended
            if self.agree(isinstance(item, _Batch)):
                return self._hand_out(item)
            # A process ran out of this pass's rows: every process ends the pass at this step.
            if self._step == self._first:
                self.close()
                raise UsageError(f"the training data gives no batch in pass {self._pass}: a process has fewer than "
                                 f"{self.batch_size} examples (its rows of a global batch): add data or lower the "
                                 "batch size")
            if self._pass == self.max_passes:
                logger.info("pass %d of the training stream ended at step %d, the last of --max_stream_passes %d",
                            self._pass, self._step, self.max_passes)
                break
            with self._entered:
                self._pass, self._first = self._pass + 1, self._step
                self._entered.notify_all()
            logger.info("pass %d of the training stream starts at step %d", self._pass, self._step + 1)
        self.close()
        raise StopIteration

    def _hand_out(self, item):
        self._step += 1
        with self._lock:
            self._steps.append((self._step, item.event, self._first))
            while self._history and self._history[0][0] <= self._steps[0][1]:
                self._history.popleft()  # no state `state_after` can still be asked for needs it
        return item.batch

    def close(self):
        """Stop reading (the threads end after the group they are on). Safe to call again."""
        self._finished = True
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
