"""The echo setting: how many times each example (or batch) is delivered, and
where. Decoded once from ``echo_factor``, ``echo_at`` and ``max_echo``; the
rest of the pipeline reads this value, never the raw ``float | "auto"``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _checks, _core

__all__ = ["Echo", "counts_at", "exact_deliveries"]


@dataclass(frozen=True)
class Echo:
    """Where and how much to echo.

    Attributes:
        factor: mean deliveries per example (or batch), >= 1; None for "auto":
            repeat only while the consumer would otherwise wait.
        at: ``"example"`` (the echo buffer repeats examples), ``"batch"``
            (whole batches are repeated) or ``"device"`` (examples are kept
            and repeated on the torch ``device``: dataecho.pipeline.stages.device_echo).
        max_echo: with "auto", the cap on deliveries per example (batch).
        gap: with "auto" per example, the fewest batches between two
            deliveries of an example.
    """

    factor: float | None
    at: str
    max_echo: float
    gap: int = 1

    @classmethod
    def of(cls, echo_factor: Any, echo_at: Any, max_echo: Any, echo_gap: Any = 1) -> Echo:
        """Validates EchoLoader's echo arguments.

        Raises:
            TypeError, ValueError: a bad argument, named in the message.
        """
        factor = _checks.echo_factor(echo_factor)
        at = _checks.choice("echo_at", echo_at, ("example", "batch", "device"))
        return cls(None if factor == "auto" else factor, at,
                   _checks.real("max_echo", max_echo, 1.0, _core.MAX_ECHO),
                   _checks.positive_int("echo_gap", echo_gap, 1 << 32))

    @property
    def auto(self) -> bool:
        return self.factor is None

    @property
    def per_example(self) -> bool:
        """Examples are repeated (on the host, or on the device), not whole batches."""
        return self.at in ("example", "device")

    @property
    def on_device(self) -> bool:
        """Examples are repeated on the device (``echo_at="device"``)."""
        return self.at == "device"

    @property
    def setting(self) -> float | str:
        """As given: the factor, or ``"auto"`` (how states and attributes show it)."""
        return "auto" if self.factor is None else self.factor

    @property
    def once(self) -> bool:
        """Every example is delivered exactly once: no echo at all."""
        return self.factor == 1

    @property
    def whole(self) -> bool:
        """A fixed whole factor: every example (batch) is delivered the same number of times."""
        return self.factor is not None and float(self.factor).is_integer()


def exact_deliveries(count: int, factor: float) -> int:
    """Deliveries of ``count`` items with exact echo counts: floor(e) each, and one
    more for floor(count * f) of them (f = e - floor(e))."""
    whole = math.floor(factor)
    return count * whole + math.floor(count * (factor - whole))


def counts_at(positions: np.ndarray, factor: float) -> np.ndarray:
    """Deliveries of the examples at ``positions`` of an order with exact echo
    counts (the native ``EchoCounts::by_seq``): floor(e), and one more for
    exactly floor(n * f) of the first n positions."""
    whole = math.floor(factor)
    fraction = factor - whole
    positions = np.asarray(positions, dtype=np.float64)
    return (whole + np.floor((positions + 1) * fraction) - np.floor(positions * fraction)).astype(np.int64)
