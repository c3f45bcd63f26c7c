"""Augment worker processes (``augment_workers="process"``): ``augment`` runs
in them, not in the training process, whose only part is to hand each worker
the batches to augment (as block numbers and offsets of the staging blocks,
dataecho.workers.augment.staging) and to assemble the results that the workers put,
numbered by delivery, into the output buffer's shared region.

The workers' messages are read by whoever waits for them (:meth:`pump`): the
consumer's thread, as it takes a batch, and no thread of its own, so that no
Python of the loader runs beside the training step (each wake-up of such a
thread would take the GIL from it). A monitor thread watches only the
processes' sentinels: a worker's death (killed, or an exit of its own) is the
consumer's error within a fraction of a second, and the exception a worker
reported before it exited is read from its pipe then. The staging blocks'
names go once every worker has mapped them, the output region's once every
worker has attached it. Each worker has at most two tasks in flight: the
training process keeps the batches those tasks name (their memory) until the
worker says "done".

With ``persistent_workers=True`` the processes outlive their epoch: one that
ended with every task done hands them to the loader's pool
(dataecho.workers.pool.WorkerPool.augmenters), and the next epoch sends them
its staging blocks. Messages of an epoch carry its number, so that a late
"ready" of one epoch is never taken for the next's.
"""

from __future__ import annotations

import multiprocessing
import pickle
import select
import selectors
import signal
import threading
import time
from typing import Any, Callable

from ...errors import BufferClosed
from ..failure import Failure
from ..life import RemoteTraceback
from ..pool import close_workers
from . import augment_worker as augment_child
from .staging import SharedBlocks

__all__ = ["AugmentProcesses"]

_POLL_S = 0.05
_IN_FLIGHT = 2  # tasks per worker
_VERDICT_S = 2.0  # how long a failed send waits for the monitor to say why the worker is gone


class AugmentProcesses:
    """The augment worker processes, and the epoch they serve.

    Args:
        count: worker processes.
        start_method: how they are started ("forkserver" or "spawn").
        augment: the function, pickled to every worker once.
        structure: the upstream examples' structure.
        seed: the workers' global generators derive from it.
    """

    def __init__(self, count: int, start_method: str, augment: Any, structure: Any, seed: int) -> None:
        self._lock = threading.RLock()  # reading the pipes, and the tasks in flight
        self._stop = threading.Event()
        self._epoch = 0
        self._monitor: threading.Thread | None = None
        self._failure, self._on_failure, self._on_done = Failure(), lambda: None, lambda task_id: None
        self._blocks: SharedBlocks | None = None
        self._output: Any = None
        self._readable: dict[int, Any] = {}
        self._poller: Any = None
        spawned = _spawn(count, start_method, augment, structure, seed)
        self._processes, self._pipes, self._tasks, self._lifeline = spawned
        self._reset()

    @property
    def alive(self) -> bool:
        """Every worker is running (a kept pool can serve another epoch)."""
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def begin(self, blocks: SharedBlocks, rng_key: tuple | None, failure: Failure, on_failure: Callable[[], None],
              on_done: Callable[[int], None]) -> bool:
        """Starts an epoch: its staging blocks, ``rng_key`` ((seed, epoch, rank)
        where ``augment`` takes ``rng``, else None), where an error goes
        (``failure``, and ``on_failure``, which stops the epoch) and what to
        call with a task's id once its rows are in the output. False if a
        worker is gone (kept workers: one died between epochs)."""
        self._epoch += 1
        self._failure, self._on_failure, self._on_done = failure, on_failure, on_done
        self._blocks, self._output = blocks, None
        self._reset()
        self._stop.clear()
        for task in self._tasks:
            try:
                task.send_bytes(_pickled(("blocks", self._epoch, blocks.names, blocks.nbytes, rng_key)))
            except OSError:
                return False
        self._readable = {pipe.fileno(): pipe for pipe in self._pipes}  # the pipes not at their end, by descriptor
        self._poller = select.poll()  # registered once: wait() would build a selector per call
        for fd in self._readable:
            self._poller.register(fd, select.POLLIN)
        self._monitor = threading.Thread(target=self._watch, name="dataecho-augment-monitor", daemon=True)
        self._monitor.start()
        return True

    def _reset(self) -> None:
        self._load = [0] * len(self._processes)  # tasks in flight, per worker
        self._results: dict[int, list] = {}
        self._ready, self._attached = set[int](), set[int]()  # the workers that mapped the blocks, the output
        self._lost = False  # a worker died after the epoch was stopped

    @property
    def has_room(self) -> bool:
        """A worker has fewer than its tasks in flight."""
        return min(self._load) < _IN_FLIGHT

    @property
    def busy(self) -> bool:
        """A task is in flight."""
        return any(self._load)

    def submit(self, task_id: int, deliveries: Any, leaves: list, send_back: bool = False) -> None:
        """Hands a task (``deliveries``: an array, or ``(first, count)``) to the
        least busy worker, waiting (reading the workers' messages) while all
        have theirs in flight.

        Raises:
            BufferClosed: the epoch was stopped, or a worker failed (its error is in ``failure``).
        """
        self._wait_for(lambda: self.has_room)
        with self._lock:
            worker = min(range(len(self._load)), key=lambda w: self._load[w])
            self._load[worker] += 1
        self._send(worker, ("task", task_id, deliveries, leaves, send_back))

    def results(self, task_id: int) -> list:
        """Waits for the results a task sent back: [(delivery, result), ...] (BufferClosed as for :meth:`submit`)."""
        self._wait_for(lambda: task_id in self._results)
        return self._results.pop(task_id)

    def attach(self, output: Any, fields: list, structure: Any) -> None:
        """Tells every worker the output buffer to put its results into."""
        self._output = output
        for worker in range(len(self._tasks)):
            self._send(worker, ("output", output.region_name, fields, structure))

    def _wait_for(self, done: Callable[[], bool]) -> None:
        """Reads the workers' messages until ``done()``; BufferClosed once the epoch is over."""
        if not self._pump_until(lambda: done() or self._stop.is_set() or self._failure.error is not None) or not done():
            raise BufferClosed("the epoch was stopped")

    def _pump_until(self, done: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Reads the workers' messages until ``done()`` (True) or ``timeout_s`` has passed (False)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done():
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.pump(_POLL_S)
        return True

    def pump(self, timeout_s: float) -> None:
        """Reads the messages the workers have sent (their "done"s above all),
        waiting up to ``timeout_s`` for the first."""
        with self._lock:  # one poller at a time: a poll object refuses two
            if self._readable:
                for fd, _ in self._poller.poll(timeout_s * 1000):
                    if fd in self._readable:
                        self._receive(self._readable[fd])
                return
            monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout_s)  # every worker is gone: what is left is the monitor's verdict on it

    def _settle(self, timeout_s: float) -> bool:
        """After a stop: waits up to ``timeout_s`` for the tasks in flight (their
        results dropped once the output is closed); False if a worker failed,
        died or is still busy."""
        self._pump_until(lambda: not self.busy or self._failure.error is not None or self._lost, timeout_s)
        return not self.busy and self._failure.error is None and not self._lost

    def _send(self, worker: int, message: tuple) -> None:
        """Sends ``message`` to a worker; if it is gone, waits for the monitor
        to say why (its exit is the epoch's error) and raises BufferClosed."""
        try:
            self._tasks[worker].send_bytes(_pickled(message))
        except OSError:
            self._pump_until(lambda: self._failure.error is not None, _VERDICT_S)
            if self._failure.error is None and self._failure.set(
                    RuntimeError(f"dataecho augment worker {worker} is gone; the epoch is stopped")):
                self._on_failure()
            raise BufferClosed("an augment worker is gone") from None

    def stop(self) -> None:
        """Stops the epoch's waits (the workers finish their tasks)."""
        self._stop.set()

    def end(self, timeout_s: float, keep: bool) -> bool:
        """Ends the epoch: with ``keep``, waits up to ``timeout_s`` for the
        workers' tasks and keeps the processes idle for the next epoch (True);
        otherwise, or if a worker failed, died or is still busy, closes them (False)."""
        self.stop()
        kept = keep and self.alive and self._settle(timeout_s)
        if kept:
            self._stop_monitor()
        else:
            self.close(timeout_s)
        if self._blocks is not None:
            self._blocks.unlink()
        if self._output is not None:
            self._output.unlink_region()
        self._blocks = self._output = None
        return kept

    def close(self, timeout_s: float) -> None:
        """Asks the workers to exit, waits up to ``timeout_s``, then terminates
        and kills any that linger; no process is left."""
        self.stop()
        close_workers(self._tasks, self._processes, timeout_s)
        self._stop_monitor()
        self._processes = []
        self._pipes.clear()  # dropped, not closed: see dataecho.workers.process_readers
        self._tasks.clear()
        self._lifeline = None

    def _stop_monitor(self) -> None:
        self._stop.set()
        monitor, self._monitor = self._monitor, None
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(1.0)

    def _watch(self) -> None:
        """The monitor: a worker that exits is the epoch's error (see :meth:`_exited`)."""
        sentinels = {p.sentinel: i for i, p in enumerate(self._processes)}
        with selectors.DefaultSelector() as selector:  # registered once: wait() would build one per call
            for sentinel in sentinels:
                selector.register(sentinel, selectors.EVENT_READ)
            while (not self._stop.is_set() or self.busy) and self._failure.error is None and sentinels:
                for key, _ in selector.select(_POLL_S):
                    self._exited(sentinels.pop(key.fileobj))
                    selector.unregister(key.fileobj)

    def _receive(self, pipe: Any) -> None:
        """One message from a worker's pipe (under the lock)."""
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            fd = pipe.fileno()  # the worker exited; its sentinel says how
            if self._readable.pop(fd, None) is not None:
                self._poller.unregister(fd)
            return
        except Exception as error:  # results that do not unpickle here
            self._fail(TypeError(f"augment: a worker's results cannot be unpickled by the loader ({error})"))
            return
        kind, worker = message[0], message[1]
        if kind in ("ready", "attached") and message[2] == self._epoch:
            self._mapped(kind, worker)
        elif kind in ("done", "results"):
            self._load[worker] -= 1
            if kind == "results":
                self._results[message[2]] = message[3]
            else:
                self._on_done(message[2])
        elif kind == "error":
            error = message[2]
            error.__cause__ = RemoteTraceback(message[3])
            self._fail(error)

    def _mapped(self, kind: str, worker: int) -> None:
        """A worker mapped this epoch's blocks ("ready") or its output ("attached");
        once all have, the name goes: nothing is left in /dev/shm."""
        if kind == "ready":
            self._ready.add(worker)
            if len(self._ready) == len(self._processes) and self._blocks is not None:
                self._blocks.unlink()
        else:
            self._attached.add(worker)
            if len(self._attached) == len(self._processes) and self._output is not None:
                self._output.unlink_region()

    def _exited(self, worker: int) -> None:
        process = self._processes[worker]
        process.join(0.1)
        pipe = self._pipes[worker]
        with self._lock:
            while pipe.fileno() in self._readable and pipe.poll(0):  # a message still in the pipe has the first word
                self._receive(pipe)
            if self._stop.is_set() or self._failure.error is not None:
                self._lost = True
                return
        code = process.exitcode
        killed = code is not None and code < 0
        how = f"was killed by {signal.Signals(-code).name}" if killed else f"exited (status {code})"
        self._fail(RuntimeError(f"dataecho augment worker {worker} (pid {process.pid}) {how}; the epoch is stopped"))

    def _fail(self, error: BaseException) -> None:
        if self._failure.set(error):
            self._on_failure()


def _pickled(message: tuple) -> bytes:
    """A message to a worker, pickled by pickle itself: multiprocessing's pickler
    (which can send handles; no message here has one) costs tens of us more each."""
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def _spawn(count: int, start_method: str, augment: Any, structure: Any, seed: int) -> tuple[list, list, list, Any]:
    """Starts ``count`` worker processes: (processes, their result pipes, their
    task pipes, the lifeline's write end); none is left if one fails to start."""
    context = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["dataecho.workers.augment.augment_worker"])
    # The lifeline: see dataecho.workers.process_readers (its EOF tells the workers this process is gone).
    lifeline, kept = context.Pipe(duplex=False)
    processes, pipes, tasks = [], [], []
    try:
        for worker in range(count):
            spec = augment_child.AugmentWorkerSpec(worker, augment, structure, (seed + 7919 * (worker + 1)) % (1 << 63))
            receiver, sender = context.Pipe(duplex=False)
            task_reader, task_writer = context.Pipe(duplex=False)
            process = context.Process(target=augment_child.main, args=(spec, sender, lifeline, task_reader),
                                      name=f"dataecho-augment-{worker}", daemon=True)
            process.start()
            sender.close()  # the child holds the only writer: EOF means it is gone
            task_reader.close()
            processes.append(process)
            pipes.append(receiver)
            tasks.append(task_writer)
    except BaseException:
        close_workers(tasks, processes, 0.0)
        raise
    finally:
        lifeline.close()  # the workers hold the read ends
    return processes, pipes, tasks, kept
