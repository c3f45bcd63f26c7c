"""The reading order of a map-style source: which dataset indices this rank
reads in an epoch, and in which order.

Without a ``sampler`` it is this rank's shard of a permutation seeded by (seed,
epoch), the same on every rank (see dataecho.reading.sharding). With one it is what
the sampler yields, taken once at the start of the epoch and not sharded again:
as in DataLoader, a sampler (``DistributedSampler``, say) decides.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from ..config.loader_config import LoaderConfig

__all__ = ["LoaderSampler", "batches_per_epoch", "epoch_order", "examples_per_epoch", "order_seed"]


def order_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's reading order: the same on every rank."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])


def epoch_order(config: LoaderConfig, epoch: int) -> np.ndarray:
    """The dataset indices read in `epoch`, in reading order.

    Raises:
        TypeError, IndexError: a sampler that yields something else than
            indices of the dataset.
    """
    length = len(config.source)
    if config.sampler is None:
        return config.shard.order(length, config.shuffle, order_seed(config.seed, epoch), config.drop_last)
    try:
        order = np.fromiter((int(i) for i in config.sampler), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"sampler: expected it to yield int indices ({exc})") from None
    if len(order) and (order.min() < 0 or order.max() >= length):
        bad = order[(order < 0) | (order >= length)][0]
        raise IndexError(f"sampler: yielded index {bad}, outside the dataset's {length} examples")
    return order


def examples_per_epoch(config: LoaderConfig) -> int:
    """Examples this rank reads per epoch (map-style sources)."""
    if config.sampler is not None:
        if not hasattr(config.sampler, "__len__"):
            raise TypeError("len(): the sampler has no len()")
        return len(config.sampler)
    return config.shard.per_rank(len(config.source), config.drop_last)


def exact_deliveries(count: int, echo: float) -> int:
    """Deliveries of `count` items with exact echo counts: floor(e) each, and one
    more for floor(count * f) of them (f = e - floor(e))."""
    whole = math.floor(echo)
    return count * whole + math.floor(count * (echo - whole))


def batches_per_epoch(config: LoaderConfig) -> int:
    """``len(loader)``: batches per epoch on this rank, for a map-style source and
    a fixed echo factor: integer, or fractional with exact echo counts
    (``deterministic=True`` or several ranks).

    Raises:
        TypeError: an iterable source, or a number of batches that is random.
    """
    if not config.map_style:
        raise TypeError("len(): the source is an iterable of unknown length")
    fixed = config.echo_factor != "auto" and (float(config.echo_factor).is_integer() or config.exact_echo)
    if not fixed:
        raise TypeError("len(): the number of batches is random with a fractional or 'auto' echo factor")
    rounding = math.floor if config.drop_last else math.ceil
    examples = examples_per_epoch(config)
    if config.echo_at == "batch":
        return exact_deliveries(rounding(examples / config.batch_size), float(config.echo_factor))
    return rounding(exact_deliveries(examples, float(config.echo_factor)) / config.batch_size)


class LoaderSampler:
    """``loader.sampler`` when no sampler was given: the loader's own order, as
    a torch Sampler would show it, with ``set_epoch`` (which tools such as
    Lightning call on a loader's sampler) forwarded to the loader.

    Iterating it gives the indices the next epoch reads (map-style sources).
    """

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        config = self._loader.config
        if not config.map_style:
            raise TypeError("sampler: an iterable source has no order of indices")
        return iter(epoch_order(config, self._loader.next_epoch).tolist())

    def __len__(self) -> int:
        if not self._loader.config.map_style:
            raise TypeError("len(): an iterable source has no length")
        return examples_per_epoch(self._loader.config)

    def __repr__(self) -> str:
        return f"LoaderSampler(epoch={self._loader.next_epoch})"
