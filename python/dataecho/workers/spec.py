"""Who reads an epoch's source: the workers' kind and number, decided once by
the planner (dataecho.pipeline.plan)."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from typing import Callable

__all__ = ["WorkersSpec", "default_start_method"]


def default_start_method() -> str:
    """forkserver where it exists (fast starts, no fork of a threaded parent), else spawn."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


@dataclass(frozen=True)
class WorkersSpec:
    """The producers of an epoch.

    Attributes:
        kind: ``"inline"`` (the consumer's own thread reads, ``num_workers=0``),
            ``"thread"`` or ``"process"``.
        count: threads or processes (1 for inline).
        auto: threads only: start with one reading thread and add more while
            reads wait (dataecho.workers.thread_readers); ``count`` is then 1.
        start_method: processes: how they are started.
        worker_init_fn: called with the worker's number in each worker, before it reads.
        window: deterministic intake: how far (in positions) a worker may read
            ahead of the next example the buffer takes in; 0 where unbounded.
            Workers then claim smaller chunks, so that every one of them has
            one in flight within the window (a late read holds back at most
            the chunks after it).
    """

    kind: str
    count: int
    auto: bool = False
    start_method: str | None = None
    worker_init_fn: Callable[[int], None] | None = None
    window: int = 0

    def chunk(self, largest: int, workers: int) -> int:
        """Positions a worker claims at a time, at most ``largest``, when
        ``workers`` read: within the window, two chunks in flight per worker."""
        if not self.window:
            return largest
        return max(1, min(largest, self.window // (2 * max(1, workers))))
