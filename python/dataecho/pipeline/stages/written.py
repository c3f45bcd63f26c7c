"""Batches written in place: at echo 1, where a batch's examples are known
before any is read (the order's next ``batch_size`` positions), a dataset with
``read_into(index, out)`` writes each example straight into its row of the
batch, one copy in all, as an array source is copied once.

The batch memory comes from :class:`BatchBlocks`, which recycles a batch's
arrays only once nothing but the pool references them: the batch handed on,
its views, and the tensors or arrays made from them (they all hold a
reference) keep it out of use. A ``read_into`` that keeps ``out`` (or a view of
it) past its return is refused: it could change a batch already delivered.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import numpy as np

from ...examples.columns import ALONE, ref_counts
from ...examples.fields import Field
from ...examples.structure import Structure

__all__ = ["BatchBlocks", "blocks_for", "release", "writable", "written"]

_KEPT = 4  # sets of batch arrays a pool keeps for reuse (read ahead, handed on, held); more are made as needed

# Per loader (keyed by its echo-buffer memory, a _core.BlockCache, which lives as long as it), its pools:
# batch memory kept from one epoch to the next, as the echo buffer's is.
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def writable(structure: Structure) -> bool:
    """Whether ``read_into`` can write examples of ``structure``: NumPy arrays and numbers alone."""
    return all(kind == "array" for kind in structure.kinds) and not structure.has_raw


class BatchBlocks:
    """Memory for batches of ``fields``, ``batch_size`` rows each, reused once
    nothing holds a batch's arrays any more (see the module docstring).

    Thread-safe: every reading thread takes its batches here.
    """

    def __init__(self, fields: list[Field], batch_size: int) -> None:
        self._fields, self._batch_size = fields, batch_size
        self._sets: list[list[np.ndarray]] = []  # each array held by its set alone while idle
        self._lock = threading.Lock()

    def take(self) -> list[np.ndarray]:
        """One array per field, ``batch_size`` rows each, that nothing else holds."""
        with self._lock:
            for arrays in self._sets:
                if all(n == ALONE for n in ref_counts(arrays)):
                    return list(arrays)
            arrays = [np.empty((self._batch_size, *f.shape), dtype=f.dtype) for f in self._fields]
            if len(self._sets) < _KEPT:
                self._sets.append(arrays)
            return list(arrays)


def blocks_for(memory: Any, fields: list[Field], batch_size: int) -> BatchBlocks:
    """The batch memory of the loader whose echo-buffer memory is ``memory``
    (None: memory of its own) for batches of ``fields``, ``batch_size`` rows."""
    if memory is None:
        return BatchBlocks(fields, batch_size)
    key = (tuple((f.shape, f.dtype.str) for f in fields), batch_size)
    with _POOLS_LOCK:
        pools = _POOLS.setdefault(memory, {})
        if key not in pools:
            pools.clear()  # another structure or batch size: the old blocks are no longer used
            pools[key] = BatchBlocks(fields, batch_size)
        return pools[key]


def release(memory: Any) -> None:
    """Frees a loader's memory kept between epochs: ``memory`` (its echo
    buffer's) and the batch memory kept with it (arrays still in use live on)."""
    memory.clear()
    with _POOLS_LOCK:
        _POOLS.pop(memory, None)


def written(structure: Structure, blocks: BatchBlocks, indices: list[int],
            read_into: Callable[[int, Any], None]) -> list[np.ndarray]:
    """The examples at dataset ``indices`` written by ``read_into(index, out)``
    (the source's reader's, dataecho.reading.dataset) into the rows of one
    batch's arrays: its leaves, ``len(indices)`` rows each.

    Raises:
        ValueError: ``read_into`` kept ``out`` (or a view of it) after it returned.
    """
    arrays = [a[:len(indices)] for a in blocks.take()]
    owners = [a.base for a in arrays]  # the pool's arrays: every view of a row references its own
    for row, index in enumerate(indices):
        views = [a[row, ...] for a in arrays]  # 0-d arrays for numbers, views all
        before = ref_counts(owners)
        read_into(index, structure.unflatten(views))
        # Kept: `out` itself (a row view held elsewhere too), or a view made from it (one more on its owner).
        if any(n != ALONE for n in ref_counts(views)) or ref_counts(owners) != before:
            raise ValueError("read_into: kept its out array (or a view of it) after it returned; it must write "
                             "out's values and keep no reference to out")
    return arrays
