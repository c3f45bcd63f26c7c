"""A map-style dataset read example by example: ``source[i]`` (or
``__getitems__(indices)`` once per chunk where the source has it, torch's
batched-fetch convention), then ``transform``.

A dataset may also write its examples straight into the loader's memory:
``read_into(index, out)`` writes example ``index`` into ``out``, the example's
structure (as ``source[index]`` gives it) of writable NumPy arrays, and keeps
no reference to them. Without ``transform``, for examples of NumPy arrays and
numbers alone, of ``FRESH_MIN_BYTES`` or more, read by threads
(dataecho.examples.columns.Columns.writes_into), the loader calls it instead of
``__getitem__`` (which still gives the first examples, and the structure):
each example is then copied once, from its slot into its batch. (At echo 1 the
loader writes whole batches in place instead: dataecho.pipeline.stages.written.)"""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np

from ..errors import stop_iteration_error
from ..examples.columns import Columns
from .chunking import CHUNK, SLICE_S, Chunk, chunked

__all__ = ["ExampleReader"]

class ExampleReader:
    """``source[i]`` per example (or ``__getitems__`` per chunk), then ``transform``."""

    def __init__(self, source: Any, transform: Any, order: np.ndarray) -> None:
        self._source, self._transform, self._order = source, transform, order
        self._getitems = getattr(source, "__getitems__", None)
        # read_into(index, out): the example written into `out`, memory of the loader's (see chunks).
        self._read_into = getattr(source, "read_into", None) if transform is None else None
        self._quick = False  # per-example reads measured fast (see chunks)
        self._reader_name = "source" if transform is None else "source or transform"

    def one(self, position: int) -> Any:
        """The example at ``position`` of the order, transformed."""
        try:
            example = self._source[int(self._order[position])]
        except StopIteration as stop:  # not the end of anything: an error (see Failure.set)
            raise stop_iteration_error(stop, "source") from stop
        return self._transformed(example)

    def chunks(self, first: int, count: int, columns: Columns) -> Iterator[Chunk]:
        """Positions [first, first + count), read and converted, in chunks
        (fewer where a lazily read order ends before)."""
        indices = self._order[first:first + count].tolist()
        count = len(indices)
        if not count:
            return
        if self._read_into is not None and columns.writes_into:  # straight into the buffer's slots
            yield first, count, columns.into(self.read_into, indices)
            return
        if self._getitems is not None:
            try:
                examples = list(self._getitems(indices))
            except StopIteration as stop:
                raise stop_iteration_error(stop, "source") from stop
            if len(examples) != count:
                raise ValueError(f"source: __getitems__ returned {len(examples)} examples for {count} indices")
            if self._transform is not None:
                examples = [self._transformed(e) for e in examples]
            yield first, count, columns.of(examples)
            return
        started = time.perf_counter()
        for seq, examples in self._quick_read(indices, first) if self._quick else chunked(self._read(indices), first):
            # Quick when a whole chunk reads in under half the slice.
            self._quick = (time.perf_counter() - started) * CHUNK < SLICE_S / 2 * len(examples)
            yield seq, len(examples), columns.of(examples)
            started = time.perf_counter()

    def read_into(self, index: int, out: Any) -> None:
        """The source's ``read_into(index, out)``, a ``StopIteration`` from it made an error."""
        try:
            self._read_into(index, out)
        except StopIteration as stop:
            raise stop_iteration_error(stop, "source") from stop

    def _read(self, indices: list[int]) -> Iterator[Any]:
        """The examples at ``indices``, transformed, one by one."""
        source, transform = self._source, self._transform
        try:
            for i in indices:
                example = source[i]
                yield example if transform is None else transform(example)
        except StopIteration as stop:
            raise stop_iteration_error(stop, self._reader_name) from stop

    def _quick_read(self, indices: list[int], first: int) -> Iterator[tuple[int, list]]:
        """``_read``'s examples in one chunk, by one list comprehension: no clock per example."""
        source, transform = self._source, self._transform
        try:
            examples = [source[i] for i in indices] if transform is None else [transform(source[i]) for i in indices]
        except StopIteration as stop:
            raise stop_iteration_error(stop, self._reader_name) from stop
        yield first, examples

    def _transformed(self, example: Any) -> Any:
        try:
            return example if self._transform is None else self._transform(example)
        except StopIteration as stop:
            raise stop_iteration_error(stop, "transform") from stop
