"""Builds an epoch's chain of stages: the one place that knows which stages a
configuration needs, in which order, and how a checkpoint's states map onto
them.

    intake -> intake_replay -> [batch_echo] -> [augment -> augment_replay]
           -> final_replay -> [device]

The replay stages are there only where a checkpoint can be exact (a map-style
source with ``deterministic=True``); on resume each yields first the batches
that had left the stage before it, or (``final_replay``) were on their way to
the device, when the state was taken.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config.loader_config import LoaderConfig
from ..examples.structure import Structure
from ..reading.source import EpochSource
from ..workers.failure import Failure
from .augment import AugmentStage
from .batch_echo import BatchEchoStage
from .device import DeviceStage
from .intake import IntakeStage
from .replay import Replay
from .stage import Stage

__all__ = ["JOIN_TIMEOUT_S", "Chain", "build_chain", "checkpoint_mode", "stage_names"]

JOIN_TIMEOUT_S = 5.0  # how long a stopped epoch waits for each stage's threads


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


def checkpoint_mode(config: LoaderConfig) -> str | None:
    """"exact", "skip" or None (see Chain.mode)."""
    if config.map_style:
        return "exact" if config.deterministic else None
    return "skip" if config.worker_type == "thread" else None


def stage_names(config: LoaderConfig) -> list[str]:
    """The names of the stages whose states an exact checkpoint holds (the
    device stage's, whose batches in flight resume through final_replay, may
    be there too)."""
    names = ["intake", "intake_replay"]
    if config.echo_at == "batch" and not config.in_order:
        names.append("batch_echo")
    if config.augment is not None:
        names += ["augment", "augment_replay"]
    return names + ["final_replay"]


def build_chain(chain: Chain, config: LoaderConfig, structure: Structure, source: EpochSource, first: Any,
                resume: dict[str, Any] | None, on_failure: Callable[[], None]) -> None:
    """Builds and starts the stages of one epoch into ``chain``, first to last.

    A stage thread may fail while later stages are still being built: each
    stage is visible in ``chain.stages`` as soon as it exists (``on_failure``
    stops those), and one registered after a failure is stopped at once.

    Args:
        chain: where the stages go (its mode from :func:`checkpoint_mode`).
        config: the loader's configuration.
        structure: the examples' structure.
        source: this epoch's view of the source.
        first: the examples read to learn the structure (put first), or none.
        resume: the epoch's state from a checkpoint ({stage name: state}), or None.
        on_failure: stops the epoch; stage threads call it after recording an error.
    """
    try:
        _build(chain, config, structure, source, first, resume or {}, on_failure)
    except BaseException:
        # Ctrl-C or an error part-way: the stages started so far stop too.
        for stage in reversed(chain.stages):
            stage.stop()
        for stage in reversed(chain.stages):
            stage.join(JOIN_TIMEOUT_S)
        raise


def _build(chain: Chain, config: LoaderConfig, structure: Structure, source: EpochSource, first: Any,
           states: dict[str, Any], on_failure: Callable[[], None]) -> None:
    exact = chain.mode == "exact"
    pinned = _pinned_batches(config)
    intake = IntakeStage(config, source, structure, first, chain.failure, on_failure, states.get("intake"),
                         pinned if config.augment is None else 0)
    last: Stage = _add(chain, intake)
    read_batch = intake.read_batch
    if exact:
        last = _add(chain, Replay("intake_replay", last, _after(states, "intake_replay", "intake"), read_batch))
    if config.echo_at == "batch" and not config.in_order:  # in order, batch echo at 1 would only mix
        echo = None if config.echo_factor == "auto" else float(config.echo_factor)
        # torch has no read-only tensors: where its tensors view the batch memory
        # (no augment, no device copy), a repeat is delivered from its own memory.
        tensors = config.output == "torch" or any(structure.torch_dtypes)  # bfloat16 leaves are tensors too
        copy = intake.copy_arrays if tensors and config.augment is None and config.device is None else None
        last = _add(chain, BatchEchoStage(last, config.shuffle_buffer, config.batch_size, echo, config.max_echo,
                                          source.seeds[1], exact=config.exact_echo, resume=states.get("batch_echo"),
                                          read_batch=read_batch, copy_repeats=copy))
    if config.augment is not None:
        augment = AugmentStage(last, structure, config, source, chain.failure, on_failure, chain.pull_lock,
                               states.get("augment"), pinned)
        last, read_batch = _add(chain, augment), augment.read_batch
        if exact:
            last = _add(chain, Replay("augment_replay", last, _after(states, "augment_replay", "augment"),
                                      read_batch))
    if exact:
        # Batches on their way to the device when the state was taken come first
        # (a loader resumed without a device yields them too).
        queued = states.get("device", {}).get("in_flight", []) + states.get("final_replay", {}).get("queued", [])
        last = _add(chain, Replay("final_replay", last, queued, read_batch))
    if config.device is not None:
        _add(chain, DeviceStage(last, config.device, config.padding))


def _add(chain: Chain, stage: Stage) -> Stage:
    chain.stages.append(stage)
    if chain.failure.error is not None:  # failed while it was being built: nothing else stops it
        stage.stop()
    return stage


def _after(states: dict[str, Any], replay: str, stage: str) -> list[dict[str, Any]]:
    """A replay's batches on resume: those it had not yielded yet, then those
    that had left `stage` (assembled, waiting) when the state was taken."""
    return states.get(replay, {}).get("queued", []) + states.get(stage, {}).get("queued", [])


def _pinned_batches(config: LoaderConfig) -> int:
    """Page-locked batch blocks for the last host buffer: prefetch + the batch
    being assembled + the consumer's + two in flight to the device (+ the
    batches held for batch echoing). Past that the pool uses pageable memory."""
    if not config.pin_memory:
        return 0
    count = config.prefetch + 4
    if config.echo_at == "batch" and config.augment is None:
        count += config.shuffle_buffer
    return count
