"""The device copy: the last stage when ``device`` is given. Each batch is
copied to the device on a side stream one batch ahead, so that the copy
overlaps the training step (see :class:`dataecho.torch_support.DeviceMover`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .stage import Batch, Stage

__all__ = ["DeviceStage"]

_AHEAD = 2  # batches in flight: the one handed out and the next


class DeviceStage:
    """Host batches in, device tensors out.

    Args:
        upstream: the stage whose (host) batches are copied.
        device: the torch device.
    """

    name = "device"
    unresumable = None

    def __init__(self, upstream: Stage, device: Any) -> None:
        from .torch_support import DeviceMover

        self._upstream = upstream
        self._mover = DeviceMover(device)
        self._in_flight: deque[Batch] = deque()  # submitted, not yet handed out (no arrays kept)
        self._exhausted = False

    def next(self, timeout_s: float | None = None) -> Batch:
        from .torch_support import to_torch

        while not self._exhausted and len(self._mover) < _AHEAD:
            try:
                batch = self._upstream.next(timeout_s)
            except StopIteration:
                self._exhausted = True
                break
            host = [to_torch(a) for a in batch.arrays]
            self._mover.submit(host, on_done=host.clear)
            self._in_flight.append(Batch(batch.structure, (), batch.rows, batch.deliveries))
        if len(self._mover) == 0:
            raise StopIteration
        taken = self._in_flight.popleft()
        return Batch(taken.structure, tuple(self._mover.take()), taken.rows, taken.deliveries)

    def stop(self) -> None:
        pass  # the mover is the consumer's: join() closes it, in the consumer's thread

    def join(self, timeout_s: float) -> None:
        """Waits for the copies in flight and gives their host memory back."""
        self._mover.close()

    def state(self) -> dict[str, Any]:
        """The batches taken from upstream and not yet handed out, oldest first."""
        return {"in_flight": [batch.ids() for batch in self._in_flight]}

    def counters(self) -> dict[str, Any]:
        return {"in_flight": len(self._in_flight)}
