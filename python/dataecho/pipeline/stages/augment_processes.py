"""Augmentation in worker processes (``augment_workers="process"``, the
default with ``worker_type="process"``): the augment stage of
dataecho.pipeline.stages.augment, whose rows are augmented by worker processes
(dataecho.workers.augment.augment_pool) instead of threads of the training process.

No thread of the training process runs Python for it: the consumer's thread
does the stage's part as it takes a batch (as DataLoader's does), so that
nothing of the loader takes the GIL from the training step. It reads the
workers' "done"s (each releases the batch its task read), hands every worker
with room a batch that the upstream has ready (numbering its rows'
deliveries, as the threads do), by where the batch lies in the staging
blocks (the echo buffer assembles its batches in shared memory: no copy, no
pickling), and takes the output's next batch; while none is ready it waits
for the workers' next message, or for the upstream where no task is in
flight. Before it returns, every worker with room has a batch again, so the
workers augment while the step runs. The workers put their results into the
output themselves, numbered by delivery, so the output's order, and so the
batches, are those of thread augment for the same seed. The first batch's
results come back pickled: they tell the output's structure, which its shared
region needs. A batch replayed on resume is augmented by a worker too, and
sent back; replays come first, before any batch is handed out.
With ``persistent_workers=True`` the workers of an epoch that ended cleanly
serve the next one (the loader's pool keeps them).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Any

import numpy as np

from ...errors import BufferClosed
from ...examples.leaves import stack
from ...workers.augment.augment_pool import AugmentProcesses
from ...workers.augment.staging import describe_leaf
from .augment import AugmentStage
from .stage import Batch

__all__ = ["AugmentProcessStage", "STAGED_BATCHES"]

STAGED_BATCHES = 8  # staging blocks beyond the workers' batches in flight (prefetched, assembling, echoed)
_WAIT_S = 0.05  # the longest wait in one piece: a stop, an error or Ctrl-C reaches a waiting consumer


class AugmentProcessStage(AugmentStage):
    """The augment stage with worker processes (see the module docstring).

    Args as for AugmentStage; ``batch_memory`` gives the staging blocks the
    echo buffer assembles its batches in (``spec.staged_batches`` of them).
    """

    _OBJECTS, _SHARED = "pickle", True

    def __init__(self, spec: Any, upstream: Any, structure: Any, source: Any, resources: Any, failure: Any,
                 on_failure: Any, pull_lock: threading.Lock, resume: dict[str, Any] | None = None,
                 batch_memory: Any = None) -> None:
        self._kept: dict[int, Any] = {}  # task -> the batch its rows are read from, until they are augmented
        self._ids = itertools.count()
        self._blocks = blocks = batch_memory(spec.staged_batches)
        self._pool = resources.pool  # the loader's persistent workers, or None
        self._upstream_over = False  # the upstream has ended
        self._closed = False  # the output was closed (every result in)
        self._workers: AugmentProcesses | None = None
        try:
            # The last epoch's workers where the pool kept them, else new ones.
            kept = self._pool.augmenters if self._pool is not None else None
            seed = resources.seeds.augment
            self._workers = kept if kept is not None and kept.alive else self._start(spec, structure, seed)
            rng_key = (spec.seed, source.epoch, spec.rank) if spec.takes_rng else None
            begin = functools.partial(self._workers.begin, blocks, rng_key, failure, on_failure,
                                      lambda task_id: self._kept.pop(task_id, None))
            started = begin()
            if not started and self._workers is kept:  # one of them died between epochs: new ones
                self._release(0.0, keep=False)
                self._workers = self._start(spec, structure, seed)
                started = self._workers.begin(*begin.args)
            if not started:
                raise RuntimeError("dataecho augment workers exited as they started; the epoch is stopped")
            super().__init__(spec, upstream, structure, source, resources, failure, on_failure, pull_lock,
                             resume)  # no thread
        except BaseException:
            if self._workers is not None:
                self._release(0.0, keep=False)
            blocks.unlink()  # not in the chain yet: nothing else would
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

    # ---- the consumer's part ----

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._replay:
            return self._replay.next(self.read_batch)
        if self._ended:
            raise StopIteration
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            arrays = self._next_output(deadline)
            self._feed()  # every worker with room gets a batch before the step runs
        except BufferClosed:
            raise StopIteration from None  # stopped, or failed: the epoch raises the error
        return self._batch_of(arrays)

    def _next_output(self, deadline: float | None) -> tuple:
        """The output's next batch, feeding the workers while none is ready.

        Raises:
            StopIteration: the epoch's end. BufferClosed: stopped, or a worker failed.
            TimeoutError: none came by ``deadline``.
        """
        while True:
            if self._stop.is_set() or self._failure.error is not None:
                raise BufferClosed("the epoch was stopped")
            output = self.output
            if output is not None:
                try:  # once closed, every result is in: wait for the last batches
                    return output.next_arrays(_WAIT_S if self._closed else 0.0)
                except TimeoutError:
                    pass
            elif self._closed:
                raise StopIteration  # nothing came from upstream
            self._feed()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no augmented batch came in time")
            if self._workers.busy:
                self._workers.pump(_WAIT_S)  # a "done" (output has grown, a worker has room) or an error
            elif not self._upstream_over:
                self._hand_over_next(_WAIT_S)

    def _feed(self) -> None:
        """Reads the workers' messages, then hands every worker with room a batch
        the upstream has ready; closes the output once the upstream is over and
        every result is in."""
        self._workers.pump(0.0)
        while not self._upstream_over and self._workers.has_room:
            if not self._hand_over_next(0.0):
                break
        if self._upstream_over and not self._workers.busy and not self._closed:
            self._closed = True
            if self.output is not None:
                self.output.close()
            self.ready.set()

    def _hand_over_next(self, timeout_s: float) -> bool:
        """Hands a worker the next batch, waiting up to ``timeout_s`` for it; False if none came."""
        try:
            task = self._take(timeout_s)
        except TimeoutError:
            return False
        except StopIteration:
            self._upstream_over = True
            return False
        if task.arrays is not None:  # a batch from upstream: its deliveries run on one by one
            self._hand_over(task.arrays, (int(task.deliveries[0]), len(task.deliveries)))
        else:
            self._hand_over(self._source.read_rows(self._structure, task.rows), task.deliveries)
        return True

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
