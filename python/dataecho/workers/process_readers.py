"""Producer processes (``worker_type="process"``): CPU-bound Python upstream on
every core, writing straight into the echo buffer's shared-memory slots.

The parent keeps the assembler, the echo and batch stages and the consumer. A
monitor thread watches every worker's pipe and process sentinel: it unlinks the
shared region's name once all workers have mapped it, closes the buffer when all
are done, and turns a worker's exception or death into the consumer's error
within a fraction of a second.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from ..examples.structure import Structure
from ..native.echo_buffer import NativeBuffer
from ..reading.source import EpochSource
from . import reader_worker as child
from .life import RemoteTraceback, starting_hint, unguarded_main
from .pool import PROCESS_GRACE_S, WorkerPool, reap
from .probe import Probe
from .readers import InBackground, Kind, Reading

__all__ = ["KIND", "ProcessProducers"]

_POLL_S = 0.05


def _worker_spec(worker: int, reading: Reading, buffer: NativeBuffer | None, structure: Structure | None,
                 probe: int) -> child.WorkerSpec:
    """What worker number ``worker`` is started with (see dataecho.workers.reader_worker)."""
    source, spec = reading.source, reading.spec
    return child.WorkerSpec(
        region=buffer.region_name if buffer is not None else None,
        fields=buffer.fields if buffer is not None else None,
        structure=structure,
        # The dataset itself, pickled as Process() pickles its arguments, so
        # that what pickles only by inheritance (multiprocessing locks, values,
        # events) reaches the workers, as with DataLoader.
        source=source.spec.dataset,
        transform=source.transform,
        worker_id=worker,
        num_workers=spec.count,
        seed=(reading.resources.seeds.workers + 7919 * (worker + 1)) % (1 << 63),
        map_style=source.order is not None,
        order=source.order,
        worker_init_fn=spec.worker_init_fn,
        chunk=spec.chunk(source.chunk, spec.count),
        probe=probe,
        persistent=reading.resources.pool is not None,
    )


class ProcessProducers(InBackground):
    """The worker processes of one epoch.

    Args:
        reading: the epoch's source (the dataset, the order whose positions
            workers claim from the buffer's counter), how many processes (their
            start method, ``worker_init_fn``), where an error goes and what
            stops the pipeline, the seeds and the loader's persistent workers.
        buffer, structure: the echo buffer (created with a shared region) and
            the example structure; None for both while ``probe`` examples are
            read first (see dataecho.workers.probe and :meth:`attach`).
    """

    grace_s = PROCESS_GRACE_S

    def __init__(self, reading: Reading, buffer: NativeBuffer | None, structure: Structure | None,
                 probe: int = 0) -> None:
        source, spec, pool = reading.source, reading.spec, reading.resources.pool
        self._buffer = buffer
        self._failure = reading.failure
        self._on_failure = reading.on_failure
        self._stop = threading.Event()
        self.workers = spec.count
        self._pool = pool
        # No buffer yet: the workers read the probe first (see dataecho.workers.probe).
        self.probe = Probe(probe, spec.count) if buffer is None else None
        # Map-style: the positions the probe reads (0 to this - 1).
        self.probed = source.available(probe) if source.order is not None else probe
        self._processes: list[Any] = []
        self._pipes: list[Any] = []
        self._tasks: list[Any] = []
        self._lifeline: Any = None
        self._monitor: threading.Thread | None = None
        self._ready: set[int] = set()
        self._done: set[int] = set()
        try:
            if pool is not None and pool.running:
                self._continue(pool, structure, source)
            else:
                if pool is not None:
                    pool.close(0.0)  # one that failed or was stopped: nothing of it is left
                self._start(reading, structure)
            self._monitor = threading.Thread(target=self._watch, name="dataecho-monitor", daemon=True)
            self._monitor.start()
        except BaseException:
            # Ctrl-C (or a failed start) part-way: the workers already started stop too.
            if buffer is not None:
                buffer.abort()
            self.stop()
            self.join()
            raise

    def _start(self, reading: Reading, structure: Structure) -> None:
        spec = reading.spec
        context = multiprocessing.get_context(spec.start_method)
        if spec.start_method == "forkserver":
            context.set_forkserver_preload(["dataecho.workers.reader_worker"])
        workers, buffer = self.workers, self._buffer
        # The lifeline: this process holds its only write end and never writes, so
        # every worker's read end sees EOF the moment this process is gone, however
        # it dies (SIGKILL, the OOM killer). The workers' parent is the forkserver,
        # which outlives us, so watching the parent would not do.
        lifeline, self._lifeline = context.Pipe(duplex=False)
        for worker in range(workers):
            task = _worker_spec(worker, reading, buffer, structure, self.probed if buffer is None else 0)
            receiver, sender = context.Pipe(duplex=False)
            # The buffer after the probe, and with persistent workers later epochs, come over a task pipe.
            task_reader, task_writer = context.Pipe(duplex=False)
            self._tasks.append(task_writer)
            args: tuple = (task, sender, lifeline, task_reader)
            process = context.Process(target=child.main, args=args, name=f"dataecho-worker-{worker}", daemon=True)
            process.start()
            sender.close()  # the child holds the only writer: EOF means it is gone
            task_reader.close()
            self._processes.append(process)
            self._pipes.append(receiver)
        lifeline.close()  # the workers hold the read ends
        if self._pool is not None:
            self._pool.adopt(self._processes, self._pipes, self._tasks, self._lifeline)

    def _continue(self, pool: WorkerPool, structure: Structure, source: EpochSource) -> None:
        """Persistent workers: this epoch goes to the pool's idle workers."""
        self._processes, self._pipes, self._lifeline = pool.processes, pool.results, pool.lifeline
        buffer = self._buffer
        pool.next_epoch({"region": buffer.region_name, "fields": buffer.fields, "structure": structure,
                         "order": source.order})

    def attach(self, buffer: NativeBuffer, structure: Structure) -> None:
        """The buffer, once the probe told the structure: every worker maps it,
        puts what it read for the probe, and reads on (map-style: the positions
        its claim counter hands out, set by the caller)."""
        self._buffer = buffer
        update = {"region": buffer.region_name, "fields": buffer.fields, "structure": structure}
        for task in self._tasks:
            try:
                task.send(update)
            except OSError:  # that worker is gone: the monitor says why
                pass

    # ---- lifecycle ----

    def join(self, timeout_s: float = PROCESS_GRACE_S) -> None:
        """Waits for the workers (the buffer must be closed or aborted first), then
        terminates and kills any that linger. No child process is left, but the
        idle workers of a pool that ran this epoch to its end (or its stop)."""
        deadline = time.monotonic() + timeout_s
        if self._pool is not None:
            self._join_pool(deadline)
            return
        if self.probe is not None and self._buffer is None:  # stopped before the buffer came
            self.probe.stop()
            for task in self._tasks:
                try:
                    task.send(None)
                except OSError:
                    pass
        reap(self._processes, deadline)
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout_s)
        if self._buffer is not None:
            self._buffer.unlink_region()
        self._tasks.clear()
        # Dropping the connections closes them. (Not close(): when a loader is
        # collected in a reference cycle, a connection's own finalizer may have
        # closed its descriptor already, and the number may be in use again.)
        self._pipes.clear()
        self._lifeline = None  # every worker has ended

    def _join_pool(self, deadline: float) -> None:
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(max(0.0, deadline - time.monotonic()))
        finished = self._monitor is None or not self._monitor.is_alive()
        if not (finished and self._failure.error is None and self._buffer is not None
                and self._pool.await_done(self._done, deadline)):
            self._pool.close(max(0.0, deadline - time.monotonic()))
        if self._buffer is not None:
            self._buffer.unlink_region()
        self._lifeline = None

    def counters(self) -> list[dict[str, float]]:
        """Per worker: its process id, examples produced and seconds busy reading
        and transforming."""
        if self._buffer is None:
            return [{"pid": process.pid, "produced": 0, "busy_s": 0.0} for process in self._processes]
        return [
            {"pid": process.pid, "produced": produced, "busy_s": busy_ns * 1e-9}
            for process, (produced, busy_ns) in zip(self._processes, self._buffer.worker_counters(self.workers))
        ]

    # ---- the monitor ----

    def _watch(self) -> None:
        ready, done = self._ready, self._done
        pipes = {pipe: i for i, pipe in enumerate(self._pipes)}
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        while not self._stop.is_set():
            for obj in wait(list(pipes) + list(sentinels), timeout=_POLL_S):
                if obj in pipes:
                    self._receive(obj, pipes, ready, done)
                elif obj in sentinels:
                    self._exited(sentinels.pop(obj), pipes, ready, done)
            if len(ready) == self.workers and self._buffer is not None:
                self._buffer.unlink_region()  # all mapped: nothing left in /dev/shm
            if len(done) == self.workers:
                self._buffer.close()  # every example is committed: drain and end
                return
            if self._failure.error is not None:
                return

    def _receive(self, pipe: Any, pipes: dict, ready: set[int], done: set[int]) -> None:
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            pipes.pop(pipe)  # the worker exited; its sentinel says how
            return
        except Exception as error:  # a probe's examples that do not unpickle here
            self._fail(TypeError(f"dataset: examples a worker read cannot be unpickled by the loader, which "
                                 f"learns their structure from them ({type(error).__name__}: {error})"))
            return
        kind, worker = message[0], message[1]
        if kind == "probe":
            self.probe.offer(message[2])
            self.probe.finish()
        elif kind == "ready":
            ready.add(worker)
        elif kind == "done":
            done.add(worker)
        elif kind == "error":
            error, text = message[2], message[3]
            error.__cause__ = RemoteTraceback(text)
            self._fail(error)

    def _exited(self, worker: int, pipes: dict, ready: set[int], done: set[int]) -> None:
        process = self._processes[worker]
        process.join(0.1)
        # A message still in the pipe (an exception, "done") has the first word.
        pipe = self._pipes[worker]
        while pipe in pipes and pipe.poll(0):
            self._receive(pipe, pipes, ready, done)
        code = process.exitcode
        if worker in done or self._stop.is_set() or self._failure.error is not None:
            return
        # Without its "done", a worker left part of its share unread, whatever its
        # exit status (os._exit(0) in user code, say): the epoch would come up short.
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited (status {code}) before finishing its share of the source"
            if worker not in ready and (script := unguarded_main()) is not None:
                how += starting_hint(script)
        self._fail(RuntimeError(f"dataecho worker {worker} (pid {process.pid}) {how}; the epoch is stopped"))

    def _fail(self, error: BaseException) -> None:
        if self._failure.set(error):
            if self.probe is not None:
                self.probe.stop()  # wakes an epoch waiting for the first examples
            self._on_failure()


def _start(reading: Reading, buffer: NativeBuffer, structure: Structure, first_seq: int,
           ready: list) -> ProcessProducers:
    return ProcessProducers(reading, buffer, structure)  # each worker reads its own share from the start


def _probe(reading: Reading, size: int) -> ProcessProducers:
    return ProcessProducers(reading, None, None, probe=size)


KIND = Kind(start=_start, probe=_probe, shared=True, own_shards=True)
