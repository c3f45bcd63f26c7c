"""The plan of a loader that echoes on the device (``echo_at="device"``): the
host part of the chain is the loader's own at echo 1 (every fresh example
read, transformed and batched once, nothing dropped: the device echo stage
decides what a short last batch is), and the device echo stage
(dataecho.pipeline.stages.device_echo) takes the delivery's place: it copies
the fresh batches to the device itself."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..config.echo import Echo
from ..config.loader_config import LoaderConfig
from .epoch_length import batches_per_epoch
from .stages.device_echo import DeviceEchoSpec
from .stages.lockstep import LockstepSpec

__all__ = ["device_plan"]

_UNRESUMABLE = ("saving a position mid-epoch with echo_at='device' needs deterministic=True (the device's "
                "buffer is named by position, which a deterministic order alone fixes)")


def device_plan(config: LoaderConfig, host_plan: Callable[[LoaderConfig], Any]) -> Any:
    """The plan of ``config`` (``echo_at="device"``), its host part made by ``host_plan``."""
    echo = config.echo
    host = dataclasses.replace(config, echo=Echo(1.0, "device", echo.max_echo, echo.gap), augment=None,
                               shuffle_buffer=2 * config.batch_size, shuffle_buffer_given=False)
    planned = host_plan(host)
    exact = planned.checkpoint == "exact"
    # Every fresh example reaches the device (drop_last is the device stage's), drawn at random from the
    # host's two batches (the device's buffer does the shuffling; in order only where the loader is: shuffle=False
    # at echo 1), and a state is exact or refused.
    intake = dataclasses.replace(planned.intake, drop_last=False, in_order=config.in_order,
                                 unresumable=None if exact else _UNRESUMABLE)
    spec = DeviceEchoSpec(device=config.device, capacity=config.shuffle_buffer, batch_size=config.batch_size,
                          echo_factor=echo.factor, max_echo=echo.max_echo, gap=echo.gap, exact=config.exact_echo,
                          drop_last=config.drop_last, augment=config.device_augment,
                          unresumable=None if exact else _UNRESUMABLE, paced=echo.auto and config.workers == 0,
                          in_order=config.in_order, inline=config.workers == 0)
    order = planned.source.order
    return dataclasses.replace(
        planned, intake=intake, device_echo=spec, delivery=None, checkpoint="exact" if exact else None,
        batches_per_epoch=lambda: batches_per_epoch(config, order),
        lockstep=LockstepSpec() if echo.auto and config.shard.world_size > 1 else None)
