"""Adaptive echo in lockstep across the ranks of a data-parallel job.

With ``echo_factor="auto"`` each rank repeats examples while its own training
step would wait for input, so the ranks' inputs run at different speeds, and
so would their epochs: a data-parallel job hangs when one rank yields fewer
batches than the others. This stage, the last before the device copy, keeps
them together:

- every rank yields its own batches (fresh, and its own auto echoes) until its
  shard has been delivered once (its upstream ends);
- then it repeats its most recent batches, so that it never makes the others
  wait: a rank whose input is fast trains on repeats while a straggler's fresh
  reads catch up, instead of waiting for it at every step. A map-style source
  without ``augment`` has the least-delivered examples of the whole shard
  read again for these repeats, a batch or two ahead in a thread of their own
  (dataecho.pipeline.stages.rereads); where none is ready, and otherwise, a
  repeat is of the kept batch whose rows this rank delivered the fewest times
  (the most of its rows' counts; the oldest among equals). Either way the
  repeats spread as the echo buffer spreads its own;
- the epoch ends on every rank at the same batch, once every rank has
  delivered its whole shard: the ranks agree through an all-reduce of two ints
  per rank (the agreement's index in the epoch, and the rank's status) every
  ``every`` batches, on a CPU (gloo) process group of the loader's own, so
  that it never synchronizes a CUDA stream or shares the training job's
  communicator. The reduce issued at batch ``k`` is waited for at batch
  ``k + every``, when the other ranks have long sent theirs: its cost is one
  small message per ``every`` steps, off the step's critical path.

The epoch's first agreement is the exception: every rank takes its first
batch, then all wait for the reduce (the first training step waits for the
slowest rank anyway). A rank with no batch at all (an empty shard, or fewer
examples than one batch with ``drop_last=True``) has nothing to repeat while
the others deliver theirs; equal batch counts would then mean dropping every
other rank's shard unannounced. So every rank raises a RuntimeError naming the
empty ranks, at its first batch. Where every rank is empty, every rank's epoch
is empty (no batch, no error).

A rank whose epoch ends early:

- its input raises or times out, or its epoch is stopped (a stage failed,
  ``close()``): it posts "stopped" as its next agreement and raises its own
  error. It does not wait for that reduce (mid-epoch, the others may be
  waiting for it in the training step's collective). The others raise a
  RuntimeError naming it at their next agreement but one (within
  ``2 * every`` batches); at the first agreement, every rank raises at once.
  Each rank has then taken part in the same agreements: the next epoch starts
  in step.
- a loop left with ``break`` (or an epoch ended by a later ``iter(loader)``)
  takes part in no more agreements. That is safe where every rank leaves at
  the same batch. Where some ranks leave alone, the others wait in their next
  agreement (until the group's timeout, unless the job's own collectives hang
  first); if the leavers start another epoch, the first reduce that pairs
  agreements of different indices raises on every rank that takes part,
  saying the ranks are out of step. (A loop left before its first batch took
  part in none of its epoch's agreements: that, the indices cannot show.)
- a rank that dies: the others fail where gloo sees the connection close, or
  wait until the process group's timeout, as in any collective of the job.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...examples.ragged import Ragged
from .rereads import Rereads
from .stage import Batch, Stage

__all__ = ["LockstepSpec", "LockstepStage", "agree_without_stages"]

# A rank's status in an agreement.
READING = 0  # its shard is not delivered yet
DELIVERED = 1  # its shard is delivered: it repeats recent batches
EMPTY = 2  # first agreement only: it has no batch at all this epoch
STOPPED = 3  # it left the epoch early (its input failed, timed out, or was stopped)


@dataclass(frozen=True)
class LockstepSpec:
    """What the lockstep stage needs (built by dataecho.pipeline.plan).

    Attributes:
        every: batches between two reduces (the epoch ends at a multiple of it).
        recent: batches kept to repeat once this rank's shard is delivered.
    """

    every: int = 8
    recent: int = 16


class _Agreements:
    """One rank's side of an epoch's agreements: a sequence of all-reduces.

    Collective order: a reduce pairs the i-th reduce of every rank on the
    group, so every rank must issue the same sequence in an epoch: the first
    at its first batch, then one per check until the check that ends the epoch
    (which issues none), or one saying it stopped (after which it issues none).
    Each rank writes only its own row, [index, status], and the reduce sums
    the rows: every rank reads every rank's row. Rows of different indices
    mean the ranks are out of step, which is raised, never read as a verdict.
    """

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._group = group
        self._rank, self._world_size = dist.get_rank(group), dist.get_world_size(group)
        self._issued = 0
        self._pending: Any = None  # (work, rows) of the last reduce not waited for

    def post(self, status: int) -> None:
        """Issues this rank's next reduce, without waiting for it."""
        import torch
        import torch.distributed as dist

        rows = torch.zeros((self._world_size, 2), dtype=torch.int64)
        rows[self._rank, 0], rows[self._rank, 1] = self._issued, status
        work = dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        self._pending, self._issued = (work, rows), self._issued + 1

    def wait(self) -> list[int] | None:
        """Every rank's status in the last reduce posted (waiting for it), or
        None where none is pending.

        Raises:
            RuntimeError: the ranks' rows are of different indices.
        """
        if self._pending is None:
            return None
        (work, rows), self._pending = self._pending, None
        work.wait()
        indices, statuses = rows[:, 0].tolist(), rows[:, 1].tolist()
        if len(set(indices)) > 1:
            raise RuntimeError(_out_of_step(indices))
        return statuses

    def exchange(self, status: int) -> list[int]:
        """Posts ``status`` and waits for every rank's."""
        self.post(status)
        statuses = self.wait()
        assert statuses is not None
        return statuses


class LockstepStage:
    """Yields upstream's batches, then repeats of the recent ones, until every
    rank's shard is delivered (see the module docstring).

    Synchronization: next() runs in the epoch's one consumer thread, which
    alone issues and waits for the agreements. stop() may run in any thread
    and only sets ``_halted``, read by next() (and stops the thread reading
    repeats again, which next() starts once the shard is delivered, unless
    stopped by then): abort() stops this stage before
    the ones upstream, so a StopIteration that the stop causes upstream reaches
    the consumer after that store (the GIL hand-over orders them). Where a
    failing stage thread closes its own output before its stop reaches this
    stage, it has recorded its error first (``failure``), which next() reads
    as a stop too.

    Args:
        spec: the stage's settings.
        upstream: the stage before.
        group: the ``torch.distributed`` process group (gloo) the ranks agree on.
        failure: the epoch's first error of any stage thread (workers/failure.py), or None.
    """

    name = "lockstep"
    unresumable = ("saving a position mid-epoch with echo_factor='auto' on several ranks is not supported: "
                   "its batches depend on timing")

    def __init__(self, spec: LockstepSpec, upstream: Stage, group: Any, failure: Any = None,
                 read_batch: Any = None) -> None:
        self._spec, self._upstream, self._failure, self._read_batch = spec, upstream, failure, read_batch
        self._rereads: Rereads | None = None  # once the shard is delivered, where read_batch is given
        self._agreements = _Agreements(group)
        self._recent: deque[Batch] = deque(maxlen=spec.recent)
        self._times = np.zeros(0, dtype=np.uint16)  # deliveries through this stage, by row position
        self._delivered = 0
        self._done = False  # this rank's upstream has ended
        self._halted = False  # stop() was called (see Synchronization)
        self._over = False  # this rank takes part in no more agreements this epoch
        self.repeats = 0  # batches repeated while other ranks finished their shards
        self.wait_s = 0.0  # seconds in the ranks' agreement

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._over:
            raise StopIteration
        try:
            if self._halted:  # stopped while this rank repeated, or between two calls
                self._leave()
                raise StopIteration
            if self._delivered == 0:
                batch = self._first(timeout_s)
            else:
                if self._delivered % self._spec.every == 0:
                    self._check()
                fresh = None if self._done else self._pull(timeout_s)
                batch = fresh if fresh is not None else self._repeat()
        except BaseException:  # the end, or an error: this rank's agreements are over either way
            self._over = True
            raise
        self._delivered += 1
        self._count(batch.rows)
        return batch

    def _count(self, rows: np.ndarray | None) -> None:
        """One more delivery of each of ``rows`` (positions)."""
        if rows is None or not len(rows):
            return
        top = int(rows.max()) + 1
        if top > len(self._times):
            grown = np.zeros(max(top, 2 * len(self._times)), dtype=np.uint16)
            grown[:len(self._times)] = self._times
            self._times = grown
        np.add.at(self._times, rows.astype(np.intp), 1)

    def _first(self, timeout_s: float | None) -> Batch:
        """The first batch, after the epoch's first agreement, which every rank
        waits for: an empty rank raises there on every rank at once."""
        batch = self._pull(timeout_s)
        started = time.perf_counter()
        statuses = self._agreements.exchange(READING if batch is not None else EMPTY)
        self.wait_s += time.perf_counter() - started
        if batch is None and self._stopping:
            # A stage thread's error closed its output before its stop reached this stage, so this
            # rank posted EMPTY; the others raise on that, and this rank's epoch raises the error itself.
            raise StopIteration
        if _verdict(statuses):  # every rank is empty
            raise StopIteration
        assert batch is not None  # else _verdict raised: this rank is empty, others are not
        return batch

    def _check(self) -> None:
        """At a multiple of ``every``: ends the epoch here (StopIteration) where
        every rank had delivered its shard at the previous check, on every
        rank, as they all read the same reduce; else issues the next reduce."""
        started = time.perf_counter()
        try:
            statuses = self._agreements.wait()  # None at the first check after the first agreement
            if statuses is not None and _verdict(statuses):
                raise StopIteration
            self._agreements.post(DELIVERED if self._done else READING)
        finally:
            self.wait_s += time.perf_counter() - started

    def _pull(self, timeout_s: float | None) -> Batch | None:
        """Upstream's next batch, or None at its end. Where upstream fails or
        was stopped, this rank posts STOPPED before it raises."""
        try:
            batch = self._upstream.next(timeout_s)
        except StopIteration:
            if not self._stopping:
                self._done = True
                if self._read_batch is not None and self._recent and not self._halted:
                    self._rereads = Rereads(self._read_batch, lambda: self._times, len(self._recent[-1]))
                return None
            self._leave()
            raise
        except Exception:
            self._leave()
            raise
        self._recent.append(batch)
        return batch

    @property
    def _stopping(self) -> bool:
        """The epoch is stopping: stop() was called, or a stage thread failed."""
        return self._halted or (self._failure is not None and self._failure.error is not None)

    def _leave(self) -> None:
        """Posts STOPPED as this rank's next agreement. Mid-epoch it does not
        wait (the other ranks may wait for this one in the training step's
        collective); at the first agreement every rank waits, so it waits too
        and all raise at once. This rank raises its own error after either way."""
        self._over = True
        self._agreements.post(STOPPED)
        if self._delivered == 0:
            with contextlib.suppress(Exception):  # this rank's own error is the cause to raise
                self._agreements.wait()

    def leave(self) -> None:
        """The epoch drops the batch this stage last delivered and ends (a stage
        thread failed after this stage pulled it): this rank's agreements end as
        they end on a stop, with STOPPED posted (in the consumer's thread, as
        every agreement is). Without it the other ranks would wait on this one's
        next agreement, or read its next epoch's first as this one's."""
        if not self._over:
            self._leave()

    def _repeat(self) -> Batch:
        """A copy of the kept batch delivered the fewest times (see the module
        docstring): the loop may change a batch in place, and a repeat must not see that."""
        again = self._rereads.take() if self._rereads is not None else None
        if again is not None:
            self.repeats += 1
            return again
        # Never empty here: the first agreement let through only ranks that had a first batch.
        most = [int(self._times[b.rows.astype(np.intp)].max()) if b.rows is not None and len(b.rows) else 0
                for b in self._recent]
        pick = most.index(min(most))  # the oldest among the least delivered
        batch = self._recent[pick]
        del self._recent[pick]
        self._recent.append(batch)
        self.repeats += 1
        return Batch(batch.structure, tuple(_copied(leaf) for leaf in batch.arrays), batch.rows)

    def stop(self) -> None:
        self._halted = True  # the epoch stops the stages before it
        if self._rereads is not None:
            self._rereads.stop()

    def join(self, timeout_s: float) -> None:
        if self._rereads is not None:
            self._rereads.join(timeout_s)

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        return None

    def counters(self) -> dict[str, Any]:
        return {"lockstep_repeats": self.repeats, "lockstep_wait_s": self.wait_s}


def agree_without_stages(group: Any, failed: bool = False) -> None:
    """A rank's part in the first agreement of an epoch that built no stages:
    it read no example (so it learned no structure), or it failed before its
    stages existed (``failed``: the caller raises its own error after).
    The other ranks' lockstep stages wait for this agreement.

    Raises:
        RuntimeError: where not every rank is empty: naming the empty ranks,
            or the ranks that stopped (see the module docstring).
    """
    agreements = _Agreements(group)
    if failed:
        agreements.post(STOPPED)
        with contextlib.suppress(Exception):  # the caller's error is the cause to raise
            agreements.wait()
        return
    _verdict(agreements.exchange(EMPTY))


def _verdict(statuses: list[int]) -> bool:
    """Whether the epoch ends here on every rank (every rank delivered its
    shard, or every rank is empty).

    Raises:
        RuntimeError: some rank stopped, or is empty while others are not.
    """
    stopped = [rank for rank, status in enumerate(statuses) if status == STOPPED]
    empty = [rank for rank, status in enumerate(statuses) if status == EMPTY]
    if stopped:
        raise RuntimeError(
            f"EchoLoader: {_ranks(stopped)} ended this epoch early (an error in its input, a timeout, or its "
            "epoch was stopped: see that rank's own error); with echo_factor='auto' the ranks' epochs end "
            "together, so this rank's ends here too")
    if empty and len(empty) < len(statuses):
        raise RuntimeError(
            f"EchoLoader: {_ranks(empty)} of {len(statuses)} had no batch to deliver this epoch (an empty "
            "shard, or fewer examples than one batch with drop_last=True); with echo_factor='auto' every rank "
            "yields as many batches as the others, repeating its own while they finish, and an empty rank has "
            "nothing to repeat, so every rank stops here: give every rank at least one batch")
    return all(status in (DELIVERED, EMPTY) for status in statuses)


def _out_of_step(indices: list[int]) -> str:
    at = "; ".join(f"{_ranks([r for r, i in enumerate(indices) if i == index])} at agreement {index}"
                   for index in sorted(set(indices)))
    return (f"EchoLoader: the ranks' lockstep agreements are out of step ({at} of its epoch): some rank left an "
            "epoch early (a loop left with break, or an epoch ended by a later iter(loader)) while others went "
            "on; with echo_factor='auto', leave the loop at the same batch on every rank")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _copied(leaf: Any) -> Any:
    if isinstance(leaf, Ragged):
        return Ragged(leaf.values.copy(), leaf.offsets.copy())
    if isinstance(leaf, list):
        return list(leaf)
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    return leaf.clone()  # a tensor
