"""Who reads a batch sampler's batches: worker threads, or with
``num_workers=0`` the consumer's own thread when a batch is asked for (as
dataecho.workers.inline_reader reads for the echo buffer).

Each worker takes the next batch number under a lock, reads that batch whole
(``read``, given by the stage) and leaves it for the consumer, who takes the
batches in number order: a reorder by number, so that the order is the
sampler's whatever the workers' timing. A worker claims a number only while
fewer than ``ahead`` batches (at least one per worker) are read or being read
beyond the consumer's next one: memory holds at most that many batches.

Synchronization: one condition (``_cond``) guards the numbers claimed and
handed out, the batches read and the list of threads. A worker publishes a
batch under it, so everything it wrote into the batch happens before the
consumer's take of it; every change of what may be claimed or taken notifies it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from .failure import Failure
from .growth import AUTO_THREADS, Growth
from .spec import WorkersSpec

__all__ = ["BatchReaders"]

_WAIT_S = 0.05  # waits are sliced, so that a stop, Ctrl-C and timeouts are seen soon


class BatchReaders:
    """Batches ``first`` to ``count - 1``, read by ``spec``'s workers and handed out in order.

    Args:
        read: reads batch ``number`` whole, in a worker thread (inline: in the
            consumer's); what it returns has a ``len()``, its examples.
        count: batches in the epoch.
        first: the number of the first batch to read (a resume starts later).
        spec: who reads (``"inline"`` or ``"thread"``), how many, and
            ``worker_init_fn``; ``auto``: one thread, more while reads wait
            (dataecho.workers.growth.Growth).
        ahead: batches read ahead of the consumer at most (raised to the
            number of threads: one in flight each).
        failure, on_failure: where a worker's exception goes, and what stops the epoch.
    """

    def __init__(self, read: Callable[[int], Any], count: int, first: int, spec: WorkersSpec, ahead: int,
                 failure: Failure, on_failure: Callable[[], None]) -> None:
        self._read, self._count, self._ahead = read, count, ahead
        self._spec, self._failure, self._on_failure = spec, failure, on_failure
        self._claimed = self._handed = first  # the next number to claim, and to hand out
        self._ready: dict[int, Any] = {}  # read, not yet handed out, by number
        self._cond = threading.Condition()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._counters: dict[threading.Thread, list] = {}  # reader -> [examples read, seconds busy]
        self._growth = Growth(AUTO_THREADS if spec.auto else 1)
        if spec.kind != "inline":
            self._spawn(spec.count)

    # ---- the consumer's side ----

    def take(self, timeout_s: float | None = None) -> Any:
        """The next batch in order.

        Raises:
            StopIteration: after the last batch, or once stopped (a worker's
                error is then in ``failure``).
            TimeoutError: it was not read within ``timeout_s``.
        """
        if self._spec.kind == "inline":
            if self._stopped or self._handed >= self._count:
                raise StopIteration
            batch = self._read_one(self._handed)[0]
            self._handed += 1
            return batch
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._stopped and self._handed < self._count and self._handed not in self._ready:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"batch {self._handed} was not read within {timeout_s:g} s")
                self._cond.wait(_WAIT_S if left is None else min(left, _WAIT_S))
            if self._stopped or self._handed >= self._count:
                raise StopIteration
            batch = self._ready.pop(self._handed)
            self._handed += 1
            self._cond.notify_all()  # the window moved: a worker may claim one more
            return batch

    def pending(self) -> tuple[int, list[Any]]:
        """(the number the consumer takes next, the batches read from it on
        without a gap, in order): where reading stands, for a state."""
        with self._cond:
            ready, number = [], self._handed
            while number in self._ready:
                ready.append(self._ready[number])
                number += 1
            return self._handed, ready

    def stop(self) -> None:
        """Stops the workers after the reads they are in; idempotent, from any thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():  # an epoch collected by one of its own threads
                thread.join(max(0.0, deadline - time.monotonic()))

    def counters(self) -> list[dict[str, float]]:
        """Per reader (thread, or the consumer's inline): examples read and seconds busy reading."""
        return [{"produced": n, "busy_s": busy} for n, busy in list(self._counters.values())]

    # ---- the workers ----

    def _spawn(self, count: int) -> None:
        """Starts ``count`` more workers, numbered on from those there are."""
        with self._cond:
            first = len(self._threads)
            threads = [threading.Thread(target=self._run, args=(first + i,), name=f"dataecho-batches-{first + i}",
                                        daemon=True) for i in range(count)]
            self._threads.extend(threads)
            for thread in threads:  # listed in worker order, from the start
                self._counters[thread] = [0, 0.0]
        for thread in threads:
            thread.start()

    def _run(self, worker_id: int) -> None:
        try:
            if self._spec.worker_init_fn is not None:
                self._spec.worker_init_fn(worker_id)
            self._work(worker_id == 0)
        except BaseException as error:  # handed to the consumer, which raises it
            # Recorded before the stop: a consumer woken by it finds the error.
            first = self._failure.set(error)
            self.stop()
            if first:
                self._on_failure()

    def _work(self, first_worker: bool) -> None:
        while (number := self._claim()) is not None:
            batch, busy_s, cpu_s = self._read_one(number)
            with self._cond:
                self._ready[number] = batch
                self._cond.notify_all()
            if first_worker and (more := self._growth.observe(busy_s, cpu_s)):
                self._spawn(more)

    def _claim(self) -> int | None:
        """The next number to read, once it is within the read-ahead window;
        None at the end, or once stopped."""
        with self._cond:
            while (not self._stopped and self._claimed < self._count
                   and self._claimed >= self._handed + max(self._ahead, len(self._threads))):
                self._cond.wait(_WAIT_S)
            if self._stopped or self._claimed >= self._count:
                return None
            self._claimed += 1
            return self._claimed - 1

    def _read_one(self, number: int) -> tuple[Any, float, float]:
        """(batch ``number``, seconds it took, seconds of them on the CPU), counted for this thread."""
        counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
        started, cpu = time.perf_counter(), time.thread_time()
        batch = self._read(number)
        busy_s = time.perf_counter() - started
        counter[0] += len(batch)
        counter[1] += busy_s
        return batch, busy_s, time.thread_time() - cpu
