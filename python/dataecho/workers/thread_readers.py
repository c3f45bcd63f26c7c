"""Producer threads: read the source, run ``transform``, put examples into a buffer.

Map-style sources (``__len__`` + ``__getitem__``) are read by every worker,
each claiming the next chunk of positions of the epoch's order. Iterable
sources are read by one thread; with a ``transform`` chunks of examples are
fanned out to the workers through a small queue, so that the transform runs on
all of them. Either way a chunk goes into the buffer in one native call
(dataecho.reading.chunking).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Any, Callable, Iterator

from ..errors import BufferClosed
from ..examples.structure import Structure
from ..native.echo_buffer import NativeBuffer
from ..reading.chunking import claimed
from ..reading.source import EpochSource
from .growth import AUTO_THREADS, Growth
from .probe import Probe, ProbePositions
from .readers import InBackground, Kind, Reading

__all__ = ["AUTO_THREADS", "KIND", "Growth", "Producers"]

_END = object()


class Producers(InBackground):
    """Worker threads feeding one buffer for one epoch.

    Args:
        reading: the epoch's source, how many threads (and ``worker_init_fn``),
            where the first exception goes and what then stops the pipeline.
        buffer: where examples go; closed when the source is exhausted; None
            while the first examples are read (:meth:`start_probe`).
        structure: checks and flattens each example (None with no buffer).
    """

    grace_s = 0.0

    def __init__(self, reading: Reading, buffer: NativeBuffer | None, structure: Structure | None) -> None:
        self._buffer = buffer
        self._structure = structure
        self._source = reading.source
        self._spec = reading.spec
        self._failure = reading.failure
        self._on_failure = reading.on_failure
        self.probe: Probe | None = None  # reading the first examples before the buffer exists
        self._transform = reading.source.transform
        self._worker_init_fn = reading.spec.worker_init_fn
        self._workers = reading.spec.count
        self._auto_limit = AUTO_THREADS if reading.spec.auto else 1
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
            self.start_iterable(first_seq, ready or [])

    def start_probe(self, size: int) -> Probe:
        """Starts reading with no buffer yet: the first ``size`` examples (map-style:
        positions 0 to ``size - 1``) go to the returned probe and are kept by the
        threads that read them until :meth:`attach` (see dataecho.workers.probe)."""
        map_style = self._source.order is not None
        offerers = 1 if map_style and self._auto_limit > 1 else self._workers
        if not map_style and self._transform is None:
            offerers = 1  # the one reading thread
        self.probe = Probe(size, offerers)
        self._probe_positions = ProbePositions(self._source.available(size) if map_style else 0)
        self.start()
        return self.probe

    @property
    def probed(self) -> int:
        """Map-style: positions the probe reads (0 to this - 1)."""
        return self._probe_positions.count

    def attach(self, buffer: NativeBuffer, structure: Structure) -> None:
        """The buffer, once the probe's examples told the structure: the
        threads put what they kept, then read on into it (map-style: the
        positions its claim counter hands out, set by the caller)."""
        self._columns = buffer.columns(structure)
        self._structure = structure
        self._buffer = buffer  # last: a thread that sees it finds the rest set
        self.probe.attach(buffer)

    def start_map(self) -> None:
        """Reads the positions of the order that the buffer's claim counter
        hands out (set by the caller), a chunk at a time, on every worker; a
        position is also the example's sequence number."""
        if self.probe is None:
            self._columns = self._buffer.columns(self._structure)
        self._growth = Growth(self._auto_limit)
        self._spawn([self._read_map] * self._workers)

    def start_iterable(self, first_seq: int = 0, ready: list | None = None) -> None:
        """Reads the source's iterator (made in the reading thread) on one thread,
        in chunks (EpochSource.chunks); transforms on ``workers``
        threads. Examples are numbered in reading order from ``first_seq``,
        ``ready`` ones (read and transformed) first."""
        if self.probe is None:
            self._columns = self._buffer.columns(self._structure)
        chunks = _numbered(self._source, first_seq, ready or [], blocks=self._transform is None)
        if self._transform is None:
            self._spawn([functools.partial(self._read_chunks, chunks)], initialized=1)
            return
        handoff: queue.Queue = queue.Queue(maxsize=2 * self._workers)
        self._spawn([functools.partial(self._transform_chunks, handoff)] * self._workers
                    + [functools.partial(self._hand_off, chunks, handoff)], initialized=self._workers)

    def _read_chunks(self, chunks: Iterator[tuple[int, Any, bool]]) -> None:
        """The one reading thread of an iterable without ``transform``: puts its chunks."""
        counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
        sink = _Sink(self)
        started = time.perf_counter()
        for seq, examples, _ in chunks:
            counter[1] += time.perf_counter() - started
            if self._stop.is_set() or not sink.put(seq, examples):
                return
            counter[0] += len(examples)
            started = time.perf_counter()
        sink.finish()

    def _hand_off(self, chunks: Iterator[tuple[int, Any, bool]], handoff: queue.Queue) -> None:
        """The reading thread of an iterable with ``transform``: hands its chunks to the workers."""
        try:
            for item in chunks:
                if not _offer(handoff, item, self._stop):
                    return
        finally:
            for _ in range(self._workers):
                _offer(handoff, _END, self._stop)

    def _transform_chunks(self, handoff: queue.Queue) -> None:
        """A worker of an iterable with ``transform``: transforms the chunks handed to it, and puts them."""
        counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
        sink = _Sink(self)
        while not self._stop.is_set():
            try:
                item = handoff.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _END:
                sink.finish()
                return
            seq, examples, transformed = item
            started = time.perf_counter()
            if not transformed:
                examples = [self._transform(example) for example in examples]
            counter[1] += time.perf_counter() - started
            if not sink.put(seq, examples):
                return
            counter[0] += len(examples)

    def _read_map(self) -> None:
        """One worker of ``start_map`` (a method, not a closure: a closure that
        spawns more of itself would hold itself, and the buffer, in a cycle)."""
        if self.probe is not None and not self._probe_map():
            return
        buffer, growth = self._buffer, self._growth
        counter = self._counters.setdefault(threading.current_thread(), [0, 0.0])
        index = list(self._counters).index(threading.current_thread())  # in the order started: 0 decides growth
        started, cpu = time.perf_counter(), growth.cpu_now()
        # Smaller chunks as threads are added, where deterministic intake bounds how far they may read ahead.
        chunk = functools.partial(self._spec.chunk, self._source.chunk)
        for seq, rows, read in claimed(buffer.claim_range, lambda: chunk(len(self._counters)), self._source.reader,
                                       self._columns, functools.partial(growth.reads, index)):
            busy = time.perf_counter() - started
            counter[1] += busy
            if index == 0 and (more := growth.observe(busy, growth.cpu_now() - cpu, rows)):
                self._spawn([self._read_map] * more, first_id=len(self._counters))
            buffer.put_each(read, rows, seq)
            counter[0] += rows
            if self._stop.is_set():
                return
            started, cpu = time.perf_counter(), growth.cpu_now()

    def _probe_map(self) -> bool:
        """Reads positions of the probe while there are any, then waits for the
        buffer and puts them; False if the epoch stopped first."""
        kept = []
        while (position := self._probe_positions.take()) is not None and not self._stop.is_set():
            kept.append((position, self._source.read(position)))
            self.probe.offer(kept[-1:])
        self.probe.finish()
        buffer = self.probe.buffer()
        if buffer is None:
            return False
        for position, example in kept:
            buffer.put_values(self._structure.flatten(example), seq=position)
        self._counters.setdefault(threading.current_thread(), [0, 0.0])[0] += len(kept)  # read by this thread
        return True

    # ---- stopping ----

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
                if self.probe is not None:
                    self.probe.stop()  # wakes an epoch waiting for the first examples
                self._on_failure()
            return
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
        if last and not self._stop.is_set() and self._buffer is not None:
            self._buffer.close()



def _offer(handoff: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts ``item`` when there is room; False if ``stop`` is set first."""
    while not stop.is_set():
        try:
            handoff.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _start(reading: Reading, buffer: NativeBuffer, structure: Structure, first_seq: int, ready: list) -> Producers:
    producers = Producers(reading, buffer, structure)
    producers.start(first_seq, ready)
    return producers


def _probe(reading: Reading, size: int) -> Producers:
    producers = Producers(reading, None, None)
    producers.start_probe(size)
    return producers


KIND = Kind(start=_start, probe=_probe)


def _numbered(source: EpochSource, first_seq: int, ready: list, blocks: bool) -> Iterator[tuple[int, Any, bool]]:
    """An iterable source's chunks as (number of the first, examples,
    transformed): ``ready`` ones (read and transformed) first, then the
    iterator's, numbered on from ``first_seq``."""
    if ready:
        yield first_seq, ready, True
    for seq, examples in source.chunks(first_seq + len(ready), blocks=blocks):
        yield seq, examples, False


class _Sink:
    """Where one reading thread's chunks go: to the probe, kept by the thread,
    until the buffer is attached; then, what was kept first, to the buffer."""

    def __init__(self, producers: Producers) -> None:
        self._producers = producers
        self._kept: list[tuple[int, Any]] | None = [] if producers.probe is not None else None

    def put(self, seq: int, examples: Any) -> bool:
        """Puts a chunk numbered from ``seq``; False if the epoch stopped first."""
        producers = self._producers
        if self._kept is not None:  # probing
            self._kept.append((seq, examples))
            probe = producers.probe
            if producers._buffer is None:
                rows = list(examples)  # a block of rows (Ray) as examples
                probe.offer([(seq + i, example) for i, example in enumerate(rows)])
                if not probe.complete:
                    return True
            return self._put_kept()
        producers._buffer.put_each(producers._columns.of(examples), len(examples), seq)
        return True

    def finish(self) -> bool:
        """This thread has nothing more to read: the probe is told, and what it kept is put."""
        if self._kept is None:
            return True
        self._producers.probe.finish()
        return self._put_kept()

    def _put_kept(self) -> bool:
        buffer = self._producers.probe.buffer()
        if buffer is None:
            return False
        kept, self._kept = self._kept, None
        for seq, examples in kept:
            buffer.put_each(self._producers._columns.of(examples), len(examples), seq)
        return True
