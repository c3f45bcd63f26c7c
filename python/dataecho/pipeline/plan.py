"""The planner: the one place that turns a loader's configuration into what
each part of an epoch needs, and so the one place that knows which
combination of options is in use.

:func:`plan` reads the validated :class:`~dataecho.config.loader_config.LoaderConfig`
once and returns a :class:`Plan` of small frozen specs: the source's, the
workers', one per stage, and the consumer's. A stage is built from its own spec
and never sees the configuration. The chain an epoch runs is::

    intake -> [batch_echo] -> [augment] -> [lockstep] -> [delivery]

``batch_echo`` with ``echo_at="batch"`` (not in order), ``augment`` where one
is given, ``delivery`` with a device, and wherever a checkpoint is exact (it
owns the batches on their way out, so that a state taken with a device resumes
without one). With a ``batch_sampler`` the intake is the sampler's batches, read
whole (dataecho.pipeline.batches), and echo repeats them whole (``batch_echo``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..config.dataloader import DEFAULT_WORKERS
from ..config.echo import exact_deliveries
from ..config.loader_config import DEFAULT_EXAMPLES, LoaderConfig
from ..native.sizing import reorder_window
from ..reading.chunking import CHUNK
from ..reading.order import OrderSpec
from ..reading.restart import is_restartable
from ..reading.source import SourceSpec
from ..workers.spec import WorkersSpec
from .augment import AugmentSpec
from .batch_echo import BatchEchoSpec
from .batches import BatchesSpec
from .delivery import DeliverySpec
from .lockstep import LockstepSpec
from .intake import IntakeSpec

__all__ = ["OutputSpec", "Plan", "plan"]


@dataclass(frozen=True)
class OutputSpec:
    """What the epoch does with each batch the last stage yields, and how it waits.

    Attributes:
        convert: what host batches become: ``"torch"`` (tensors, ``output="torch"``
            without a device), ``"jax"`` (JAX arrays), or None (as the last stage gives them).
        batched: False for ``batch_size=None``: each batch of one is yielded as its example.
        collate_fn: called with the batch's examples (or, not batched, the
            example), each as the dataset returned it; its result is yielded.
        padding: ragged leaves padded on the host (no device), or None.
        timeout_s: how long to wait for a batch (None: for ever).
        declared_ragged: leaf paths declared ragged.
        strict: a declared path that is not a leaf of the examples raises
            (False where ``augment`` may make it one).
        warn_starved: say when the ragged budget made a deterministic order depend on timing.
        jax_device: with ``convert="jax"``, the ``jax.Device`` (None: JAX's default).
    """

    convert: str | None
    batched: bool
    collate_fn: Callable[[list], Any] | None
    padding: int | str | None
    timeout_s: float | None
    declared_ragged: frozenset[str]
    strict: bool
    warn_starved: bool
    jax_device: Any = None


@dataclass(frozen=True)
class Plan:
    """An epoch's specs, built once per loader.

    Attributes:
        source: what the epoch reads.
        intake, batch_echo, augment, delivery: the stages' specs (None: not in
            the chain); the intake's is a BatchesSpec with a batch sampler.
        lockstep: ``echo_factor="auto"`` on several ranks: the stage that keeps
            their epochs the same length (dataecho.pipeline.lockstep), before
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

    @property
    def reads_batches(self) -> bool:
        """The intake reads a batch sampler's batches whole (dataecho.pipeline.batches),
        and learns the examples' structure from the first of them itself."""
        return isinstance(self.intake, BatchesSpec)

    @property
    def stage_names(self) -> list[str]:
        """The names of the stages an exact state holds, first to last."""
        names = ["intake", "batch_echo", "augment", "delivery"]
        return [name for name in names if getattr(self, name) is not None]


def plan(config: LoaderConfig) -> Plan:
    """The specs of ``config``'s epochs (see the module docstring)."""
    exact = config.exact_checkpoint
    order = OrderSpec(config.dataset, config.sampler, config.shard, config.shuffle, config.seed,
                      config.drop_last, config.batch_sampler) if config.map_style else None
    source = SourceSpec(config.dataset, config.transform, order, config.seed, config.shard.rank,
                        for_processes=config.worker_type == "process", chunk=min(CHUNK, config.batch_size),
                        marks=_marks(config))
    batch_echo = _batch_echo(config, exact) if config.echo.at == "batch" and not config.in_order else None
    intake = _batches(config, source) if config.batch_sampler is not None else _intake(config, source, exact)
    return Plan(
        source=source, intake=intake, batch_echo=batch_echo,
        augment=_augment(config, exact) if config.augment is not None else None,
        delivery=DeliverySpec(config.device, config.padding) if exact or config.device is not None else None,
        output=OutputSpec(config.output if config.output != "numpy" and config.device is None else None,
                          config.batched, config.collate_fn, config.padding if config.device is None else None,
                          config.timeout, config.ragged or frozenset(), config.augment is None,
                          config.deterministic_given, config.jax_device),
        checkpoint=_checkpoint(config),
        batches_per_epoch=lambda: _batches_per_epoch(config, order),
        lockstep=LockstepSpec() if config.echo.auto and config.shard.world_size > 1 else None,
    )


def _checkpoint(config: LoaderConfig) -> str | None:
    if config.exact_checkpoint:
        return "exact"
    return None if config.map_style or config.worker_type == "process" else "skip"


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
        auto_echo=echo.per_example and echo.auto, max_echo=echo.max_echo,
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


def _batches(config: LoaderConfig, source: SourceSpec) -> BatchesSpec:
    # No echo buffer: the sampler's batches are read whole, `prefetch` of them
    # ahead (at least one per worker thread).
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
                         torch_output=config.output == "torch",
                         views_batch_memory=config.augment is None and config.device is None)


def _augment(config: LoaderConfig, exact: bool) -> AugmentSpec:
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


def _batches_per_epoch(config: LoaderConfig, order: OrderSpec | None) -> int:
    """``len(loader)``: batches per epoch on this rank, for a map-style source and
    a fixed echo factor: integer, or fractional with exact echo counts
    (``deterministic=True`` or several ranks). With a batch sampler, its
    ``len()`` times the echo factor (batch echo counts, exact).

    Raises:
        TypeError: an iterable source, a batch sampler without ``len()``, or a
            number of batches that is random.
    """
    if order is None:
        raise TypeError("len(): the source is an iterable of unknown length")
    echo = config.echo
    if echo.auto or not (echo.whole or config.exact_echo):
        raise TypeError("len(): the number of batches is random with a fractional or 'auto' echo factor")
    if config.batch_sampler is not None:
        if not hasattr(config.batch_sampler, "__len__"):
            raise TypeError("len(): the batch_sampler has no len()")
        return exact_deliveries(len(config.batch_sampler), echo.factor)
    rounding = math.floor if config.drop_last else math.ceil
    examples = order.examples_per_epoch()
    if echo.at == "batch":
        return exact_deliveries(rounding(examples / config.batch_size), echo.factor)
    return rounding(exact_deliveries(examples, echo.factor) / config.batch_size)
