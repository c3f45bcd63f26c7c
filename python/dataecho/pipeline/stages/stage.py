"""The stage protocol: what every step of an epoch's pipeline is.

An epoch of an ``EchoLoader`` is a short chain of stages, built by
:func:`dataecho.pipeline.chain.build_chain` in the order drawn in
dataecho.pipeline.plan, each pulling batches from the one before.

A stage hands on :class:`Batch` objects. Its state, for checkpoints, is a
small dict of numbers and arrays that names examples (by their position in
the epoch's order) instead of storing them; a stage restored from its state
re-reads what it needs. The epoch takes every stage's state at one point
between two batches, holding the chain's pull lock, which a stage thread holds
while it pulls from its upstream: no batch is then half-way between two stages,
and the states agree with each other.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ...errors import BufferClosed
from ...examples.structure import Structure

__all__ = ["COUNTERS", "Batch", "Replay", "Stage", "weakly"]

# Every counter a stage reports (Stage.counters), named here once; the chain
# refuses any other name, and the epoch and EchoLoader.stats() read them by these.
COUNTERS = {
    "fresh": "examples read from the source (the intake)",
    "starved": "batches whose order the ragged memory budget made depend on timing (a buffer's)",
    "memory": "the echo buffer's slots and ragged memory in use (the intake)",
    "workers": "per reader: examples produced, seconds busy, a process's pid (the intake)",
    "augmented": "rows taken to augment (augment, or device_augment: device echo)",
    "device_memory": "examples kept on the device, its rows and bytes, budget evicted (device echo)",
    "fresh_batches": "batches taken from upstream (batch echo)",
    "delivered_batches": "batches handed on, repeats included (batch echo)",
    "lockstep_repeats": "batches repeated while other ranks delivered theirs (lockstep)",
    "lockstep_wait_s": "seconds waiting for the ranks' agreements (lockstep)",
}


@dataclass
class Batch:
    """One batch on its way through the stages.

    Attributes:
        structure: the example structure the arrays are the leaves of.
        arrays: one stacked array per leaf (host), or tensors on a device.
        rows: each row's position in the epoch's reading order (its sequence
            number), where the chain keeps them for checkpoints; else None.
        deliveries: after ``augment``: each row's delivery number, the key of
            the random generator its augmentation was given; else None.
    """

    structure: Structure
    arrays: tuple[Any, ...]
    rows: np.ndarray | None = None
    deliveries: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrays[0])

    def ids(self) -> dict[str, np.ndarray] | None:
        """What names this batch's rows in a checkpoint, or None where nothing does."""
        if self.rows is None:
            return None
        ids = {"rows": np.asarray(self.rows, dtype=np.uint64)}
        if self.deliveries is not None:
            ids["deliveries"] = np.asarray(self.deliveries, dtype=np.uint64)
        return ids


class Replay:
    """The batches a state names on their way out of a stage (built, not yet
    taken downstream, when the state was taken): a resumed stage yields them
    first, each read again from what names it, and a state taken before they
    are all out names those left. (It holds no reader: a stage's own method
    held here would keep the stage, and its buffer, alive in a cycle.)

    Args:
        saved: what names each batch (``Batch.ids()``), in order; None for none.
    """

    def __init__(self, saved: list[dict[str, np.ndarray]] | None) -> None:
        self._left: deque[dict[str, np.ndarray]] = deque(saved or [])

    def __bool__(self) -> bool:
        return bool(self._left)

    def next(self, read: Callable[[dict[str, np.ndarray]], Batch]) -> Batch:
        """The next batch to replay (there is one: ``bool(replay)``), read (and
        worked) again by ``read`` from its ids."""
        return read(self._left.popleft())

    def saved(self) -> list[dict[str, np.ndarray]]:
        """What names the batches left, for a state."""
        return list(self._left)


class Stage(Protocol):
    """One step of an epoch's pipeline.

    Attributes:
        name: the stage's key in the epoch's state; unique within a chain.
        unresumable: None, or why the stage's state cannot be saved mid-epoch
            (then ``state()`` returns None). Fixed when the stage is built.
    """

    name: str
    unresumable: str | None

    def next(self, timeout_s: float | None = None) -> Batch:
        """The next batch. Raises StopIteration at the end of the epoch (or when
        the epoch was stopped), TimeoutError when ``timeout_s`` passes first."""

    def stop(self) -> None:
        """Stops the stage's threads and wakes whatever waits on it, at once.
        Idempotent; callable from any thread."""

    def join(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the stage's threads (and processes) to end."""

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Where the stage stands, for a checkpoint; None if it cannot say (see
        ``unresumable``). Called from the consumer's thread between batches,
        under the chain's pull lock; ``timeout_s``: how long it may wait for a
        batch being assembled (TimeoutError after), None: as long as it takes."""

    def counters(self) -> dict[str, Any]:
        """Counters for ``EchoLoader.stats()``, by the names in :data:`COUNTERS`."""


def weakly(method: Callable[..., Any], raise_if_gone: bool = False) -> Callable[..., Any]:
    """`method` for a stage's thread to call without keeping its object alive:
    an epoch nobody iterates is collected, and its finalizer stops the threads.
    Once the object is gone the call does nothing, or raises BufferClosed (the
    stage then ends quietly)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is not None:
            return bound(*args)
        if raise_if_gone:
            raise BufferClosed("the epoch has ended")
        return None

    return call
