"""The reading order of a map-style source: which dataset indices this rank
reads in an epoch, and in which order.

Without a ``sampler`` it is this rank's shard of a permutation seeded by (seed,
epoch), the same on every rank (see dataecho.reading.sharding). With one it is what
the sampler yields (dataecho.reading.sampled), not sharded again: as in
DataLoader, a sampler (``DistributedSampler``, say) decides. With a
``batch_sampler`` it is the sampler's batches one after another, with where each
batch starts (:meth:`OrderSpec.batches`), not sharded again either.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from .sampled import LazyOrder, batched_order, sampled_order
from .sharding import Shard
from .stateful import restored

__all__ = ["LoaderSampler", "OrderSpec", "order_seed"]


def order_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's reading order: the same on every rank."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])


@dataclass(frozen=True)
class OrderSpec:
    """What decides a map-style source's reading order.

    Attributes:
        dataset: the map-style source (its length is read each epoch).
        sampler: an iterable of indices that decides the order, or None.
        shard: this rank's part of the dataset (without a sampler).
        shuffle: permute the dataset each epoch (without a sampler).
        seed: seeds the permutations; the same on every rank.
        drop_last: a shard drops the tail that does not divide evenly, instead of padding.
        batch_sampler: an iterable of lists of indices that decides the order
            and the batches, or None.
    """

    dataset: Any
    sampler: Any
    shard: Shard
    shuffle: bool
    seed: int
    drop_last: bool
    batch_sampler: Any = None

    @property
    def sampled(self) -> bool:
        """A sampler or batch sampler decides the order: it may not give it again,
        so a state saves it (see :meth:`resumed`)."""
        return self.sampler is not None or self.batch_sampler is not None

    def order(self, epoch: int) -> np.ndarray | LazyOrder:
        """The dataset indices read in ``epoch``, in reading order (a sampler's
        as dataecho.reading.sampled reads it: a LazyOrder where it has no length;
        a batch sampler's batches one after another).

        Raises:
            TypeError, IndexError: a sampler that yields something else than
                indices of the dataset (ValueError: an empty batch).
        """
        return self.drawn(epoch)[0]

    def drawn(self, epoch: int) -> tuple[np.ndarray | LazyOrder, np.ndarray | None, dict[str, Any] | None]:
        """``epoch``'s order as :meth:`order` gives it, with where each batch of
        a batch sampler starts in it (else None) and where a stateful sampler
        stood once it was read (dataecho.reading.stateful; else None)."""
        length = len(self.dataset)
        if self.batch_sampler is not None:
            return batched_order(self.batch_sampler, length)
        if self.sampler is None:
            return self.shard.order(length, self.shuffle, order_seed(self.seed, epoch), self.drop_last), None, None
        order, state = sampled_order(self.sampler, length)
        return order, None, state

    def resumed(self, saved: np.ndarray, state: dict[str, Any] | None = None) -> np.ndarray | LazyOrder:
        """A sampler's order of an epoch resumed from a state, which saved the
        indices it had read (all of them, for a sampler with a length): a
        sampler that draws a new order each time (``RandomSampler``) is not
        asked again for the positions the state names. A sampler without a
        length goes on from where the saved indices end; a batch sampler's
        order was saved whole.

        A stateful sampler's ``state`` (dataecho.reading.stateful) is restored
        first: one with a length (or a batch sampler) is then asked once for an
        index beyond its epoch's (as StatefulDataLoader would go on reading it),
        so that it stands where it stood after giving them; one without a
        length goes on from its restored iterator.
        """
        decider = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if decider is not None and state is not None:
            iterator = restored(decider, state)
            if self.batch_sampler is not None or hasattr(self.sampler, "__len__"):
                next(iterator, None)
                return saved
            return LazyOrder(iterator, len(self.dataset), saved, sampler=self.sampler)
        if self.sampler is None or self.batch_sampler is not None or hasattr(self.sampler, "__len__"):
            # Whole (without a sampler: one spread over another world size, dataecho.pipeline.progress.elastic).
            return saved
        return LazyOrder(itertools.islice(iter(self.sampler), len(saved), None), len(self.dataset), saved)

    def examples_per_epoch(self) -> int:
        """Examples this rank reads per epoch.

        Raises:
            TypeError: a sampler without a length, or a batch sampler (its
                batches' sizes are known once it is read).
        """
        if self.batch_sampler is not None:
            raise TypeError("len(): the examples of a batch_sampler's epoch are known once its batches are read")
        if self.sampler is not None:
            if not hasattr(self.sampler, "__len__"):
                raise TypeError("len(): the sampler has no len()")
            return len(self.sampler)
        return self.shard.per_rank(len(self.dataset), self.drop_last)


class LoaderSampler:
    """``loader.sampler`` when no sampler was given: the loader's own order, as
    a torch Sampler would show it, with ``set_epoch`` (which tools such as
    Lightning call on a loader's sampler) forwarded to the loader.

    Iterating it gives the indices the next epoch reads (map-style sources).

    Args:
        order: the loader's order, or None for an iterable source.
        next_epoch: the number of the epoch the loader starts next.
        set_epoch: the loader's ``set_epoch``.
    """

    def __init__(self, order: OrderSpec | None, next_epoch: Callable[[], int],
                 set_epoch: Callable[[int], None]) -> None:
        self._order, self._next_epoch, self._set_epoch = order, next_epoch, set_epoch

    def set_epoch(self, epoch: int) -> None:
        self._set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        if self._order is None:
            raise TypeError("sampler: an iterable source has no order of indices")
        return iter(self._order.order(self._next_epoch()).tolist())

    def __len__(self) -> int:
        if self._order is None:
            raise TypeError("len(): an iterable source has no length")
        return self._order.examples_per_epoch()

    def __repr__(self) -> str:
        return f"LoaderSampler(epoch={self._next_epoch()})"
