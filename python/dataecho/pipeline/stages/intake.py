"""The first stage of an epoch: the source, its producers (threads, worker
processes, or the consumer's own thread) and the echo buffer they fill.

Example echoing happens in the echo buffer itself; with ``echo_at="batch"`` it
shuffles examples with factor 1 and the batch echo stage repeats its batches.

Its state (map-style sources read in a deterministic order): the echo
buffer's batch counter ``batches``, RNG counter ``rng_state``, intake position
``next_seq`` (every position of the epoch's order below it was read),
``available``; each resident example's position, dataset index and remaining
echo count (``positions``, ``indices``, ``echoes``), in reservoir order;
``queued``: the batches assembled but not yet taken (and, once resumed, those
restored and not yet yielded); ``ended``. An iterable source read by threads:
``skip``, the examples taken from the iterator; on resume the source is
iterated again from its start and these are dropped (resident examples are not
restored). An iterable that can restart (dataecho.reading.restart) restarts
instead from its state saved beside either (``restart``; the epoch adds it:
dataecho.pipeline.checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import _core
from ...examples.structure import Structure
from ...native.echo_buffer import NativeBuffer
from ...native.sizing import buffer_config, ragged_heap, reorder_window
from ...reading.source import SourceSpec
from ...tensors.pinned import pin_batch_memory
from ...workers.augment.staging import SharedBlocks
from ...workers.reader_kinds import kind_of
from ...workers.readers import Probing, Readers, Reading
from ...workers.spec import WorkersSpec
from .. import checkpoint
from . import buffer_states
from .stage import Batch, Replay

__all__ = ["IntakeSpec", "IntakeStage", "check_state"]



@dataclass(frozen=True)
class IntakeSpec:
    """What the intake needs (built by dataecho.pipeline.plan).

    Attributes:
        source, workers: what is read, and who reads it.
        capacity: the echo buffer's slots; ``bounded``: no more than the
            epoch's examples (map-style), with room for a reorder window.
        batch_size, echo_factor, auto_echo, max_echo, echo_gap, drop_last, prefetch,
            initial, deterministic, exact_echo, in_order: the echo buffer's
            settings (see ``_core.BufferConfig``).
        ragged_bytes: the page heap's budget for ragged values, or None (sized
            from the first examples).
        exact: rows carry their positions: a state names every example.
        unresumable: why no state can be taken mid-epoch, or None.
        pinned_batches, pinned_device: page-locked batch blocks for the echo buffer (0: none), for a device.
    """

    source: SourceSpec
    workers: WorkersSpec
    capacity: int
    bounded: bool
    batch_size: int
    echo_factor: float
    auto_echo: bool
    max_echo: float
    echo_gap: int
    drop_last: bool
    prefetch: int
    initial: int
    deterministic: bool
    exact_echo: bool
    in_order: bool
    ragged_bytes: int | None
    exact: bool
    unresumable: str | None
    pinned_batches: int
    pinned_device: Any = None


class IntakeStage:
    """Reads the source into the echo buffer; yields the buffer's batches.

    Args:
        spec: the stage's settings.
        reading: this epoch's view of the source, where a reader's exception
            goes and what stops the epoch, the epoch's resources.
        structure: the examples' structure.
        first: the examples read (transformed) to learn the structure in the
            consumer's thread (``num_workers=0``), or none; they are put first,
            numbered 0, 1, ...
        resume: this stage's state from a checkpoint, or None.
        probing: readers that read the first examples (dataecho.workers.probe)
            and wait for the buffer, which this stage attaches; or None.
    """

    name = "intake"

    def __init__(self, spec: IntakeSpec, reading: Reading, structure: Structure, first: list[Any],
                 resume: dict[str, Any] | None = None, probing: Probing | None = None) -> None:
        self._spec = spec
        self._reading = reading
        self._source = reading.source
        self.structure = structure
        self.unresumable = spec.unresumable
        self._map_style = reading.source.order is not None
        self._skipped = resume.get("skip", 0) if resume and not self._map_style else 0
        # Batches that had left the buffer when the state was taken: yielded first.
        self._replay = Replay(resume.get("queued") if resume else None)
        self._buffer: NativeBuffer | None = None
        self._producers: Readers | None = None
        if resume is not None and resume.get("ended"):
            self._read_at_end = int(resume.get("next_seq", 0))
            return  # nothing more to assemble: only the queued batches
        shared = kind_of(spec.workers).shared
        objects = "pickle" if shared else "key"
        # A resumed buffer gets at least the ragged memory the saved one had: its
        # resident examples fit there, and are all put back before any batch.
        saved_bytes = resume.get("ragged_bytes", 0) if resume and spec.exact else 0
        restored = None
        if spec.exact and resume:
            restored = buffer_states.restored(resume, resume["positions"], resume["echoes"])
        self._buffer = NativeBuffer(structure.fields(), self._buffer_config(objects, shared, saved_bytes), restored,
                                    None if shared else reading.resources.memory, objects)
        try:
            if spec.pinned_batches:
                pin_batch_memory(self._buffer, spec.pinned_batches, spec.pinned_device)
            if probing is not None:
                self._attach(probing)
            else:
                self._start(first, resume)
        except BaseException:
            self.stop()  # not in the chain yet: nothing else would stop its threads
            self.join(0.0)
            raise

    def _buffer_config(self, objects: str, shared: bool, saved_bytes: int = 0) -> _core.BufferConfig:
        spec = self._spec
        capacity = spec.capacity
        if spec.bounded and self._source.length is not None:
            # No more slots than the epoch has examples (with room for the reorder window).
            capacity = min(capacity, max(self._source.length, 2 * spec.batch_size))
        pages, page_bytes = ragged_heap(self.structure, capacity, spec.ragged_bytes, objects)
        if page_bytes and saved_bytes > pages * page_bytes:
            pages = min(-(-saved_bytes // page_bytes), _core.MAX_PAGES)
        return buffer_config(
            capacity=capacity, pages=pages, page_bytes=page_bytes, batch_size=spec.batch_size,
            echo_factor=spec.echo_factor, auto_echo=spec.auto_echo, max_echo=spec.max_echo, echo_gap=spec.echo_gap,
            paced=spec.auto_echo and spec.workers.kind == "inline",  # the loop reads: it waits only in next()
            seed=self._reading.resources.seeds.buffer, drop_last=spec.drop_last, prefetch=spec.prefetch,
            initial=spec.initial,
            shared=shared, deterministic=spec.deterministic, exact_echo=spec.exact_echo, in_order=spec.in_order,
            window=reorder_window(capacity, spec.batch_size) if spec.deterministic else 0,
        )

    def _start(self, first: list[Any], resume: dict[str, Any] | None) -> None:
        spec, buffer, source, map_style = self._spec, self._buffer, self._source, self._map_style
        kind = kind_of(spec.workers)
        exact_resume = resume is not None and spec.exact
        if (map_style and resume is not None) or exact_resume or (not map_style and kind.own_shards):
            first = []  # they only told the structure (the order resumes; readers that iterate shards of their own)
        # The first examples go in while they fit at once: this thread must not
        # wait on a buffer whose batches nobody takes yet. The rest are put by
        # the producers, who read the positions after them (map-style) or take
        # them before the iterator's next (iterables).
        start = self._put_first(first)
        if map_style or exact_resume:
            if resume is not None:
                start = resume["next_seq"]
            if map_style:
                # Positions of the order are claimed by readers from a counter in
                # the buffer's region; a position is also the example's sequence
                # number for deterministic intake.
                buffer.set_index_range(start, source.end)
            if resume is not None:
                # An iterable read again up to next_seq (EpochSource.keep) kept
                # the resident examples on the way; reading goes on after them.
                buffer_states.put_resident(buffer, self.structure, source.read, resume["positions"],
                                           spec.workers.count)
        self._producers = kind.start(self._reading, buffer, self.structure, start, [] if map_style else first[start:])

    def _attach(self, probing: Probing) -> None:
        """Gives the buffer to workers that read the first examples: they put
        those, then read on (map-style: from the position after them)."""
        self._producers = probing
        if self._map_style:
            self._buffer.set_index_range(probing.probed, self._source.end)
        probing.attach(self._buffer, self.structure)

    def _put_first(self, first: list[Any]) -> int:
        """Puts the first examples, numbered from 0, until one does not go in at
        once; returns how many went in."""
        for seq, example in enumerate(first):
            try:
                self._buffer.put_values(self.structure.flatten(example), timeout_s=0.0, seq=seq)
            except TimeoutError:
                return seq
        return len(first)

    # ---- the stage ----

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._replay:
            return self._replay.next(self.read_batch)
        if self._buffer is None:
            raise StopIteration
        arrays = self._producers.next_arrays(timeout_s)
        return Batch(self.structure, arrays, self._buffer.last_seqs)

    def share_batch_memory(self, count: int) -> SharedBlocks:
        """Has the echo buffer assemble its batches in ``count`` blocks of named
        shared memory (it takes them before any of its own), where augment
        worker processes read them (dataecho.workers.augment.staging)."""
        if self._buffer is None:  # resumed after the end: nothing more is assembled
            return SharedBlocks(0, 1)
        blocks = SharedBlocks(count, self._buffer.batch_bytes)
        for address, nbytes in blocks.pointers():
            self._buffer.add_batch_memory(address, nbytes, blocks)
        return blocks

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
        if self._producers is not None:
            self._producers.join(max(timeout_s, self._producers.grace_s))

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        if self.unresumable is not None:
            return None
        if not self._spec.exact:
            return {"skip": self._skipped + self.counters()["fresh"]}
        replayed = self._replay.saved()
        if self._buffer is None:  # resumed after the end: nothing resident, every position read
            return checkpoint.ended_intake(self._read_at_end, replayed)
        snap = self._buffer.snapshot(timeout_s)
        state = buffer_states.saved(snap)
        state["ragged_bytes"] = self._buffer.stats()["pages"] * self._buffer.page_bytes
        positions = snap.seqs
        # An iterable's examples are named by their position in the iteration alone.
        order = self._source.order if self._map_style else checkpoint.Iterated(int(snap.next_seq))
        if self._source.sampled:  # a sampler may not give this order again: it is saved (and its own state)
            saved, sampler = self._source.saved_order()
            state["order"] = checkpoint.compact(saved)
            if sampler is not None:
                state["sampler"] = sampler
        state.update(
            positions=positions,
            indices=np.asarray(order[positions.astype(np.int64)], dtype=np.int64),
            echoes=snap.echoes,
            queued=replayed + [{"rows": rows} for rows in snap.queued],
        )
        # An ended assembler's snapshot no longer says how far an iterable was
        # read: the epoch sets it to the last position any stage names
        # (checkpoint.read_to_named), as far as a resume must read again.
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


def check_state(spec: IntakeSpec, state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    """This stage's saved state, checked against ``spec`` and the epoch's order,
    and normalized: every value within what this stage could have saved.

    Raises:
        ValueError: a state this stage could not have saved, naming the key.
    """
    checked = buffer_states.checked_counters(state, where)
    checked["ragged_bytes"] = checkpoint.int_at(state, "ragged_bytes", where) if "ragged_bytes" in state else 0
    positions = checkpoint.array_at(state, "positions", np.uint64, where)
    echoes = checkpoint.array_at(state, "echoes", np.uint32, where)
    indices = checkpoint.array_at(state, "indices", np.int64, where)
    if not (len(positions) == len(echoes) == len(indices)):
        raise ValueError(f"{where}: positions, indices and echoes differ in length")
    if (len(positions) and positions.max() >= checked["next_seq"]) or checked["next_seq"] > len(order):
        raise ValueError(f"{where}: positions beyond the epoch's order")
    if len(np.unique(positions)) != len(positions):
        raise ValueError(f"{where}['positions']: a resident example is listed twice")
    if not np.array_equal(order[positions.astype(np.int64)], indices):
        raise ValueError(f"{where}: the resident examples' indices do not match this epoch's order")
    if len(echoes) and echoes.min() == 0:
        raise ValueError(f"{where}['echoes']: every resident example has an echo left")
    most = math.ceil(spec.echo_factor)
    if len(echoes) and echoes.max() > most:
        raise ValueError(f"{where}['echoes']: at most {most} echoes left per example at echo_factor="
                         f"{spec.echo_factor:g}, got {int(echoes.max())}")
    if checked["ended"] and (len(positions) or checked["available"]):
        raise ValueError(f"{where}['ended']: True, with examples resident")
    if checked["available"] > len(positions):
        raise ValueError(f"{where}['available']: more than the resident examples")
    queued = checkpoint.batches_at(state, "queued", order, where)
    for i, batch in enumerate(queued):  # near the end of an epoch a batch may hold an example more than once
        if len(batch["rows"]) and np.unique(batch["rows"], return_counts=True)[1].max() > most:
            raise ValueError(f"{where}['queued'][{i}]['rows']: an example more than {most} times in one batch")
    checked.update(positions=positions, echoes=echoes, indices=indices, queued=queued)
    if "order" in state:
        checked["order"] = checkpoint.array_at(state, "order", np.int64, where)
    if "sampler" in state:
        checked["sampler"] = checkpoint.sampler_at(state, where)
    return checked
