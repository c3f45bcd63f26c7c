"""What an epoch uses beside its source: its seeds, named, and the loader's
resources that outlive it (persistent worker processes, the echo buffer's
memory, the process group ranks keep in lockstep on). The epoch builds one
:class:`EpochResources` and hands it to the stages and the readers it starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["EpochResources", "Seeds"]


class Seeds(NamedTuple):
    """One rank's seeds for one epoch, drawn from (the loader's seed, epoch, rank).

    Attributes:
        batch_echo: the batch echo stage's draws.
        workers: worker processes' generators (each offset by its number).
        buffer: the echo buffer's draws.
        augment: the augment stage's output buffer draws.
    """

    batch_echo: int
    workers: int
    buffer: int
    augment: int

    @classmethod
    def of(cls, seed: int, epoch: int, rank: int) -> Seeds:
        """The seeds of ``epoch`` on ``rank``: they differ per rank and per epoch."""
        drawn = [int(s) for s in np.random.SeedSequence([seed, epoch, rank]).generate_state(4, dtype=np.uint64)]
        return cls(batch_echo=drawn[1], workers=drawn[1], buffer=drawn[2], augment=drawn[3])


@dataclass(frozen=True)
class EpochResources:
    """What the stages of one epoch use beside its source.

    Attributes:
        seeds: this rank's seeds for the epoch.
        pool: the loader's persistent worker processes
            (dataecho.workers.pool.WorkerPool, ``persistent_workers=True``), or None.
        memory: the loader's ``_core.BlockCache`` for the echo buffer's slots, or None.
        group: the process group ranks keep in lockstep on (``echo_factor="auto"``), or None.
    """

    seeds: Seeds
    pool: Any = None
    memory: Any = None
    group: Any = None
