"""The planner: the one place that turns a loader's configuration into what
each part of an epoch needs, and so the one place that knows which
combination of options is in use.

:func:`plan` reads the validated :class:`~dataecho.config.loader_config.LoaderConfig`
once and returns a :class:`Plan` of small frozen specs: the source's, the
workers', one per stage, and the consumer's. A stage is built from its own spec
and never sees the configuration. The chain an epoch runs is (:data:`CHAIN`,
drawn by :func:`drawing`; a test keeps this drawing and docs/design.md's equal
to it, and dataecho.pipeline.chain builds the stages in its order)::

    intake -> [batch_echo] -> [augment] -> [device_echo] -> [lockstep] -> [delivery]

``batch_echo`` with ``echo_at="batch"`` (not in order), ``augment`` where one
is given, ``device_echo`` with ``echo_at="device"`` (in place of the delivery:
dataecho.pipeline.device_plan), ``lockstep`` with ``echo_factor="auto"`` on several ranks,
``delivery`` with a device, and wherever a checkpoint is exact (it owns the
batches on their way out, so that a state taken with a device resumes without
one). With a ``batch_sampler`` the intake is the sampler's batches, read
whole (dataecho.pipeline.stages.batches), and echo repeats them whole (``batch_echo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config.dataloader import DEFAULT_WORKERS
from ..config.loader_config import DEFAULT_EXAMPLES, LoaderConfig
from ..config.stand_in import stand_in
from ..examples.outputs import Output, output_kind
from ..native.sizing import reorder_window
from ..reading.chunking import CHUNK
from ..reading.order import OrderSpec
from ..reading.restart import is_restartable
from ..reading.sharding import Shard
from ..reading.source import SourceSpec
from ..workers.reader_kinds import kind_of
from ..workers.spec import WorkersSpec
from .device_plan import device_plan
from .epoch_length import batches_per_epoch
from .stages.augment import AugmentSpec
from .stages.augment_processes import STAGED_BATCHES
from .stages.batch_echo import BatchEchoSpec
from .stages.batches import BatchesSpec
from .stages.delivery import DeliverySpec
from .stages.device_echo import DeviceEchoSpec
from .stages.intake import IntakeSpec
from .stages.lockstep import LockstepSpec

__all__ = ["CHAIN", "OutputSpec", "Plan", "Planner", "drawing", "plan"]

# The chain an epoch runs, first to last: each stage's name, and whether every epoch has it.
CHAIN: tuple[tuple[str, bool], ...] = (
    ("intake", True), ("batch_echo", False), ("augment", False), ("device_echo", False), ("lockstep", False),
    ("delivery", False),
)
_STATELESS = frozenset({"lockstep"})  # stages whose state a checkpoint does not hold


def drawing() -> str:
    """The chain as the docs draw it, optional stages in brackets."""
    return " -> ".join(name if always else f"[{name}]" for name, always in CHAIN)


@dataclass(frozen=True)
class OutputSpec:
    """What the epoch does with each batch the last stage yields, and how it waits.

    Attributes:
        kind: what host batches become (dataecho.examples.outputs): ``output``'s
            kind, or with a device the NumPy one (as the last stage gives them:
            the delivery stage made them tensors on the device).
        batched: False for ``batch_size=None``: each batch of one is yielded as its example.
        collate_fn: called with the batch's examples (or, not batched, the
            example), each as the dataset returned it; its result is yielded.
        padding: ragged leaves padded on the host (no device), or None.
        timeout_s: how long to wait for a batch (None: for ever).
        declared_ragged: leaf paths declared ragged.
        strict: a declared path that is not a leaf of the examples raises
            (False where ``augment`` may make it one).
        warn_starved: say when the ragged budget made a deterministic order depend on timing.
    """

    kind: Output
    batched: bool
    collate_fn: Callable[[list], Any] | None
    padding: int | str | None
    timeout_s: float | None
    declared_ragged: frozenset[str]
    strict: bool
    warn_starved: bool


@dataclass(frozen=True)
class Plan:
    """An epoch's specs, built once per loader.

    Attributes:
        source: what the epoch reads.
        intake, batch_echo, augment, delivery: the stages' specs (None: not in
            the chain); the intake's is a BatchesSpec with a batch sampler.
        device_echo: with ``echo_at="device"``, the stage that keeps examples
            on the device and echoes them there; else None.
        lockstep: ``echo_factor="auto"`` on several ranks: the stage that keeps
            their epochs the same length (dataecho.pipeline.stages.lockstep), before
            the delivery; else None.
        output: the consumer's side.
        batches_per_epoch: ``len(loader)`` (TypeError where it is not known).
        checkpoint: how a state is taken mid-epoch: ``"exact"`` (every stage's
            state), ``"skip"`` (an iterable read by threads: how many examples
            were read), or None (refused, for the intake's reason).
    """

    source: SourceSpec
    intake: IntakeSpec | BatchesSpec
    batch_echo: BatchEchoSpec | None
    augment: AugmentSpec | None
    delivery: DeliverySpec | None
    output: OutputSpec
    checkpoint: str | None
    batches_per_epoch: Callable[[], int]
    lockstep: LockstepSpec | None = None
    device_echo: DeviceEchoSpec | None = None

    @property
    def reads_batches(self) -> bool:
        """The intake reads a batch sampler's batches whole (dataecho.pipeline.stages.batches),
        and learns the examples' structure from the first of them itself."""
        return isinstance(self.intake, BatchesSpec)

    @property
    def stage_names(self) -> list[str]:
        """The names of the stages an exact state holds, first to last."""
        return [name for name, _ in CHAIN if name not in _STATELESS and getattr(self, name) is not None]


class Planner:
    """A loader's configuration as the code that serves the loader across
    epochs sees it (dataecho.pipeline.progress: resume, replay, elastic
    resume, the job): the plan of its epochs, where this rank stands, and the
    planner of the same loader on another rank, world size or seed. That code
    never reads the configuration itself.

    Args:
        config: the loader's validated configuration.
        planned: its plan, where made already (else made here).

    Attributes:
        plan: the plan of the configuration's epochs.
    """

    def __init__(self, config: LoaderConfig, planned: Plan | None = None) -> None:
        self._config = config
        self.plan = planned if planned is not None else plan(config)

    @property
    def configuration(self) -> LoaderConfig:
        """The configuration itself, for the loader that exposes it (``loader.config``)."""
        return self._config

    @property
    def shard(self) -> Shard:
        """This loader's rank and world size."""
        return self._config.shard

    @property
    def seed(self) -> int:
        return self._config.seed

    @property
    def seed_given(self) -> bool:
        """The seed was given (else drawn: a loaded state's replaces it)."""
        return self._config.seed_given

    @property
    def shard_given(self) -> bool:
        """rank and world_size were given (else torch.distributed decides)."""
        return self._config.shard_given

    @property
    def replayable(self) -> bool:
        """A position mid-epoch follows from the seed alone (LoaderConfig.replayable; not batches written in place)."""
        return self._config.replayable and not writes_batches(self._config) and not self._config.echo.on_device

    @property
    def echo_factor(self) -> float:
        return self._config.echo.factor

    @property
    def examples(self) -> int:
        """The map-style dataset's length."""
        return len(self._config.dataset)

    def fingerprint(self) -> dict[str, Any]:
        """What a state records of the arguments that decide the batches (LoaderConfig.fingerprint)."""
        return self._config.fingerprint()

    def dealing(self, epoch: int, segment: int) -> dict[str, Any]:
        """The settings by which an elastic resume deals out an epoch's owed
        deliveries (dataecho.pipeline.progress.elastic.Dealing's fields)."""
        config = self._config
        return {"world_size": config.shard.world_size, "batch_size": config.batch_size,
                "factor": config.echo.factor, "drop_last": config.drop_last, "capacity": self.plan.intake.capacity,
                "seed": config.seed, "epoch": epoch, "segment": segment, "augmented": config.augment is not None}

    def on_shard(self, shard: Shard) -> Planner:
        """The same loader as rank ``shard.rank`` of ``shard.world_size``."""
        return self if shard == self._config.shard else Planner(self._config.with_shard(shard))

    def with_seed(self, seed: int) -> Planner:
        """The same loader with ``seed`` (a loaded state's)."""
        return Planner(self._config.with_seed(seed))

    def stand_in(self, augment: Callable[..., Any]) -> Plan:
        """The plan of a stand-in for this loader whose examples are their
        dataset indices (dataecho.config.stand_in), ``augment`` in place of the user's."""
        return plan(stand_in(self._config, augment))


def plan(config: LoaderConfig) -> Plan:
    """The specs of ``config``'s epochs (see the module docstring)."""
    return device_plan(config, _plan) if config.echo.on_device else _plan(config)


def _plan(config: LoaderConfig) -> Plan:
    exact = config.exact_checkpoint
    order = OrderSpec(config.dataset, config.sampler, config.shard, config.shuffle, config.seed,
                      config.drop_last, config.batch_sampler) if config.map_style else None
    source = SourceSpec(config.dataset, config.transform, order, config.seed, config.shard.rank,
                        chunk=min(CHUNK, config.batch_size),
                        marks=_marks(config),
                        batches=(config.batch_size, config.drop_last) if writes_batches(config) else None)
    batch_echo = _batch_echo(config, exact) if config.echo.at == "batch" and not config.in_order else None
    whole = config.batch_sampler is not None or writes_batches(config)  # batches read whole, no echo buffer
    intake = _batches(config, source) if whole else _intake(config, source, exact)
    return Plan(
        source=source, intake=intake, batch_echo=batch_echo,
        augment=_augment(config, exact, batch_echo) if config.augment is not None else None,
        delivery=DeliverySpec(config.device, config.padding) if exact or config.device is not None else None,
        output=OutputSpec(output_kind(config.output if config.device is None else "numpy", config.jax_device),
                          config.batched, config.collate_fn, config.padding if config.device is None else None,
                          config.timeout, config.ragged or frozenset(), config.augment is None,
                          config.deterministic_given),
        checkpoint=_checkpoint(config),
        batches_per_epoch=lambda: batches_per_epoch(config, order),
        lockstep=LockstepSpec() if config.echo.auto and config.shard.world_size > 1 else None,
    )


def _checkpoint(config: LoaderConfig) -> str | None:
    if config.exact_checkpoint:
        return "exact"
    # An iterable whose readers each iterate a shard of their own has no one count to skip ahead by.
    return None if config.map_style or kind_of(_workers(config)).own_shards else "skip"


def _marks(config: LoaderConfig) -> bool:
    """Whether the epochs mark where a restartable iterable stood as they read it
    (dataecho.reading.restart): wherever a state mid-epoch can be taken, so
    that it names where the iterable can restart. An exact state needs every
    stage's, which an ``augment`` without ``rng`` refuses; a skip-ahead count
    is the intake's alone."""
    mode = _checkpoint(config)
    if config.map_style or mode is None or not is_restartable(config.dataset):
        return False
    return mode == "skip" or config.augment is None or config.augment_takes_rng


def _workers(config: LoaderConfig, capacity: int | None = None) -> WorkersSpec:
    """Who reads; ``capacity``: the echo buffer's examples, whose reorder window
    (deterministic intake) bounds how far ahead the workers' chunks may reach."""
    kind = "inline" if config.workers == 0 else config.worker_type
    window = reorder_window(capacity, config.batch_size) if config.deterministic and capacity is not None else 0
    return WorkersSpec(kind, max(1, config.workers), config.auto_workers, config.start_method, config.worker_init_fn,
                       window=window)


def _intake(config: LoaderConfig, source: SourceSpec, exact: bool) -> IntakeSpec:
    echo, batch = config.echo, config.batch_size
    if echo.per_example:
        capacity = config.shuffle_buffer
        if echo.once and config.map_style and config.shuffle and not config.shuffle_buffer_given:
            # Nothing to spread apart at echo 1, and the reading order is a new
            # permutation already (as DataLoader's): a large buffer would only
            # delay the first batch and make reads run ahead to fill it (it
            # grows by one example per delivery). Batches as they come.
            capacity = 2 * batch
    elif config.map_style:
        # Batch echoing over an index order that is already a new permutation
        # each epoch (the sampler's): batch it as it comes, as DataLoader
        # does. A larger shuffle here would only delay the echoes: the
        # reservoir grows by one example per delivery, at one more fresh read.
        capacity = 2 * batch
    else:
        capacity = max(2 * batch, DEFAULT_EXAMPLES)
    return IntakeSpec(
        source=source, workers=_workers(config, capacity), capacity=capacity, bounded=config.map_style,
        batch_size=batch,
        echo_factor=echo.factor if echo.per_example and not echo.auto else 1.0,
        auto_echo=echo.per_example and echo.auto, max_echo=echo.max_echo, echo_gap=echo.gap,
        # With augment, its output buffer decides what a short last batch means.
        drop_last=config.drop_last and config.augment is None, prefetch=config.prefetch,
        # Batch echoing: batches flow from the first one on; the example
        # shuffle behind them still grows to its capacity.
        # "auto": the first batch as soon as two batches are in, so that a slow
        # input does not first fill a quarter of the buffer while the step waits.
        initial=batch if not echo.per_example else 2 * batch if echo.auto else 0,
        deterministic=config.deterministic, exact_echo=config.exact_echo and echo.per_example,
        in_order=config.in_order, ragged_bytes=config.ragged_bytes, exact=exact,
        unresumable=_unresumable(config), pinned_batches=_pinned_batches(config) if config.augment is None else 0,
        pinned_device=config.device,
    )


def writes_batches(config: LoaderConfig) -> bool:
    """Echo 1 over a map-style dataset with ``read_into`` (no transform, batch_sampler or sampler without a
    length; threads or inline): batches read whole, written in place (dataecho.pipeline.stages.written)."""
    return (config.map_style and config.echo.once and not config.echo.on_device and config.batch_sampler is None
            and config.transform is None and callable(getattr(config.dataset, "read_into", None))
            and (config.sampler is None or hasattr(config.sampler, "__len__"))
            and (config.workers == 0 or config.worker_type == "thread"))


def _batches(config: LoaderConfig, source: SourceSpec) -> BatchesSpec:
    # No echo buffer: the sampler's batches (or at echo 1, the order's batches,
    # written in place) are read whole, `prefetch` of them ahead (at least one per worker thread).
    return BatchesSpec(source=source, workers=_workers(config), ahead=config.prefetch,
                       declared_ragged=config.ragged or frozenset(), unresumable=_unresumable(config))


def _unresumable(config: LoaderConfig) -> str | None:
    """Why no state can be taken mid-epoch, or None (see Plan.checkpoint)."""
    if _checkpoint(config) is not None:
        return None
    if config.map_style:
        return "saving a position mid-epoch needs deterministic=True (otherwise the order depends on thread timing)"
    return ("worker processes each read their own shard of an iterable source, so there is no "
            "single position to skip to; use a map-style source")


def _batch_echo(config: LoaderConfig, exact: bool) -> BatchEchoSpec:
    # torch has no read-only tensors: where its tensors view the batch memory
    # (no augment, no device copy), a repeat is delivered from its own memory.
    # A batch sampler's batches have no fixed size: every one is full.
    batch_size = None if config.batch_sampler is not None else config.batch_size
    return BatchEchoSpec(resident=config.shuffle_buffer, batch_size=batch_size, echo_factor=config.echo.factor,
                         max_echo=config.echo.max_echo, exact=config.exact_echo,
                         writable_output=not output_kind(config.output).read_only,
                         views_batch_memory=config.augment is None and config.device is None)


def _augment(config: LoaderConfig, exact: bool, batch_echo: BatchEchoSpec | None) -> AugmentSpec:
    takes_rng = config.augment_takes_rng
    workers = DEFAULT_WORKERS if config.auto_workers else max(1, config.workers)
    processes = workers if config.augment_workers == "process" else 0
    return AugmentSpec(
        augment=config.augment, takes_rng=takes_rng, seed=config.seed, rank=config.shard.rank,
        # num_workers=0 reads inline; augment still runs on threads (2 when num_workers is not given),
        # or worker processes, which the consumer's thread feeds.
        threads=0 if processes else workers, processes=processes, start_method=config.start_method, exact=exact,
        capacity=max(4 * config.batch_size, 256), batch_size=config.batch_size, drop_last=config.drop_last,
        prefetch=config.prefetch, deterministic=config.deterministic, in_order=config.in_order,
        declared_ragged=config.ragged, ragged_bytes=config.ragged_bytes, pinned_batches=_pinned_batches(config),
        pinned_device=config.device,
        # Staging blocks: those in flight to the workers, and what the echo buffer and batch echo hold beyond.
        staged_batches=STAGED_BATCHES + 2 * processes + (batch_echo.resident if batch_echo else 0) if processes else 0,
    )


def _pinned_batches(config: LoaderConfig) -> int:
    """Page-locked batch blocks for the last host buffer: prefetch + the batch
    being assembled + the consumer's + two in flight to the device (+ the
    batches held for batch echoing). Past that the pool uses pageable memory."""
    if not config.pin_memory:
        return 0
    count = config.prefetch + 4
    if config.echo.at == "batch" and config.augment is None:
        count += config.shuffle_buffer
    return count
