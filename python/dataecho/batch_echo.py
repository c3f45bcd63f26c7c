"""Batch echoing: each upstream batch is yielded about ``e`` times, its repeats
spread out through a small shuffle buffer of batches so that they are not
consecutive.

Repeats share memory (no copy), so a batch that will be yielded more than once
is yielded as read-only views: an in-place change by the consumer cannot
corrupt a later repeat.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from .structure import read_only

__all__ = ["BatchEcho"]

Arrays = tuple[np.ndarray, ...]


class _Entry:
    __slots__ = ("arrays", "left")

    def __init__(self, arrays: Arrays, left: int) -> None:
        self.arrays = arrays
        self.left = left


class BatchEcho:
    """A shuffle buffer of batches with per-batch echo counts.

    Args:
        upstream: ``upstream(timeout)`` returns the next batch (one array per
            field), raises StopIteration at the end and TimeoutError when
            ``timeout`` passes first.
        resident: batches held at once.
        echo_factor: mean deliveries per batch (``floor(e)`` or ``floor(e) + 1``),
            or None for "auto": a batch is repeated only when no fresh one is
            ready, at most about ``max_echo`` times in all.
        max_echo: the cap for "auto".
        rng: draws echo counts and picks.
        exact: the fractional part of the factor by batch number (exactly
            floor(n * f) of the first n batches get the extra delivery) instead
            of at random, so that the number of deliveries is known in advance.
    """

    def __init__(
        self,
        upstream: Callable[[float | None], Arrays],
        resident: int,
        echo_factor: float | None,
        max_echo: float,
        rng: np.random.Generator,
        exact: bool = False,
    ) -> None:
        self._upstream = upstream
        self._resident = resident
        self._echo = echo_factor
        self._max_echo = max_echo
        self._rng = rng
        self._exact = exact
        self._entries: list[_Entry] = []
        self._last: _Entry | None = None
        self._upstream_done = False
        self._delivered = 0
        self.fresh_batches = 0
        self.delivered_batches = 0

    def next_batch(self, timeout: float | None = None) -> Arrays:
        """The next batch to yield; StopIteration at the end."""
        entry = self._next_auto() if self._echo is None else self._next_fixed()
        entry.left -= 1
        if entry.left == 0:
            self._entries.remove(entry)
        self._last = entry
        self.delivered_batches += 1
        return entry.arrays

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
            arrays = self._upstream(timeout)
        except StopIteration:
            self._upstream_done = True
            if self._echo is None or not self._entries:
                raise
            return self._entries[0]  # fixed: drain what is resident
        self.fresh_batches += 1
        deliveries = self._draw_count(self._echo if self._echo is not None else self._max_echo)
        if deliveries > 1:
            arrays = read_only(arrays)
        entry = _Entry(arrays, deliveries)
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
