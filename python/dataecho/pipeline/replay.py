"""The replay of batches restored from a checkpoint.

A checkpoint names the batches that had left a stage but not yet reached the
training loop (assembled and waiting, or on their way to the device) by their
rows. On resume a ``Replay`` placed after that stage reads them again and
yields them first, in their order; then it passes the upstream's batches on.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable

import numpy as np

from .stage import Batch, Stage

__all__ = ["Replay"]


class Replay:
    """Yields restored batches first, then the upstream's.

    Args:
        name: the stage's name in the epoch's state.
        upstream: the stage to pass on after the restored batches.
        queued: the restored batches, each as its ids (``rows``, and
            ``deliveries`` after augment), in the order they are to be yielded.
        read_batch: recomputes a batch from its ids.
    """

    unresumable = None

    def __init__(self, name: str, upstream: Stage, queued: list[dict[str, np.ndarray]],
                 read_batch: Callable[[dict[str, np.ndarray]], Batch]) -> None:
        self.name = name
        self._upstream = upstream
        self._queued = deque(queued)
        self._read_batch = read_batch

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._queued:
            return self._read_batch(self._queued.popleft())
        return self._upstream.next(timeout_s)

    def stop(self) -> None:
        pass  # no threads of its own

    def join(self, timeout_s: float) -> None:
        pass

    def state(self) -> dict[str, Any]:
        """The restored batches not yet yielded."""
        return {"queued": list(self._queued)}

    def counters(self) -> dict[str, Any]:
        return {"replayed_left": len(self._queued)}
