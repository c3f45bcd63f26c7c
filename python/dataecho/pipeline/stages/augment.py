"""Augmentation after the echo stage: every delivery of an example is augmented
anew, by worker threads, and the results are batched through an output buffer
that this stage owns.

``augment`` receives one example (the structure ``transform`` produced) whose
arrays are read-only views of the echo stage's batch, so an in-place change
cannot reach a repeat. A leaf of a torch dtype NumPy lacks (bfloat16, say)
comes as a tensor of that dtype with memory of its own, as torch has no
read-only tensors. It may return a different structure (a crop, an added
field, such a tensor): the output batches take the structure of its first
result.

Each row taken from upstream gets a delivery number, in the order rows are
taken (deterministic when the upstream is). When ``augment`` accepts a keyword
``rng``, it is called with a generator keyed by (seed, epoch, rank, delivery
number): its output is then a function of the seed alone, whichever thread
runs it, and a checkpoint can name each pending row by (position, delivery)
and have it recomputed on resume.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ... import _core
from ...errors import BufferClosed
from ...examples.leaves import stack
from ...examples.structure import Structure
from ...native.echo_buffer import NativeBuffer
from ...native.sizing import buffer_config, ragged_heap, reorder_window
from ...reading.source import EpochSource
from ...tensors.pinned import pin_batch_memory
from ...workers.augment.augment_rows import augmented
from ...workers.augment.delivery_rng import DeliveryRng
from ...workers.failure import Failure
from ...workers.resources import EpochResources
from .. import checkpoint
from . import buffer_states
from .stage import Batch, Replay, Stage

__all__ = ["AugmentSpec", "AugmentStage", "check_state"]



@dataclass(frozen=True)
class AugmentSpec:
    """What the augment stage needs (built by dataecho.pipeline.plan).

    Attributes:
        augment: the function, called per delivery.
        takes_rng: it accepts ``rng``: it is given a generator per delivery
            (keyed by ``seed``, the epoch, ``rank`` and the delivery number).
        threads: threads that run it (with ``processes``: none, the
            consumer's thread hands the worker processes their rows).
        processes: worker processes that run it (0: threads do), and
            ``start_method``, how they are started.
        staged_batches: worker processes: the staging blocks the echo buffer
            assembles its batches in, where they read them.
        exact: rows carry their positions: a state names every row.
        capacity, batch_size, drop_last, prefetch, deterministic, in_order:
            the output buffer's settings.
        declared_ragged: leaf paths of augment's output declared ragged.
        ragged_bytes: the output's page heap budget, or None.
        pinned_batches: page-locked batch blocks for the output buffer (0: none).
        pinned_device: the CUDA device they are page-locked for (its context), or None.
    """

    augment: Callable[..., Any]
    takes_rng: bool
    seed: int
    rank: int
    threads: int
    exact: bool
    capacity: int
    batch_size: int
    drop_last: bool
    prefetch: int
    deterministic: bool
    in_order: bool
    declared_ragged: frozenset[str] | None
    ragged_bytes: int | None
    pinned_batches: int
    pinned_device: Any = None
    processes: int = 0
    start_method: str | None = None
    staged_batches: int = 0

    @property
    def kind(self) -> str:
        """Who augments: ``"process"`` (worker processes) or ``"thread"``
        (dataecho.pipeline.stages.augment_kinds)."""
        return "process" if self.processes else "thread"


class _Task:
    """Rows to augment: stacked arrays (or None: read them again from their
    positions), each row's position (or None) and delivery number."""

    __slots__ = ("arrays", "rows", "deliveries")

    def __init__(self, arrays: tuple | None, rows: np.ndarray | None, deliveries: np.ndarray) -> None:
        self.arrays, self.rows, self.deliveries = arrays, rows, deliveries


class AugmentStage:
    """Worker threads from an upstream stage to an output buffer.

    Args:
        spec: the stage's settings.
        upstream: the stage whose batches are augmented, pulled under ``pull_lock``.
        structure: the structure of upstream examples.
        source: this epoch's source, to read rows again on resume.
        resources: the epoch's seeds and the loader's persistent workers.
        failure, on_failure: where a worker's exception goes, and what stops the epoch.
        pull_lock: held while pulling from upstream (and while the epoch takes states).
        resume: this stage's state from a checkpoint, or None.
        batch_memory: ``batch_memory(count)`` has the intake's echo buffer
            assemble its batches in ``count`` shared blocks (worker processes read
            them there); threads do not use it.
    """

    name = "augment"

    def __init__(self, spec: AugmentSpec, upstream: Stage, structure: Structure, source: EpochSource,
                 resources: EpochResources, failure: Failure, on_failure: Callable[[], None],
                 pull_lock: threading.Lock, resume: dict[str, Any] | None = None,
                 batch_memory: Callable[[int], Any] | None = None) -> None:
        self._upstream, self._structure, self._source = upstream, structure, source
        self._augment = spec.augment
        self._rng_key = (spec.seed, source.epoch, spec.rank) if spec.takes_rng else None
        self.unresumable = None if spec.takes_rng else (
            "saving a position mid-epoch with augment needs augment to accept a keyword argument rng "
            "(def augment(example, rng): ...; draw its randomness from that numpy Generator) so that "
            "its output can be recomputed on resume")
        self._failure, self._on_failure, self._pull_lock = failure, on_failure, pull_lock
        self._output_config = buffer_config(
            capacity=spec.capacity, batch_size=spec.batch_size, seed=resources.seeds.augment, drop_last=spec.drop_last,
            prefetch=spec.prefetch, initial=spec.batch_size, deterministic=spec.deterministic,
            in_order=spec.in_order, window=reorder_window(spec.capacity, spec.batch_size) if spec.deterministic else 0,
        )
        self._pinned, self._chunk = (spec.pinned_batches, spec.pinned_device), spec.batch_size
        self._ragged, self._ragged_bytes = spec.declared_ragged, spec.ragged_bytes
        # Output batches that had left the output buffer when the state was taken: yielded first.
        self._replay = Replay(resume["queued"] if resume else None)
        self._setup = threading.Lock()
        self._stop = threading.Event()
        self._taken = 0  # deliveries numbered so far
        self._positions: dict[int, int] = {}  # delivery -> position, for rows not yet handed downstream
        self._carried: deque[tuple[int, int]] = deque()  # resume: (delivery, position) to redo first
        self._restore: _core.Snapshot | None = None
        self._replay_rng: DeliveryRng | None = None
        self.ready = threading.Event()  # set once `output` exists or nothing will come
        self.output: NativeBuffer | None = None
        self.out_structure: Structure | None = None
        self._ended = resume is not None and resume["output"] is not None and resume["output"]["ended"]
        if resume is not None:
            self._resume_from(resume)
        workers = 0 if self._ended else spec.threads
        self._running = workers
        self._threads = [threading.Thread(target=self._run, name=f"dataecho-augment-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    # What the output buffer's objects are, and whether it is shared with worker processes (a subclass's).
    _OBJECTS, _SHARED = "key", False

    # ---- the stage ----

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._replay:
            return self._replay.next(self.read_batch)
        if self._ended:
            raise StopIteration
        while not self.ready.wait(0.05):  # in slices: Ctrl-C reaches a waiting consumer
            pass
        output = self.output
        if output is None or self._failure.error is not None:
            raise StopIteration
        return self._batch_of(output.next_arrays(timeout_s))

    def _batch_of(self, arrays: tuple) -> Batch:
        """The batch the output just yielded, with its rows' positions."""
        deliveries = self.output.last_seqs
        rows = np.array([self._positions.pop(d) for d in deliveries.tolist()], dtype=np.uint64)
        return Batch(self.out_structure, arrays, rows, deliveries)

    def read_batch(self, ids: dict[str, np.ndarray]) -> Batch:
        """The output batch of rows ``ids`` (positions and delivery numbers),
        recomputed: read again, augmented with each delivery's generator."""
        if self._replay_rng is None:
            self._replay_rng = DeliveryRng(*self._rng_key)
        task = _Task(None, ids["rows"], ids["deliveries"])
        results = list(self._augmented(task, self._replay_rng))
        structure = self._out_structure_for([result for _, result in results])
        arrays = stack(structure, [structure.flatten(result) for _, result in results])
        return Batch(structure, arrays, ids["rows"], ids["deliveries"])

    def stop(self) -> None:
        # Under the set-up lock: an output created before this is aborted here,
        # and none is created after it (_create_output checks the flag).
        with self._setup:
            self._stop.set()
            output = self.output
        if output is not None:
            output.abort()
        self.ready.set()

    def join(self, timeout_s: float) -> None:
        for thread in self._threads:
            if thread is not threading.current_thread():  # an epoch collected by one of its own threads
                thread.join(timeout_s)

    def counters(self) -> dict[str, Any]:
        output = None if self._ended else self.output
        return {"augmented": self._taken, "starved": output.stats()["starved"] if output is not None else 0}

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """Under the pull lock: no row is being taken from upstream meanwhile."""
        if self.unresumable is not None:
            return None
        output = None if self._ended else self.output
        # Resumed, before the output exists: its state is the snapshot it is to be
        # restored from. None would restart the next output at delivery 0, outside
        # whose intake window (batch_size numbers) the pending rows would wait
        # forever. An output created since the read above has yielded nothing:
        # the consumer is the thread taking this state.
        snap = output.snapshot(timeout_s) if output is not None else None if self._ended else self._restore
        queued = [] if snap is None else [
            {"rows": np.array([self._positions[d] for d in q.tolist()], dtype=np.uint64), "deliveries": q}
            for q in snap.queued
        ]
        in_queued = {d for q in queued for d in q["deliveries"].tolist()}
        pending = sorted(d for d in self._positions if d not in in_queued)
        return {
            "taken": self._taken,
            "output": None if snap is None else {
                **buffer_states.saved(snap), "deliveries": snap.seqs, "echoes": snap.echoes,
            },
            "pending": {"deliveries": np.array(pending, dtype=np.uint64),
                        "rows": np.array([self._positions[d] for d in pending], dtype=np.uint64)},
            "queued": self._replay.saved() + queued,
        }

    def _resume_from(self, state: dict[str, Any]) -> None:
        """Rows taken before the checkpoint and not yet handed downstream are
        augmented again first (in delivery order); the output buffer resumes
        from its snapshot once the resident ones among them are back."""
        self._taken = int(state["taken"])
        pending = state["pending"]
        for delivery, position in zip(pending["deliveries"].tolist(), pending["rows"].tolist()):
            self._positions[delivery] = position
            self._carried.append((delivery, position))
        saved = state["output"]
        if saved is not None and not saved["ended"]:
            self._restore = buffer_states.restored(saved, saved["deliveries"], saved["echoes"])

    # ---- the workers ----

    def _run(self) -> None:
        """A thread of the stage: its work, whose error (but a stop) is the consumer's."""
        try:
            self._work()
        except BufferClosed:
            pass
        except BaseException as error:  # handed to the consumer, which raises it
            if self._failure.set(error):
                self._on_failure()
        finally:
            self._thread_done()

    def _work(self) -> None:
        """Augments the rows of every batch taken from upstream, into the output."""
        rng = DeliveryRng(*self._rng_key) if self._rng_key is not None else None
        while not self._stop.is_set():
            try:
                task = self._take()
            except StopIteration:
                break  # the upstream has ended
            results = list(self._augmented(task, rng))
            output = self.output or self._create_output([result for _, result in results])
            for delivery, result in results:
                output.put_values(self.out_structure.flatten(result), seq=delivery, where="augment's result")

    def _thread_done(self) -> None:
        """The last thread to end closes the output (the epoch's end, unless stopped)."""
        with self._setup:
            self._running -= 1
            last = self._running == 0
        if last:
            if self.output is not None and not self._stop.is_set():
                self.output.close()
            self.ready.set()  # nothing more will come, if no output was made

    def _take(self, timeout_s: float | None = None) -> _Task:
        """The next rows to augment: carried over from a checkpoint first, then
        the upstream's next batch (StopIteration at its end; TimeoutError if
        none came within ``timeout_s``, nothing taken)."""
        # Not under the pull lock: the carried rows are in the state either way
        # (pending until handed downstream), and the output buffer's restore
        # waits for them, so a state asked for right after a resume must not
        # hold them back.
        with self._setup:
            chunk = [self._carried.popleft() for _ in range(min(self._chunk, len(self._carried)))]
        if chunk:
            deliveries, rows = zip(*chunk)
            return _Task(None, np.array(rows, dtype=np.uint64), np.array(deliveries, dtype=np.uint64))
        with self._pull_lock:
            batch = self._upstream.next(timeout_s)
            first = self._taken
            self._taken += len(batch)
            deliveries = np.arange(first, self._taken, dtype=np.uint64)
            self._positions.update(zip(deliveries.tolist(), batch.rows.tolist()))
            return _Task(batch.arrays, batch.rows, deliveries)

    def _augmented(self, task: _Task, rng: DeliveryRng | None) -> Any:
        """(delivery, augment's result) for each row of ``task``."""
        arrays = task.arrays
        if arrays is None:
            arrays = self._source.read_rows(self._structure, task.rows)
        return augmented(self._augment, self._structure, arrays, task.deliveries, rng)

    def _out_structure_for(self, results: list) -> Structure:
        """The output's structure, from the first results (a batch of them: leaves
        whose length varies among them are ragged)."""
        with self._setup:
            if self.out_structure is None:
                self.out_structure = Structure.infer(results[0], results[1:], self._ragged, strict=False)
            return self.out_structure

    def _create_output(self, results: list) -> NativeBuffer:
        structure = self._out_structure_for(results)
        with self._setup:
            if self._stop.is_set():
                raise BufferClosed("the epoch was stopped")
            if self.output is None:
                config = self._output_config
                config.shared = self._SHARED
                config.pages, config.page_bytes = ragged_heap(structure, config.capacity, self._ragged_bytes,
                                                              self._OBJECTS)
                output = NativeBuffer(structure.fields(), config, self._restore, None, self._OBJECTS)
                if self._pinned[0]:
                    pin_batch_memory(output, *self._pinned)
                self.output = output
                self.ready.set()
            return self.output


def check_state(spec: AugmentSpec, state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    """This stage's saved state, checked against the epoch's order and normalized:
    ``taken``, rows taken from upstream (the next delivery number); ``output``,
    its output buffer's state (resident rows named by delivery number), or None
    before it exists (once resumed, the state it is to be restored from);
    ``pending``, each row taken and not yet in a batch, by delivery number and
    position; ``queued``, output batches assembled but not yet taken.

    Raises:
        ValueError: a state this stage could not have saved, naming the key.
    """
    taken = checkpoint.int_at(state, "taken", where)
    pending = checkpoint.ids_of(checkpoint.dict_at(state, "pending", where), order, f"{where}['pending']",
                                deliveries=True)
    if len(pending["deliveries"]) and pending["deliveries"].max() >= taken:
        raise ValueError(f"{where}['pending']: delivery numbers beyond 'taken'")
    output = state.get("output")
    if output is not None:
        at = f"{where}['output']"
        output = checkpoint.dict_at(state, "output", where)
        checked = buffer_states.checked_counters(output, at)
        resident = checkpoint.array_at(output, "deliveries", np.uint64, at)
        echoes = checkpoint.array_at(output, "echoes", np.uint32, at)
        if len(resident) != len(echoes) or (len(echoes) and (echoes.min() == 0 or echoes.max() > 1)):
            raise ValueError(f"{at}: expected one delivery left for each resident row (the output echoes nothing)")
        if checked["ended"] and (len(resident) or checked["available"]):
            raise ValueError(f"{at}['ended']: True, with rows resident")
        if not set(resident.tolist()) <= set(pending["deliveries"].tolist()) or checked["next_seq"] > taken:
            raise ValueError(f"{at}: resident rows that are not pending")
        if checked["available"] > len(resident):
            raise ValueError(f"{at}['available']: more than the resident rows")
        output = {**checked, "deliveries": resident, "echoes": echoes}
    return {"taken": taken, "output": output, "pending": pending,
            "queued": checkpoint.batches_at(state, "queued", order, where, deliveries=True)}
