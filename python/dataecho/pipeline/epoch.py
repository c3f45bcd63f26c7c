"""One pass over the source: the iterator ``iter(EchoLoader)`` returns.

Where the examples' structure is known (a later epoch), or the intake learns
it itself (a batch sampler's, from its first batch), the epoch has
:func:`dataecho.pipeline.chain.build_chain` start the stages of its plan at
once. Otherwise its workers start reading the first examples
(dataecho.workers.probe) and the first ``next()`` learns the structure from
them and builds the chain; with ``num_workers=0`` that ``next()`` reads them
itself. Either way no user code runs in ``iter(loader)``'s thread, and an error
in the first reads, or a timeout, comes from ``next()``, as with DataLoader.
The epoch then pulls batches from the last stage, timing the waits. It stops and joins the stages, last to
first, at the end, on an error, on ``close()``, or when it is dropped (a loop
left early). Its state for a checkpoint is ``{stage name: stage.state()}``,
and for an iterable that can restart, where to restart it
(dataecho.reading.restart): the epoch is what sees every stage's names, so it
adds that to the intake's state, and drops the marks that no state needs.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from typing import Any, Callable

from ..examples.structure import Structure
from ..reading.restart import Mark
from ..reading.source import SAMPLE, EpochSource
from . import checkpoint
from .chain import JOIN_TIMEOUT_S, Chain, build_chain
from .intake import start_probe
from .output import output_of
from .plan import Plan
from .stage import Batch, weakly

__all__ = ["Epoch"]


LEAVE_WAIT_S = 2.0  # how long a dropped epoch waits for a stage thread's pull to take its state
_STARVED = ("EchoLoader: the memory budget for ragged values ran out this epoch (producers waited for it), so some "
            "batches were drawn from fewer examples than planned and their order depended on timing, despite "
            "deterministic=True; raise ragged_bytes")


def _source_of(plan: Plan, epoch: int, resume: dict[str, Any] | None, pool: Any, memory: Any) -> EpochSource:
    """The epoch's view of the source, from where a resumed state's intake says it stood."""
    saved = (resume or {}).get("intake", {})
    skip = saved.get("skip", 0) if plan.source.order is None else 0
    restart = Mark(**saved["restart"]) if "restart" in saved else None
    return EpochSource(plan.source, epoch, skip, pool, memory, saved.get("order"), saved.get("bounds"), restart)


def _probe_size(plan: Plan) -> int:
    """Examples read to learn the structure: SAMPLE, and at least one per
    worker, so that every worker reads before any waits (a dataset may wait
    for all its workers, at a barrier)."""
    return max(SAMPLE, plan.intake.workers.count)


class Epoch:
    """An epoch's stages and its consumer side.

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
        structure: the examples' structure (None for an empty source).
        stages: the chain's stages, first to last (empty for an empty epoch).
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
        self._state = "running"  # then "complete", "stopped" or "failed" (see dataecho.pipeline.stats)
        self._superseded = False  # ended by a later iter(loader): its next() says so
        self._consumer = threading.Lock()
        self._started = time.perf_counter()
        self._wait_s, self._delivered, self._batches = 0.0, 0, 0
        self._chain = Chain(mode=plan.checkpoint, group=group)
        self._probing: Any = None  # workers reading the first examples before the chain exists
        self._built = False  # the chain exists (built at once, or by the first next() once the structure is known)
        self._plan, self._resume, self._on_structure = plan, resume, on_structure
        self._source = _source_of(plan, epoch, resume, pool, memory)
        self.structure = structure
        try:
            if (structure is not None or plan.reads_batches) and resume is None:
                self._build(structure, [])  # a resumed chain reads examples again: in next(), as errors come
            elif structure is None and plan.intake.workers.kind != "inline" and resume is None:
                # The workers read the first examples; the chain is built from them in next().
                self._probing = start_probe(plan.intake, self._source, _probe_size(plan),
                                            self._chain.failure, weakly(self.abort))
        except BaseException:
            self.close()
            raise

    def _build(self, structure: Structure | None, first: list[Any], probing: Any = None) -> None:
        build_chain(self._chain, self._plan, structure, self._source, first, self._resume, weakly(self.abort),
                    probing, weakly(self._learned))
        self._built = True

    def _learned(self, structure: Structure) -> None:
        """A batch sampler's intake learned the structure (in a worker thread)."""
        self.structure = structure
        self._on_structure(structure)

    def _start_chain(self, timeout_s: float | None) -> None:
        """The first next(), where iter() did not build the chain: learns the
        structure, where not known, from the first examples (read by the
        workers, or here with ``num_workers=0``), and builds the chain.

        Raises:
            TimeoutError: the workers' first examples did not come within ``timeout_s``.
        """
        structure, probing, first = self.structure, self._probing, []
        if structure is None and not self._plan.reads_batches:  # which learns it from its first batch
            first = probing.probe.examples(timeout_s) if probing is not None else self._source.first()
            if first is None:  # a worker failed, or the epoch was stopped
                self._chain.failure.raise_if_set()
                raise StopIteration
            structure = self.structure = self._source.structure_of(first, self._spec.declared_ragged, self._spec.strict)
            if structure is None:  # an empty epoch
                self._built = True
                return
            self._on_structure(structure)
        self._build(structure, first if probing is None else [], probing)
        self._probing = None  # the intake stage owns them now

    @property
    def stages(self) -> list[Any]:
        return self._chain.stages

    def start(self, timeout_s: float | None = None) -> None:
        """Builds the stages now, as the first ``next()`` would (waiting for the
        first examples where the structure is not known yet).

        Raises:
            TimeoutError: the first examples did not come within ``timeout_s``.
        """
        if not self._built and not self._closed:
            self._start_chain(timeout_s)

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
            self._finish("complete" if self._chain.failure.error is None else "failed")
            self._chain.failure.raise_if_set()
            raise
        except BaseException as error:  # Ctrl-C, or an error of the native core: stop every stage
            self._finish("stopped" if isinstance(error, KeyboardInterrupt) else "failed")
            raise
        finally:
            self._wait_s += time.perf_counter() - start
        self._batches += 1
        self._delivered += len(batch)
        checkpoint.prune(self._source.marks, self._chain.state)
        return output_of(self._spec, batch)

    def _next_batch(self) -> Batch:
        if self._closed:
            raise StopIteration
        timeout = self._spec.timeout_s
        try:
            if not self._built:
                self._start_chain(timeout)
            if not self._chain.stages:
                raise StopIteration
            return self._chain.stages[-1].next(timeout)
        except TimeoutError:
            if timeout is None:
                raise
            raise RuntimeError(f"EchoLoader timed out after {timeout:g} seconds (timeout={timeout:g}) "
                               f"waiting for a batch") from None

    # ---- checkpoints and counters ----

    def state(self, lock_timeout_s: float = -1) -> dict[str, Any] | None:
        """{stage name: state} between two batches, or None before the first
        batch (the epoch's start); see Chain.state.

        Raises:
            ValueError: a stage whose state cannot be saved, with its reason.
        """
        if not self._built and self._resume is not None:
            return self._resume  # resumed, no batch taken yet: where the loaded state stood
        return checkpoint.with_restart(self._chain.state(lock_timeout_s), self._source.marks)

    def counters(self) -> dict[str, Any]:
        """This epoch's counters (see dataecho.pipeline.stats), from every stage."""
        stages = self._chain.counters()
        return {
            "epoch": self.epoch,
            "state": self._state,
            "fresh": stages.get("fresh", 0),
            "delivered": self._delivered,
            "batches": self._batches,
            **{key: stages.get(key, 0) for key in ("fresh_batches", "delivered_batches", "augmented",
                                                   "lockstep_repeats", "lockstep_wait_s")},
            "wait_s": self._wait_s,
            "active_s": time.perf_counter() - self._started,
            "memory": stages.get("memory"),
        }

    def worker_counters(self) -> list[dict[str, float]]:
        if self._probing is not None:  # still reading the first examples
            return self._probing.counters()
        return self._chain.stages[0].counters()["workers"] if self._chain.stages else []

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- shutting down ----

    def abort(self) -> None:
        """Stops every stage at once (an error in a stage thread, or the consumer
        leaving); callable from any thread."""
        for stage in reversed(self._chain.stages):
            stage.stop()
        if self._probing is not None:
            self._probing.stop()

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
        if self._spec.warn_starved and any(s.counters().get("starved") for s in self._chain.stages):
            warnings.warn(_STARVED, RuntimeWarning, stacklevel=3)
        self.abort()
        for stage in reversed(self._chain.stages):
            stage.join(JOIN_TIMEOUT_S if wait else 0.0)
        if self._probing is not None:
            self._probing.join(JOIN_TIMEOUT_S if wait else 0.0)
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
        if self._batches > 0 and self._chain.resumable:
            try:
                self._left = self.state(LEAVE_WAIT_S)
            except Exception:  # noqa: BLE001 - no state then: a later state_dict() gives the next epoch's start
                self._left = None
        self._finish(wait=False)
