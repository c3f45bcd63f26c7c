"""Where an epoch stands after a number of batches, worked out without its
examples: wherever reading is deterministic and the order is dataecho's own
(``LoaderConfig.replayable``), a rank's position follows from the seed, the
epoch, the world size and the batches it delivered.

A *stand-in* epoch runs the loader's own chain of stages over a source whose
examples are their dataset indices (dataecho.config.stand_in), read natively
in the caller's thread: it delivers the same positions in the same batches as
the real epoch, since deterministic reading depends on nothing else, at
millions of examples a second. Its state after ``k`` batches resumes what the
real epoch's state after ``k`` batches resumes.

An epoch's *history* says how it was delivered: ``[[world_size, batches],
...]``, one entry per job that delivered a part of it, each rank of that job
the same number of batches (a data-parallel job steps in lockstep): the first
from the epoch's start, each later one from where the job before it left the
epoch, dealt out over its ranks (dataecho.pipeline.progress.elastic). So:

- any rank's state resumes every rank of a job of the same world size
  (Lightning, HF Trainer and Accelerate save rank 0's alone): each replays its
  own position;
- any one state resumes a job of another world size: every old rank's
  position is replayed, and what they had not yet delivered is dealt out anew.

Cost: a stand-in reads and batches each delivery once (a few microseconds
each with an ``augment``, under one without); a rank replays its own part of
the epoch, an elastic resume every old rank's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...reading.sharding import Shard
from ..epoch import Epoch
from ..plan import Planner
from . import elastic

__all__ = ["Ledger", "job_ledger", "replayed_stages", "resumed_length"]


def _pass_through(example: Any, rng: Any) -> Any:
    """The stand-in's ``augment``: keyed by delivery as the user's, changes nothing."""
    return example


def _ignore(*args: Any) -> None:
    pass


@dataclass
class Ledger:
    """A whole job's account of one epoch, by dataset index: ``target``, the
    deliveries each index is to have in the epoch; ``delivered``, those it had."""

    target: np.ndarray
    delivered: np.ndarray

    @property
    def owed(self) -> np.ndarray:
        return np.maximum(self.target - self.delivered, 0)


def replayed_stages(planner: Planner, epoch: int,
                    history: list[list[int]]) -> tuple[dict[str, Any] | None, int | None]:
    """(the state of ``planner``'s rank ({stage name: state}, as the epoch's
    ``state()`` gives it; None at the epoch's start) after the epoch's
    ``history``, whose last job has ``planner``'s world size; and, where an
    earlier job had another, the epoch's batches on this rank in all, else None).

    Raises:
        ValueError: a history this configuration cannot have delivered (more
            batches than its epoch has), naming it.
    """
    *before, (world, batches) = history
    start, length = None, None
    if before:
        dealing = _dealing(planner, epoch, len(before))
        start = elastic.dealt(job_ledger(planner, epoch, before), dealing)[planner.shard.rank]
        length = sum(k for _, k in before) + elastic.start_batches(start, dealing)
    elif batches == 0:
        return None, None
    stages, _ = _run(planner, epoch, start, batches)
    return stages, length


def job_ledger(planner: Planner, epoch: int, history: list[list[int]]) -> Ledger:
    """The account of the epoch over every rank of every job in ``history``."""
    length = planner.examples
    ledger = Ledger(np.zeros(length, np.int64), np.zeros(length, np.int64))
    for segment, (world, batches) in enumerate(history):
        ranks = [planner.on_shard(Shard(rank, world)) for rank in range(world)]
        if segment == 0:
            starts: list[Any] = [None] * world
            for rank in ranks:
                order = rank.plan.source.order.order(epoch)
                np.add.at(ledger.target, order, elastic.counts_by_position(0, len(order), planner.echo_factor))
        else:
            dealing = _dealing(ranks[0], epoch, segment)
            starts = elastic.dealt(ledger, dealing)
            ledger.target = ledger.delivered + elastic.assigned(starts, dealing, length)
        for rank, start in zip(ranks, starts):
            _, indices = _run(rank, epoch, start, batches)
            np.add.at(ledger.delivered, indices, 1)
    return ledger


def _dealing(planner: Planner, epoch: int, segment: int) -> elastic.Dealing:
    if planner.plan.batch_echo is not None:
        raise ValueError("load_state_dict: a job that echoes whole batches (echo_at='batch') resumes mid-epoch on "
                         "the same number of ranks only; resume it at an epoch boundary")
    return elastic.Dealing(**planner.dealing(epoch, segment))


def _run(planner: Planner, epoch: int, start: dict[str, Any] | None,
         batches: int) -> tuple[dict | None, np.ndarray]:
    """(the stand-in's state after ``batches`` batches from ``start``, the
    dataset indices those batches delivered).

    Raises:
        ValueError: the epoch ended before ``batches`` batches.
    """
    running = Epoch(planner.stand_in(_pass_through), epoch, None, start, _ignore)
    delivered = []
    try:
        for taken in range(batches):
            try:
                delivered.append(np.asarray(next(running), dtype=np.int64).reshape(-1))
            except StopIteration:
                raise ValueError(
                    f"state: says rank {planner.shard.rank} of {planner.shard.world_size} delivered {batches} batches "
                    f"of epoch {epoch}, but that epoch has {taken}; a state resumes only a loader with the "
                    f"arguments and dataset length it was saved with") from None
        stages = running.state()
    finally:
        running.close()
    return stages, np.concatenate(delivered) if delivered else np.zeros(0, np.int64)


def resumed_length(planner: Planner, epoch: int, history: list[list[int]]) -> int:
    """Batches of ``epoch`` that ``planner``'s rank yields in all, across a
    ``history`` whose last job resumed it under another world size: those of
    the jobs before, and its own share of what they left."""
    *before, _ = history
    dealing = _dealing(planner, epoch, len(before))
    start = elastic.dealt(job_ledger(planner, epoch, before), dealing)[planner.shard.rank]
    return sum(batches for _, batches in before) + elastic.start_batches(start, dealing)
