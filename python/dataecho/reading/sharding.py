"""Data-parallel sharding: each rank reads a disjoint part of a map-style
dataset, with the same number of examples (and so of batches) on every rank.

As torch's ``DistributedSampler`` does, every rank draws the same permutation
of the whole dataset from (seed, epoch), pads it by repeating its first
indices so that it divides evenly (or, with ``drop_last``, drops the tail),
and takes every ``world_size``-th index starting at its rank. Shuffling and
echoing then stay local to each rank, with a seed that differs per rank.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _checks

__all__ = ["Shard", "current_shard", "resolve_shard", "warn_if_ungrouped"]


@dataclass(frozen=True)
class Shard:
    """This process's part of the data: ``rank`` of ``world_size``."""

    rank: int = 0
    world_size: int = 1

    def order(self, length: int, shuffle: bool, seed: Any, drop_last: bool) -> np.ndarray:
        """The dataset indices this rank reads in one epoch, in reading order.

        Args:
            length: examples in the whole dataset.
            shuffle: permute the dataset (the same permutation on every rank).
            seed: seeds that permutation; the same on every rank.
            drop_last: drop the tail that does not divide evenly instead of padding.
        """
        order = np.random.default_rng(seed).permutation(length) if shuffle else np.arange(length)
        if self.world_size == 1:
            return order
        if drop_last:
            order = order[: length - length % self.world_size]
        elif length % self.world_size:
            pad = self.world_size - length % self.world_size
            order = np.concatenate([order, np.resize(order, pad)])
        return order[self.rank :: self.world_size].copy()  # a copy: contiguous, and without the other ranks

    def per_rank(self, length: int, drop_last: bool) -> int:
        """Examples each rank reads per epoch."""
        if drop_last:
            return length // self.world_size
        return -(-length // self.world_size)


def resolve_shard(rank: Any, world_size: Any) -> Shard:
    """The shard from explicit ``rank``/``world_size``, else from an initialized
    ``torch.distributed`` process group, else the whole dataset (see
    :func:`current_shard`, which a loader asks again when each epoch starts).

    Raises:
        TypeError, ValueError: naming ``rank`` or ``world_size``.
    """
    if rank is None and world_size is None:
        return current_shard()
    if rank is None or world_size is None:
        raise ValueError("rank, world_size: give both, or neither (then torch.distributed decides)")
    world_size = _checks.positive_int("world_size", world_size)
    rank = _checks.integer("rank", rank, "an int")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}), got {rank}")
    return Shard(rank, world_size)


def current_shard() -> Shard:
    """This process's part now: from an initialized ``torch.distributed``
    process group, else the whole dataset. torch is never imported just to ask."""
    torch = sys.modules.get("torch")
    if torch is None:
        return Shard()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return Shard(dist.get_rank(), dist.get_world_size())
    return Shard()


def warn_if_ungrouped(shard: Shard) -> None:
    """Warns, once per process, where the environment says the job is
    distributed (``WORLD_SIZE`` > 1, as torchrun and Lightning set it) but no
    process group exists as an epoch starts: every rank would read the whole
    dataset."""
    global _warned
    if _warned or shard.world_size > 1:
        return
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1:
        _warned = True
        warnings.warn(
            f"EchoLoader: WORLD_SIZE={world} says this is one of {world} ranks, but no torch.distributed process "
            f"group is initialized as the epoch starts, so this rank reads the whole dataset; call "
            f"torch.distributed.init_process_group() before iterating, or give rank= and world_size=",
            UserWarning, stacklevel=4)


_warned = False
