"""Resuming under another world size: what a job of ``W1`` ranks had not yet
delivered of an epoch, dealt out over the ``W2`` ranks of the job that
resumes it.

What was delivered follows from any one rank's state (dataecho.pipeline.progress.replay
replays every old rank's batches), as a :class:`~dataecho.pipeline.progress.replay.Ledger`
by dataset index: the deliveries each index is to have in the epoch, and those
it had. Then, seeded by (seed, epoch, job):

- an index never delivered is *fresh*: it is dealt to one new rank, whose echo
  buffer reads it as any fresh example (its echo count by its new position:
  ``echo_factor`` for a whole factor, ``floor`` or ``ceil`` of it for a
  fractional one);
- an index delivered part of its count is *partly delivered*: all of its
  remaining deliveries go to one new rank (in entries of at most
  ``ceil(echo_factor)``), where they start resident in the echo buffer with
  those counts, mixed by the buffer's shuffle with the fresh ones; where more
  are owed than the buffer holds, the rest come first, as full batches.

Entries are dealt so that every new rank has about the same number of
deliveries; a rank then short of the others' number of batches delivers a few
examples once more (fewer than a batch's worth, its own where it has any), as
a distributed sampler pads its shards: every new rank yields the same number
of batches, and across the two jobs every example has its count (those few
one more). Each new rank's start is a state of its own (an ``order``, its
resident examples, its queued batches), which it checks and loads as any
state. Only example echoing: whole batches cannot be dealt out example by
example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config.echo import counts_at

__all__ = ["Dealing", "assigned", "batches_of", "counts_by_position", "dealt", "start_batches"]

_PAD_ROUNDS = 64  # a bound on padding passes (each adds a delivery to every rank short of the most)


@dataclass(frozen=True)
class Dealing:
    """What dealing out an epoch's rest needs: the new job's ``world_size``,
    its ranks' ``batch_size``, ``factor`` (echo), ``drop_last``, the echo
    buffer's ``capacity``, and the seed, epoch and ``segment`` (the job's
    place in the epoch's history) that seed it; ``augmented``: an augment
    stage follows the intake."""

    world_size: int
    batch_size: int
    factor: float
    drop_last: bool
    capacity: int
    seed: int
    epoch: int
    segment: int
    augmented: bool


def counts_by_position(first: int, count: int, factor: float) -> np.ndarray:
    """Deliveries of positions ``first`` to ``first + count - 1`` of an order
    with exact echo counts (the native ``EchoCounts::by_seq``)."""
    return counts_at(np.arange(first, first + count), factor)


def dealt(ledger: Any, dealing: Dealing) -> list[dict[str, Any]]:
    """Every new rank's start ({stage name: state}), by rank: what ``ledger``
    says is owed, dealt out (see the module docstring)."""
    rng = np.random.default_rng(np.random.SeedSequence([dealing.seed, dealing.epoch, dealing.segment, 0x5EA1]))
    owed, delivered = ledger.owed, ledger.delivered
    fresh = rng.permutation(np.flatnonzero((delivered == 0) & (owed > 0)))
    most = math.ceil(dealing.factor)
    partly = [(int(index), min(most, int(owed[index]) - start))
              for index in np.flatnonzero((delivered > 0) & (owed > 0)).tolist()
              for start in range(0, int(owed[index]), most)]
    partly = [partly[i] for i in rng.permutation(len(partly))]
    ranks = _deal(partly, fresh, dealing)
    _pad(ranks, owed, dealing)
    return [_start(entries, own_fresh, dealing) for entries, own_fresh in ranks]


def _deal(partly: list, fresh: np.ndarray, dealing: Dealing) -> list[tuple[list, np.ndarray]]:
    """(partly delivered entries, fresh indices) per new rank: the entries to
    whoever has the fewest deliveries, then the fresh indices so as to level
    every rank's deliveries."""
    world = dealing.world_size
    loads = [0] * world
    entries: list[list] = [[] for _ in range(world)]
    for entry in partly:
        rank = min(range(world), key=lambda r: (loads[r], r))
        entries[rank].append(entry)
        loads[rank] += entry[1]
    level = (sum(loads) + len(fresh) * dealing.factor) / world
    wanted = [max(0.0, (level - load) / dealing.factor) for load in loads]
    share = np.floor(wanted).astype(np.int64)
    short = len(fresh) - int(share.sum())
    for rank in np.argsort([share[r] - wanted[r] for r in range(world)], kind="stable")[:max(0, short)]:
        share[rank] += 1  # the largest remainders first
    while share.sum() > len(fresh):  # rounding gave out more than there is
        share[int(np.argmax(share))] -= 1
    bounds = np.concatenate([[0], np.cumsum(share)])
    return [(entries[r], fresh[bounds[r]:bounds[r + 1]]) for r in range(world)]


def deliveries_between(first: int, count: int, factor: float) -> int:
    """The sum of :func:`counts_by_position` (its terms telescope)."""
    whole = math.floor(factor)
    fraction = factor - whole
    end = float(first + count)
    return count * whole + int(math.floor(end * fraction) - math.floor(float(first) * fraction))


def _total(entries: list, fresh: np.ndarray, factor: float) -> int:
    """A rank's deliveries: its entries', and its fresh indices' by their positions after them."""
    return sum(count for _, count in entries) + deliveries_between(len(entries), len(fresh), factor)


def batches_of(deliveries: int, dealing: Dealing) -> int:
    """The batches a rank with ``deliveries`` yields (one run of them)."""
    rounding = math.floor if dealing.drop_last else math.ceil
    return rounding(deliveries / dealing.batch_size)


def _pad(ranks: list[tuple[list, np.ndarray]], owed: np.ndarray, dealing: Dealing) -> None:
    """Adds deliveries of one example (the rank's own, else any owed one) to
    the ranks with fewer batches than the most, until all have as many: one
    more for an entry that has fewer than ``ceil(echo_factor)`` (which moves
    nothing), else a new entry of one (which moves the fresh examples one
    position on: their counts by position may change by one, either way)."""
    most_echoes = math.ceil(dealing.factor)
    pool = np.flatnonzero(owed > 0)
    pool = pool if len(pool) else np.arange(len(owed))
    for _ in range(_PAD_ROUNDS * dealing.batch_size):
        batches = [batches_of(_total(e, f, dealing.factor), dealing) for e, f in ranks]
        most = max(batches)
        short = [r for r in range(len(ranks)) if batches[r] < most]
        if not short:
            return
        for rank in short:
            entries, fresh = ranks[rank]
            bumped = next((i for i in range(len(entries) - 1, -1, -1) if entries[i][1] < most_echoes), None)
            if bumped is not None:
                entries[bumped] = (entries[bumped][0], entries[bumped][1] + 1)
                continue
            own = [index for index, _ in entries] + fresh.tolist()
            source = own if own else pool.tolist()
            entries.append((int(source[len(entries) % len(source)]), 1))
    raise RuntimeError("elastic resume: the new ranks' batch counts did not level")  # a bug, not an input


def _start(entries: list, fresh: np.ndarray, dealing: Dealing) -> dict[str, Any]:
    """A new rank's start: its entries at the first positions of its order
    (resident in the echo buffer, those beyond its capacity queued first as
    full batches), its fresh indices after them."""
    order = np.concatenate([np.array([index for index, _ in entries], dtype=np.int64), fresh.astype(np.int64)])
    echoes = np.array([count for _, count in entries], dtype=np.int64)
    resident = min(len(entries), dealing.capacity)
    queued = _overflow(echoes, resident, dealing.batch_size)
    kept = np.flatnonzero(echoes[:resident] > 0)
    empty = np.zeros(0, dtype=np.uint64)
    intake = {"batches": 0, "rng_state": 0, "next_seq": len(entries), "available": len(kept),
              "positions": kept.astype(np.uint64), "indices": order[kept], "echoes": echoes[kept].astype(np.uint32),
              "queued": queued, "ended": False, "order": order}
    stages: dict[str, Any] = {"intake": intake}
    if dealing.augmented:
        stages["augment"] = {"taken": 0, "output": None, "queued": [],
                             "pending": {"deliveries": empty, "rows": empty}}
    stages["delivery"] = {"in_flight": []}
    return stages


def _overflow(echoes: np.ndarray, resident: int, batch_size: int) -> list[dict[str, np.ndarray]]:
    """The deliveries of the entries at positions ``resident`` and after, as
    full batches of positions, round by round (an entry at most once a round);
    a last batch short of full takes one delivery each of resident entries
    (``echoes`` is lowered for them). Empties the overflow entries' echoes."""
    if resident == len(echoes):
        return []
    rows = [p for k in range(int(echoes[resident:].max())) for p in range(resident, len(echoes)) if echoes[p] > k]
    echoes[resident:] = 0
    short = -len(rows) % batch_size
    for p in np.flatnonzero(echoes[:resident] > 0)[:short].tolist():
        rows.append(p)
        echoes[p] -= 1
    return [{"rows": np.array(rows[i:i + batch_size], dtype=np.uint64)} for i in range(0, len(rows), batch_size)]


def assigned(starts: list[dict[str, Any]], dealing: Dealing, length: int) -> np.ndarray:
    """The deliveries the new ranks' ``starts`` owe, by dataset index."""
    total = np.zeros(length, np.int64)
    for stages in starts:
        intake = stages["intake"]
        order = intake["order"]
        np.add.at(total, order[intake["positions"].astype(np.int64)], intake["echoes"].astype(np.int64))
        for batch in intake["queued"]:
            np.add.at(total, order[batch["rows"].astype(np.int64)], 1)
        first = int(intake["next_seq"])
        np.add.at(total, order[first:], counts_by_position(first, len(order) - first, dealing.factor))
    return total


def start_batches(stages: dict[str, Any], dealing: Dealing) -> int:
    """The batches a new rank yields from its start ``stages``."""
    intake = stages["intake"]
    first = int(intake["next_seq"])
    deliveries = (int(intake["echoes"].sum()) + sum(len(b["rows"]) for b in intake["queued"])
                  + deliveries_between(first, len(intake["order"]) - first, dealing.factor))
    return batches_of(deliveries, dealing)
