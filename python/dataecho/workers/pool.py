"""``persistent_workers=True``: a loader's worker processes (those that read,
and those that augment), kept from one epoch to the next, as DataLoader keeps them, so that an epoch does not pay for
starting processes and unpickling the source again.

Between epochs a worker waits on its task pipe. Each epoch sends it what
changes (the new buffer region, the epoch's reading order); it maps the region,
reads its share, reports "done" and waits again. A worker that does not finish
its epoch in time, dies, or fails makes the pool unusable: it is reaped, and the
next epoch starts new workers.
"""

from __future__ import annotations

import time
from multiprocessing.connection import wait
from typing import Any

__all__ = ["PROCESS_GRACE_S", "WorkerPool", "close_workers", "reap"]

PROCESS_GRACE_S = 2.0  # a stopped worker gets this long to exit before it is terminated


def close_workers(tasks: list[Any], processes: list[Any], grace_s: float) -> None:
    """Asks workers to exit (None on each task pipe), gives them ``grace_s``
    seconds, then terminates and kills those that linger."""
    for task in tasks:
        try:
            task.send(None)
        except OSError:  # that worker is gone already
            pass
        except Exception:  # noqa: BLE001 - at interpreter exit pickling may be gone: the lifeline's EOF ends it
            pass
    reap(processes, time.monotonic() + grace_s)


def reap(processes: list[Any], deadline: float) -> None:
    """Waits for `processes` until `deadline` (time.monotonic()), then
    terminates and at last kills those still running."""
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(0.5)
        if process.is_alive():
            process.kill()
            process.join(0.5)


class WorkerPool:
    """The processes of a loader with ``persistent_workers=True``.

    Attributes:
        processes: the worker processes, by worker id.
        results: per worker, the connection its messages arrive on.
        lifeline: the write end of the pipe whose EOF tells the workers that
            this process is gone (see dataecho.workers.process_readers).
        augmenters: the augment worker processes (dataecho.workers.augment.augment_pool),
            kept idle between epochs, or None.
    """

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.results: list[Any] = []
        self.lifeline: Any = None
        self._tasks: list[Any] = []
        self._usable = False
        self.augmenters: Any = None

    @property
    def running(self) -> bool:
        """The workers are alive and idle or busy with the current epoch."""
        return self._usable and all(p.is_alive() for p in self.processes)

    def adopt(self, processes: list[Any], results: list[Any], tasks: list[Any], lifeline: Any) -> None:
        """Keeps workers started for an epoch; ``tasks``: the connections their next epochs are sent on."""
        self.processes, self.results, self._tasks, self.lifeline = processes, results, tasks, lifeline
        self._usable = True

    def next_epoch(self, update: dict[str, Any]) -> None:
        """Sends every worker its next epoch (the WorkerSpec fields that change)."""
        for task in self._tasks:
            task.send(update)

    def await_done(self, done: set[int], deadline: float) -> bool:
        """Reads the messages of each worker not in ``done`` until its "done"
        for this epoch; False if one fails, exits or is still busy at
        ``deadline`` (time.monotonic(); the pool is then to be closed)."""
        pending = {pipe: i for i, pipe in enumerate(self.results) if i not in done}
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            for pipe in ready:
                try:
                    message = pipe.recv()
                except (EOFError, OSError):
                    return False
                if message[0] == "error":
                    return False
                if message[0] == "done":
                    pending.pop(pipe)
        return True

    def close(self, grace_s: float) -> None:
        """Asks the workers to exit, gives them ``grace_s`` seconds, then
        terminates and kills those that linger. No process is left."""
        self._usable = False
        augmenters, self.augmenters = self.augmenters, None
        if augmenters is not None:
            augmenters.close(grace_s)
        close_workers(self._tasks, self.processes, grace_s)
        # Dropped, not closed: see ProcessProducers.join.
        self.processes, self.results, self._tasks, self.lifeline = [], [], [], None
