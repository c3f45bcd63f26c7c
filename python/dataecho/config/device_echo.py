"""Checks of echo on the device (``echo_at="device"``) and of
``device_augment``, against the rest of a loader's configuration
(dataecho.pipeline.stages.device_echo says what the stage does)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .dataloader import check_callable

__all__ = ["check_device_echo"]


def check_device_echo(config: Any, device_augment: Any) -> Any:
    """``config`` (a LoaderConfig) with ``device_augment``, checked.

    Raises:
        TypeError, ValueError: an argument that does not go with ``echo_at="device"``, named.
    """
    device_augment = check_callable("device_augment", device_augment)
    if not config.echo.on_device:
        if device_augment is not None:
            raise ValueError("device_augment: augments the batches echo_at='device' gathers on the device; give "
                             "echo_at='device' (and device=), or augment per example on the host with augment=")
        return config
    if config.device is None:
        raise ValueError("echo_at: 'device' keeps the examples on a torch device; give device= (a 'cuda' device, "
                         "or 'cpu')")
    if config.batch_sampler is not None:
        raise ValueError("echo_at: 'device' forms new batches of repeated examples, which would break "
                         "batch_sampler's batches; echo them whole with echo_at='batch'")
    if config.augment is not None:
        raise ValueError("augment: runs per example on the host, before the device's echo, so its repeats would "
                         "be the same; with echo_at='device' give device_augment=(batch, generator), which runs "
                         "on every batch on the device")
    if config.ragged or config.padding is not None:
        raise ValueError("ragged: echo_at='device' keeps examples as fixed-shape rows on the device; echo "
                         "leaves of varying length on the host (echo_at='example')")
    if config.shuffle_buffer < 2 * config.batch_size:
        raise ValueError(f"shuffle_buffer: with echo_at='device', expected at least 2 * batch_size = "
                         f"{2 * config.batch_size} examples on the device, got {config.shuffle_buffer}")
    return dataclasses.replace(config, device_augment=device_augment)
