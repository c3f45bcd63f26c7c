"""The reading order a ``sampler`` gives, as DataLoader reads it.

A sampler with ``__len__`` is read once per epoch, at its start, for
``len(sampler)`` indices (so a sampler that would yield for ever gives one
epoch of them, as ``len(loader)`` says). A sampler without ``__len__`` (a
stream, a sampler that samples for ever) is read lazily, a block of indices at
a time as the workers claim positions (:class:`LazyOrder`), never all at once.
Every index is checked as it is read: an integral number (``int``, a NumPy or
0-d torch integer) within the dataset, else a ``TypeError`` or ``IndexError``
naming ``sampler``; nothing is coerced.

A ``batch_sampler``'s batches (lists of indices) are read whole at the
epoch's start (:func:`batched_order`): one flat order and where each batch
starts in it, checked the same way, the errors naming ``batch_sampler``.

Each also says where a stateful sampler stood once its indices were read
(dataecho.reading.stateful), for a state to save beside the order.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Iterable
from typing import Any, Iterator

import numpy as np

from .stateful import sampler_state

__all__ = ["LazyOrder", "batched_order", "checked_indices", "sampled_order"]

_BLOCK = 1024  # indices read from a lazy sampler at a time


def sampled_order(sampler: Any, length: int) -> tuple[np.ndarray | LazyOrder, dict[str, Any] | None]:
    """The indices ``sampler`` yields for one epoch, checked against a dataset
    of ``length`` examples: all of them where it has a length, else lazily;
    and where a stateful sampler stood once they were read (a LazyOrder says
    it as it is saved: :meth:`LazyOrder.saved`)."""
    iterator = iter(sampler)
    if not hasattr(sampler, "__len__"):
        return LazyOrder(iterator, length, sampler=sampler), None
    order = checked_indices(itertools.islice(iterator, len(sampler)), length)
    return order, sampler_state(sampler, iterator)


def batched_order(batch_sampler: Any, length: int) -> tuple[np.ndarray, np.ndarray, dict[str, Any] | None]:
    """The batches ``batch_sampler`` yields for one epoch, read once (its first
    ``len(batch_sampler)`` where it has a length, else to its end), checked
    against a dataset of ``length`` examples.

    Returns:
        (order, bounds, state): every batch's indices one after another, where
        each batch starts (batch ``i`` is ``order[bounds[i]:bounds[i + 1]]``),
        and where a stateful batch sampler stood once they were read.

    Raises:
        TypeError: a batch that is not an iterable of indices, or an item that
            is not an integral number.
        IndexError: an index outside the dataset.
        ValueError: an empty batch.
    """
    iterator = iter(batch_sampler)
    batches = itertools.islice(iterator, len(batch_sampler)) if hasattr(batch_sampler, "__len__") else iterator
    parts, bounds = [], [0]
    for number, batch in enumerate(batches):
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Iterable):
            raise TypeError(f"batch_sampler: expected it to yield lists of int indices, got {batch!r} "
                            f"({type(batch).__name__}) as batch {number}")
        indices = checked_indices(iter(batch), length, name="batch_sampler")
        if not len(indices):
            raise ValueError(f"batch_sampler: batch {number} is empty; a batch holds at least one index "
                             f"(as DataLoader needs)")
        parts.append(indices)
        bounds.append(bounds[-1] + len(indices))
    order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return order, np.asarray(bounds, dtype=np.int64), sampler_state(batch_sampler, iterator)


def checked_indices(items: Iterator[Any], length: int, limit: int = -1, name: str = "sampler") -> np.ndarray:
    """Up to ``limit`` items (all for -1) as int64 indices of a dataset of ``length`` examples.

    Raises:
        TypeError: an item that is not an integral number (naming ``name``, the argument that yielded it).
        IndexError: an index outside the dataset.
    """
    if limit >= 0:
        items = itertools.islice(items, limit)
    return np.fromiter((_index(item, length, name) for item in items), dtype=np.int64)


def _index(item: Any, length: int, name: str) -> int:
    try:
        index = operator.index(item)
    except TypeError:
        if name == "sampler" and (isinstance(item, (list, tuple)) or getattr(item, "ndim", 0) == 1):
            raise TypeError(
                f"{name}: yields lists of indices ({item!r}): DataLoader's bulk loading (batch_size=None, each "
                f"list handed to __getitem__) is not read that way here, where every example is one index; pass "
                f"it as batch_sampler= instead (each list is a batch, read in one call where the dataset has "
                f"__getitems__)") from None
        raise TypeError(f"{name}: expected it to yield int indices, got {item!r} ({type(item).__name__})") from None
    if not 0 <= index < length:
        raise IndexError(f"{name}: yielded index {index}, outside the dataset's {length} examples")
    return index


class LazyOrder:
    """The order of a sampler without ``__len__``, read as positions are needed.

    Indexing by an int or a slice reads the sampler up to there (a slice past
    the end is cut short); indexing by an array of positions looks only at what
    was read. Thread-safe: the workers claim positions concurrently.

    Args:
        iterator: the sampler's iterator for this epoch.
        length: the dataset's length (indices are checked against it).
        prefix: indices already known for the first positions (a resume), or None.
        sampler: the sampler, where its state is saved with the indices read
            (:meth:`saved`); None where ``iterator`` is not its own.
    """

    def __init__(self, iterator: Iterator[Any], length: int, prefix: np.ndarray | None = None,
                 sampler: Any = None) -> None:
        self._iterator, self._length, self._sampler = iterator, length, sampler
        self._values = np.zeros(_BLOCK, dtype=np.int64) if prefix is None else np.array(prefix, dtype=np.int64)
        self._count = 0 if prefix is None else len(prefix)
        self._ended = False
        self._lock = threading.Lock()

    @property
    def read(self) -> np.ndarray:
        """The indices read so far (a view)."""
        return self._values[:self._count]

    def saved(self) -> tuple[np.ndarray, dict[str, Any] | None]:
        """The indices read so far (a copy), and where a stateful sampler stood
        after them: the two taken at once, as the workers go on reading."""
        with self._lock:
            state = None if self._sampler is None else sampler_state(self._sampler, self._iterator)
            return self.read.copy(), state

    def available(self, count: int) -> int:
        """Reads up to ``count`` positions; how many there are (fewer at the end)."""
        self._extend(count)
        return min(count, self._count)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            self._extend(key.stop if key.stop is not None else -1)
            return self.read[key]
        if isinstance(key, (int, np.integer)):
            self._extend(int(key) + 1)
            if key >= self._count:
                raise IndexError(f"position {key}: the sampler ended after {self._count} indices")
            return self._values[key]
        return self.read[key]

    def _extend(self, end: int) -> None:
        """Reads the sampler until ``end`` positions are known (-1: to its end)."""
        with self._lock:
            while (end < 0 or self._count < end) and not self._ended:
                block = checked_indices(self._iterator, self._length, _BLOCK)
                if len(block) < _BLOCK:
                    self._ended = True
                if self._count + len(block) > len(self._values):
                    grown = np.zeros(max(2 * len(self._values), self._count + len(block)), dtype=np.int64)
                    grown[:self._count] = self._values[:self._count]
                    self._values = grown
                self._values[self._count:self._count + len(block)] = block
                self._count += len(block)
