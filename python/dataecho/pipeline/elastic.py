"""Resuming under another world size: every rank's state of a job of ``W1``
ranks, spread over the ``W2`` ranks of the job that resumes it.

Mid-epoch, what each old rank had still to deliver is gathered by dataset
index, from its state (checked as that rank would check it):

- its *unread* examples (positions at and after its intake's ``next_seq``),
  each still owed its full echo count;
- its *partly delivered* ones: each resident example's remaining echoes, and
  one delivery per row of every batch on its way (assembled, being augmented,
  in flight to the device).

The unread examples are dealt round robin to the new ranks, which echo them as
any fresh examples (exact counts by position). The partly delivered ones go,
whole (all of an index's remaining deliveries to one rank), to the rank with
the fewest deliveries so far, and are delivered first, as batches of their
remaining deliveries (an example at most once per such batch, the last one
possibly short). Each new rank's epoch is then its partly delivered examples
followed by its unread ones: a state of its own (an ``order`` and those
batches), which it checks and loads as any state. So across the two jobs every
example of the epoch is delivered its count: exactly ``echo_factor`` times for
a whole factor, ``floor`` or ``ceil`` of it for a fractional one, as always.
Where that leaves the new ranks with different numbers of batches, the ranks
with fewer deliver a few examples once more (fewer than a batch's worth each),
as a distributed sampler pads its shards, so that a data-parallel job does
not hang. At an epoch boundary nothing is owed: the next epoch is planned for
the new world size.

Map-style sources with exact states only (deterministic reading, the
default), and example echoing (``echo_at="batch"`` repeats whole batches,
which cannot be dealt out example by example).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable

import numpy as np

from ..config.echo import exact_deliveries
from ..reading.sharding import Shard
from .checkpoint import FORMAT

__all__ = ["redistributed"]


def redistributed(states: list, config: Any, checked_for: Callable[[dict, Any], dict]) -> dict[str, Any]:
    """This rank's state for the epoch that every rank's ``states`` left.

    Args:
        states: every old rank's ``state_dict()``, in any order.
        config: this loader's configuration (its rank and world size are the new ones).
        checked_for: checks one old state as a loader of the given configuration
            would (dataecho.pipeline.resume), returning it normalized and the
            epoch's order that rank read.

    Raises:
        TypeError, ValueError: not every rank's state of one job and one epoch,
            or a job that cannot be spread (naming why).
    """
    olds = _old_states(states)
    world = len(olds)
    first = olds[0]
    seed = first["config"]["seed"]
    envelope = {"format": FORMAT, "epoch": first["epoch"], "structure": first.get("structure"), "stages": None}
    if first.get("stages") is None:
        return {**envelope, "config": {**first["config"], "rank": config.shard.rank,
                                       "world_size": config.shard.world_size}}
    old_configs = [config.with_shard(Shard(rank, world)).with_seed(seed) for rank in range(world)]
    checked, orders = zip(*(checked_for(state, old) for state, old in zip(olds, old_configs)))
    if any("batch_echo" in c["stages"] for c in checked):
        raise ValueError("load_state_dict: a job that echoes whole batches (echo_at='batch') resumes mid-epoch on "
                         "the same number of ranks only; resume it at an epoch boundary")
    owed = [_owed(c["stages"], order) for c, order in zip(checked, orders)]
    mine = _share(owed, config.shard, config.echo.factor, config.batch_size, config.drop_last,
                  rebatched=config.augment is not None)
    stages = {"intake": _intake_state(mine, max(c["stages"]["intake"].get("ragged_bytes", 0) for c in checked),
                                      config.batch_size, config.echo.factor)}
    if config.augment is not None:
        stages["augment"] = {"taken": 0, "output": None, "queued": [],
                             "pending": {"deliveries": np.zeros(0, np.uint64), "rows": np.zeros(0, np.uint64)}}
    stages["delivery"] = {"in_flight": []}
    new_config = config.with_seed(seed).fingerprint()
    return {**envelope, "config": new_config, "stages": stages}


def _old_states(states: list) -> list[dict]:
    """The old ranks' states, by rank, checked to be one job's at one epoch."""
    if not states or not all(isinstance(s, dict) and isinstance(s.get("config"), dict) for s in states):
        raise TypeError("state: expected every rank's state_dict() (a list of dicts), got something else")
    world = len(states)
    ranks = sorted(s["config"].get("rank") for s in states)
    if ranks != list(range(world)) or any(s["config"].get("world_size") != world for s in states):
        raise ValueError(f"state: expected the states of all {world} ranks of one job (ranks 0 to {world - 1}, "
                         f"each once, world_size {world}), got ranks {ranks}")
    by_rank = sorted(states, key=lambda s: s["config"]["rank"])
    keys = {k for s in by_rank for k in s["config"]} - {"rank", "world_size"}
    for key in keys:
        if len({repr(s["config"].get(key)) for s in by_rank}) != 1:
            raise ValueError(f"state: the ranks' states differ in {key}; expected the states of one job")
    if len({s.get("epoch") for s in by_rank}) != 1 or len({s.get("stages") is None for s in by_rank}) != 1:
        raise ValueError("state: the ranks' states were taken at different epochs or points; take them at the "
                         "same step on every rank")
    return by_rank


def _owed(stages: dict, order: np.ndarray) -> tuple[np.ndarray, Counter]:
    """(unread dataset indices, deliveries owed per partly delivered index) of
    one old rank, whose epoch read ``order``."""
    intake = stages["intake"]
    unread = np.asarray(order[intake["next_seq"]:], dtype=np.int64)
    partly: Counter = Counter()
    for index, echoes in zip(intake["indices"].tolist(), intake["echoes"].tolist()):
        partly[index] += echoes
    rows = [b["rows"] for b in intake["queued"]]
    augment = stages.get("augment")
    if augment is not None:
        rows += [augment["pending"]["rows"]] + [b["rows"] for b in augment["queued"]]
    rows += [b["rows"] for b in stages.get("delivery", {}).get("in_flight", [])]
    for batch in rows:
        partly.update(np.asarray(order)[batch.astype(np.int64)].tolist())
    return unread, partly


def _share(owed: list, shard: Shard, factor: float, batch_size: int, drop_last: bool,
           rebatched: bool) -> tuple[list, np.ndarray]:
    """This new rank's (partly delivered (index, deliveries) pairs, unread indices);
    ``rebatched``: as for :func:`_pad`."""
    world = shard.world_size
    unread = np.concatenate([u for u, _ in owed]) if owed else np.zeros(0, np.int64)
    fresh = [unread[rank::world] for rank in range(world)]
    partly: Counter = Counter()
    for _, counts in owed:
        partly.update(counts)
    given: list[list] = [[] for _ in range(world)]
    totals = [exact_deliveries(len(f), factor) for f in fresh]
    for index in sorted(partly, key=lambda i: (-partly[i], i)):  # the largest first: the totals end up level
        rank = min(range(world), key=lambda r: (totals[r], r))
        given[rank].append((index, partly[index]))
        totals[rank] += partly[index]
    _pad(given, fresh, factor, batch_size, drop_last, rebatched)
    return given[shard.rank], fresh[shard.rank]


def _pad(given: list, fresh: list, factor: float, batch_size: int, drop_last: bool, rebatched: bool) -> None:
    """Gives ranks with fewer batches one more delivery of an example at a
    time (of their own, as a distributed sampler pads) until all have as many.
    A rank yields its partly delivered examples' batches (the last possibly
    short), then its fresh deliveries' batches; ``rebatched`` (an augment stage
    batches every delivery anew through its output buffer): all its deliveries,
    as one run of batches."""
    rounding = math.floor if drop_last else math.ceil

    def batches(rank: int) -> int:
        owed = sum(count for _, count in given[rank])
        fresh_deliveries = exact_deliveries(len(fresh[rank]), factor)
        if rebatched:
            return rounding((owed + fresh_deliveries) / batch_size)
        return -(-owed // batch_size) + rounding(fresh_deliveries / batch_size)

    most = max(batches(rank) for rank in range(len(given)))
    for rank in range(len(given)):
        pool = [index for index, _ in given[rank]] + fresh[rank].tolist()
        while pool and batches(rank) < most:  # an empty rank has nothing of its own to repeat
            given[rank].append((pool[len(given[rank]) % len(pool)], 1))


def _batches_of(given: list, batch_size: int) -> list[list[int]]:
    """The deliveries owed to ``given`` (the example at position p is
    ``given[p]``) as batches of positions: round by round (every example owing
    a k-th delivery, in order), so an example is in a batch at most once while
    a round fills a batch; the last batch may be short."""
    most = max((count for _, count in given), default=0)
    flat = [p for k in range(most) for p, (_, count) in enumerate(given) if count > k]
    return [flat[i:i + batch_size] for i in range(0, len(flat), batch_size)]


def _intake_state(mine: tuple, ragged_bytes: int, batch_size: int, factor: float) -> dict[str, Any]:
    """An intake state that owes exactly ``mine``: its partly delivered examples
    at the first positions of its order, queued as batches, and its unread ones
    after them."""
    given, fresh = mine
    order = np.concatenate([np.array([index for index, _ in given], dtype=np.int64), fresh])
    empty = np.zeros(0, dtype=np.uint64)
    queued = [{"rows": np.array(batch, dtype=np.uint64)} for batch in _batches_of(given, batch_size)]
    return {"batches": 0, "rng_state": 0, "next_seq": len(given), "available": 0, "positions": empty,
            "indices": empty.astype(np.int64), "echoes": empty.astype(np.uint32), "queued": queued,
            "ended": False, "ragged_bytes": ragged_bytes, "order": order}
