"""The first examples of an epoch whose structure is not known yet, read by its
workers.

The echo buffer's fields follow from the examples' structure (which leaves
there are, their shapes and dtypes, which vary in length), so the first epoch
of a loader learns it from the first examples before any buffer exists. Those
examples are read by the workers themselves, after ``worker_init_fn``, as they
will read every later one: the training loop's thread never calls the user's
dataset to learn the structure (with ``num_workers=0`` it reads everything, as
in DataLoader). The workers hand what they read to a :class:`Probe`, keep it,
and wait; the epoch infers the structure from the probe, builds the buffer and
attaches it; each worker then puts what it kept, with its sequence number, and
reads on into the buffer.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

__all__ = ["Probe", "ProbePositions"]


class Probe:
    """Examples offered by the workers until there are ``size`` of them or
    every worker that offers has finished (its share, or the source, ended),
    then the buffer they go into.

    Args:
        size: examples to learn the structure from.
        offerers: the workers that offer.
    """

    def __init__(self, size: int, offerers: int) -> None:
        self.size = size
        self._offerers = offerers
        self._finished = 0
        self._examples: list[tuple[int, Any]] = []
        self._stopped = False
        self._buffer: Any = None
        self._cond = threading.Condition()

    @property
    def complete(self) -> bool:
        """Enough examples came to learn the structure (or every one there is)."""
        with self._cond:
            return self._complete()

    def _complete(self) -> bool:
        return len(self._examples) >= self.size or self._finished >= self._offerers

    def offer(self, numbered: list[tuple[int, Any]]) -> None:
        """Examples read, as (sequence number, example)."""
        with self._cond:
            self._examples.extend(numbered)
            self._cond.notify_all()

    def finish(self) -> None:
        """One offerer has no more examples to offer."""
        with self._cond:
            self._finished += 1
            self._cond.notify_all()

    def examples(self, timeout_s: float | None) -> list[Any] | None:
        """The examples offered, in sequence order (at most ``size``), once the
        probe is complete; None if it was stopped first (a worker failed).

        Raises:
            TimeoutError: not complete within ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not (self._complete() or self._stopped):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("the first examples did not come in time")
                self._cond.wait(0.05 if left is None else min(left, 0.05))
            if self._stopped:
                return None
            return [example for _, example in sorted(self._examples, key=lambda item: item[0])[:self.size]]

    def attach(self, buffer: Any) -> None:
        """The buffer the kept examples go into, and every later one; None: the
        epoch is empty, and the workers stop."""
        with self._cond:
            self._buffer = buffer
            self._stopped = self._stopped or buffer is None
            self._cond.notify_all()

    def buffer(self) -> Any:
        """Waits for :meth:`attach`; the buffer, or None once stopped."""
        with self._cond:
            while self._buffer is None and not self._stopped:
                self._cond.wait(0.05)
            return self._buffer

    def stop(self) -> None:
        """Wakes everyone waiting: the epoch is stopping."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


class ProbePositions:
    """The positions of a map-style order that the probe reads, handed out one
    at a time to the threads that read them: 0, 1, ... up to ``count``."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = itertools.count()
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            position = next(self._next)
        return position if position < self.count else None
