"""``EchoLoader.stats()``: counters summed over epochs."""

from __future__ import annotations

from typing import Any

__all__ = ["Totals"]

_SUMMED = ("fresh", "delivered", "batches", "wait_s", "active_s")


class Totals:
    """The counters of the epochs that have ended, and the last epoch's workers."""

    def __init__(self) -> None:
        self._sums = dict.fromkeys(_SUMMED, 0)
        self._workers: list[dict[str, float]] = []

    def add(self, counters: dict[str, float], workers: list[dict[str, float]]) -> None:
        """An epoch has ended with these counters (see Epoch.counters)."""
        for key in _SUMMED:
            self._sums[key] += counters[key]
        self._workers = workers

    def stats(self, current: Any, epoch: int) -> dict[str, Any]:
        """The totals, with the running epoch's counters (``current``, or None)
        added; ``epoch`` is the number of the current or last epoch.

        Returns:
            fresh: examples read from the source and put in the echo buffer;
            delivered: examples in the batches yielded (repeats counted);
            echo_factor_achieved: delivered / fresh;
            upstream_examples_per_s: fresh examples per second of iteration;
            consumer_wait_fraction: share of iteration time spent waiting in next();
            batches, epoch;
            workers: for the current (or last) epoch, per producer thread or
            process: examples produced and seconds busy reading and transforming
            (and a worker process's ``pid``).
        """
        sums, workers = dict(self._sums), self._workers
        if current is not None:
            for key, value in current.counters().items():
                sums[key] += value
            workers = current.worker_counters()
        active = sums["active_s"]
        return {
            "fresh": sums["fresh"],
            "delivered": sums["delivered"],
            "batches": sums["batches"],
            "echo_factor_achieved": sums["delivered"] / sums["fresh"] if sums["fresh"] else 0.0,
            "upstream_examples_per_s": sums["fresh"] / active if active > 0 else 0.0,
            "consumer_wait_fraction": sums["wait_s"] / active if active > 0 else 0.0,
            "epoch": epoch,
            "workers": workers,
        }
