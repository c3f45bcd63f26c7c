"""Producer threads: read the source, run ``transform``, put examples into a buffer.

Map-style sources (``__len__`` + ``__getitem__``) are read by every worker,
each taking the next index of the epoch's order. Iterable sources are read by
one thread; with a ``transform`` the examples are fanned out to the workers
through a small queue, so that the transform runs on all of them.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from .buffer import NativeBuffer
from .errors import BufferClosed
from .stage import Failure
from .structure import Structure

if TYPE_CHECKING:
    from .config import LoaderConfig
    from .source import EpochSource

__all__ = ["Producers"]

_END = object()


class Producers:
    """Worker threads feeding one buffer for one epoch.

    Args:
        buffer: where examples go; closed when the source is exhausted.
        structure: checks and flattens each example.
        source: this epoch's view of the source (order or iterator).
        config: the loader's configuration (``transform``, ``workers``).
        failure: where the first exception goes; ``on_failure`` is then called.
        on_failure: stops the pipeline (aborts its buffers).
    """

    def __init__(
        self,
        buffer: NativeBuffer,
        structure: Structure,
        source: EpochSource,
        config: LoaderConfig,
        failure: Failure,
        on_failure: Callable[[], None],
    ) -> None:
        self._buffer = buffer
        self._structure = structure
        self._source = source
        self._transform = config.transform
        self._worker_init_fn = config.worker_init_fn
        self._workers = config.workers
        self._failure = failure
        self._on_failure = on_failure
        self._threads: list[threading.Thread] = []
        self._running = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counters: dict[threading.Thread, list] = {}  # worker thread -> [produced, busy seconds]

    # ---- starting ----

    def start(self, first_seq: int = 0) -> None:
        """Starts reading: positions the buffer hands out (map-style), or the
        iterator's examples numbered from ``first_seq``."""
        if self._source.order is not None:
            self.start_map(self._source.config.source, self._source.order)
        else:
            self.start_iterable(self._source.iterator, first_seq)

    def start_map(self, source: Any, order: np.ndarray) -> None:
        """Reads ``source[order[p]]`` on every worker, for each position p the
        buffer's claim counter hands out (set by the caller); p is also the
        example's sequence number."""
        claim = self._buffer.claim_index

        def work() -> None:
            while not self._stop.is_set():
                position = claim()
                if position < 0:
                    return
                start = time.perf_counter()
                self._put(source[int(order[position])], start, position)

        self._spawn([work] * self._workers)

    def start_iterable(self, iterator: Iterator[Any], first_seq: int = 0) -> None:
        """Reads ``iterator`` on one thread; transforms on ``workers`` threads.
        Examples are numbered in reading order from ``first_seq``."""
        numbered = enumerate(iterator, first_seq)
        if self._transform is None:

            def read() -> None:
                start = time.perf_counter()
                for seq, example in numbered:
                    if self._stop.is_set():
                        return
                    self._put(example, start, seq)
                    start = time.perf_counter()

            self._spawn([read], initialized=1)
            return
        handoff: queue.Queue = queue.Queue(maxsize=4 * self._workers)

        def read_and_hand_off() -> None:
            try:
                for item in numbered:
                    if not self._offer(handoff, item):
                        return
            finally:
                for _ in range(self._workers):
                    self._offer(handoff, _END)

        def work() -> None:
            while not self._stop.is_set():
                try:
                    item = handoff.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _END:
                    return
                seq, example = item
                self._put(example, time.perf_counter(), seq)

        self._spawn([work] * self._workers + [read_and_hand_off], initialized=self._workers)

    # ---- stopping ----

    def stop(self) -> None:
        """Asks every thread to stop; callers abort the buffer to release blocked puts."""
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():  # an epoch collected by one of its own threads
                thread.join(max(0.0, deadline - time.monotonic()))

    def counters(self) -> list[dict[str, float]]:
        """Per thread: examples produced and seconds busy reading and transforming."""
        return [{"produced": n, "busy_s": busy} for n, busy in self._counters.values()]

    # ---- internals ----

    def _spawn(self, targets: list[Callable[[], None]], initialized: int | None = None) -> None:
        """One thread per target; the first `initialized` (all by default) are
        workers: each calls ``worker_init_fn`` with its number first."""
        self._running = len(targets)
        initialized = len(targets) if initialized is None else initialized
        for i, target in enumerate(targets):
            worker_id = i if i < initialized else None
            thread = threading.Thread(target=self._run, args=(target, worker_id), name=f"dataecho-producer-{i}",
                                      daemon=True)
            self._threads.append(thread)
            if worker_id is not None:  # listed in worker order, from the start
                self._counters[thread] = [0, 0.0]
        for thread in self._threads:
            thread.start()

    def _run(self, target: Callable[[], None], worker_id: int | None) -> None:
        try:
            if worker_id is not None and self._worker_init_fn is not None:
                self._worker_init_fn(worker_id)
            target()
        except BufferClosed:
            pass  # the pipeline is shutting down
        except BaseException as error:  # handed to the consumer, which raises it
            if self._failure.set(error):
                self._on_failure()
            return
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
        if last and not self._stop.is_set():
            self._buffer.close()

    def _put(self, example: Any, started: float, seq: int) -> None:
        """Transforms and puts example number `seq`; `started` is when reading it began."""
        if self._transform is not None:
            example = self._transform(example)
        leaves = self._structure.flatten(example)
        counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
        counter[1] += time.perf_counter() - started
        self._buffer.put_values(leaves, seq=seq)
        counter[0] += 1

    def _offer(self, handoff: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                handoff.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False
