"""What one epoch reads: the reading order of a map-style source (this rank's
shard of a seeded permutation) or an iterator over an iterable one, with
``transform`` applied. (An epoch's seeds and the loader's resources are
dataecho.workers.resources'.)

Positions in the order are also the examples' sequence numbers: a checkpoint
names an example by its position, and :meth:`EpochSource.read_rows` reads any
of them again. An iterable's examples are named by their position in its
iteration; one that can restart part-way (dataecho.reading.restart) is marked
as it is read, so that a resume reads it again from near where the state stood.
"""

from __future__ import annotations

import itertools
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator

import numpy as np

from ..errors import stop_iteration_error
from ..examples.leaves import stack
from ..examples.structure import Structure
from .chunking import CHUNK, chunked
from .map_readers import map_reader
from .order import OrderSpec
from .restart import Mark, Marks, restart_hooks
from .sampled import LazyOrder

__all__ = ["SAMPLE", "EpochSource", "SourceSpec", "cut", "in_fixed_order", "is_map_style"]

SAMPLE = 8  # examples read first, to learn the structure (which leaves vary in length)


def is_map_style(source: Any) -> bool:
    """A dataset read by index: ``__len__`` and ``__getitem__`` (not a str or
    bytes), and not a torch ``IterableDataset``, which is iterable-style whatever
    else it defines (torch's ``Dataset`` base class defines ``__getitem__``, so
    an ``IterableDataset`` with ``__len__`` would otherwise look map-style)."""
    if isinstance(source, (str, bytes)) or not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        return False
    return not _is_torch_iterable(source)


def in_fixed_order(source: Any) -> bool:
    """An iterable yields its examples in the same order each time it is read
    (a source kind that does not says so with ``fixed_order = False``, as
    dataecho.reading.ray.RayRows): only then can reading be deterministic."""
    return getattr(source, "fixed_order", True)


def _is_torch_iterable(source: Any) -> bool:
    # Only where torch is already imported: a torch dataset cannot exist otherwise.
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(source, data.IterableDataset)


@dataclass(frozen=True)
class SourceSpec:
    """What an epoch's source needs to know.

    Attributes:
        dataset: the map-style dataset or the iterable.
        transform: per-example function run by the producers, or None.
        order: a map-style source's reading order; None for an iterable.
        seed: the loader's seed (the per-epoch seeds derive from it:
            dataecho.workers.resources.Seeds).
        rank: this process's rank (seeds differ per rank).
        chunk: positions of a map-style order a worker claims at a time.
        marks: a restartable iterable (dataecho.reading.restart) whose states
            a checkpoint can use: its iteration is marked as it is read.
        batches: (batch_size, drop_last) where a map-style order is read in
            whole batches of its own (dataecho.pipeline.stages.written): the
            epoch gives bounds for them, as a batch sampler's; else None.
    """

    dataset: Any
    transform: Callable[[Any], Any] | None
    order: OrderSpec | None
    seed: int
    rank: int
    chunk: int = CHUNK
    marks: bool = False
    batches: tuple[int, bool] | None = None


def cut(order: np.ndarray, batch_size: int, drop_last: bool) -> tuple[np.ndarray, np.ndarray]:
    """``order`` in batches of ``batch_size`` as (order, bounds): batch ``i`` is
    ``order[bounds[i]:bounds[i + 1]]``; a short last batch kept, or dropped
    (and its positions with it) with ``drop_last``."""
    length = len(order) - len(order) % batch_size if drop_last else len(order)
    bounds = np.arange(0, length + batch_size, batch_size, dtype=np.int64)
    bounds[-1] = min(bounds[-1], length)
    if len(bounds) > 1 and bounds[-1] == bounds[-2]:
        bounds = bounds[:-1]
    return np.asarray(order[:length]), bounds


class EpochSource:
    """The source as one epoch reads it.

    Args:
        spec: what to read.
        epoch: the epoch number (seeds the order).
        skip: iterable sources: examples to read and drop first (a resume).
        saved_order, saved_bounds: a sampler's order (and a batch sampler's
            bounds) as a state saved them (a resume), or None.
        restart: a restartable iterable's state at a position at or before
            where reading resumes (a resume), or None: it is restarted there
            rather than iterated from its start.
        sampler_state: with ``saved_order``, where a stateful sampler stood
            once it gave it (dataecho.reading.stateful), or None.

    Attributes:
        order: map-style: the dataset index at each position this rank reads;
            None for iterables.
        bounds: with a batch sampler, where each of its batches starts in
            ``order`` (batch i is positions ``bounds[i]`` to ``bounds[i + 1] - 1``);
            else None.
        reader: map-style: how positions of the order are read (dataecho.reading.map_readers).
        iterator: iterable sources: the iterator, made by whoever first asks for
            it (a reading thread: ``__iter__`` is user code, and the training
            loop's thread does not run it when workers read).
        marks: where a restartable iterable stood before the chunks read
            (positions in the epoch's iteration), or None.
    """

    def __init__(self, spec: SourceSpec, epoch: int, skip: int = 0, saved_order: np.ndarray | None = None,
                 saved_bounds: np.ndarray | None = None, restart: Mark | None = None,
                 sampler_state: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.epoch = epoch
        self.transform, self.chunk = spec.transform, spec.chunk
        self.order: np.ndarray | None = None
        self.bounds: np.ndarray | None = None
        self.reader: Any = None
        self._skip = skip
        self.marks = Marks() if spec.marks and spec.order is None else None
        # A state's restart serves only an iterable that can restart (else it is read from its start).
        self._restart = restart if self.marks is not None else None
        # What says where a restartable iterable stands, and restarts it (the iterable, or an adapter).
        self._hooks = restart_hooks(spec.dataset) if self.marks is not None else None
        self._order_saved = saved_order is not None
        self._iterator: Iterator[Any] | None = None
        self._iterator_lock = threading.Lock()
        self._sampler_state = sampler_state
        if spec.order is not None:
            # The same permutation on every rank (seeded by seed and epoch alone), of which this
            # rank reads its shard; or a sampler's order (a batch sampler's, read whole now).
            if saved_order is None:
                self.order, self.bounds, self._sampler_state = spec.order.drawn(epoch)
                if spec.batches is not None:
                    self.order, self.bounds = cut(self.order, *spec.batches)
            else:
                self.order, self.bounds = spec.order.resumed(saved_order, sampler_state), saved_bounds
            self.reader = map_reader(spec.dataset, spec.transform, self.order)

    @property
    def iterator(self) -> Iterator[Any]:
        with self._iterator_lock:
            if self._iterator is None and self.marks is not None:
                self._iterator = self._begin()
            elif self._iterator is None:
                iterator = iter(self.spec.dataset)
                self._iterator = itertools.islice(iterator, self._skip, None) if self._skip else iterator
            return self._iterator

    def _begin(self) -> Iterator[Any]:
        """A restartable iterable's iterator, at position :attr:`start`: restarted
        from the saved state, the examples up to ``skip`` dropped now (so that
        its state is that of its next position), and marked there."""
        dataset, restart, hooks = self.spec.dataset, self._restart, self._hooks
        iterator = iter(dataset) if restart is None else hooks.iter_from(restart.state)
        ahead = self.start - (0 if restart is None else restart.position)
        next(itertools.islice(iterator, ahead, ahead), None)  # drops `ahead` examples
        self.marks.add(self.start, hooks.state_of(iterator))
        return iterator

    @property
    def start(self) -> int:
        """An iterable's position of its iterator's first example: 0, or on
        resume where it skips to or restarts from."""
        return max(self._skip, self._restart.position if self._restart else 0)

    def chunks(self, first_seq: int, blocks: bool) -> Iterator[tuple[int, Any]]:
        """The iterator's examples in chunks numbered from ``first_seq``
        (dataecho.reading.chunking.chunked), each marked before it is read
        where the iterable is restartable."""
        iterator, marks = self.iterator, self.marks
        if marks is None:
            return chunked(iterator, first_seq, blocks=blocks)
        state_of, offset = self._hooks.state_of, self._skip  # seqs count from the skip

        def mark(seq: int) -> None:
            marks.add(offset + seq, state_of(iterator))

        return chunked(iterator, first_seq, blocks=blocks, before=mark)

    def __len__(self) -> int:
        """Positions in this epoch's order (map-style sources; of a sampler
        without a length, those read so far)."""
        return 0 if self.order is None else len(self.order)

    @property
    def length(self) -> int | None:
        """Positions in this epoch's order; None where a sampler without a length decides it."""
        return None if self.order is None or isinstance(self.order, LazyOrder) else len(self.order)

    @property
    def end(self) -> int:
        """The end of the positions producers may claim (beyond a lazy order's
        end a claim reads nothing, and the producer stops)."""
        return self.length if self.length is not None else 1 << 62

    @property
    def sampled(self) -> bool:
        """The order is a sampler's (or a batch sampler's), or came from a state
        (spread over another world size): a state saves it (see OrderSpec.resumed)."""
        return self.spec.order is not None and (self.spec.order.sampled or self._order_saved)

    def saved_order(self) -> tuple[np.ndarray, dict[str, Any] | None]:
        """Map-style: the order as a state saves it (a lazy one's indices read
        so far), and where a stateful sampler stood once it gave them, or None
        (dataecho.reading.stateful)."""
        if isinstance(self.order, LazyOrder):
            return self.order.saved()
        return self.order, self._sampler_state

    def available(self, count: int) -> int:
        """Map-style: how many of the first ``count`` positions exist."""
        if isinstance(self.order, LazyOrder):
            return self.order.available(count)
        return min(count, len(self))

    def keep(self, positions: set[int], count: int) -> None:
        """An iterable source resumed: reads its examples up to position ``count``
        again (from :attr:`start`: its first, or where it restarts), keeping those
        at ``positions`` (the examples a checkpoint names: resident or in batches
        on their way), so that ``read`` gives them; reading then goes on from
        position ``count``.

        Raises:
            ValueError: the source now has fewer than ``count`` examples.
        """
        iterator, kept = self.iterator, {}
        for position in range(self.start, count):
            example = next(iterator, _END)
            if example is _END:
                raise ValueError(f"load_state_dict: the source ended after {position} examples, but the state was "
                                 f"saved after {count} were read; a resumed iterable must yield what it yielded "
                                 f"before")
            if position in positions:
                kept[position] = example
        self.reader = _Kept(kept, self.transformed)

    def first(self) -> list[Any]:
        """The first examples, transformed (up to SAMPLE; none for an empty
        epoch): positions 0, 1, ... of a map-style order, or the iterator's first."""
        if self.order is not None:
            return [self.read(position) for position in range(self.available(SAMPLE))]
        return [self.transformed(example) for example in itertools.islice(self.iterator, SAMPLE)]

    def structure_of(self, examples: list[Any], declared: Collection[str], strict: bool = True) -> Structure | None:
        """The structure of the first examples read (None for none: an empty
        epoch), with the leaves ``declared`` ragged and those the source itself
        says vary in length (see Structure.infer)."""
        declared = set(declared) | self.declared_ragged()
        return None if not examples else Structure.infer(examples[0], examples[1:], declared, strict=strict)

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


_END = object()


class _Kept:
    """The examples of a resumed iterable source that a checkpoint names, by position."""

    def __init__(self, examples: dict[int, Any], transformed: Callable[[Any], Any]) -> None:
        self._examples, self._transformed = examples, transformed

    def one(self, position: int) -> Any:
        return self._transformed(self._examples[position])
