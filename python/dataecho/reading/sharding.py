"""Data-parallel sharding: each rank reads a disjoint part of a map-style
dataset, with the same number of examples (and so of batches) on every rank.

As torch's ``DistributedSampler`` does, every rank draws the same permutation
of the whole dataset from (seed, epoch), pads it by repeating its first
indices so that it divides evenly (or, with ``drop_last``, drops the tail),
and takes every ``world_size``-th index starting at its rank. Shuffling and
echoing then stay local to each rank, with a seed that differs per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _checks

__all__ = ["Shard", "resolve_shard"]


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
        return order[self.rank :: self.world_size]

    def per_rank(self, length: int, drop_last: bool) -> int:
        """Examples each rank reads per epoch."""
        if drop_last:
            return length // self.world_size
        return -(-length // self.world_size)


def resolve_shard(rank: Any, world_size: Any) -> Shard:
    """The shard from explicit ``rank``/``world_size``, else from an initialized
    ``torch.distributed`` process group, else the whole dataset.

    Raises:
        TypeError, ValueError: naming ``rank`` or ``world_size``.
    """
    if rank is None and world_size is None:
        rank, world_size = _torch_distributed()
    elif rank is None or world_size is None:
        raise ValueError("rank, world_size: give both, or neither (then torch.distributed decides)")
    world_size = _checks.positive_int("world_size", world_size)
    rank = _checks.integer("rank", rank, "an int")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}), got {rank}")
    return Shard(rank, world_size)


def _torch_distributed() -> tuple[int, int]:
    import sys

    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is None:
        return 0, 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
