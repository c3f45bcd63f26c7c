"""The first exception raised by any thread or process of an epoch, kept for the consumer."""

from __future__ import annotations

import threading

from ..errors import stop_iteration_error

__all__ = ["Failure"]

class Failure:
    """The first exception raised by any thread of an epoch, kept for the consumer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def set(self, error: BaseException) -> bool:
        """Records ``error`` if it is the first; returns whether it was. A
        StopIteration (user code calling next() on an exhausted iterator, say)
        is recorded as a RuntimeError: raised in the training loop as it is, it
        would end the epoch silently, short of examples (as in a generator, PEP 479)."""
        if isinstance(error, StopIteration):
            error = stop_iteration_error(error)
        with self._lock:
            if self.error is not None:
                return False
            self.error = error
            return True

    def raise_if_set(self) -> None:
        if self.error is not None:
            # Re-raising the worker's own exception keeps its traceback (the
            # worker's frames) and adds the consumer's.
            raise self.error
