"""Ray Data as the upstream of an EchoLoader.

A Ray ``Dataset``, or the ``DataIterator`` that ``ray.train.get_dataset_shard``
returns on each training worker, is read in the training process: the
preprocessing runs on the Ray cluster, and echoing happens next to the
accelerator. Each epoch iterates the dataset again. Ray's row order is not
deterministic unless the dataset's ``DataContext.execution_options.preserve_order``
is set.

Reading: ``iter_batches(batch_size=None, batch_format="numpy",
prefetch_batches=1)``, the call ``iter_rows`` makes itself. ``batch_size=None``
takes Ray's blocks as they are: no re-batching (which slices every block, and
copies the rows of a batch that spans two), one NumPy conversion per block
(zero-copy for numbers and tensors without missing values). A block is at most
Ray's ``DataContext.target_max_block_size`` (128 MiB by default), and already
sits in Ray's object store; one is read ahead, while the current one is put.

Without ``transform``, each block goes into the echo buffer as it is: one
native put per block, its rows gathered from its NumPy columns without the GIL,
and no per-row Python object (:class:`RowBlock`, taken by dataecho.reading.chunking).
The first few rows, which tell the examples' structure, a ``transform``, and a
resumed epoch (which drops the rows taken before) see rows.

Memory: a block's rows are copied into the echo buffer, never held by
reference (dataecho.native.hold): holding a row would keep its whole
block alive, in Ray's object store, until the last echo of the last of its
rows. A row is a view into its block, so a ``transform`` that returns it as it
is gets it copied too.

Rows are dicts of column values, as ``iter_rows`` gives them, so batches are
dicts of stacked columns: a number is a Python ``int``, ``float`` or ``bool``
(NumPy's ``tolist``), a string ``str``, bytes ``bytes``, a tensor a read-only
NumPy array over the block. Two kinds of column differ from ``iter_rows``:

* a column of Arrow lists is a NumPy array per row, not a Python ``list``: a
  list column of one length is then one leaf, batched ``(batch, length)``, not
  a list of ``length`` leaves; one whose length varies is ragged either way;
* a missing value is what Ray's NumPy conversion makes of it (``nan`` in a
  number column, where ``iter_rows`` gives ``None``).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..examples.blocks import RowBlock

__all__ = ["RayRows", "RowIterator", "is_ray_data"]

def is_ray_data(source: Any) -> bool:
    """A Ray Data Dataset or DataIterator (without importing ray)."""
    return type(source).__module__.startswith("ray.data") and callable(getattr(source, "iter_batches", None))


class RayRows:
    """An iterable over the rows of a Ray Dataset or DataIterator, whose
    iterators also hand them out a block at a time (:class:`RowIterator`).

    Args:
        data: a Ray ``Dataset`` or ``DataIterator``.
        batch_size: rows per NumPy batch; None: Ray's blocks as they are.
        prefetch_batches: batches Ray reads ahead.
    """

    fixed_order = False  # Ray may hand out the rows in another order at each read (see in_fixed_order)

    def __init__(self, data: Any, batch_size: int | None = None, prefetch_batches: int = 1) -> None:
        self.data = data
        self.batch_size, self.prefetch_batches = batch_size, prefetch_batches

    def __iter__(self) -> RowIterator:
        return RowIterator(iter(self.data.iter_batches(
            batch_size=self.batch_size, batch_format="numpy", prefetch_batches=self.prefetch_batches)))

    def __repr__(self) -> str:
        return f"RayRows({type(self.data).__name__})"


class RowIterator:
    """The rows of an epoch, one at a time; ``blocks()`` hands out the rest
    (what ``next`` has not taken) a :class:`RowBlock` at a time.

    Args:
        batches: Ray's NumPy batches (dicts of column arrays).
    """

    def __init__(self, batches: Iterator[dict[str, np.ndarray]]) -> None:
        self._batches = batches
        self._block: RowBlock | None = None  # the block next() reads from
        self._rows: Iterator[dict[str, Any]] = iter(())
        self._taken = 0  # rows of _block next() returned

    def __iter__(self) -> RowIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        while True:
            row = next(self._rows, None)  # rows are dicts, never None
            if row is not None:
                self._taken += 1
                return row
            self._block, self._taken = RowBlock(next(self._batches)), 0
            self._rows = iter(self._block)

    def blocks(self) -> Iterator[RowBlock]:
        """The rows not yet taken, a block at a time (none empty)."""
        if self._block is not None and self._taken < len(self._block):
            yield self._block.after(self._taken)
        self._block, self._rows = None, iter(())
        for batch in self._batches:
            block = RowBlock(batch)
            if len(block):
                yield block
