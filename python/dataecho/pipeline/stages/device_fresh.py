"""The device echo stage's fresh batches on their way to the device
(dataecho.pipeline.stages.device_echo): each host batch taken from upstream
is handed to a :class:`~dataecho.pipeline.stages.device_copy.DeviceMover` at
once, and where readers read ahead, the next one is taken and its copy
started as a batch is handed out, a batch before its rows are needed: the copy
runs on the side stream while the training step runs, and the consumer's
stream waits for it (on the device, not the host) only when the rows are
written.

Which fresh batch comes when does not change: they are taken from upstream in
the same order, and the stage writes each into its rows at the same point of
its choices as without the read-ahead; one taken and not yet written is
``pending``, named in the stage's state and read again on resume.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable

import numpy as np

from ...examples.leaves import leaf_to_torch
from .device_copy import DeviceMover
from .stage import Batch, Replay, Stage

__all__ = ["FreshBatches"]


class FreshBatches:
    """Fresh host batches, copied to the device a batch ahead where they can be.

    Args:
        device: the torch device.
        upstream: the stage the fresh batches come from.
        ahead: take the next batch as one is handed out (readers read ahead:
            taking one that is ready costs the loop nothing); False where the
            loop's thread reads (``num_workers=0``).
        check: refuses a batch that cannot be kept on the device (raises).
        pending: a resumed stage's pending batches (their ids), or None.
        read_batch: reads a batch again from its ids (for ``pending``).
        backend: the copies' backend (device_copy), None: the device's.
    """

    def __init__(self, device: Any, upstream: Stage, ahead: bool, check: Callable[[Batch], None],
                 pending: list[dict[str, np.ndarray]] | None = None,
                 read_batch: Callable[[dict[str, np.ndarray]], Batch] | None = None, backend: Any = None) -> None:
        self._mover = DeviceMover(device, backend=backend, max_unreleased=2)
        # Held around each use of the mover: the consumer's thread uses it, close() may come from another.
        self._lock = threading.Lock()
        self._upstream, self._ahead, self._check, self._read_batch = upstream, ahead, check, read_batch
        self._replay = Replay(pending)
        self._pending: deque[Batch] = deque()  # submitted, not yet taken (their ids: no arrays)
        self.done = False  # the input has ended

    def take(self, timeout_s: float | None) -> tuple[Batch, list[Any]] | None:
        """The next fresh batch (its structure and rows, no arrays) and its leaves
        on the device, the current stream waiting for their copy; None at the
        input's end. TimeoutError where ``timeout_s`` passes first."""
        if not self._pending and not self._submit(timeout_s):
            return None
        batch = self._pending.popleft()
        with self._lock:
            if self._mover.closed:
                raise StopIteration
            return batch, self._mover.take()

    def ahead(self) -> None:
        """Starts the next batch's copy now, where one is ready without waiting."""
        if self._ahead and not self._pending and not self.done:
            try:
                self._submit(0.0)
            except TimeoutError:
                pass

    def copy(self, batch: Batch) -> list[Any]:
        """``batch``'s leaves on the device now (a resumed stage's resident examples, before any other)."""
        assert not self._pending, "the mover hands batches out in the order they were submitted"
        self._check(batch)
        with self._lock:
            self._start(batch)
            return self._mover.take()

    def saved(self) -> list[dict[str, np.ndarray]]:
        """What names the batches taken and not yet written, for a state."""
        return [batch.ids() for batch in self._pending] + self._replay.saved()

    def close(self) -> None:
        """Waits for the copies in flight and gives their host memory back (raises where the device failed)."""
        with self._lock:
            self._mover.close()

    def _submit(self, timeout_s: float | None) -> bool:
        try:
            batch = self._replay.next(self._read_batch) if self._replay else self._upstream.next(timeout_s)
        except StopIteration:
            self.done = True
            return False
        self._check(batch)
        with self._lock:
            if self._mover.closed:
                raise StopIteration
            self._start(batch)
        self._pending.append(Batch(batch.structure, (), batch.rows))
        return True

    def _start(self, batch: Batch) -> None:
        host = [leaf_to_torch(leaf) for leaf in batch.arrays]
        self._mover.submit(host, on_done=host.clear)  # on the copy stream; the host memory kept until it is done
