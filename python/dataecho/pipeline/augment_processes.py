"""Augmentation in worker processes (``augment_workers="process"``, the
default with ``worker_type="process"``): the augment stage of
dataecho.pipeline.augment, whose rows are augmented by worker processes
(dataecho.workers.augmenters) instead of threads of the training process.

The training process keeps one thread, which takes each batch from upstream
(numbering its rows' deliveries, as the threads do), hands it to a worker by
where it lies in the staging blocks (the echo buffer assembles its batches in
shared memory: no copy, no pickling), and keeps the batch until the worker
says its rows are in the output buffer. The workers put their results there
themselves, numbered by delivery, so the output's order, and so the batches,
are those of thread augment for the same seed. The first batch's results come
back pickled: they tell the output's structure, which its shared region needs.
A batch replayed on resume is augmented by a worker too, and sent back; the
thread hands out its first batch only once the replays are done (the first
``next`` with none left), so that no worker waits to put a result into an
output nobody reads while the consumer waits for a replay behind it.
With ``persistent_workers=True`` the workers of an epoch that ended cleanly
serve the next one (the loader's pool keeps them).
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any

import numpy as np

from ..errors import BufferClosed
from ..examples.leaves import stack
from ..workers.augmenters import AugmentProcesses
from ..workers.staging import SharedBlocks, describe_leaf
from .augment import AugmentStage
from .stage import Batch

__all__ = ["AugmentProcessStage", "STAGED_BATCHES"]

STAGED_BATCHES = 8  # staging blocks beyond the workers' batches in flight (prefetched, assembling, echoed)


class AugmentProcessStage(AugmentStage):
    """The augment stage with worker processes (see the module docstring).

    Args:
        blocks: the staging blocks the echo buffer assembles its batches in.
        (The rest as for AugmentStage.)
    """

    _OBJECTS, _SHARED = "pickle", True

    def __init__(self, spec: Any, upstream: Any, structure: Any, source: Any, failure: Any, on_failure: Any,
                 pull_lock: threading.Lock, resume: dict[str, Any] | None = None,
                 blocks: SharedBlocks | None = None) -> None:
        self._kept: dict[int, Any] = {}  # task -> the batch its rows are read from, until they are augmented
        self._ids = itertools.count()
        self._blocks = blocks
        self._pool = source.pool  # the loader's persistent workers, or None
        self._go = threading.Event()  # set once no replayed batch is left to hand out
        if resume is None:
            self._go.set()
        # Before the stage's thread starts (in AugmentStage.__init__), which hands them batches at once.
        kept = self._pool.augmenters if self._pool is not None else None
        self._workers = kept if kept is not None and kept.alive else self._start(spec, structure, source.seeds[3])
        try:
            rng_key = (spec.seed, source.epoch, spec.rank) if spec.takes_rng else None
            begin = functools.partial(self._workers.begin, blocks, rng_key, failure, on_failure,
                                      lambda task_id: self._kept.pop(task_id, None))
            started = begin()
            if not started and self._workers is kept:  # one of them died between epochs: new ones
                self._release(0.0, keep=False)
                self._workers = self._start(spec, structure, source.seeds[3])
                started = self._workers.begin(*begin.args)
            if not started:
                raise RuntimeError("dataecho augment workers exited as they started; the epoch is stopped")
            super().__init__(spec, upstream, structure, source, failure, on_failure, pull_lock, resume)
        except BaseException:
            self._release(0.0, keep=False)
            raise

    def _start(self, spec: Any, structure: Any, seed: int) -> AugmentProcesses:
        """New workers, which the pool (if any) keeps instead of its old ones."""
        if self._pool is not None and self._pool.augmenters is not None:
            self._pool.augmenters.close(0.0)  # one that failed or was stopped: nothing of it is left
        workers = AugmentProcesses(spec.processes, spec.start_method, spec.augment, structure, seed)
        if self._pool is not None:
            self._pool.augmenters = workers
        return workers

    def _release(self, timeout_s: float, keep: bool) -> None:
        """Ends the workers' epoch; the pool keeps them if it can."""
        if not self._workers.end(timeout_s, keep and self._pool is not None) and self._pool is not None:
            self._pool.augmenters = None

    def _work(self) -> None:
        """The one thread: hands every batch to the workers, then closes the output."""
        while not self._go.wait(0.05):
            if self._stop.is_set():
                return
        while not self._stop.is_set():
            try:
                task = self._take()
            except StopIteration:
                break  # the upstream has ended
            if task.arrays is not None:  # a batch from upstream: its deliveries run on one by one
                self._hand_over(task.arrays, (int(task.deliveries[0]), len(task.deliveries)))
            else:
                self._hand_over(self._source.read_rows(self._structure, task.rows), task.deliveries)
        self._workers.drain()
        self._failure.raise_if_set()
        if self.output is not None and not self._stop.is_set():
            self.output.close()

    def _thread_done(self) -> None:
        self.ready.set()  # nothing more will come, if no output was made

    def _hand_over(self, arrays: tuple, deliveries: np.ndarray | tuple[int, int]) -> None:
        """One batch to a worker (``deliveries``: as AugmentProcesses.submit takes
        them); the first one's results make the output buffer."""
        task_id = next(self._ids)
        first = self.output is None
        if not first:
            self._kept[task_id] = arrays
        self._workers.submit(task_id, deliveries, [describe_leaf(a, self._blocks) for a in arrays], first)
        if first:
            results = self._workers.results(task_id)
            output = self._create_output([result for _, result in results])
            for delivery, result in results:
                output.put_values(self.out_structure.flatten(result), seq=delivery, where="augment's result")
            self._workers.attach(output, output.fields, self.out_structure)

    def next(self, timeout_s: float | None = None) -> Batch:
        if not self._replay:
            self._go.set()  # the replays (this stage's and the delivery's, handed out first) are done
        return super().next(timeout_s)

    def read_batch(self, ids: dict[str, np.ndarray]) -> Batch:
        """The output batch of rows ``ids``, augmented again by a worker (a resume's replay)."""
        arrays = self._source.read_rows(self._structure, ids["rows"])
        task_id = next(self._ids)
        self._workers.submit(task_id, ids["deliveries"], [("leaf", a) for a in arrays], True)
        results = [result for _, result in self._workers.results(task_id)]  # in the batch's row order
        structure = self._out_structure_for(results)
        arrays = stack(structure, [structure.flatten(result) for result in results])
        return Batch(structure, arrays, ids["rows"], ids["deliveries"])

    def stop(self) -> None:
        super().stop()
        self._workers.stop()

    def join(self, timeout_s: float) -> None:
        super().join(timeout_s)
        self._release(max(timeout_s, 1.0), keep=True)  # worker processes are always reaped or kept idle
        self._blocks.unlink()
        self._kept.clear()
