"""Iterable sources that can restart part-way: the hook that lets a resumed
epoch read an iterable again from near where its state stood rather than from
its start (dataecho.reading.source.EpochSource.keep).

An iterable is *restartable* when, besides ``__iter__``, it has:

    state_of(iterator)   the state of one of its iterators before its next
                         example: a value that later reading does not change
    iter_from(state)     an iterator that goes on from such a state

(Grain's ``DatasetIterator.get_state``/``set_state`` and torchdata's
``state_dict``/``reset`` are of this kind: dataecho.echo_step adapts them.) So
is an iterable torch's ``StatefulDataLoader`` resumes: one whose iterators, or
which itself, have ``state_dict()`` and ``load_state_dict(state)``
(:class:`StatefulIterable` adapts it: its state is taken before each chunk,
and a resume loads it and iterates anew).
While an epoch reads one, the reading thread records its state before each
chunk it takes (:class:`Marks`: position -> state). A checkpoint saves the
latest mark at or before the earliest position it names, and a resume restarts
the iterable there and reads on up to where the state stood. The consumer's
thread drops the marks that no state can need any more.
"""

from __future__ import annotations

import bisect
import copy
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, runtime_checkable

__all__ = ["Mark", "Marks", "Restartable", "StatefulIterable", "is_restartable", "restart_hooks"]

_FEW = 64  # marks kept before the first pruning: with 64-example chunks, a 4,096-example buffer's worth


@runtime_checkable
class Restartable(Protocol):
    """An iterable whose iteration can say where it stands, and go on from there."""

    def __iter__(self) -> Iterator[Any]: ...

    def state_of(self, iterator: Iterator[Any]) -> Any:
        """The state of ``iterator`` (one of this iterable's) before its next example."""
        ...

    def iter_from(self, state: Any) -> Iterator[Any]:
        """An iterator that yields what an iterator in ``state`` would have yielded next."""
        ...


def is_restartable(source: Any) -> bool:
    """Whether ``source`` is an iterable that can restart part-way (see the module docstring)."""
    return restart_hooks(source) is not None


def restart_hooks(source: Any) -> Restartable | None:
    """What restarts ``source`` part-way: itself, its torch-style state as a
    :class:`StatefulIterable`, or None where it cannot."""
    if isinstance(source, Restartable):
        return source
    kind = type(source)
    if hasattr(kind, "__iter__") and hasattr(kind, "state_dict") and hasattr(kind, "load_state_dict") \
            and not hasattr(kind, "__getitem__"):
        return StatefulIterable(source)
    return None


class StatefulIterable:
    """An iterable as torch's ``StatefulDataLoader`` resumes it, as a
    :class:`Restartable`: its iterator's ``state_dict()`` where the iterator
    has one, else the iterable's own (which then says where its iteration
    stands); a resume loads that state, into a new iterator or into the
    iterable before a new ``iter()``. The states go into the loader's state as
    plain values: dicts, lists, numbers and strings (arrays come back as lists)."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable)

    def state_of(self, iterator: Iterator[Any]) -> Any:
        # A copy: a state_dict() may hand out the dict its owner goes on changing.
        if hasattr(iterator, "state_dict"):
            return {"iterator": copy.deepcopy(iterator.state_dict())}
        return {"iterable": copy.deepcopy(self.iterable.state_dict())}

    def iter_from(self, state: Any) -> Iterator[Any]:
        if "iterator" in state:
            iterator = iter(self.iterable)
            iterator.load_state_dict(state["iterator"])
            return iterator
        self.iterable.load_state_dict(state["iterable"])
        return iter(self.iterable)


@dataclass(frozen=True)
class Mark:
    """A restartable iterable's ``state`` before the example at ``position`` of an epoch's iteration."""

    position: int
    state: Any


class Marks:
    """The marks of one epoch's iteration, oldest first.

    Added by the one thread that reads the iterable; looked up and pruned by
    the consumer's thread, as it takes a state. The lock keeps the two lists
    whole between them.

    Memory: the marks since the latest one at or before the earliest position
    a state named when last pruned, and at most as many again until the next
    pruning (:attr:`crowded` says when).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._positions: list[int] = []  # rising
        self._states: list[Any] = []
        self._limit = _FEW

    def add(self, position: int, state: Any) -> None:
        """The iterable's ``state`` before ``position`` (positions rise; a repeated one is ignored)."""
        with self._lock:
            if not self._positions or position > self._positions[-1]:
                self._positions.append(position)
                self._states.append(state)

    @property
    def crowded(self) -> bool:
        """More marks than the last pruning left, twice over: time to prune again."""
        return len(self._positions) > self._limit

    def at_or_before(self, position: int) -> Mark | None:
        """The latest mark at or before ``position``, or None (none recorded that early)."""
        with self._lock:
            i = bisect.bisect_right(self._positions, position) - 1
            return Mark(self._positions[i], self._states[i]) if i >= 0 else None

    def forget_before(self, position: int) -> None:
        """Drops the marks that a state naming no position before ``position``
        cannot need: every one before the latest at or before it."""
        with self._lock:
            i = bisect.bisect_right(self._positions, position) - 1
            if i > 0:
                del self._positions[:i], self._states[:i]
            self._limit = max(_FEW, 2 * len(self._positions))

    def __len__(self) -> int:
        return len(self._positions)
