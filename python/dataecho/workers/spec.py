"""Who reads an epoch's source: the workers' kind and number, decided once by
the planner (dataecho.pipeline.plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["WorkersSpec"]


@dataclass(frozen=True)
class WorkersSpec:
    """The producers of an epoch.

    Attributes:
        kind: ``"inline"`` (the consumer's own thread reads, ``num_workers=0``),
            ``"thread"`` or ``"process"``.
        count: threads or processes (1 for inline).
        auto: threads only: start with one reading thread and add more while
            reads wait (dataecho.workers.threads); ``count`` is then 1.
        start_method: processes: how they are started.
        worker_init_fn: called with the worker's number in each worker, before it reads.
    """

    kind: str
    count: int
    auto: bool = False
    start_method: str | None = None
    worker_init_fn: Callable[[int], None] | None = None
