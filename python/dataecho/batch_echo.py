"""Batch echoing: each upstream batch is yielded about ``e`` times, its repeats
spread out through a small shuffle buffer of batches so that they are not
consecutive.

Repeats share memory (no copy), so a batch that will be yielded more than once
is yielded as read-only views: an in-place change by the consumer cannot
corrupt a later repeat.

With exact echo counts the stage's state names its resident batches by their
rows, with their remaining deliveries, and the generator's state: a resumed
stage reads those rows again and picks exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .stage import Batch, Stage
from .structure import read_only

__all__ = ["BatchEchoStage"]


class _Entry:
    __slots__ = ("batch", "left", "deliveries")

    def __init__(self, batch: Batch, left: int, deliveries: int) -> None:
        self.batch = batch
        self.left = left
        self.deliveries = deliveries


class BatchEchoStage:
    """A shuffle buffer of batches with per-batch echo counts.

    Args:
        upstream: the stage whose batches are echoed.
        resident: batches held at once.
        echo_factor: mean deliveries per batch (``floor(e)`` or ``floor(e) + 1``),
            or None for "auto": a batch is repeated only when no fresh one is
            ready, at most about ``max_echo`` times in all.
        max_echo: the cap for "auto".
        seed: seeds the echo counts and picks.
        exact: the fractional part of the factor by batch number (exactly
            floor(n * f) of the first n batches get the extra delivery) instead
            of at random, so that the number of deliveries is known in advance;
            the stage can then be checkpointed.
        resume: this stage's state from a checkpoint, or None.
        read_batch: reads a batch again from its rows (for ``resume``).
    """

    name = "batch_echo"

    def __init__(self, upstream: Stage, resident: int, echo_factor: float | None, max_echo: float, seed: int,
                 exact: bool = False, resume: dict[str, Any] | None = None,
                 read_batch: Callable[[dict[str, np.ndarray]], Batch] | None = None) -> None:
        self._upstream = upstream
        self._resident = resident
        self._echo = echo_factor
        self._max_echo = max_echo
        self._rng = np.random.default_rng(seed)
        self._exact = exact
        self.unresumable = None if exact else "batch echoing with echo_factor='auto' depends on timing"
        self._entries: list[_Entry] = []
        self._last: _Entry | None = None
        self._upstream_done = False
        self.fresh_batches = 0
        self.delivered_batches = 0
        if resume is not None:
            self._restore(resume, read_batch)

    def next(self, timeout_s: float | None = None) -> Batch:
        """The next batch to yield; StopIteration at the end."""
        entry = self._next_auto() if self._echo is None else self._next_fixed()
        entry.left -= 1
        if entry.left == 0:
            self._entries.remove(entry)
        self._last = entry
        self.delivered_batches += 1
        return entry.batch

    def stop(self) -> None:
        pass  # no threads: the upstream's stop ends it

    def join(self, timeout_s: float) -> None:
        pass

    def counters(self) -> dict[str, Any]:
        return {"fresh_batches": self.fresh_batches, "delivered_batches": self.delivered_batches}

    def state(self) -> dict[str, Any] | None:
        if not self._exact:
            return None
        return {
            "entries": [{**e.batch.ids(), "left": e.left, "deliveries": e.deliveries} for e in self._entries],
            "last": next((i for i, e in enumerate(self._entries) if e is self._last), -1),
            "fresh_batches": self.fresh_batches,
            "delivered_batches": self.delivered_batches,
            "upstream_done": self._upstream_done,
            "rng": self._rng.bit_generator.state,
        }

    def _restore(self, state: dict[str, Any], read_batch: Callable[[dict[str, np.ndarray]], Batch]) -> None:
        for saved in state["entries"]:
            batch = read_batch({"rows": saved["rows"]})
            if saved["deliveries"] > 1:
                batch = Batch(batch.structure, read_only(batch.arrays), batch.rows)
            self._entries.append(_Entry(batch, saved["left"], saved["deliveries"]))
        self._last = self._entries[state["last"]] if state["last"] >= 0 else None
        self.fresh_batches = state["fresh_batches"]
        self.delivered_batches = state["delivered_batches"]
        self._upstream_done = state["upstream_done"]
        self._rng.bit_generator.state = state["rng"]

    # ---- fixed factor ----

    def _next_fixed(self) -> _Entry:
        # Hold at least two batches as soon as possible, so that a repeat never
        # follows its original; then grow by one per delivery up to `resident`.
        target = min(self._resident, 2 + self.delivered_batches)
        while not self._upstream_done and len(self._entries) < target:
            self._pull(timeout=None)
        if not self._entries:
            raise StopIteration
        return self._pick(lambda e: True)

    # ---- auto ----

    def _next_auto(self) -> _Entry:
        if not self._upstream_done:
            try:
                return self._pull(timeout=0.0)  # fresh first
            except TimeoutError:
                pass
        if self._upstream_done:
            # The input is over: no more repeats, as for example echoing.
            raise StopIteration
        if any(e.left > 0 for e in self._entries):
            return self._pick(lambda e: e.left > 0)  # the consumer would wait: repeat
        return self._pull(timeout=None)

    # ---- shared ----

    def _pull(self, timeout: float | None) -> _Entry:
        """Takes one upstream batch into the buffer and returns its entry."""
        try:
            batch = self._upstream.next(timeout)
        except StopIteration:
            self._upstream_done = True
            if self._echo is None or not self._entries:
                raise
            return self._entries[0]  # fixed: drain what is resident
        self.fresh_batches += 1
        deliveries = self._draw_count(self._echo if self._echo is not None else self._max_echo)
        if deliveries > 1:
            batch = Batch(batch.structure, read_only(batch.arrays), batch.rows)
        entry = _Entry(batch, deliveries, deliveries)
        if len(self._entries) >= self._resident:
            self._entries.pop(0)  # auto only: the oldest gives way
        self._entries.append(entry)
        return entry

    def _pick(self, eligible: Callable[[_Entry], bool]) -> _Entry:
        """A resident batch other than the last one yielded, chosen with odds
        proportional to its remaining deliveries: a uniform draw over the
        pending deliveries, which also empties the buffer evenly at the end."""
        choices = [e for e in self._entries if eligible(e) and e is not self._last]
        if not choices:
            choices = [e for e in self._entries if eligible(e)]
        weights = np.array([e.left for e in choices], dtype=np.float64)
        return choices[int(self._rng.choice(len(choices), p=weights / weights.sum()))]

    def _draw_count(self, factor: float) -> int:
        whole = math.floor(factor)
        if self._exact:
            n, f = self.fresh_batches - 1, factor - whole  # this batch's number
            return whole + math.floor((n + 1) * f) - math.floor(n * f)
        return whole + int(self._rng.random() < factor - whole)
