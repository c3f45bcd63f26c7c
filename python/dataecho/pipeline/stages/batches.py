"""The first stage of an epoch with a ``batch_sampler``: the sampler's batches,
each read whole and yielded in the sampler's order, without the echo buffer
(the sampler forms the batches; echo repeats them whole, in batch_echo).

The epoch's order is the sampler's batches one after another, read once at
the epoch's start (dataecho.reading.sampled.batched_order, which keeps where
each batch starts); a row's position in it names its example. Worker threads
(or the consumer's own thread, ``num_workers=0``) read the batches
(dataecho.workers.batch_readers): each example with ``transform``, then its
leaves stacked (arrays stacked at the batch's own shape, ragged leaves packed,
objects listed). Where the loader does not know the examples' structure yet,
it is learned from the first batch a worker read, all of its examples, and
reported with ``on_structure``.

Its state: ``next_batch``, the number of the next sampler batch to read;
``queued``, the batches read but not yet handed on (``{"rows": positions}``),
oldest first, which a resumed stage reads again and yields first; ``order``
and ``bounds``, the epoch's batches (a batch sampler may not give the same
batches again).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...examples.leaves import stack
from ...examples.structure import Structure
from ...reading.source import EpochSource, SourceSpec
from ...workers.batch_readers import BatchReaders
from ...workers.failure import Failure
from ...workers.spec import WorkersSpec
from .. import checkpoint
from .stage import Batch, Replay
from .written import BatchBlocks, blocks_for, writable, written

__all__ = ["BatchesIntake", "BatchesSpec", "check_state"]


@dataclass(frozen=True)
class BatchesSpec:
    """What the intake of a batch sampler's batches needs (built by dataecho.pipeline.plan).

    Attributes:
        source: what is read; its order holds the batch sampler.
        workers: who reads: ``"inline"`` (the consumer's thread) or ``"thread"``.
        ahead: batches read ahead of the consumer at most (at least one per
            worker thread): the memory this stage holds, in batches.
        declared_ragged: leaf paths declared ragged.
        unresumable: why no state can be taken mid-epoch, or None.
    """

    source: SourceSpec
    workers: WorkersSpec
    ahead: int
    declared_ragged: frozenset[str]
    unresumable: str | None


class BatchesIntake:
    """Reads the batch sampler's batches; yields them in its order.

    Args:
        spec: the stage's settings.
        source: this epoch's view of the source (its ``order`` and ``bounds``).
        structure: the examples' structure, or None: learned from the first batch read.
        failure, on_failure: where a worker's exception goes, and what stops the epoch.
        resume: this stage's state from a checkpoint, or None.
        on_structure: called with the structure once the first batch told it
            (from a worker thread).
        memory: the loader's memory kept between epochs (batches written in
            place keep theirs with it: dataecho.pipeline.stages.written), or None.
    """

    name = "intake"

    def __init__(self, spec: BatchesSpec, source: EpochSource, structure: Structure | None, failure: Failure,
                 on_failure: Callable[[], None], resume: dict[str, Any] | None = None,
                 on_structure: Callable[[Structure], None] = lambda structure: None, memory: Any = None) -> None:
        self._spec, self._source, self.structure = spec, source, structure
        self.unresumable = spec.unresumable
        self._on_structure = on_structure
        self._learning = threading.Lock()
        self._read_into = getattr(source.reader, "read_into", None)  # a dataset's (dataecho.reading.dataset)
        self._memory = memory
        self._blocks: BatchBlocks | None = None  # where batches are written in place (see written)
        self._writes(structure)
        # Batches that had been read but not handed on when the state was taken: yielded first.
        self._replay = Replay(resume["queued"] if resume else None)
        count = len(source.bounds) - 1
        workers = spec.workers
        if source.spec.batches is not None and workers.auto:
            # Batches written in place: every read is a copy into batch memory, and two threads copy at once
            # (read_into at 150 KiB: 0.79 of an array source's rate with two, 0.68 starting with one).
            workers = dataclasses.replace(workers, count=max(workers.count, 2))
        self._readers = BatchReaders(self._read, count, resume["next_batch"] if resume else 0, workers,
                                     spec.ahead, failure, on_failure)

    # ---- the stage ----

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._replay:
            return self._replay.next(self.read_batch)
        return self._readers.take(timeout_s)

    def read_batch(self, ids: dict[str, np.ndarray]) -> Batch:
        """The batch whose rows are at positions ``ids["rows"]``, read again."""
        return self._batch(np.asarray(ids["rows"], dtype=np.uint64))

    def copy_arrays(self, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
        """A copy of a batch's leaves (object leaves: a list of the same objects)."""
        return tuple(leaf.copy() for leaf in arrays)

    def stop(self) -> None:
        self._readers.stop()

    def join(self, timeout_s: float) -> None:
        self._readers.join(timeout_s)

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        if self.unresumable is not None:
            return None
        handed, ready = self._readers.pending()
        order, sampler = self._source.saved_order()
        state = {
            "next_batch": handed + len(ready),
            "queued": self._replay.saved() + [batch.ids() for batch in ready],
            "order": checkpoint.compact(order),
            "bounds": checkpoint.compact(self._source.bounds),
        }
        if sampler is not None:
            state["sampler"] = sampler
        return state

    def counters(self) -> dict[str, Any]:
        workers = self._readers.counters()
        return {"fresh": sum(w["produced"] for w in workers), "workers": workers}

    # ---- reading ----

    def _read(self, number: int) -> Batch:
        """Batch ``number`` of the sampler (a worker's read)."""
        bounds = self._source.bounds
        return self._batch(np.arange(bounds[number], bounds[number + 1], dtype=np.uint64))

    def _batch(self, rows: np.ndarray) -> Batch:
        """The examples at positions ``rows``, read, transformed and stacked, or
        written in place where the dataset writes its examples (see written)."""
        blocks, structure = self._blocks, self.structure  # the blocks are set after the structure
        if blocks is not None:
            indices = self._source.order[rows.astype(np.int64)].tolist()
            return Batch(structure, tuple(written(structure, blocks, indices, self._read_into)), rows)
        examples = [self._source.read(int(position)) for position in rows]
        structure = self.structure if self.structure is not None else self._learn(examples)
        try:
            leaves = stack(structure, [structure.flatten(e) for e in examples], "a batch of batch_sampler",
                           batch_shapes=True)
        except ValueError as error:  # shapes that differ within a batch
            raise ValueError(f"{error}; a leaf whose length varies within a batch is ragged: declare it in "
                             f"`ragged` where the first batch read does not show it") from None
        return Batch(structure, leaves, rows)

    def _learn(self, examples: list[Any]) -> Structure:
        """The structure of the first batch read: one worker infers it, and the loader is told."""
        with self._learning:
            if self.structure is None:
                structure = self._source.structure_of(examples, self._spec.declared_ragged)
                self._on_structure(structure)
                self.structure = structure  # a worker that sees it knows the loader was told
                self._writes(structure)
        return self.structure

    def _writes(self, structure: Structure | None) -> None:
        """Batches are written in place from now on, where the source says so
        and ``structure`` allows it (set once the structure is)."""
        batches = self._source.spec.batches
        if batches is not None and self._read_into is not None and structure is not None and writable(structure):
            self._blocks = blocks_for(self._memory, structure.fields(), batches[0])


def check_state(spec: BatchesSpec, state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    """This stage's saved state, checked against the epoch's order (the saved
    one) and normalized: every value within what this stage could have saved.

    Raises:
        ValueError: a state this stage could not have saved, naming the key.
    """
    bounds = checkpoint.array_at(state, "bounds", np.int64, where)
    if not len(bounds) or bounds[0] != 0 or bounds[-1] != len(order) or (np.diff(bounds) <= 0).any():
        raise ValueError(f"{where}['bounds']: expected where each batch starts in the order, rising from 0 to "
                         f"its length {len(order)}, no batch empty")
    batches = len(bounds) - 1
    queued = checkpoint.batches_at(state, "queued", order, where)
    if len(queued) > batches:
        raise ValueError(f"{where}['queued']: more batches than the epoch's {batches}")
    for i, ids in enumerate(queued):
        if not len(ids["rows"]):
            raise ValueError(f"{where}['queued'][{i}]['rows']: an empty batch")
    checked = {"next_batch": checkpoint.int_at(state, "next_batch", where, batches), "queued": queued,
               "order": checkpoint.array_at(state, "order", np.int64, where), "bounds": bounds}
    if "sampler" in state:
        checked["sampler"] = checkpoint.sampler_at(state, where)
    return checked
