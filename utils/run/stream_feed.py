"""A streamed run's data as the training loop takes it (`--streaming`): `StreamedData`."""

import itertools

import jax
import numpy as np

from utils.data.stream import Stream
from utils.data.stream_head import check_one_batch, eval_set
from utils.data.text_sources import open_sources

DEFAULT_EVAL_EXAMPLES = 10000


class StreamedData:
    """`--streaming`: the eval set (the validation data's first `--max_eval_samples` examples, else
    that many of the training stream's first, held out from training on every pass) and the
    training batches, read, tokenized and shuffled on the fly, pass after pass until `--max_steps`
    (or `--max_stream_passes`). The methods are those of `utils.run.loop.InMemoryData`; checkpoints keep
    the stream's state (`state_after`), a resumed run gets it back (`resume_from`).

    `encoder` is the task's (see `utils.data.stream`); `global_batch_size` the training batch over all
    processes, of which this process streams its share; `do_train` / `do_eval` the phases that run."""

    def __init__(self, data_args, encoder, global_batch_size, do_train, do_eval, cache_dir=None):
        self.data_args, self.encoder = data_args, encoder
        self.size = None  # a stream has no length
        self.sources = open_sources(data_args, jax.process_index(), jax.process_count(), cache_dir)
        self.eval_arrays, self._start = None, None
        if do_eval:
            limit = data_args.max_eval_samples or DEFAULT_EVAL_EXAMPLES
            self.eval_arrays, self._start = eval_set(self.sources["train"], encoder, limit,
                                                     self.sources.get("validation"), limit)
        # Process p reads rows p, p + P, ... of the stream (round robin): those are its rows' places in
        # the global batch, so an example's mask is the same on any number of processes.
        local = global_batch_size // jax.process_count()
        self._row_ids = np.arange(local) * jax.process_count() + jax.process_index()
        if do_train:
            check_one_batch(self.sources["train"], encoder, local, self._start, global_batch_size)
        self._state, self._stream = None, None

    def example_batch(self, global_batch_size, transform=None):
        batch = {name: np.zeros((len(self._row_ids), self.encoder.width), np.int32) for name in self.encoder.columns}
        return transform(batch, 0, self._row_ids) if transform else batch

    def batches(self, global_batch_size, seed, steps_per_epoch, start_step, total_steps, layout, transform=None):
        """This process's rows of each global batch from `start_step` on, placed by `layout`; fewer
        than `total_steps - start_step` when `--max_stream_passes` ends the stream first (every
        process stops at the same step)."""
        masked = None if transform is None else (lambda batch, step: transform(batch, step, self._row_ids))
        self._stream = Stream(self.sources["train"], self.encoder, len(self._row_ids),
                              self.data_args.shuffle_buffer_size, seed, self.data_args.preprocessing_num_workers or 1,
                              state=self._state, start=self._start, transform=masked,
                              max_passes=self.data_args.max_stream_passes)
        return layout.prefetch(itertools.islice(self._stream, total_steps - start_step))

    def state_template(self):
        """{column: (shape, dtype)} of the stream state's arrays (the shuffle pool) for this run."""
        rows = self.data_args.shuffle_buffer_size + len(self._row_ids)
        return {name: ((rows, self.encoder.width), np.dtype(np.int32)) for name in self.encoder.columns}

    def state_after(self, step):
        return self._stream.state_after(step)

    def resume_from(self, state):
        self._state = state
