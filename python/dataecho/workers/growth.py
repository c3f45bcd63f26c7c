"""How many reading threads, when ``num_workers`` is not given.

One reading thread, and more only where reading *waits* rather than computes:
a read whose thread's CPU time is a small part of its wall time waits on I/O,
a sleep or a lock, and more threads overlap those waits; a read that computes,
in Python (holding the GIL) or natively, gains little from a second thread and
loses to the contention.

A thread that waits for the GIL looks the same as one that waits on I/O: its
wall time runs while its CPU time does not. The GIL is held by whatever Python
runs, and in a training job that is above all the training loop, whose every
small torch op's dispatch holds it: more reading threads would add to the
contention they misread as I/O (and slow the step they feed). So a decision to
grow also measures how long this thread waits to take the GIL back after
giving it up (``time.sleep(0)``: microseconds when nobody holds it, up to the
interpreter's switch interval, 5 ms, when a busy thread does), and while that
wait is long it adds no thread, and the threads beyond the first stop at their
next chunk. The decision is made after ``SAMPLE_S`` of reading and checked
again every ``RECHECK_S``, since the training loop starts only once batches
come. Reads that compute in Python are said once on the ``dataecho`` logger,
with the figures, pointing at worker processes.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from typing import Callable

__all__ = ["AUTO_THREADS", "GIL_BUSY_S", "Growth", "gil_wait_s"]

AUTO_THREADS = 8  # the most reading threads it grows to
SAMPLE_S = 0.05  # seconds of reading measured before deciding
RECHECK_S = 0.5  # then how often the GIL is checked again
GIL_BUSY_S = 0.001  # a median wait to take the GIL back longer than this: another thread keeps it busy

logger = logging.getLogger("dataecho")  # silent unless configured (see dataecho.pipeline.progress.stats)


def gil_wait_s(probes: int = 3) -> float:
    """The median time this thread takes to get the GIL back after giving it up."""
    waits = []
    for _ in range(probes):
        start = time.perf_counter()
        time.sleep(0)  # gives the GIL up and takes it back
        waits.append(time.perf_counter() - start)
    return statistics.median(waits)


class Growth:
    """The reading threads a loader grows to (see the module docstring).

    Args:
        limit: the most threads (1: ``num_workers`` was given, no growth).
        gil_wait: measures how long this thread waits for the GIL (default :func:`gil_wait_s`).

    Attributes:
        allowed: threads that may read, None for all: those started beyond it
            stop before their next claim (the GIL is busy).
    """

    def __init__(self, limit: int, gil_wait: Callable[[], float] | None = None) -> None:
        self._limit, self._wall, self._cpu, self._rows = limit, 0.0, 0.0, 0
        self._gil_wait = gil_wait or gil_wait_s
        self._decided = limit <= 1
        self._next_check = 0.0
        self._said = False
        self.allowed: int | None = None

    def cpu_now(self) -> float:
        """This thread's CPU time while the reads are sampled, else 0 (the
        clock costs a system call per read on some machines)."""
        return 0.0 if self._decided else time.thread_time()

    def observe(self, wall_s: float, cpu_s: float, rows: int = 1) -> int:
        """Threads to add after a read of ``rows`` examples in ``wall_s``
        seconds, ``cpu_s`` of them on the CPU (called by the first thread)."""
        if self._limit <= 1:
            return 0
        if self._decided:
            self._recheck()
            return 0
        self._wall, self._cpu, self._rows = self._wall + wall_s, self._cpu + cpu_s, self._rows + rows
        if self._wall < SAMPLE_S:
            return 0
        self._decided = True
        self._next_check = time.monotonic() + RECHECK_S
        if self._gil_busy():
            return 0
        threads = min(self._limit, int(self._wall / max(self._cpu, 1e-6)))
        if threads <= 1 and self._cpu >= self._wall / 2:
            self._say(f"reading computes ({self._cpu / max(self._rows, 1) * 1e6:.0f} us of CPU per example, "
                      f"{self._cpu / self._wall:.0%} of its time) on one thread, which would only contend for "
                      f"the GIL with a second one")
        return threads - 1 if threads >= 2 else 0

    def reads(self, thread: int) -> bool:
        """Whether the reading thread ``thread`` (0 the first) may claim more."""
        return self.allowed is None or thread < self.allowed

    def _recheck(self) -> None:
        if self.allowed is None and time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + RECHECK_S
            self._gil_busy()

    def _gil_busy(self) -> bool:
        """Whether another thread keeps the GIL busy; if so, only one thread reads."""
        wait = self._gil_wait()
        if wait < GIL_BUSY_S:
            return False
        self.allowed = 1
        self._say(f"the reading thread waits {wait * 1e3:.1f} ms for the GIL, which the training loop (or "
                  f"other Python) keeps busy: more reading threads would only slow it further")
        return True

    def _say(self, what: str) -> None:
        if not self._said:
            self._said = True
            logger.info("dataecho: %s; worker_type='process' reads (and augments) in worker processes, which "
                        "take nothing from the training loop's GIL (switch interval %.0f ms)", what,
                        sys.getswitchinterval() * 1e3)
