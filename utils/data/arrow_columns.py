"""Token columns read in place from the Arrow tables of the `datasets` cache (`to_arrays` -> `ArrowColumn`).

The cache files are memory-mapped, so the corpus is never copied into the process's memory; only the
rows of a batch are.
"""

import numpy as np
import pyarrow as pa


def to_arrays(dataset, columns):
    """{name: ArrowColumn} of columns (fixed-length number lists, or numbers) for fast row gathering.

    Nothing is copied: the columns are read where `datasets` keeps them (its memory-mapped cache
    files, several of them after a multi-process map), through the dataset's indices mapping when it
    has one (after `select`, `shuffle`, `filter`). Gathered rows of integer columns are int32, which
    is what JAX computes with anyway.
    """
    table = dataset.data.table
    # `_indices` is how `datasets` keeps a row selection without rewriting the table; reading through
    # it costs one lookup per gathered row, where `flatten_indices` would rewrite the whole corpus.
    mapping = dataset._indices
    indices = ArrowColumn(mapping.column(0), "indices") if mapping is not None else None
    return {name: ArrowColumn(table.column(name), name, indices) for name in columns}


def _root(buffer):
    while buffer.parent is not None:
        buffer = buffer.parent
    return buffer


class ArrowColumn:
    """One Arrow column of numbers or fixed-length number lists, gathered by row without copying it.

    Each chunk's values are located inside the buffer that holds them (for a memory-mapped cache file:
    the whole file), and the chunks of one buffer are read through one numpy view of it, so a
    gather costs one numpy indexing per buffer, not per chunk (a `datasets` cache has a chunk per
    1000 rows). Indexing (`column[rows]`, `column[a:b]`, `column[i]`) returns numpy rows; integers
    come back as int32. With `indices` (another ArrowColumn) row i is the table's row `indices[i]`.
    """

    def __init__(self, chunked, name, indices=None):
        self.name, self._indices = name, indices
        views, view_ids = [], {}
        starts, firsts, segments, widths = [0], [], [], set()
        for chunk in chunked.chunks:
            if not len(chunk):
                continue
            values, chunk_widths = self._values(chunk, name)
            widths.update(chunk_widths)
            itemsize = values.type.byte_width
            buffer = values.buffers()[1]
            root = _root(buffer)
            byte = buffer.address - root.address + values.offset * itemsize
            # One view per buffer (and alignment: a view's elements start where the values do).
            key = (root.address, root.size, byte % itemsize)
            if key not in view_ids:
                view_ids[key] = len(views)
                views.append(np.frombuffer(root, values.type.to_pandas_dtype(), count=(root.size - key[2]) // itemsize,
                                           offset=key[2]))
            segments.append(view_ids[key])
            firsts.append(byte // itemsize)
            starts.append(starts[-1] + len(chunk))
        if len(widths) > 1:
            shortest, longest = min(widths), max(widths)
            raise ValueError(f"column {name!r} holds sequences of {shortest} to {longest} items; pad them first")
        self.width = widths.pop() if widths else None
        stored = views[0].dtype if views else np.dtype(np.int32)
        self.dtype = np.dtype(np.int32) if np.issubdtype(stored, np.integer) else stored
        self._starts, self._firsts, self._segments = np.array(starts), np.array(firsts, np.int64), np.array(segments)
        # Row views: row k of `views[s]` holds the `width` values from element k on.
        self._views = [view if self.width is None else np.lib.stride_tricks.as_strided(
            view, (max(len(view) - self.width + 1, 0), self.width), (view.itemsize, view.itemsize), writeable=False)
            for view in views]
        self._table_rows = starts[-1]

    @staticmethod
    def _values(chunk, name):
        """(flat values, the row lengths found: {items per row}, or {None} for numbers) of one chunk, zero-copy."""
        kind = chunk.type
        if pa.types.is_fixed_size_list(kind):
            values, widths = chunk.flatten(), {kind.list_size}
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
            lengths = np.diff(np.asarray(chunk.offsets))
            values, widths = chunk.flatten(), {int(lengths.min()), int(lengths.max())}
        else:
            values, widths = chunk, {None}
        if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
            raise ValueError(f"column {name!r} holds {kind}: only numbers and fixed-length lists of numbers "
                             "become arrays")
        if chunk.null_count or values.null_count:
            raise ValueError(f"column {name!r} has missing values: fill or drop them first")
        return values, widths

    def __len__(self):
        return len(self._indices) if self._indices is not None else self._table_rows

    @property
    def shape(self):
        return (len(self),) if self.width is None else (len(self), self.width)

    @property
    def ndim(self):
        return len(self.shape)

    def _table_values(self, rows):
        """The values of table `rows` (int64, in range), in their stored dtype."""
        chunk = np.searchsorted(self._starts, rows, side="right") - 1
        first = self._firsts[chunk] + (rows - self._starts[chunk]) * (self.width or 1)
        segments = self._segments[chunk]
        if len(self._views) == 1:
            return self._views[0][first]
        out = np.empty((len(rows),) + self.shape[1:], self._views[0].dtype)
        for segment in np.unique(segments):
            where = segments == segment
            out[where] = self._views[segment][first[where]]
        return out

    def _take(self, rows):
        rows = np.asarray(rows, np.int64)
        if not rows.size:
            return np.empty((0,) + self.shape[1:], self.dtype)
        if rows.min() < 0 or rows.max() >= len(self):
            raise IndexError(f"rows {rows.min()}..{rows.max()} of column {self.name!r}, which has {len(self)}")
        if self._indices is not None:
            rows = self._indices._table_values(rows).astype(np.int64)
        return self._table_values(rows)

    def __getitem__(self, key):
        if isinstance(key, slice):
            rows = np.arange(*key.indices(len(self)))
        elif isinstance(key, (int, np.integer)):
            return self[np.array([key])][0]
        else:
            rows = np.asarray(key)
            if rows.dtype == bool:
                rows = np.flatnonzero(rows)
        rows = np.where(rows < 0, rows + len(self), rows)
        values = self._take(rows.reshape(-1)).astype(self.dtype, copy=False)
        return values.reshape(rows.shape + self.shape[1:])

    def __iter__(self):
        for start in range(0, len(self), 4096):
            yield from self[start: start + 4096]

    def __array__(self, dtype=None, copy=None):
        values = self[:]
        return values if dtype is None else values.astype(dtype, copy=False)
