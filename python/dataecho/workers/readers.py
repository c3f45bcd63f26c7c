"""Who reads an epoch's source into the echo buffer, behind one protocol.

A kind of reader is one module that exports a :class:`Kind`: how it starts
over a buffer, how it starts before one exists (reading the first examples,
from which the buffer's fields are learned: dataecho.workers.probe), and what
it asks of the buffer. dataecho.workers.reader_kinds lists the kinds; the
pipeline asks that list for a kind by the planner's ``WorkersSpec.kind`` and
never asks which kind it holds.

The kinds: ``"thread"`` (producer threads: dataecho.workers.thread_readers),
``"process"`` (worker processes: dataecho.workers.process_readers) and
``"inline"`` (the training loop's own thread, ``num_workers=0``:
dataecho.workers.inline_reader).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from ..examples.structure import Structure
from ..native.echo_buffer import NativeBuffer
from ..reading.source import EpochSource
from .failure import Failure
from .probe import Probe
from .resources import EpochResources
from .spec import WorkersSpec

__all__ = ["InBackground", "Kind", "Probing", "Readers", "Reading"]


class Readers(Protocol):
    """The readers of one epoch, filling one echo buffer.

    Attributes:
        grace_s: the least time :meth:`join` is given (worker processes are
            always reaped, however short the caller's wait).
    """

    grace_s: float

    def next_arrays(self, timeout_s: float | None) -> tuple[np.ndarray, ...]:
        """The buffer's next batch: readers in the background only wait for it;
        the inline reader reads in the caller's thread until one is made.

        Raises:
            TimeoutError: none within ``timeout_s``. StopIteration: the epoch ended.
        """

    def stop(self) -> None:
        """Asks the readers to stop; the caller aborts the buffer to release blocked puts."""

    def join(self, timeout_s: float) -> None:
        """Waits for the readers to end; no thread or process of theirs is left after it."""

    def counters(self) -> list[dict[str, Any]]:
        """Per reader: examples produced (``produced``), seconds busy (``busy_s``), and its ``pid`` if a process."""


class Probing(Readers, Protocol):
    """Readers started before the buffer exists, reading the first examples.

    Attributes:
        probe: where those examples arrive (dataecho.workers.probe).
        probed: map-style: the positions the probe reads (0 to this - 1).
    """

    probe: Probe
    probed: int

    def attach(self, buffer: NativeBuffer, structure: Structure) -> None:
        """The buffer, once the first examples told the structure: the readers
        put what they read, then read on into it."""


class InBackground:
    """What readers that run on their own (threads, processes) share: the loop
    only waits for the buffer's batches, and a stop sets their event and wakes
    a probe waiting for the first examples."""

    _buffer: NativeBuffer | None
    _stop: threading.Event
    probe: Probe | None

    def next_arrays(self, timeout_s: float | None) -> tuple[np.ndarray, ...]:
        return self._buffer.next_arrays(timeout_s)

    def stop(self) -> None:
        """Asks every reader to stop; the caller aborts the buffer to release blocked puts."""
        self._stop.set()
        if self.probe is not None:
            self.probe.stop()


@dataclass(frozen=True)
class Reading:
    """What every kind of reader starts from.

    Attributes:
        source: this epoch's view of the source.
        spec: how many readers, and the settings of the kind.
        failure, on_failure: where a reader's exception goes, and what stops the epoch.
        resources: the epoch's seeds and the loader's persistent workers.
    """

    source: EpochSource
    spec: WorkersSpec
    failure: Failure
    on_failure: Callable[[], None]
    resources: EpochResources


@dataclass(frozen=True)
class Kind:
    """One kind of reader.

    Attributes:
        start: ``start(reading, buffer, structure, first_seq, ready)`` starts
            reading into ``buffer``: map-style, the positions its claim
            counter hands out; iterables, the iterator's examples numbered from
            ``first_seq``, after ``ready`` (read and transformed already).
        probe: ``probe(reading, size)`` starts reading the first ``size``
            examples before the buffer exists; None: the kind reads nothing
            until asked, and the caller's thread reads them.
        shared: the buffer lives in shared memory and object leaves travel
            pickled (the readers are other processes).
        own_shards: each reader iterates an iterable's shard of its own, so
            examples read in this process to learn the structure are not put.
    """

    start: Callable[[Reading, NativeBuffer, Structure, int, list], Readers]
    probe: Callable[[Reading, int], Probing] | None
    shared: bool = False
    own_shards: bool = False
