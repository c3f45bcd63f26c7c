"""Reading in chunks: what the producers (threads, worker processes, or the
caller's thread with ``num_workers=0``) do per example, amortized.

A producer claims up to ``CHUNK`` consecutive positions of the epoch's order at
once, reads them, converts them column by column (dataecho.examples.columns),
and puts them with one native call, which copies every row into its slot
without the GIL. An iterable source is read in chunks of up to ``CHUNK``
examples, or of what ``SLICE_S`` seconds of reading gave.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from ..examples.blocks import RowBlock
from ..examples.columns import Columns
from .ray import RowIterator

__all__ = ["CHUNK", "Chunk", "SLICE_S", "chunked", "claimed"]

CHUNK = 64  # positions claimed at a time

SLICE_S = 0.01  # examples read one by one are put at least this often, however slow they are

# A chunk to put: (sequence number of its first row, rows, one column per field;
# see _core.Buffer.put_each for the forms a column takes).
Chunk = tuple[int, int, list]


def claimed(claim_range: Any, chunk: int | Callable[[], int], reader: Any, columns: Columns,
            more: Callable[[], bool] = lambda: True) -> Iterator[Chunk]:
    """The chunks of the positions a worker claims, ``chunk`` at a time (asked
    again before each claim where it is a function; the reader's own ``claim``
    where larger), from a buffer's ``claim_range`` (in this process or a
    worker's), until all are claimed or ``more()``, asked before each claim,
    says no (a claimed range is always read whole: every position is put)."""
    size = chunk if callable(chunk) else (lambda: chunk)
    own = getattr(reader, "claim", 0)
    while more():
        first, count = claim_range(max(size(), own))
        if count == 0:
            return
        read = False
        for item in reader.chunks(first, count, columns):
            read = True
            yield item
        if not read:  # a lazily read order ended before `first` (dataecho.reading.sampled)
            return


def chunked(iterator: Iterator[Any], first_seq: int = 0, blocks: bool = False,
            before: Callable[[int], None] | None = None) -> Iterator[tuple[int, list | RowBlock]]:
    """An iterable source's examples in chunks: (number of the first, up to
    CHUNK examples read within SLICE_S), numbered from ``first_seq``; with
    ``blocks`` (a put without transform), from an iterator that hands them out
    in blocks (dataecho.reading.ray), a block each. ``before(seq)`` is called
    before each chunk is read (dataecho.reading.restart marks the iteration)."""
    seq = first_seq
    if blocks and isinstance(iterator, RowIterator):
        for block in iterator.blocks():
            yield seq, block
            seq += len(block)
        return
    while True:
        if before is not None:
            before(seq)
        examples, started = [], time.perf_counter()
        for example in iterator:
            examples.append(example)
            if len(examples) == CHUNK or time.perf_counter() - started > SLICE_S:
                break
        if not examples:
            return
        yield seq, examples
        seq += len(examples)
