"""The first stage of an epoch: the source, its producers (threads or worker
processes) and the echo buffer they fill.

Example echoing happens in the echo buffer itself; with ``echo_at="batch"`` it
shuffles examples with factor 1 and the batch echo stage repeats its batches.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from .. import _core
from ..config.loader_config import DEFAULT_EXAMPLES, LoaderConfig
from ..examples.structure import Structure
from ..native.buffer import NativeBuffer
from ..native.sizing import buffer_config, ragged_heap
from ..reading.source import EpochSource
from ..tensors.pinned import pin_batch_memory
from ..workers.failure import Failure
from ..workers.inline import INLINE_WAIT_S, InlineReader
from ..workers.processes import PROCESS_GRACE_S, ProcessProducers
from ..workers.threads import Producers
from .stage import Batch

__all__ = ["IntakeStage"]

_SNAPSHOT_KEYS = ("batches", "rng_state", "next_seq", "available")


class IntakeStage:
    """Reads the source into the echo buffer; yields the buffer's batches.

    Args:
        config: the loader's configuration.
        source: this epoch's view of the source.
        structure: the examples' structure.
        first: the examples read (transformed) to learn the structure, or none;
            they are put first, numbered 0, 1, ...
        failure, on_failure: where a producer's exception goes, and what stops the epoch.
        resume: this stage's state from a checkpoint, or None.
        pinned_batches: page-locked batch blocks to give the echo buffer (0: none).
    """

    name = "intake"

    def __init__(self, config: LoaderConfig, source: EpochSource, structure: Structure, first: list[Any],
                 failure: Failure, on_failure: Callable[[], None], resume: dict[str, Any] | None = None,
                 pinned_batches: int = 0) -> None:
        self._config, self._source, self.structure = config, source, structure
        self.unresumable = _unresumable(config)
        self._exact = config.map_style and config.deterministic
        self._skipped = resume.get("skip", 0) if resume and not config.map_style else 0
        self._buffer: NativeBuffer | None = None
        self._producers: Producers | ProcessProducers | InlineReader | None = None
        if resume is not None and resume.get("ended"):
            return  # nothing more to assemble: only the queued batches, replayed downstream
        objects = "pickle" if config.worker_type == "process" else "key"
        self._buffer = NativeBuffer(structure.fields(), self._buffer_config(objects),
                                    _restore_snapshot(resume) if self._exact and resume else None,
                                    source.memory if config.worker_type == "thread" else None, objects)
        try:
            if pinned_batches:
                pin_batch_memory(self._buffer, pinned_batches)
            self._start(first, resume, failure, on_failure)
        except BaseException:
            self.stop()  # not in the chain yet: nothing else would stop its threads
            self.join(0.0)
            raise

    def _buffer_config(self, objects: str) -> _core.BufferConfig:
        config = self._config
        per_example = config.echo_at == "example"
        auto = per_example and config.echo_factor == "auto"
        if per_example:
            capacity = config.shuffle_buffer
        elif config.map_style:
            # Batch echoing over an index order that is already a new permutation
            # each epoch (the sampler's): batch it as it comes, as DataLoader
            # does. A larger shuffle here would only delay the echoes: the
            # reservoir grows by one example per delivery, at one more fresh read.
            capacity = 2 * config.batch_size
        else:
            capacity = max(2 * config.batch_size, DEFAULT_EXAMPLES)
        if config.map_style:  # no more slots than the epoch has examples (with room for the reorder window)
            capacity = min(capacity, max(len(self._source), 2 * config.batch_size))
        pages, page_bytes = ragged_heap(self.structure, capacity, config.ragged_bytes, objects)
        return buffer_config(
            capacity=capacity, pages=pages, page_bytes=page_bytes,
            batch_size=config.batch_size, echo_factor=float(config.echo_factor) if per_example and not auto else 1.0,
            auto_echo=auto, max_echo=config.max_echo, seed=self._source.seeds[2],
            # With augment, its output buffer decides what a short last batch means.
            drop_last=config.drop_last and config.augment is None, prefetch=config.prefetch,
            # Batch echoing: batches flow from the first one on; the example
            # shuffle behind them still grows to its capacity.
            initial=0 if per_example else config.batch_size,
            shared=config.worker_type == "process", deterministic=config.deterministic,
            exact_echo=config.exact_echo and per_example, in_order=config.in_order,
        )

    def _start(self, first: list[Any], resume: dict[str, Any] | None, failure: Failure,
               on_failure: Callable[[], None]) -> None:
        config, buffer, source = self._config, self._buffer, self._source
        if (config.map_style and resume is not None) or not (config.map_style or config.worker_type == "thread"):
            first = []  # they only told the structure (the order resumes; worker processes read their own shards)
        # The first examples go in while they fit at once: this thread must not
        # wait on a buffer whose batches nobody takes yet. The rest are put by
        # the producers, who read the positions after them (map-style) or take
        # them before the iterator's next (iterables).
        start = self._put_first(first)
        if config.map_style:
            if resume is not None:
                start = resume["next_seq"]
            # Positions of the order are claimed by producers (threads or
            # processes) from a counter in the buffer's region; a position is
            # also the example's sequence number for deterministic intake.
            buffer.set_index_range(start, len(source))
            if resume is not None:
                self._put_resident(resume["positions"])
        ready = [] if config.map_style else first[start:]
        if config.workers == 0:
            self._producers = InlineReader(buffer, self.structure, source, first_seq=start, ready=ready)
        elif config.worker_type == "process":
            self._producers = ProcessProducers(buffer, self.structure, source, config, failure, on_failure,
                                               source.pool)
        else:
            self._producers = Producers(buffer, self.structure, source, config, failure, on_failure)
            self._producers.start(first_seq=start, ready=ready)

    def _put_first(self, first: list[Any]) -> int:
        """Puts the first examples, numbered from 0, until one does not go in at
        once; returns how many went in."""
        for seq, example in enumerate(first):
            try:
                self._buffer.put_values(self.structure.flatten(example), timeout_s=0.0, seq=seq)
            except TimeoutError:
                return seq
        return len(first)

    def _put_resident(self, positions: np.ndarray) -> None:
        """Resume: reads the resident examples again and puts them with their
        numbers, before any producer starts (the buffer waits for all of them)."""
        positions = sorted(int(p) for p in positions)
        if not positions:
            return
        structure, source = self.structure, self._source
        with ThreadPoolExecutor(max_workers=min(max(1, self._config.workers), len(positions))) as pool:
            for position, example in zip(positions, pool.map(source.read, positions)):
                self._buffer.put_values(structure.flatten(example), seq=position)

    # ---- the stage ----

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._buffer is None:
            raise StopIteration
        if isinstance(self._producers, InlineReader):
            arrays = self._read_inline(timeout_s)
        else:
            arrays = self._buffer.next_arrays(timeout_s)
        return Batch(self.structure, arrays, self._buffer.last_seqs if self._exact else None)

    def _read_inline(self, timeout_s: float | None) -> tuple[np.ndarray, ...]:
        """workers=0: a ready batch, else read in this thread until a put cannot
        go in (a full buffer, or with deterministic intake one whose assembler has
        not yet taken the examples before it) or the source ends."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return self._buffer.next_arrays(0.0)
            except TimeoutError:
                pass
            if not self._producers.fill():
                return self._buffer.next_arrays(None if deadline is None else max(0.0, deadline - time.monotonic()))
            # The assembler moves next: it makes a batch, or takes what was put
            # and opens the intake window; either way reading can go on.
            try:
                return self._buffer.next_arrays(INLINE_WAIT_S)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def copy_arrays(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        """A copy of a batch's arrays, in a recycled block of the echo buffer's batch pool."""
        if self._buffer is None:  # resumed after the end: only replayed batches are left
            return tuple(a.copy() for a in arrays)
        return self._buffer.copy_batch(arrays)

    def read_batch(self, ids: dict[str, np.ndarray]) -> Batch:
        """The batch whose rows are at positions ``ids["rows"]``, read again."""
        return Batch(self.structure, self._source.read_rows(self.structure, ids["rows"]), ids["rows"])

    def stop(self) -> None:
        if self._producers is not None:
            self._producers.stop()
        if self._buffer is not None:
            self._buffer.abort()

    def join(self, timeout_s: float) -> None:
        if isinstance(self._producers, ProcessProducers):
            timeout_s = max(timeout_s, PROCESS_GRACE_S)  # worker processes are always reaped
        if self._producers is not None:
            self._producers.join(timeout_s)

    def state(self) -> dict[str, Any] | None:
        if self.unresumable is not None:
            return None
        if not self._config.map_style:
            return {"skip": self._skipped + self.counters()["fresh"]}
        if self._buffer is None:  # resumed after the end: nothing resident, every position read
            empty = np.zeros(0, dtype=np.uint64)
            return {"batches": 0, "rng_state": 0, "next_seq": len(self._source), "available": 0,
                    "positions": empty, "indices": empty.astype(np.int64), "echoes": empty.astype(np.uint32),
                    "queued": [], "ended": True}
        snap = self._buffer.snapshot()
        state = {key: int(getattr(snap, key)) for key in _SNAPSHOT_KEYS}
        positions = snap.seqs
        state.update(
            positions=positions,
            indices=np.asarray(self._source.order, dtype=np.int64)[positions.astype(np.int64)],
            echoes=snap.echoes,
            queued=[{"rows": rows} for rows in snap.queued],
            ended=bool(snap.ended),
        )
        return state

    def counters(self) -> dict[str, Any]:
        buffer = self._buffer
        stats = buffer.stats() if buffer is not None else {"fresh": 0, "starved": 0, "resident": 0, "pages": 0,
                                                            "pages_in_use": 0, "free_slots": 0}
        page = buffer.page_bytes if buffer is not None else 0
        return {
            "fresh": stats["fresh"],
            "starved": stats["starved"],
            "memory": {"resident": stats["resident"], "held": buffer.capacity - stats["free_slots"] if buffer else 0,
                       "slot_bytes": buffer.slot_bytes if buffer is not None else 0,
                       "ragged_bytes_in_use": stats["pages_in_use"] * page, "ragged_bytes": stats["pages"] * page},
            "workers": self._producers.counters() if self._producers is not None else [],
        }


def _unresumable(config: LoaderConfig) -> str | None:
    if not config.map_style:
        if config.worker_type == "process":
            return ("worker processes each read their own shard of an iterable source, so there is no "
                    "single position to skip to; use a map-style source")
        return None
    if not config.deterministic:
        return "saving a position mid-epoch needs deterministic=True (otherwise the order depends on thread timing)"
    return None


def _restore_snapshot(state: dict[str, Any]) -> _core.Snapshot:
    snap = _core.Snapshot()
    for key in _SNAPSHOT_KEYS:
        setattr(snap, key, state[key])
    snap.seqs, snap.echoes = state["positions"], state["echoes"]
    return snap
