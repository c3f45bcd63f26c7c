"""One pass over the source: the iterator ``iter(EchoLoader)`` returns.

Its stages run in :class:`dataecho.pipeline.epoch_stages.EpochStages`, which
builds them at once where the examples' structure is known, or at the first
``next()`` once the first examples told it: no user code runs in
``iter(loader)``'s thread, and an error in the first reads, or a timeout,
comes from ``next()``, as with DataLoader. The epoch pulls batches from the
last stage, timing the waits. It stops and joins the stages, last to first,
at the end, on an error, on ``close()``, or when it is dropped (a loop left
early). Its state for a checkpoint is ``{stage name: stage.state()}``, and
for an iterable that can restart, where to restart it
(dataecho.reading.restart). Until its first batch it can still be renumbered
(``set_epoch`` after ``iter()``, as Lightning calls them): it then runs the
other epoch instead.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from typing import Any, Callable

from ..examples.structure import Structure
from .epoch_stages import EpochStages
from .output import output_of
from .plan import Plan
from .progress.repetition import Ledger
from .stages.stage import Batch, weakly
from .stages.written import release  # the loader frees the memory its epochs kept with it

__all__ = ["Epoch", "release"]


LEAVE_WAIT_S = 2.0  # how long a dropped epoch waits for a stage thread's pull to take its state
_STARVED = ("EchoLoader: the memory budget for ragged values ran out this epoch (producers waited for it), so some "
            "batches were drawn from fewer examples than planned and their order depended on timing, despite "
            "deterministic=True; raise ragged_bytes")


class Epoch:
    """An epoch's consumer side, over its running stages.

    Args:
        plan: the loader's plan (dataecho.pipeline.plan).
        epoch: the epoch number.
        structure: the examples' structure if known (from an earlier epoch), else None.
        resume: {stage name: state} from a checkpoint, or None.
        on_finish: called once at the end with this epoch's counters, the
            per-worker counters, and the state it stood at when its consumer
            left it part-way (a loop left with ``break``), or None.
        on_structure, group: called with the structure the first examples told;
            the lockstep stage's process group, or None.
        owner: kept alive while the epoch is (``for b in EchoLoader(...)`` holds only the epoch).
        pool: the loader's persistent worker processes, or None.
        memory: the loader's ``_core.BlockCache``: the echo buffer's memory, kept
            from one epoch to the next; or None.

    Attributes:
        epoch: the epoch number.
        taken: the batches taken from it so far.
    """

    def __init__(self, plan: Plan, epoch: int, structure: Structure | None,
                 resume: dict[str, Any] | None, on_finish: Callable[[dict, list, Any], None], owner: Any = None,
                 pool: Any = None, memory: Any = None,
                 on_structure: Callable[[Structure], None] = lambda structure: None, group: Any = None) -> None:
        self.epoch = epoch
        self._owner = owner
        self._spec, self._on_finish = plan.output, on_finish
        self._left: dict[str, Any] | None = None
        self._closed = False
        self._state = "running"  # then "complete", "stopped" or "failed" (see dataecho.pipeline.progress.stats)
        self._superseded = False  # ended by a later iter(loader): its next() says so
        self._failure_raised = False  # the failure of a stage reached the loop (once)
        self._consumer = threading.Lock()
        self._started = time.perf_counter()
        self._wait_s, self._delivered, self.taken = 0.0, 0, 0
        self._plan, self._pool, self._memory, self._group, self._on_structure = plan, pool, memory, group, on_structure
        self._stages: EpochStages | None = None
        self._run(epoch, structure, resume)

    def _run(self, epoch: int, structure: Structure | None, resume: dict[str, Any] | None) -> None:
        # Every delivered row, by position (dataecho.pipeline.progress.repetition); a resume's ledger goes on.
        self._ledger = Ledger((resume or {}).get("ledger"))
        resume = {name: state for name, state in resume.items() if name != "ledger"} if resume else resume
        try:
            self._stages = EpochStages(self._plan, epoch, structure, resume, weakly(self.abort), self._pool,
                                       self._memory, self._group, self._on_structure)
        except BaseException:
            self.close()
            raise

    def renumber(self, epoch: int, resume: dict[str, Any] | None) -> bool:
        """Runs epoch ``epoch`` (from ``resume``) instead, if no batch was taken
        yet (``set_epoch`` after ``iter()``); returns whether it does."""
        with self._consumer:
            if self.taken or self._closed:
                return False
            old = self._stages
            old.abort()
            old.join(wait=True)
            self.epoch = epoch
            self._run(epoch, old.structure, resume)
            return True

    @property
    def stages(self) -> list[Any]:
        """The chain's stages, first to last (empty before it is built, or for an empty epoch)."""
        return self._stages.chain.stages if self._stages is not None else []

    @property
    def structure(self) -> Structure | None:
        """The examples' structure (None until known, and for an empty source)."""
        return self._stages.structure if self._stages is not None else None

    @property
    def resumed(self) -> bool:
        """It resumes a checkpoint (rather than starting the epoch afresh)."""
        return self._stages is not None and self._stages.resume is not None

    def start(self, timeout_s: float | None = None) -> None:
        """Builds the stages now, as the first ``next()`` would (waiting for the
        first examples where the structure is not known yet).

        Raises:
            TimeoutError: the first examples did not come within ``timeout_s``.
        """
        if not self._closed:
            self._stages.start(timeout_s)

    # ---- consuming ----

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> Any:
        # One consumer: the stages after the buffers (batch echo, replays, the
        # device copy) keep state that a second thread pulling at once would tear.
        if not self._consumer.acquire(blocking=False):
            raise RuntimeError("EchoLoader: another thread is already taking batches from this epoch")
        try:
            if not self._superseded:
                try:
                    return self._next()
                except StopIteration:
                    if not self._superseded:  # ended while this call waited: say why
                        raise
            raise RuntimeError(
                "EchoLoader: this iterator's epoch was ended by a later iter(loader); a loader runs one "
                "epoch at a time (its workers and epoch count are shared), so take batches from the newest "
                "iterator only"
            )
        finally:
            self._consumer.release()

    def _next(self) -> Any:
        start = time.perf_counter()
        try:
            batch = self._next_batch()
        except StopIteration:
            # The end, or a stage failed: either way the epoch is over. Its
            # threads and processes are stopped before the error reaches the loop.
            failure = self._stages.chain.failure
            self._finish("complete" if failure.error is None else "failed")
            if not self._failure_raised:  # once: the loop that catches it and goes on finds the epoch over
                self._failure_raised = failure.error is not None
                failure.raise_if_set()
            raise
        except BaseException as error:  # Ctrl-C, or an error of the native core: stop every stage
            self._finish("stopped" if isinstance(error, KeyboardInterrupt) else "failed")
            raise
        finally:
            self._wait_s += time.perf_counter() - start
        self.taken += 1
        self._delivered += len(batch)
        self._ledger.add(batch.rows)
        self._stages.prune()
        return output_of(self._spec, batch)

    def _next_batch(self) -> Batch:
        if self._closed:
            raise StopIteration
        timeout = self._spec.timeout_s
        try:
            return self._stages.next(timeout)
        except TimeoutError:
            if timeout is None:
                raise
            raise RuntimeError(f"EchoLoader timed out after {timeout:g} seconds (timeout={timeout:g}) "
                               f"waiting for a batch") from None

    # ---- checkpoints and counters ----

    def state(self, lock_timeout_s: float = -1) -> dict[str, Any] | None:
        """{stage name: state} between two batches, with the delivery ledger
        under "ledger", or None before the first batch (the epoch's start); see Chain.state.

        Raises:
            ValueError: a stage whose state cannot be saved, with its reason.
        """
        stages = self._stages.state(lock_timeout_s)
        return None if stages is None else {**stages, "ledger": self._ledger.state()}

    def counters(self) -> dict[str, Any]:
        """This epoch's counters (see dataecho.pipeline.progress.stats), from every stage."""
        stages = self._stages.counters() if self._stages is not None else {}
        fresh = stages.get("fresh", 0)
        return {
            "epoch": self.epoch,
            "state": self._state,
            "fresh": fresh,
            "delivered": self._delivered,
            "distinct": self._ledger.distinct,
            "repetition": self._ledger.report(fresh),
            "batches": self.taken,
            **{key: stages.get(key, 0) for key in ("fresh_batches", "delivered_batches", "augmented",
                                                   "lockstep_repeats", "lockstep_wait_s")},
            "wait_s": self._wait_s,
            "active_s": time.perf_counter() - self._started,
            "memory": stages.get("memory"),
            "device_memory": stages.get("device_memory"),
            "ledger": (self._ledger, self._stages.source if self._stages is not None else None),
        }

    def worker_counters(self) -> list[dict[str, float]]:
        return self._stages.worker_counters() if self._stages is not None else []

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- shutting down ----

    def abort(self) -> None:
        """Stops every stage at once (an error in a stage thread, or the consumer
        leaving); callable from any thread."""
        if self._stages is not None:
            self._stages.abort()

    def close(self) -> None:
        """Stops this epoch's threads and processes and waits for them (idempotent)."""
        self._finish()

    def supersede(self) -> None:
        """Ends this epoch for a newer one: a later next() raises instead of ending quietly."""
        if not self._closed:
            self._superseded = True
        self._finish()

    def _finish(self, state: str = "stopped", wait: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._state = state
        if self._stages is not None:
            if self._spec.warn_starved and self._stages.starved():
                warnings.warn(_STARVED, RuntimeWarning, stacklevel=3)
            if state == "complete":
                _warn_if_longer(self._plan, self.taken)
            self._stages.abort()
            self._stages.join(wait)
        self._on_finish(self.counters(), self.worker_counters(), self._left)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # The last reference went (the loop left, the loader was deleted): stop every stage,
        # keeping the epoch's position first where it can be saved (for state_dict(), as
        # StatefulDataLoader after a `break`), waiting a bounded time for a stage thread's pull;
        # threads are not waited for (one may be in user code), worker processes are reaped.
        # Not at interpreter exit (`_finalizing` bound early: globals may be gone): atexit stopped
        # the buffers and no stage thread runs any more: nothing to save or wait for.
        if getattr(self, "_closed", True) or _finalizing():
            return
        if self.taken > 0 and self._stages is not None and self._stages.chain.resumable:
            try:
                self._left = self.state(LEAVE_WAIT_S)
            except Exception:  # noqa: BLE001 - no state then: a later state_dict() gives the next epoch's start
                self._left = None
        self._finish(wait=False)


def _warn_if_longer(plan: Plan, taken: int) -> None:
    """An iterable whose ``__len__`` gave ``len(loader)`` yielded more batches
    than that said: warned, as DataLoader warns of an ``IterableDataset`` that
    yields more than its length."""
    dataset = plan.source.dataset
    if plan.source.order is not None or not hasattr(dataset, "__len__"):
        return
    try:
        said = plan.batches_per_epoch()
    except TypeError:  # a factor that makes the count random
        return
    if taken > said:
        warnings.warn(f"len(loader) said {said} batches from the iterable's __len__ ({len(dataset)} examples), but "
                      f"the epoch yielded {taken}: its __len__ is less than what it yields (with several workers "
                      f"or ranks, each may be iterating the whole of it)", UserWarning, stacklevel=4)
