"""``workers=0`` (``num_workers=0``): the source is read in the consumer's own
thread, as torch's ``DataLoader(num_workers=0)`` reads it.

Nothing reads ahead: when the training loop asks for a batch and none is ready,
the loop's thread reads and transforms examples into the echo buffer, in chunks
(dataecho.reading.chunking), until a put cannot go in (the buffer is full: the assembler
then has what it needs for a batch) or the source ends. No thread touches the
dataset but the caller's, so a dataset that is not thread-safe, or that must
run in the main thread, works as under DataLoader.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ..examples.structure import Structure
from ..native.echo_buffer import NativeBuffer
from ..reading.chunking import Chunk, claimed
from ..reading.source import EpochSource
from .readers import Kind, Reading

__all__ = ["INLINE_WAIT_S", "KIND", "InlineReader"]

INLINE_WAIT_S = 0.02  # how long the wait for a batch may park before reading resumes


class InlineReader:
    """Reads an epoch's source into a buffer on demand, in the calling thread.

    Args:
        buffer: the echo buffer; closed when the source is exhausted.
        structure: checks and flattens each example.
        source: this epoch's view of the source.
        first_seq: iterable sources: the number of the first example read.
        ready: iterable sources: examples already read and transformed, to put
            first (numbered from ``first_seq``).
    """

    grace_s = 0.0

    def __init__(self, buffer: NativeBuffer, structure: Structure, source: EpochSource, first_seq: int = 0,
                 ready: list | None = None) -> None:
        self._buffer, self._structure, self._source = buffer, structure, source
        self._chunks = self._positions() if source.order is not None else self._iterated(first_seq, ready or [])
        self._pending: Chunk | None = None  # read, not yet all taken by a full buffer
        self._done = 0  # rows of the pending chunk put so far
        self._exhausted = False
        self._produced, self._busy_s = 0, 0.0

    def next_arrays(self, timeout_s: float | None) -> tuple[np.ndarray, ...]:
        """A ready batch, else reads in this thread until a put cannot go in (a
        full buffer, or with deterministic intake one whose assembler has not yet
        taken the examples before it) or the source ends."""
        buffer = self._buffer
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return buffer.next_arrays(0.0)
            except TimeoutError:
                pass
            if not self.fill():
                return buffer.next_arrays(None if deadline is None else max(0.0, deadline - time.monotonic()))
            # The assembler moves next: it makes a batch, or takes what was put
            # and opens the intake window; either way reading can go on.
            try:
                return buffer.next_arrays(INLINE_WAIT_S)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def fill(self) -> bool:
        """Reads and puts examples until a put cannot go in at once
        (True: the buffer is full, or with deterministic intake the assembler has
        not yet taken the examples before it) or the source is exhausted and the
        buffer closed (False)."""
        while not self._exhausted:
            if self._pending is None:
                started = time.perf_counter()
                self._pending, self._done = next(self._chunks, None), 0
                self._busy_s += time.perf_counter() - started
                if self._pending is None:
                    self._exhausted = True
                    self._buffer.close()
                    break
            seq, rows, columns = self._pending
            done = self._buffer.put_each(columns, rows, seq, timeout_s=0.0, done=self._done)
            self._produced += done - self._done
            self._done = done
            if done < rows:
                return True  # full: the assembler can make a batch
            self._pending = None
        return False

    def counters(self) -> list[dict[str, float]]:
        """One entry, for the calling thread: examples produced, seconds reading."""
        return [{"produced": self._produced, "busy_s": self._busy_s}]

    def _positions(self) -> Iterator[Chunk]:
        columns = self._buffer.columns(self._structure)
        return claimed(self._buffer.claim_range, self._source.chunk, self._source.reader, columns)

    def _iterated(self, first_seq: int, ready: list) -> Iterator[Chunk]:
        source, columns = self._source, self._buffer.columns(self._structure)
        if ready:
            yield first_seq, len(ready), columns.of(ready)
        transform = source.transform
        for seq, examples in source.chunks(first_seq + len(ready), blocks=transform is None):
            yield seq, len(examples), columns.of(examples if transform is None else
                                                 [source.transformed(e) for e in examples])

    # nothing runs on its own: nothing to stop or wait for

    def stop(self) -> None:
        pass

    def join(self, timeout_s: float) -> None:
        pass


def _start(reading: Reading, buffer: NativeBuffer, structure: Structure, first_seq: int, ready: list) -> InlineReader:
    return InlineReader(buffer, structure, reading.source, first_seq, ready)


KIND = Kind(start=_start, probe=None)
