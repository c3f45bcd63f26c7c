"""Augmentation after the echo stage: every delivery of an example is augmented
anew, by worker threads, and the results are batched through a second buffer.

``augment`` receives one example (the structure ``transform`` produced) whose
arrays are read-only views of the echo stage's batch, so an in-place change
cannot reach a repeat. It may return a different structure (a crop, an added
field): the output batches take the structure of its first result.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from .buffer import NativeBuffer
from .errors import BufferClosed
from .producers import Failure
from .structure import Structure, read_only

__all__ = ["AugmentStage"]


class AugmentStage:
    """Worker threads from an upstream batch stage to an output buffer.

    Args:
        upstream: ``upstream(timeout)`` returns a batch (one array per field of
            ``structure``) or raises StopIteration; called under a lock, so it
            need not be thread-safe.
        structure: the structure of upstream examples.
        augment: the per-example function.
        workers: threads.
        make_output: builds the output buffer for the structure of augment's results.
        failure, on_failure: where a worker's exception goes, and what stops the pipeline.
    """

    def __init__(
        self,
        upstream: Callable[[float | None], tuple[np.ndarray, ...]],
        structure: Structure,
        augment: Callable[[Any], Any],
        workers: int,
        make_output: Callable[[Structure], NativeBuffer],
        failure: Failure,
        on_failure: Callable[[], None],
    ) -> None:
        self._upstream = upstream
        self._structure = structure
        self._augment = augment
        self._make_output = make_output
        self._failure = failure
        self._on_failure = on_failure
        self._take = threading.Lock()
        self._setup = threading.Lock()
        self._stop = threading.Event()
        self._running = workers
        self._rows_taken = 0  # numbers the examples in upstream order (deterministic intake)
        self.ready = threading.Event()  # set once `output` exists or nothing will come
        self.output: NativeBuffer | None = None
        self.out_structure: Structure | None = None
        self._threads = [
            threading.Thread(target=self._run, name=f"dataecho-augment-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

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

    def _run(self) -> None:
        try:
            self._work()
        except (BufferClosed, StopIteration):
            pass
        except BaseException as error:  # handed to the consumer, which raises it
            if self._failure.set(error):
                self._on_failure()
        finally:
            with self._setup:
                self._running -= 1
                last = self._running == 0
            if last:
                if self.output is not None and not self._stop.is_set():
                    self.output.close()
                self.ready.set()

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._take:
                arrays = self._upstream(None)
                first_seq = self._rows_taken
                self._rows_taken += len(arrays[0])
            views = read_only(arrays)
            for row in range(len(views[0])):
                example = self._structure.unflatten([v[row] for v in views])
                result = self._augment(example)
                output = self.output or self._create_output(result)
                output.put_values(self.out_structure.flatten(result), seq=first_seq + row)

    def _create_output(self, first_result: Any) -> NativeBuffer:
        with self._setup:
            if self._stop.is_set():
                raise BufferClosed("the epoch was stopped")
            if self.output is None:
                self.out_structure = Structure.infer(first_result)
                self.output = self._make_output(self.out_structure)
                self.ready.set()
            return self.output
