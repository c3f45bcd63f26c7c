"""Repeats read again: once a rank's shard is delivered, the lockstep stage
(dataecho.pipeline.stages.lockstep) repeats while the other ranks finish
theirs. Its kept batches hold only the last few; this reads batches of the
least-delivered examples of the whole shard again, in a thread of its own and
a batch or two ahead, so that the repeats spread over the shard instead of
piling onto the kept batches. The stage takes a batch read here where one is
ready and a kept one otherwise, so reading again never slows the rank down.

For a map-style source without ``augment``: an example is read again by its
position in the epoch's order, as a resumed epoch reads it (the intake's
``read_batch``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import numpy as np

from .stage import Batch

__all__ = ["Rereads"]

_DEPTH = 2  # batches read ahead
_POLL_S = 0.05  # how often a full queue's put checks for a stop


class Rereads:
    """Batches of the least-delivered positions, read again (see the module docstring).

    Args:
        read_batch: reads the batch at positions ``{"rows": ...}`` again.
        times: how many times each position was delivered so far (the stage's
            array, read as it grows: a callable returning it).
        batch_size: rows per batch read.
        seed: breaks ties among equally delivered positions.
    """

    def __init__(self, read_batch: Callable[[dict[str, np.ndarray]], Batch], times: Callable[[], np.ndarray],
                 batch_size: int, seed: int = 0) -> None:
        self._read_batch, self._times, self._batch_size = read_batch, times, batch_size
        self._rng = np.random.default_rng(seed)
        self._ready: queue.Queue[Batch] = queue.Queue(maxsize=_DEPTH)
        self._queued: list[np.ndarray] = []  # rows read but not yet taken (they count as delivered once more)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dataecho-rereads", daemon=True)
        self._thread.start()

    def take(self) -> Batch | None:
        """A batch read again, if one is ready (else None).

        Raises:
            Exception: the error that reading raised (the dataset's, or transform's).
        """
        if self._error is not None:
            raise self._error
        try:
            batch = self._ready.get_nowait()
        except queue.Empty:
            return None
        with self._lock:
            self._queued.pop(0)
        return batch

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                rows = self._pick()
                if rows is None:
                    return
                batch = self._read_batch({"rows": rows})
                with self._lock:
                    self._queued.append(rows)
                while not self._stop.is_set():
                    try:
                        self._ready.put(batch, timeout=_POLL_S)
                        break
                    except queue.Full:
                        continue
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            self._error = error

    def _pick(self) -> np.ndarray | None:
        """The ``batch_size`` positions delivered the fewest times (counting
        those read and not yet taken), ties at random; None if none was delivered."""
        times = self._times().astype(np.float64)
        with self._lock:
            for rows in self._queued:
                np.add.at(times, rows.astype(np.intp), 1)
        delivered = np.flatnonzero(times)
        if not len(delivered):
            return None
        keys = times[delivered] + self._rng.random(len(delivered))  # below 1: ties only
        count = min(self._batch_size, len(delivered))
        chosen = delivered[np.argpartition(keys, count - 1)[:count]] if count < len(delivered) else delivered
        return np.sort(chosen).astype(np.uint64)

