"""``dataecho.get_worker_info()``: which worker process this is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerInfo", "get_worker_info", "set_worker_info"]

@dataclass(frozen=True)
class WorkerInfo:
    """What ``dataecho.get_worker_info()`` returns inside a worker process.

    Attributes:
        id: this worker's index, in ``range(num_workers)``.
        num_workers: worker processes of the loader.
        seed: a seed distinct per worker and epoch, for the worker's own randomness
            (``random``, NumPy's global generator and torch's are seeded from it).
        dataset: this worker's copy of the source.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any = None


_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """In a worker process, the worker's id, count, seed and dataset; None elsewhere.

    An iterable source that runs in worker processes is iterated by every
    worker: use this to read a different shard in each (a torch ``Dataset``
    may use torch's ``get_worker_info()`` instead, which returns the same)::

        def __iter__(self):
            info = dataecho.get_worker_info()
            start, step = (0, 1) if info is None else (info.id, info.num_workers)
            for i in range(start, len(self.files), step):
                yield load(self.files[i])
    """
    return _info


def set_worker_info(info: WorkerInfo) -> None:
    """In a worker process, once at start: what ``get_worker_info()`` returns there."""
    global _info
    _info = info
