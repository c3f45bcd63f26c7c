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
  reads catch up, instead of waiting for it at every step;
- the epoch ends on every rank at the same batch, once every rank has
  delivered its whole shard: the ranks agree through a one-int all-reduce
  (MIN of "my shard is done") every ``every`` batches, on a CPU (gloo) process
  group of the loader's own, so that it never synchronizes a CUDA stream or
  shares the training job's communicator. The reduce issued at batch ``k`` is
  waited for at batch ``k + every``, when the other ranks have long sent
  theirs: its cost is one small message per ``every`` steps, off the step's
  critical path.

If a rank fails, the others wait in that reduce until the process group's
timeout (or fail at once where gloo sees the connection close), as in any
collective of the job.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..examples.ragged import Ragged
from .stage import Batch, Stage

__all__ = ["LockstepSpec", "LockstepStage"]


@dataclass(frozen=True)
class LockstepSpec:
    """What the lockstep stage needs (built by dataecho.pipeline.plan).

    Attributes:
        every: batches between two reduces (the epoch ends at a multiple of it).
        recent: batches kept to repeat once this rank's shard is delivered.
    """

    every: int = 8
    recent: int = 16


class LockstepStage:
    """Yields upstream's batches, then repeats of the recent ones, until every
    rank's shard is delivered (see the module docstring).

    Args:
        spec: the stage's settings.
        upstream: the stage before.
        group: the ``torch.distributed`` process group (gloo) the ranks agree on.
    """

    name = "lockstep"
    unresumable = ("saving a position mid-epoch with echo_factor='auto' on several ranks is not supported: "
                   "its batches depend on timing")

    def __init__(self, spec: LockstepSpec, upstream: Stage, group: Any) -> None:
        self._spec, self._upstream, self._group = spec, upstream, group
        self._recent: deque[Batch] = deque(maxlen=spec.recent)
        self._delivered = 0
        self._done = False  # this rank's upstream has ended
        self._pending: Any = None  # (work, tensor) of the reduce issued at the last check
        self._stopped = False
        self.repeats = 0  # batches repeated while other ranks finished their shards
        self.wait_s = 0.0  # seconds in the ranks' agreement

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._stopped:
            raise StopIteration
        if self._delivered % self._spec.every == 0:
            started = time.perf_counter()
            finished = self._check()
            self.wait_s += time.perf_counter() - started
            if finished:
                self._stopped = True
                raise StopIteration
        batch = self._fresh(timeout_s) if not self._done else None
        if batch is None:
            batch = self._repeat()
        self._delivered += 1
        return batch

    def _check(self) -> bool:
        """At a multiple of ``every``: whether every rank had finished its shard
        at the previous check (then all stop here, at the same batch); issues
        the next reduce."""
        import torch
        import torch.distributed as dist

        finished = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            finished = bool(flag.item())
        if finished:
            return True
        flag = torch.tensor([1 if self._done else 0], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group, async_op=True), flag)
        return False

    def _fresh(self, timeout_s: float | None) -> Batch | None:
        try:
            batch = self._upstream.next(timeout_s)
        except StopIteration:
            self._done = True
            return None
        self._recent.append(batch)
        return batch

    def _repeat(self) -> Batch:
        """A copy of a recent batch, oldest first, round robin: the loop may
        change a batch in place, and a repeat must not see that."""
        if not self._recent:  # an empty shard: nothing to repeat (equal shards make this the empty epoch)
            raise StopIteration
        batch = self._recent[0]
        self._recent.rotate(-1)
        self.repeats += 1
        return Batch(batch.structure, tuple(_copied(leaf) for leaf in batch.arrays))

    def stop(self) -> None:
        pass  # no thread of its own; the epoch stops the stages before it

    def join(self, timeout_s: float) -> None:
        pass

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        return None

    def counters(self) -> dict[str, Any]:
        return {"lockstep_repeats": self.repeats, "lockstep_wait_s": self.wait_s}


def _copied(leaf: Any) -> Any:
    if isinstance(leaf, Ragged):
        return Ragged(leaf.values.copy(), leaf.offsets.copy())
    if isinstance(leaf, list):
        return list(leaf)
    if isinstance(leaf, np.ndarray):
        return leaf.copy()
    return leaf.clone()  # a tensor
