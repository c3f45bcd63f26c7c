"""``EchoLoader.stats()``: counters over every epoch and for the current one, as
nested dicts or flat for a metrics logger, and one INFO line per epoch on the
``dataecho`` logger (standard :mod:`logging`; silent unless configured)."""

from __future__ import annotations

import logging
from typing import Any

from ...reading.sampled import LazyOrder
from .repetition import Seen

__all__ = ["Totals", "logger"]

logger = logging.getLogger("dataecho")
logger.addHandler(logging.NullHandler())  # a library prints nothing unless asked

_SUMMED = ("fresh", "delivered", "distinct", "batches", "fresh_batches", "delivered_batches", "augmented", "wait_s",
           "active_s", "lockstep_repeats", "lockstep_wait_s")


def _figures(counters: dict[str, float]) -> dict[str, Any]:
    """Counts and the rates derived from them (see Totals.stats)."""
    active, fresh = counters["active_s"], counters["fresh"]
    return {
        "fresh": fresh,
        "delivered": counters["delivered"],
        "batches": counters["batches"],
        "fresh_batches": counters["fresh_batches"],
        "delivered_batches": counters["delivered_batches"],
        "augmented": counters["augmented"],
        "lockstep_repeats": counters["lockstep_repeats"],
        "lockstep_wait_s": counters["lockstep_wait_s"],
        "seconds": active,
        "distinct": counters["distinct"],
        "echo_factor_achieved": counters["delivered"] / counters["distinct"] if counters["distinct"] else 0.0,
        "upstream_examples_per_s": fresh / active if active > 0 else 0.0,
        "consumer_wait_fraction": counters["wait_s"] / active if active > 0 else 0.0,
    }


class Totals:
    """The counters of the epochs that have ended, and the last epoch's own."""

    def __init__(self) -> None:
        self._sums = dict.fromkeys(_SUMMED, 0)
        self._last: dict[str, Any] | None = None  # the last ended epoch's counters
        self._workers: list[dict[str, float]] = []
        self._ended = {"complete": 0, "stopped": 0, "failed": 0}
        self._seen = Seen()

    def add(self, counters: dict[str, Any], workers: list[dict[str, float]]) -> None:
        """An epoch has ended with these counters (see Epoch.counters), and is logged."""
        for key in _SUMMED:
            self._sums[key] += counters[key]
        self._last, self._workers = counters, workers
        self._ended[counters["state"]] += 1
        ledger, source = counters["ledger"]
        if ledger.distinct:
            order = None if source is None else source.order
            self._seen.add(ledger, order.read if isinstance(order, LazyOrder) else order, ledger.extent())
        if logger.isEnabledFor(logging.INFO):
            figures = {**_figures(counters), "repetition": counters["repetition"]}
            logger.info(epoch_line(counters["epoch"], counters["state"], figures),
                        extra={"dataecho": flatten({"epoch": counters["epoch"], **figures}, "dataecho/epoch/")})

    def stats(self, current: Any, epoch: int, flat: bool = False, prefix: str = "dataecho/") -> dict[str, Any]:
        """The totals, with the running epoch's (``current``, or None); ``epoch``: the current or last one's number.

        Returns:
            fresh: examples read from the source and put in the echo buffer;
            delivered: examples in the batches yielded (repeats counted);
            batches, seconds (of iteration);
            fresh_batches, delivered_batches: with ``echo_at="batch"``, the
            batches batch echoing took from the echo buffer, and those it
            yielded (repeats counted); 0 otherwise;
            augmented: examples handed to ``augment`` or ``device_augment`` (every repeat; 0 without);
            lockstep_repeats, lockstep_wait_s: with ``echo_factor="auto"`` on
            several ranks, the batches this rank repeated once its shard was
            delivered, while other ranks finished theirs, and the seconds its
            consumer spent in the ranks' agreement (dataecho.pipeline.stages.lockstep);
            distinct: examples delivered at least once (summed over epochs);
            echo_factor_achieved: delivered / distinct: the mean number of
            times an example delivered was delivered (at least 1; examples
            read ahead and never delivered do not lower it);
            upstream_examples_per_s: fresh examples per second of iteration;
            consumer_wait_fraction: share of iteration time spent waiting in next();
            epoch: the current (or last) epoch's number;
            repetition: deliveries per example of the dataset over the epochs
            that ended (dataecho.pipeline.progress.repetition, Seen.report);
            epochs: how many epochs ended: ``complete`` (read to the end),
            ``stopped`` (left early, closed, or ended by a later iter(loader):
            their read-ahead counts in fresh) and ``failed``;
            this_epoch: the same figures for the current epoch alone (or the
            last one, if none is running), with its ``epoch`` number and
            ``state``: "running", "complete", "stopped" or "failed", its
            ``repetition`` (deliveries per example, the distances between
            repeats: Ledger.report there), and
            ``memory``: the echo buffer's ``resident`` examples (``held``: in
            its slots, on their way in too), ``slot_bytes`` per example, and the
            bytes of ragged values held (``ragged_bytes_in_use``) out of its
            budget (``ragged_bytes``); None before the first; ``device_memory`` (``echo_at="device"``):
            examples ``resident`` there, ``rows``, ``bytes``, unspent budget ``evicted``;
            workers: for that epoch, per producer thread or process: examples
            produced and seconds busy reading and transforming (and a worker
            process's ``pid``).

            With ``flat=True``, one level of numbers under '/'-joined names
            beginning with ``prefix`` (``dataecho/this_epoch/fresh``,
            ``dataecho/workers/0/busy_s``), as a metrics logger takes them
            (``SummaryWriter.add_scalar`` per item, ``wandb.log``,
            Lightning's ``log_dict``); the epoch's state is a 0/1
            ``this_epoch/running``, and pids are left out.
        """
        sums, this, workers = dict(self._sums), self._last, self._workers
        if current is not None:
            this = current.counters()
            for key in _SUMMED:
                sums[key] += this[key]
            workers = current.worker_counters()
        stats = {**_figures(sums), "epoch": epoch, "epochs": dict(self._ended), "repetition": self._seen.report(),
                 "this_epoch": None if this is None else {"epoch": this["epoch"], "state": this["state"],
                                                          **_figures(this), "repetition": this["repetition"],
                                                          **{k: this.get(k) for k in ("memory", "device_memory")}},
                 "workers": workers}
        return flatten(stats, prefix) if flat else stats


def flatten(stats: dict[str, Any], prefix: str) -> dict[str, float]:
    """Nested stats as {prefix + 'a/b': number}: numbers only (see Totals.stats)."""
    flat: dict[str, float] = {}

    def visit(value: Any, name: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "state":
                    flat[f"{name}running"] = float(item == "running")
                elif key != "pid":
                    visit(item, f"{name}{key}/")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                visit(item, f"{name}{i}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name[:-1]] = value

    visit(stats, prefix if prefix.endswith("/") or not prefix else prefix + "/")
    return flat


def epoch_line(epoch: int, state: str, figures: dict[str, Any]) -> str:
    """The log line of an ended epoch (``figures``: its, with its ``repetition``)."""
    how = {"complete": "", "stopped": " (stopped early)", "failed": " (failed)"}[state]
    return (f"epoch {epoch}{how}: {figures['fresh']} fresh, {figures['delivered']} delivered examples "
            f"(echo factor {figures['echo_factor_achieved']:.2f}) in {figures['batches']} batches, "
            f"{figures['seconds']:.1f} s; input {figures['upstream_examples_per_s']:.0f} examples/s; "
            f"the loop waited {100 * figures['consumer_wait_fraction']:.1f}% of the time; "
            f"{repetition_line(figures['repetition'])}")


def repetition_line(repetition: dict[str, Any]) -> str:
    """An epoch's repetition report in words."""
    counts = ", ".join(f"{n} x{times}" for times, n in enumerate(repetition["deliveries"]) if n)
    line = f"examples delivered: {counts or 'none'} (at most {repetition['max']} times each)"
    if repetition["gap_min"] is None:
        return line + ", no repeats"
    return (line + f"; repeats at least {repetition['gap_min']} batches apart, "
            f"{repetition['gap_p05']} at the 5th percentile")
