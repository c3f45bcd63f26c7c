"""``workers=0`` (``num_workers=0``): the source is read in the consumer's own
thread, as torch's ``DataLoader(num_workers=0)`` reads it.

Nothing reads ahead: when the training loop asks for a batch and none is ready,
the loop's thread reads and transforms examples into the echo buffer, in chunks
(dataecho.reading.chunking), until a put cannot go in (the buffer is full: the assembler
then has what it needs for a batch) or the source ends. No thread touches the
dataset but the caller's, so a dataset that is not thread-safe, or that must
run in the main thread, works as under DataLoader.

With ``echo_factor="auto"`` reading cannot overlap the training step, so it is
paced instead: each ask reads (at least one chunk) for no longer than the loop
spent outside ``next()`` since the last batch (its step; the first ask reads a
chunk at a time until the first batch is out), then lets the echo buffer
complete the batch with repeats. Where a
batch's reads take longer than a step, the factor settles near their ratio
(up to ``max_echo``); where they take less, the buffer stays full of fresh
examples and nothing is repeated.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from ..examples.structure import Structure
from ..native.echo_buffer import NativeBuffer
from ..reading.chunking import CHUNK, Chunk, claimed
from ..reading.source import EpochSource
from .readers import Kind, Reading

__all__ = ["INLINE_WAIT_S", "KIND", "InlineReader"]

INLINE_WAIT_S = 0.02  # how long the wait for a batch may park before reading resumes
PACED_WAIT_S = 0.002  # ... after paced reading, whose batch is completed with repeats at once where it can be


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
        self._paced = buffer.paced
        self._want = CHUNK  # paced: positions to claim next, what the budget left has time for
        self._chunks = self._positions() if source.order is not None else self._iterated(first_seq, ready or [])
        self._pending: Chunk | None = None  # read, not yet all taken by a full buffer
        self._done = 0  # rows of the pending chunk put so far
        self._exhausted = False
        self._produced, self._busy_s = 0, 0.0
        self._returned: float | None = None  # when the last batch went to the loop (paced reading)

    def next_arrays(self, timeout_s: float | None) -> tuple[np.ndarray, ...]:
        """A ready batch, else reads in this thread until a put cannot go in (a
        full buffer, or with deterministic intake one whose assembler has not yet
        taken the examples before it) or the source ends."""
        buffer = self._buffer
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        budget = None  # paced: as long as the step took (the first ask: a chunk at a time, to the first batch)
        if self._paced:
            budget = 0.0 if self._returned is None else time.perf_counter() - self._returned
        while True:
            try:
                return self._out(buffer.next_arrays(0.0))
            except TimeoutError:
                pass
            if not self.fill(budget):
                left_s = None if deadline is None else max(0.0, deadline - time.monotonic())
                return self._out(buffer.next_arrays(left_s))
            # The assembler moves next: it makes a batch (paced: with repeats),
            # or takes what was put and opens the intake window; either way
            # reading can go on.
            try:
                return self._out(buffer.next_arrays(PACED_WAIT_S if budget is not None else INLINE_WAIT_S))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def _out(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        self._returned = time.perf_counter()
        return arrays

    def fill(self, budget_s: float | None = None) -> bool:
        """Reads and puts examples until a put cannot go in at once
        (True: the buffer is full, or with deterministic intake the assembler has
        not yet taken the examples before it), ``budget_s`` seconds were spent
        reading after the first chunk (True), or the source is exhausted and the
        buffer closed (False)."""
        began, chunks = time.perf_counter(), 0
        while not self._exhausted:
            if self._pending is None:
                left_s = None if budget_s is None else budget_s - (time.perf_counter() - began)
                if left_s is not None and chunks > 0 and left_s <= 0:
                    return True
                if left_s is not None and self._produced:
                    self._want = min(CHUNK, max(1, int(left_s * self._produced / max(self._busy_s, 1e-9))))
                chunks += 1
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
        chunk = (lambda: self._want) if self._paced else self._source.chunk
        return claimed(self._buffer.claim_range, chunk, self._source.reader, columns)

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
