"""One pass over the source: the iterator ``iter(EchoLoader)`` returns.

The epoch reads one example to learn the structure if it is not known yet,
has :func:`dataecho.pipeline.chain.build_chain` start the stages of its plan, then pulls batches
from the last stage, timing the waits. It stops and joins the stages, last to
first, at the end, on an error, on ``close()``, or when it is dropped (a loop
left early). Its state for a checkpoint is ``{stage name: stage.state()}``.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable

from ..examples.leaves import leaf_to_torch, padded_leaves, row_of
from ..examples.structure import Structure
from ..reading.source import EpochSource
from .chain import JOIN_TIMEOUT_S, Chain, build_chain
from .plan import Plan
from .stage import Batch, weakly

__all__ = ["Epoch"]


class Epoch:
    """An epoch's stages and its consumer side.

    Args:
        plan: the loader's plan (dataecho.pipeline.plan).
        epoch: the epoch number.
        structure: the examples' structure if known (from an earlier epoch), else None.
        resume: {stage name: state} from a checkpoint, or None.
        on_finish: called once at the end with this epoch's counters and the
            per-worker counters.
        owner: kept alive while the epoch is (the loader: ``for b in
            EchoLoader(...)`` holds only the epoch).
        pool: the loader's persistent worker processes, or None.
        memory: the loader's ``_core.BlockCache``: the echo buffer's memory, kept
            from one epoch to the next; or None.

    Attributes:
        epoch: the epoch number.
        structure: the examples' structure (None for an empty source).
        stages: the chain's stages, first to last (empty for an empty epoch).
    """

    def __init__(self, plan: Plan, epoch: int, structure: Structure | None,
                 resume: dict[str, Any] | None, on_finish: Callable[[dict, list], None], owner: Any = None,
                 pool: Any = None, memory: Any = None) -> None:
        self.epoch = epoch
        self._owner = owner
        self._spec, self._on_finish = plan.output, on_finish
        self._closed = False
        self._state = "running"  # then "complete", "stopped" or "failed" (see dataecho.pipeline.stats)
        self._superseded = False  # ended by a later iter(loader): its next() says so
        self._consumer = threading.Lock()
        self._started = time.perf_counter()
        self._wait_s, self._delivered, self._batches = 0.0, 0, 0
        self._chain = Chain(mode=plan.checkpoint)
        map_style = plan.source.order is not None
        skip = (resume or {}).get("intake", {}).get("skip", 0) if not map_style else 0
        source = EpochSource(plan.source, epoch, skip, pool, memory)
        try:
            first: list[Any] = []
            if structure is None:
                first = source.first()
                declared = set(plan.output.declared_ragged) | source.declared_ragged()
                structure = None if not first else Structure.infer(first[0], first[1:], declared,
                                                                   strict=plan.output.strict)
            self.structure = structure
            if structure is not None:
                build_chain(self._chain, plan, structure, source, first, resume, weakly(self.abort))
        except BaseException:
            self.close()
            raise

    @property
    def stages(self) -> list[Any]:
        return self._chain.stages

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
        return self._output(batch)

    def _next_batch(self) -> Batch:
        if self._closed or not self._chain.stages:
            raise StopIteration
        timeout = self._spec.timeout_s
        try:
            return self._chain.stages[-1].next(timeout)
        except TimeoutError:
            if timeout is None:
                raise
            raise RuntimeError(f"EchoLoader timed out after {timeout:g} seconds (timeout={timeout:g}) "
                               f"waiting for a batch") from None

    def _output(self, batch: Batch) -> Any:
        output = self._spec
        wrap = leaf_to_torch if output.to_torch else None
        if output.collate_fn is not None:
            # Each example as views of its rows of the batch (no copy), in the batch's order.
            examples = [batch.structure.unflatten([row_of(a, i) for a in batch.arrays], wrap=wrap)
                        for i in range(len(batch))]
            return output.collate_fn(examples)
        leaves = batch.arrays
        if output.padding is not None:
            leaves = padded_leaves(leaves, output.padding)
        return batch.structure.unflatten(leaves, wrap=wrap)

    # ---- checkpoints and counters ----

    def state(self) -> dict[str, Any]:
        """{stage name: state} between two batches (see dataecho.pipeline.checkpoint).

        Raises:
            ValueError: a stage whose state cannot be saved, with its reason.
        """
        chain = self._chain
        stages = chain.stages if chain.mode == "exact" else chain.stages[:1]
        for stage in stages:
            if stage.unresumable is not None:
                raise ValueError(f"state_dict: {stage.unresumable}")
        with chain.pull_lock:  # no batch is half-way between two stages meanwhile
            return {stage.name: stage.state() for stage in stages}

    def counters(self) -> dict[str, Any]:
        """This epoch's counters (see dataecho.pipeline.stats), from every stage."""
        stages: dict[str, Any] = {}
        for stage in self._chain.stages:
            stages.update(stage.counters())
        return {
            "epoch": self.epoch,
            "state": self._state,
            "fresh": stages.get("fresh", 0),
            "delivered": self._delivered,
            "batches": self._batches,
            "fresh_batches": stages.get("fresh_batches", 0),
            "delivered_batches": stages.get("delivered_batches", 0),
            "augmented": stages.get("augmented", 0),
            "wait_s": self._wait_s,
            "active_s": time.perf_counter() - self._started,
            "memory": stages.get("memory"),
        }

    def worker_counters(self) -> list[dict[str, float]]:
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
            warnings.warn("EchoLoader: the memory budget for ragged values ran out this epoch (producers waited "
                          "for it), so some batches were drawn from fewer examples than planned and their order "
                          "depended on timing, despite deterministic=True; raise ragged_bytes", RuntimeWarning,
                          stacklevel=3)
        self.abort()
        for stage in reversed(self._chain.stages):
            stage.join(JOIN_TIMEOUT_S if wait else 0.0)
        self._on_finish(self.counters(), self.worker_counters())

    def __del__(self) -> None:
        # The last reference went (the loop left, the loader was deleted): stop
        # every stage. Threads are not waited for (one may be inside the user's
        # code); each ends at its next put. Worker processes are reaped.
        if not getattr(self, "_closed", True):
            self._finish(wait=False)
