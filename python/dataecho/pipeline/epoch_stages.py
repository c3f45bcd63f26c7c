"""The stages of one epoch as they run, behind its iterator
(dataecho.pipeline.epoch): its view of the source, its chain of stages, and
the workers that read its first examples before the chain exists.

Where the examples' structure is known (a later epoch), or the intake learns
it itself (a batch sampler's, from its first batch), the chain is built at
once. Otherwise the workers start reading the first examples
(dataecho.workers.probe) and the first batch asked for learns the structure
from them and builds the chain; with ``num_workers=0`` that first ask reads
them itself. Either way no user code runs in ``iter(loader)``'s thread.
"""

from __future__ import annotations

from typing import Any, Callable

from ..examples.structure import Structure
from ..reading.restart import Mark
from ..reading.source import SAMPLE, EpochSource
from ..workers.reader_kinds import kind_of
from ..workers.readers import Probing, Reading
from ..workers.resources import EpochResources, Seeds
from . import checkpoint
from .chain import JOIN_TIMEOUT_S, Chain, build_chain
from .plan import Plan
from .stages import lockstep
from .stages.stage import Batch, weakly

__all__ = ["EpochStages"]


def _source_of(plan: Plan, epoch: int, resume: dict[str, Any] | None) -> EpochSource:
    """The epoch's view of the source, from where a resumed state's intake says it stood."""
    saved = (resume or {}).get("intake", {})
    skip = saved.get("skip", 0) if plan.source.order is None else 0
    restart = Mark(**saved["restart"]) if "restart" in saved else None
    return EpochSource(plan.source, epoch, skip, saved.get("order"), saved.get("bounds"), restart,
                       saved.get("sampler"))


def _probe_size(plan: Plan) -> int:
    """Examples read to learn the structure: SAMPLE, and at least one per
    worker, so that every worker reads before any waits (a dataset may wait
    for all its workers, at a barrier)."""
    return max(SAMPLE, plan.intake.workers.count)


class EpochStages:
    """The running stages of epoch ``epoch`` (see the module docstring).

    Args:
        plan: the loader's plan.
        epoch: the epoch number.
        structure: the examples' structure if known, else None.
        resume: {stage name: state} from a checkpoint, or None.
        on_failure: stops the epoch (a stage thread's error).
        pool, memory, group: the loader's persistent workers, echo-buffer
            memory and lockstep process group, or None: with the epoch's
            seeds, its resources (dataecho.workers.resources).
        on_structure: called with the structure the first examples told.

    Attributes:
        epoch, resume, structure: as given (the structure once learned).
        source, resources: the epoch's view of the source, and what its stages use beside it.
        built: the chain exists (built at once, or by the first batch asked
            for once the structure is known).
    """

    def __init__(self, plan: Plan, epoch: int, structure: Structure | None, resume: dict[str, Any] | None,
                 on_failure: Callable[[], None], pool: Any = None, memory: Any = None, group: Any = None,
                 on_structure: Callable[[Structure], None] = lambda structure: None) -> None:
        self.epoch, self.resume, self.structure = epoch, resume, structure
        self._plan, self._on_failure, self._on_structure = plan, on_failure, on_structure
        self.chain = Chain(mode=plan.checkpoint, group=group)
        self._probing: Probing | None = None  # readers of the first examples, before the chain exists
        self.built = False
        self.source = _source_of(plan, epoch, resume)
        self.resources = EpochResources(Seeds.of(plan.source.seed, epoch, plan.source.rank), pool, memory, group)
        probe = kind_of(plan.intake.workers).probe
        if (structure is not None or plan.reads_batches) and resume is None:
            self._build(structure, [])  # a resumed chain reads examples again: when asked, as errors come
        elif structure is None and probe is not None and resume is None:
            # The readers read the first examples; the chain is built from them when a batch is asked for.
            reading = Reading(self.source, plan.intake.workers, self.chain.failure, on_failure, self.resources)
            self._probing = probe(reading, _probe_size(plan))

    def _build(self, structure: Structure | None, first: list[Any], probing: Any = None) -> None:
        build_chain(self.chain, self._plan, structure, self.source, self.resources, first, self.resume,
                    self._on_failure, probing, weakly(self._learned))
        self.built = True

    def _learned(self, structure: Structure) -> None:
        """A batch sampler's intake learned the structure (in a worker thread)."""
        self.structure = structure
        self._on_structure(structure)

    def start(self, timeout_s: float | None) -> None:
        """Builds the chain where it is not built yet: learns the structure,
        where not known, from the first examples (read by the workers, or here
        with ``num_workers=0``).

        Raises:
            TimeoutError: the workers' first examples did not come within ``timeout_s``.
            StopIteration: a worker failed, or the epoch was stopped.
        """
        if self.built:
            return
        structure, probing, first = self.structure, self._probing, []
        if structure is None and not self._plan.reads_batches:  # which learns it from its first batch
            try:
                first = probing.probe.examples(timeout_s) if probing is not None else self.source.first()
                if first is None:  # a worker failed, or the epoch was stopped
                    self.chain.failure.raise_if_set()
                    raise StopIteration
                structure = self.structure = self.source.structure_of(
                    first, self._plan.output.declared_ragged, self._plan.output.strict)
            except BaseException:
                self._agree_without_stages(failed=True)  # the other ranks' lockstep learns it stopped
                raise
            if structure is None:  # an empty epoch
                self.built = True
                self._agree_without_stages(failed=False)  # raises unless every rank is empty
                return
            self._on_structure(structure)
        self._build(structure, first if probing is None else [], probing)
        self._probing = None  # the intake stage owns them now

    def _agree_without_stages(self, failed: bool) -> None:
        """Ranks kept in lockstep: this rank's part of the epoch's first
        agreement, where it builds no stages (dataecho.pipeline.stages.lockstep)."""
        if self._plan.lockstep is not None:
            lockstep.agree_without_stages(self.chain.group, failed=failed)

    def next(self, timeout_s: float | None) -> Batch:
        """The last stage's next batch (building the chain first where needed)."""
        self.start(timeout_s)
        if not self.chain.stages:
            raise StopIteration
        batch = self.chain.stages[-1].next(timeout_s)
        # A stage thread records its error before it stops the epoch, so a stage
        # after it that took the stop for the end (batch echo draining its
        # repeats, augment's last short batch) is caught here: what it made is
        # not the epoch's next batch, and the error comes instead.
        if self.chain.failure.error is not None:
            for stage in self.chain.stages:
                if isinstance(stage, lockstep.LockstepStage):
                    stage.leave()  # it counted the dropped batch delivered: the other ranks learn it stopped
            raise StopIteration
        return batch

    def state(self, lock_timeout_s: float = -1) -> dict[str, Any] | None:
        """{stage name: state} between two batches, or None at the epoch's start
        (see Chain.state); resumed, no batch taken yet: the state it resumed."""
        if not self.built and self.resume is not None:
            return self.resume
        stages = self.chain.state(lock_timeout_s)
        if self.source.order is None and self._plan.checkpoint == "exact":
            stages = checkpoint.read_to_named(stages)
        return checkpoint.with_restart(stages, self.source.marks)

    def prune(self) -> None:
        """Drops the restart marks no state needs any more (after each batch)."""
        checkpoint.prune(self.source.marks, self.chain.state)

    def counters(self) -> dict[str, Any]:
        return self.chain.counters()

    def worker_counters(self) -> list[dict[str, float]]:
        if self._probing is not None:  # still reading the first examples
            return self._probing.counters()
        return self.chain.stages[0].counters()["workers"] if self.chain.stages else []

    def starved(self) -> bool:
        """The ragged budget made some batch's order depend on timing."""
        return any(s.counters().get("starved") for s in self.chain.stages)

    def abort(self) -> None:
        """Stops every stage at once; callable from any thread."""
        for stage in reversed(self.chain.stages):
            stage.stop()
        if self._probing is not None:
            self._probing.stop()

    def join(self, wait: bool) -> None:
        """Waits (a bounded time, or not at all) for the stopped stages' threads."""
        for stage in reversed(self.chain.stages):
            stage.join(JOIN_TIMEOUT_S if wait else 0.0)
        if self._probing is not None:
            self._probing.join(JOIN_TIMEOUT_S if wait else 0.0)
