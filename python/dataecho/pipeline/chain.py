"""Builds an epoch's chain of stages from the plan, first to last, in the
order of ``dataecho.pipeline.plan.CHAIN`` (drawn there), each from its own spec
and its own part of a checkpoint. The intake is the echo buffer's (dataecho.pipeline.stages.intake) or, with a
``batch_sampler``, the sampler's batches (dataecho.pipeline.stages.batches).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..examples.structure import Structure
from ..reading.source import EpochSource
from ..workers.failure import Failure
from ..workers.readers import Probing, Reading
from ..workers.resources import EpochResources
from . import checkpoint
from .checkpoint import StateCheck
from .plan import CHAIN, Plan
from .stages import augment, batch_echo, batches, delivery, device_echo, intake, lockstep
from .stages.augment_kinds import augment_stage
from .stages.stage import COUNTERS, Stage

__all__ = ["JOIN_TIMEOUT_S", "Chain", "build_chain", "state_checks"]

JOIN_TIMEOUT_S = 5.0  # how long a stopped epoch waits for each stage's threads

_ORDER = {name: index for index, (name, _) in enumerate(CHAIN)}

# Each stage's check, by its spec's type (two intakes share the name "intake").
_CHECKS: dict[type, Callable[..., dict]] = {
    intake.IntakeSpec: intake.check_state, batches.BatchesSpec: batches.check_state,
    batch_echo.BatchEchoSpec: batch_echo.check_state, augment.AugmentSpec: augment.check_state,
    delivery.DeliverySpec: delivery.check_state, device_echo.DeviceEchoSpec: device_echo.check_state,
}


def state_checks(plan: Plan) -> dict[str, StateCheck]:
    """Per stage whose state an exact checkpoint of ``plan``'s epochs holds, its
    check, bound to the stage's spec (which bounds what it could have saved)."""
    specs = {name: getattr(plan, name) for name in plan.stage_names}
    return {name: functools.partial(_CHECKS[type(spec)], spec) for name, spec in specs.items()}


@dataclass
class Chain:
    """An epoch's stages, first to last, and what they share.

    Attributes:
        stages: first to last; the epoch pulls from the last.
        failure: the first exception of any stage thread.
        pull_lock: held by a stage thread pulling from its upstream, and by the
            epoch while it takes the stages' states.
        mode: how a checkpoint is taken: "exact" (every stage's state), "skip"
            (iterable sources: how many examples were read), or None (refused,
            by the first stage's reason).
    """

    stages: list[Stage] = field(default_factory=list)
    failure: Failure = field(default_factory=Failure)
    pull_lock: threading.Lock = field(default_factory=threading.Lock)
    mode: str | None = None
    group: Any = None  # the process group the ranks keep in lockstep on (dataecho.pipeline.stages.lockstep)

    @property
    def resumable(self) -> bool:
        """A state can be taken now: built, no stage failed, none refuses."""
        return (self.mode is not None and self.failure.error is None and bool(self.stages)
                and self.stages[0].unresumable is None)

    def state(self, lock_timeout_s: float = -1) -> dict[str, Any] | None:
        """{stage name: state} between two batches (see dataecho.pipeline.checkpoint),
        or None before any stage exists (the epoch's start); ``lock_timeout_s``:
        how long to wait for a stage thread's pull, and each stage for a batch
        being assembled (-1: as long as it takes).

        Raises:
            ValueError: a stage whose state cannot be saved, with its reason.
            TimeoutError: a stage thread's pull, or a batch, took longer than ``lock_timeout_s``.
        """
        if not self.stages:
            return None
        stages = self.stages if self.mode == "exact" else self.stages[:1]
        for stage in stages:
            if stage.unresumable is not None:
                raise ValueError(f"state_dict: {stage.unresumable}")
        # No batch is half-way between two stages meanwhile.
        if not self.pull_lock.acquire(timeout=lock_timeout_s):
            raise TimeoutError("a stage thread is still pulling a batch")
        try:
            timeout_s = None if lock_timeout_s < 0 else lock_timeout_s
            return {stage.name: stage.state(timeout_s) for stage in stages}
        finally:
            self.pull_lock.release()

    def counters(self) -> dict[str, Any]:
        """Every stage's counters, in one dict (see dataecho.pipeline.progress.stats)."""
        found: dict[str, Any] = {}
        for stage in self.stages:
            counters = stage.counters()
            unnamed = set(counters) - set(COUNTERS)
            if unnamed:
                raise RuntimeError(f"dataecho: stage {stage.name!r} reports counters not named in COUNTERS: "
                                   f"{sorted(unnamed)}")
            found.update(counters)
        return found


def build_chain(chain: Chain, plan: Plan, structure: Structure | None, source: EpochSource,
                resources: EpochResources, first: Any, resume: dict[str, Any] | None,
                on_failure: Callable[[], None], probing: Probing | None = None,
                on_structure: Callable[[Structure], None] = lambda structure: None) -> None:
    """Builds and starts the stages of one epoch into ``chain``, first to last.

    A stage thread may fail while later stages are still being built: each
    stage is visible in ``chain.stages`` as soon as it exists (``on_failure``
    stops those), and one registered after a failure is stopped at once.

    Args:
        chain: where the stages go.
        plan: the loader's plan.
        structure: the examples' structure (None: a batch sampler's intake learns it).
        source: this epoch's view of the source.
        resources: the epoch's seeds and the loader's resources (dataecho.workers.resources).
        first: the examples read to learn the structure (put first), or none.
        resume: the epoch's state from a checkpoint ({stage name: state}), or None.
        on_failure: stops the epoch; stage threads call it after recording an error.
        probing: workers that read the first examples and wait for the echo
            buffer (a reader kind's ``probe``: dataecho.workers.readers), or None.
        on_structure: called with the structure a batch sampler's intake learned.
    """
    try:
        _build(chain, plan, structure, Reading(source, plan.intake.workers, chain.failure, on_failure, resources),
               first, resume or {}, probing, on_structure)
    except BaseException:
        # Ctrl-C or an error part-way: the stages started so far stop too.
        for stage in reversed(chain.stages):
            stage.stop()
        for stage in reversed(chain.stages):
            stage.join(JOIN_TIMEOUT_S)
        raise


def _build(chain: Chain, plan: Plan, structure: Structure | None, reading: Reading, first: Any,
           states: dict[str, Any], probing: Probing | None, on_structure: Callable[[Structure], None]) -> None:
    source, resources, on_failure = reading.source, reading.resources, reading.on_failure
    if states and plan.checkpoint == "exact" and source.order is None:
        # An iterable resumes by reading itself again up to where its intake
        # stood, keeping the examples the state names on the way.
        source.keep(checkpoint.named_rows(states), int(states["intake"].get("next_seq", 0)))
    if plan.reads_batches:
        stage = batches.BatchesIntake(plan.intake, source, structure, chain.failure, on_failure,
                                      states.get("intake"), on_structure, resources.memory)
    else:
        stage = intake.IntakeStage(plan.intake, reading, structure, first, states.get("intake"), probing)
    last: Stage = _add(chain, stage)
    read_batch = stage.read_batch
    if plan.batch_echo is not None:
        spec = plan.batch_echo
        copy = stage.copy_arrays if spec.views_batch_memory else None  # used where the leaves are tensors
        last = _add(chain, batch_echo.BatchEchoStage(spec, last, resources.seeds.batch_echo, copy,
                                                     states.get("batch_echo"), read_batch))
    if plan.augment is not None:
        augmenting = augment_stage(plan.augment)(plan.augment, last, structure, source, resources, chain.failure,
                                                 on_failure, chain.pull_lock, states.get("augment"),
                                                 stage.share_batch_memory)
        last, read_batch = _add(chain, augmenting), augmenting.read_batch
    if plan.device_echo is not None:
        seeds = resources.seeds
        last = _add(chain, device_echo.DeviceEchoStage(plan.device_echo, last, seeds.batch_echo, seeds.augment,
                                                       states.get("device_echo"), read_batch))
    if plan.lockstep is not None:
        # Repeats read again where an example is read by position, as it was (no augment to recompute),
        # and on the host (not where they are kept on the device).
        again = (stage.read_batch if plan.source.order is not None and plan.augment is None
                 and plan.device_echo is None else None)
        last = _add(chain, lockstep.LockstepStage(plan.lockstep, last, chain.group, chain.failure, again))
    if plan.delivery is not None:
        _add(chain, delivery.DeliveryStage(plan.delivery, last, states.get("delivery"), read_batch))


def _add(chain: Chain, stage: Stage) -> Stage:
    if chain.stages and _ORDER[stage.name] <= _ORDER[chain.stages[-1].name]:
        stage.stop()  # not in the chain: its cleanup would not reach it
        stage.join(JOIN_TIMEOUT_S)
        raise RuntimeError(f"dataecho: stage {stage.name!r} built after {chain.stages[-1].name!r}, against CHAIN")
    chain.stages.append(stage)
    if chain.failure.error is not None:  # failed while it was being built: nothing else stops it
        stage.stop()
    return stage
