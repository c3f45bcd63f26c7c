"""Loading a checkpoint into a loader: the configuration and plan that resume
it, the state checked against them (dataecho.pipeline.checkpoint), and what a
resume that cannot be exact would lose, said at load time.

A state names the rank and world size that saved it. Another rank's state,
or a state of a job of another world size, resumes this rank by working out
its own position from the epoch's history (dataecho.pipeline.progress.replay) wherever
that follows from the seed alone; the list of every rank's states is taken
too (this rank's own is used where it is in it). Where a position cannot be
worked out (an iterable, a sampler's order), each rank loads its own state.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from ...reading.sharding import Shard
from ..chain import state_checks
from ..checkpoint import check_state, int_at, plain
from ..plan import Planner
from .replay import replayed_stages

__all__ = ["for_epoch", "resumed"]


def resumed(planner: Planner, state: Any) -> tuple[Planner, dict[str, Any]]:
    """(planner, checked state) that resume ``state``: a loader that drew its
    own seed (none given) takes the state's, so that a job restarted with the
    same arguments resumes as StatefulDataLoader does. The checked state's
    "dataset" is the chosen state's dataset state, or None.

    Args:
        planner: the loader's, on the part of the job it runs now.
        state: what ``state_dict()`` returned, on any rank of a job of any
            world size, or the list of every rank's.

    Raises:
        TypeError, ValueError: a state that is not one, was saved by a loader
            with other arguments that decide the batches (named), or cannot
            resume this rank (saying what to load instead).
    """
    if isinstance(state, (list, tuple)):
        state = _one_of(list(state), planner)
    own = state.get("dataset") if isinstance(state, dict) else None  # a stateful dataset's (dataecho.reading.stateful)
    saved = state.get("config") if isinstance(state, dict) else None
    if not planner.seed_given and isinstance(saved, dict) and saved.get("seed") not in (None, planner.seed):
        planner = planner.with_seed(saved["seed"])
    length = None  # the epoch's batches on this rank, where working out its position told them
    if isinstance(saved, dict) and (saved.get("rank"), saved.get("world_size")) != _place(planner):
        state, length = _for_this_rank(state, planner)
    checked = {**_checked(state, planner), "length": length, "dataset": own}
    if planner.plan.checkpoint == "skip" and checked["stages"] is not None:
        warnings.warn(
            f"load_state_dict: this loader reads an iterable in no fixed order (deterministic=False, or a Ray "
            f"dataset), so resuming skips the {checked['stages']['intake']['skip']} examples taken from it "
            f"before the state was saved, those taken but not yet delivered (resident in the echo buffer, or "
            f"in batches on their way) included; with deterministic=True a resume delivers exactly the "
            f"examples not yet delivered", UserWarning, stacklevel=3)
    return planner, checked


def for_epoch(planner: Planner, checked: dict[str, Any], epoch: int) -> dict[str, Any] | None:
    """A loaded mid-epoch state moved to epoch ``epoch`` (``set_epoch`` after
    ``load_state_dict``, as StatefulDataLoader reads its sampler's epoch): the
    same batches delivered of that epoch instead; None where the position
    cannot be worked out for another epoch (the caller then starts it afresh)."""
    if not planner.replayable:
        return None
    stages, length = replayed_stages(planner, epoch, checked["history"])
    return {**_checked({**checked, "epoch": epoch, "stages": plain(stages)}, planner), "length": length}


def _place(planner: Planner) -> tuple[int, int]:
    return planner.shard.rank, planner.shard.world_size


def _checked(state: Any, planner: Planner) -> dict[str, Any]:
    planned = planner.plan
    return check_state(state, planner.fingerprint(), state_checks(planned),
                       functools.partial(_saved_order, planned.source.order), planned.checkpoint)


def _for_this_rank(state: dict, planner: Planner) -> tuple[dict[str, Any], int | None]:
    """Another rank's state (of this job or another), as this rank's: its own
    position worked out from the epoch's history (dataecho.pipeline.progress.replay);
    and the epoch's batches on this rank in all, where that told them."""
    saved = state["config"]
    world = int_at(saved, "world_size", "state['config']")
    if world < 1:
        raise ValueError(f"state['config']['world_size']: expected an int >= 1, got {world}")
    rank = int_at(saved, "rank", "state['config']", at_most=world - 1)
    old = planner.on_shard(Shard(rank, world))
    old_checked = _checked(state, old)  # every other argument checked as that rank would
    out = {**old_checked, "config": planner.fingerprint()}
    if old_checked["stages"] is None:  # an epoch boundary: the next epoch planned for this rank
        return out, None
    if not planner.replayable:
        raise ValueError(
            f"state: saved by rank {rank} of {world}, but this loader is rank {planner.shard.rank} of "
            f"{planner.shard.world_size}; a rank's position mid-epoch follows from another's only for a map-style "
            f"dataset read in dataecho's own order (no sampler or batch_sampler, and at echo 1 no read_into) with "
            f"deterministic reading: load "
            f"each rank's own state_dict() on that rank (the same world size), or resume at an epoch boundary")
    history = old_checked["history"]
    if world != planner.shard.world_size:
        history = history + [[planner.shard.world_size, 0]]
    stages, length = replayed_stages(planner, old_checked["epoch"], history)
    return {**out, "history": history, "stages": plain(stages)}, length


def _one_of(states: list, planner: Planner) -> dict[str, Any]:
    """The state to resume from, of every rank's ``states`` (of one job, one
    epoch, one point): this rank's own where it is among them, else any."""
    if not states or not all(isinstance(s, dict) and isinstance(s.get("config"), dict) for s in states):
        raise TypeError("state: expected every rank's state_dict() (a list of dicts), got something else")
    world = len(states)
    ranks = sorted(s["config"].get("rank") for s in states)
    if ranks != list(range(world)) or any(s["config"].get("world_size") != world for s in states):
        raise ValueError(f"state: expected the states of all {world} ranks of one job (ranks 0 to {world - 1}, "
                         f"each once, world_size {world}), got ranks {ranks}")
    keys = {k for s in states for k in s["config"]} - {"rank", "world_size"}
    for key in sorted(keys):
        if len({repr(s["config"].get(key)) for s in states}) != 1:
            raise ValueError(f"state: the ranks' states differ in {key}; expected the states of one job")
    points = {(repr(s.get("epoch")), repr(s.get("history")), s.get("stages") is None) for s in states}
    if len(points) != 1:
        raise ValueError("state: the ranks' states were taken at different epochs or points; take them at the "
                         "same step on every rank")
    for state in states:
        if (state["config"]["rank"], world) == _place(planner):
            return state
    return states[0]


def _saved_order(order: Any, epoch: int, saved: Any) -> Any:
    """The order of the epoch a state resumes: the one it saved (a sampler's or
    a batch sampler's, never drawn again: a RandomSampler would give another;
    one dealt out over another world size), else a map-style source's own;
    None for an iterable."""
    if order is None:
        return None
    if not order.sampled and saved is None:
        return order.order(epoch)
    if saved is None:
        raise ValueError("state['stages']['intake']['order']: missing; a state of a loader with a sampler or a "
                         "batch_sampler saves its order")
    if len(saved) and saved.max() >= len(order.dataset):
        raise ValueError("state['stages']['intake']['order']: indices beyond the dataset")
    return saved
