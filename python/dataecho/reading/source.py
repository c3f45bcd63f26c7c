"""What one epoch reads: the reading order of a map-style source (this rank's
shard of a seeded permutation) or an iterator over an iterable one, with
``transform`` applied, and the per-epoch seeds.

Positions in the order are also the examples' sequence numbers: a checkpoint
names an example by its position, and :meth:`EpochSource.read_rows` reads any
of them again.
"""

from __future__ import annotations

import itertools
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import stop_iteration_error
from ..examples.leaves import stack
from ..examples.structure import Structure
from .chunking import CHUNK
from .order import OrderSpec
from .readers import map_reader

__all__ = ["SAMPLE", "EpochSource", "Pickled", "SourceSpec", "is_map_style"]

SAMPLE = 8  # examples read first, to learn the structure (which leaves vary in length)


def is_map_style(source: Any) -> bool:
    """A dataset read by index: ``__len__`` and ``__getitem__`` (not a str or bytes)."""
    return hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(source, (str, bytes))


@dataclass(frozen=True)
class SourceSpec:
    """What an epoch's source needs to know.

    Attributes:
        dataset: the map-style dataset or the iterable.
        transform: per-example function run by the producers, or None.
        order: a map-style source's reading order; None for an iterable.
        seed: the loader's seed (the per-epoch seeds derive from it).
        rank: this process's rank (seeds differ per rank).
        for_processes: worker processes read it: the dataset is pickled for them.
        chunk: positions of a map-style order a worker claims at a time.
    """

    dataset: Any
    transform: Callable[[Any], Any] | None
    order: OrderSpec | None
    seed: int
    rank: int
    for_processes: bool
    chunk: int = CHUNK


class EpochSource:
    """The source as one epoch reads it.

    Args:
        spec: what to read.
        epoch: the epoch number (seeds the order).
        skip: iterable sources: examples to read and drop first (a resume).

    Attributes:
        order: map-style: the dataset index at each position this rank reads;
            None for iterables.
        reader: map-style: how positions of the order are read (dataecho.reading.readers).
        seeds: per-rank seeds of this epoch: [unused, batch echo and workers,
            echo buffer, augment output].
        pool: the loader's WorkerPool (``persistent_workers``), or None.
        memory: the loader's ``_core.BlockCache`` for the echo buffer, or None.
        for_workers: the source pickled once (worker processes), taken before
            this process reads from it, so that its reads do not leak into the
            workers' copies; else (or for running persistent workers) None.
    """

    def __init__(self, spec: SourceSpec, epoch: int, skip: int = 0, pool: Any = None,
                 memory: Any = None) -> None:
        self.spec = spec
        self.epoch = epoch
        self.pool, self.memory = pool, memory
        self.transform, self.chunk = spec.transform, spec.chunk
        # Persistent workers that are running have their copy: no need to pickle it again.
        kept = pool is not None and pool.running
        self.for_workers = Pickled(spec.dataset) if spec.for_processes and not kept else None
        self.order: np.ndarray | None = None
        self.iterator: Iterator[Any] | None = None
        self.reader: Any = None
        if spec.order is not None:
            # The same permutation on every rank (seeded by seed and epoch alone),
            # of which this rank reads its shard.
            self.order = spec.order.order(epoch)
            self.reader = map_reader(spec.dataset, spec.transform, self.order)
        else:
            self.iterator = itertools.islice(iter(spec.dataset), skip, None) if skip else iter(spec.dataset)
        # The shuffle, echo and worker seeds differ per rank.
        seeds = np.random.SeedSequence([spec.seed, epoch, spec.rank]).generate_state(4, dtype=np.uint64)
        self.seeds = [int(s) for s in seeds]

    def pickled(self) -> Pickled:
        """``for_workers``, or the source pickled now where it was not (the
        persistent workers it was left out for have died since)."""
        return self.for_workers if self.for_workers is not None else Pickled(self.spec.dataset)

    def __len__(self) -> int:
        """Positions in this epoch's order (map-style sources)."""
        return 0 if self.order is None else len(self.order)

    def first(self) -> list[Any]:
        """The first examples, transformed (up to SAMPLE; none for an empty
        epoch): positions 0, 1, ... of a map-style order, or the iterator's first."""
        if self.order is not None:
            return [self.read(position) for position in range(min(SAMPLE, len(self.order)))]
        return [self.transformed(example) for example in itertools.islice(self.iterator, SAMPLE)]

    def declared_ragged(self) -> set[str]:
        """Leaves the source itself says vary in length: a Hugging Face dataset's
        sequence features, where it is read through its Arrow table."""
        return self.reader.ragged_columns() if hasattr(self.reader, "ragged_columns") else set()

    def read(self, position: int) -> Any:
        """The example at ``position`` of the order, transformed."""
        return self.reader.one(position)

    def transformed(self, example: Any) -> Any:
        transform = self.transform
        try:
            return example if transform is None else transform(example)
        except StopIteration as stop:
            raise stop_iteration_error(stop, "transform") from stop

    def read_rows(self, structure: Structure, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """The examples at ``rows`` (positions), stacked as the buffer would
        gather them: the batches a resumed epoch re-reads."""
        return stack(structure, [structure.flatten(self.read(int(p))) for p in rows])


class Pickled:
    """A value pickled once, so that every worker gets the same bytes (and the
    parent's later reads from it do not leak into the workers' copies)."""

    def __init__(self, value: Any) -> None:
        self._bytes = pickle.dumps(value)

    def __reduce__(self) -> tuple:
        return pickle.loads, (self._bytes,)
