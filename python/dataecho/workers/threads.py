"""Producer threads: read the source, run ``transform``, put examples into a buffer.

Map-style sources (``__len__`` + ``__getitem__``) are read by every worker,
each claiming the next chunk of positions of the epoch's order. Iterable
sources are read by one thread; with a ``transform`` chunks of examples are
fanned out to the workers through a small queue, so that the transform runs on
all of them. Either way a chunk goes into the buffer in one native call
(dataecho.reading.chunking).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

from ..errors import BufferClosed
from ..examples.columns import Columns
from ..examples.structure import Structure
from ..native.buffer import NativeBuffer
from ..reading.chunking import chunked, claimed
from ..reading.source import EpochSource
from .failure import Failure
from .spec import WorkersSpec

__all__ = ["AUTO_THREADS", "Producers"]

_END = object()
AUTO_THREADS = 8  # workers=None: the most reading threads it grows to
_SAMPLE_S = 0.05  # seconds of reading measured before deciding


class Producers:
    """Worker threads feeding one buffer for one epoch.

    Args:
        buffer: where examples go; closed when the source is exhausted.
        structure: checks and flattens each example.
        source: this epoch's view of the source (order or iterator).
        spec: how many threads, and ``worker_init_fn``.
        failure: where the first exception goes; ``on_failure`` is then called.
        on_failure: stops the pipeline (aborts its buffers).
    """

    def __init__(
        self,
        buffer: NativeBuffer,
        structure: Structure,
        source: EpochSource,
        spec: WorkersSpec,
        failure: Failure,
        on_failure: Callable[[], None],
    ) -> None:
        self._buffer = buffer
        self._structure = structure
        self._source = source
        self._transform = source.transform
        self._worker_init_fn = spec.worker_init_fn
        self._workers = spec.count
        self._auto_limit = AUTO_THREADS if spec.auto else 1
        self._failure = failure
        self._on_failure = on_failure
        self._threads: list[threading.Thread] = []
        self._running = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counters: dict[threading.Thread, list] = {}  # worker thread -> [produced, busy seconds]

    # ---- starting ----

    def start(self, first_seq: int = 0, ready: list | None = None) -> None:
        """Starts reading: positions the buffer hands out (map-style), or the
        iterator's examples numbered from ``first_seq``, after ``ready``
        (examples already read and transformed, numbered first)."""
        if self._source.order is not None:
            self.start_map()
        else:
            self.start_iterable(self._source.iterator, first_seq, ready or [])

    def start_map(self) -> None:
        """Reads the positions of the order that the buffer's claim counter
        hands out (set by the caller), a chunk at a time, on every worker; a
        position is also the example's sequence number."""
        self._columns = Columns(self._structure, self._buffer.fields, self._buffer.codec)
        self._growth = _Growth(self._auto_limit)
        self._spawn([self._read_map] * self._workers)

    def start_iterable(self, iterator: Iterator[Any], first_seq: int = 0, ready: list | None = None) -> None:
        """Reads ``iterator`` on one thread, in chunks (dataecho.reading.chunking.chunked);
        transforms on ``workers`` threads. Examples are numbered in reading order
        from ``first_seq``, ``ready`` ones (read and transformed) first."""
        ready = ready or []
        chunks = chunked(iterator, first_seq + len(ready), blocks=self._transform is None)
        columns = Columns(self._structure, self._buffer.fields, self._buffer.codec)

        def put_ready() -> None:
            if ready:
                self._buffer.put_each(columns.of(ready), len(ready), first_seq)

        if self._transform is None:

            def read() -> None:
                counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
                put_ready()
                started = time.perf_counter()
                for seq, examples in chunks:
                    counter[1] += time.perf_counter() - started
                    if self._stop.is_set():
                        return
                    self._buffer.put_each(columns.of(examples), len(examples), seq)
                    counter[0] += len(examples)
                    started = time.perf_counter()

            self._spawn([read], initialized=1)
            return
        handoff: queue.Queue = queue.Queue(maxsize=2 * self._workers)

        def read_and_hand_off() -> None:
            try:
                put_ready()
                for item in chunks:
                    if not self._offer(handoff, item):
                        return
            finally:
                for _ in range(self._workers):
                    self._offer(handoff, _END)

        def work() -> None:
            counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
            while not self._stop.is_set():
                try:
                    item = handoff.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is _END:
                    return
                seq, examples = item
                started = time.perf_counter()
                examples = [self._transform(example) for example in examples]
                counter[1] += time.perf_counter() - started
                self._buffer.put_each(columns.of(examples), len(examples), seq)
                counter[0] += len(examples)

        self._spawn([work] * self._workers + [read_and_hand_off], initialized=self._workers)

    def _read_map(self) -> None:
        """One worker of ``start_map`` (a method, not a closure: a closure that
        spawns more of itself would hold itself, and the buffer, in a cycle)."""
        buffer, growth = self._buffer, self._growth
        counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
        first_worker = threading.current_thread() is self._threads[0]
        started, cpu = time.perf_counter(), time.thread_time()
        for seq, rows, read in claimed(buffer.claim_range, self._source.chunk, self._source.reader,
                                       self._columns):
            busy = time.perf_counter() - started
            counter[1] += busy
            if first_worker and (more := growth.observe(busy, time.thread_time() - cpu)):
                self._spawn([self._read_map] * more, first_id=len(self._counters))
            buffer.put_each(read, rows, seq)
            counter[0] += rows
            if self._stop.is_set():
                return
            started, cpu = time.perf_counter(), time.thread_time()

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

    def _spawn(self, targets: list[Callable[[], None]], initialized: int | None = None, first_id: int = 0) -> None:
        """One thread per target; the first `initialized` (all by default) are
        workers, numbered from `first_id`: each calls ``worker_init_fn`` with
        its number first."""
        initialized = len(targets) if initialized is None else initialized
        threads = []
        for i, target in enumerate(targets):
            worker_id = first_id + i if i < initialized else None
            thread = threading.Thread(target=self._run, args=(target, worker_id),
                                      name=f"dataecho-producer-{first_id + i}", daemon=True)
            threads.append(thread)
            if worker_id is not None:  # listed in worker order, from the start
                self._counters[thread] = [0, 0.0]
        with self._lock:  # a worker may add threads while others end
            self._running += len(threads)
            self._threads.extend(threads)
        for thread in threads:
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

    def _offer(self, handoff: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                handoff.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False


class _Growth:
    """``workers=None``: one reading thread, and more only where reading waits
    rather than computes. A read whose thread's CPU time is a small part of its
    wall time waits on I/O, a sleep or a lock, and more threads overlap those
    waits; a read that computes, in Python (holding the GIL) or natively, gains
    little from a second thread and loses to the contention. After ``_SAMPLE_S``
    of reading, it asks for wall / CPU threads in all, up to ``limit``, once."""

    def __init__(self, limit: int) -> None:
        self._limit, self._wall, self._cpu = limit, 0.0, 0.0
        self._decided = limit <= 1

    def observe(self, wall_s: float, cpu_s: float) -> int:
        """Threads to add after a read of ``wall_s`` seconds, ``cpu_s`` of them on the CPU."""
        if self._decided:
            return 0
        self._wall, self._cpu = self._wall + wall_s, self._cpu + cpu_s
        if self._wall < _SAMPLE_S:
            return 0
        self._decided = True
        threads = min(self._limit, int(self._wall / max(self._cpu, 1e-6)))
        return threads - 1 if threads >= 2 else 0
