"""Batch echoing: each upstream batch is yielded about ``e`` times, its repeats
spread out through a small shuffle buffer of batches so that they are not
consecutive. A short batch (the epoch's last, without ``drop_last``) and its
repeats come after every full batch, as ``DataLoader`` yields it last: a batch
of one mid-epoch would upset batch norm and static shapes. Batches of a
``batch_sampler`` have no fixed size: every one counts as full, and they are
echoed whole.

A batch yielded more than once must not let an in-place change by the
consumer reach a later delivery. With NumPy output its deliveries share memory
as read-only views (a write raises). torch has no read-only tensors, so with
``copy_repeats`` every delivery but the last is a copy, and the last gets the
original memory: each tensor yielded can be modified in place. Whether a
batch's leaves become tensors is read from its structure, which the chain may
learn only from its first batch.

With exact echo counts the stage's state names its resident batches by their
rows (``entries``: ``rows``, deliveries ``left`` of ``deliveries``), the last
one yielded, its counters and its generator's state: a resumed stage reads
those rows again and picks exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...examples.leaves import read_only
from .. import checkpoint
from .stage import Batch, Stage

__all__ = ["BatchEchoSpec", "BatchEchoStage", "check_state"]


@dataclass(frozen=True)
class BatchEchoSpec:
    """What batch echoing needs (built by dataecho.pipeline.plan).

    Attributes:
        resident: batches held at once.
        batch_size: rows of a full batch; None: no fixed size (a batch
            sampler's batches), every batch is full.
        echo_factor: mean deliveries per batch (``floor(e)`` or ``floor(e) + 1``),
            or None for "auto": a batch is repeated only when no fresh one is
            ready, at most about ``max_echo`` times in all.
        max_echo: the cap for "auto".
        exact: the fractional part of the factor by batch number (exactly
            floor(n * f) of the first n batches get the extra delivery) instead
            of at random, so that the number of deliveries is known in advance;
            the stage can then be checkpointed.
        writable_output: the output's values cannot be made read-only (torch
            tensors: dataecho.examples.outputs.Output.read_only).
        views_batch_memory: what is handed out views the upstream's batch
            memory (no augment, no device copy): with tensors (torch output,
            or leaves of a dtype NumPy lacks), repeats are copies (see above).
    """

    resident: int
    batch_size: int | None
    echo_factor: float | None
    max_echo: float
    exact: bool
    writable_output: bool = False
    views_batch_memory: bool = False


class _Entry:
    __slots__ = ("batch", "left", "deliveries")

    def __init__(self, batch: Batch, left: int, deliveries: int) -> None:
        self.batch = batch
        self.left = left
        self.deliveries = deliveries


class BatchEchoStage:
    """A shuffle buffer of batches with per-batch echo counts.

    Args:
        spec: the stage's settings.
        upstream: the stage whose batches are echoed.
        seed: seeds the echo counts and picks.
        copy_repeats: copies a batch's arrays, or None: where a batch's leaves
            become tensors (see above), deliver copies (and the original last)
            instead of read-only views of one batch.
        resume: this stage's state from a checkpoint, or None.
        read_batch: reads a batch again from its rows (for ``resume``).
    """

    name = "batch_echo"

    def __init__(self, spec: BatchEchoSpec, upstream: Stage, seed: int,
                 copy_repeats: Callable[[tuple], tuple] | None = None, resume: dict[str, Any] | None = None,
                 read_batch: Callable[[dict[str, np.ndarray]], Batch] | None = None) -> None:
        self._upstream = upstream
        self._copy_repeats = copy_repeats
        self._writable_output = spec.writable_output
        self._resident = spec.resident
        self._batch_size = spec.batch_size
        self._echo = spec.echo_factor
        self._max_echo = spec.max_echo
        self._rng = np.random.default_rng(seed)
        self._exact = spec.exact
        self.unresumable = None if spec.exact else "batch echoing with echo_factor='auto' depends on timing"
        self._entries: list[_Entry] = []
        self._last: _Entry | None = None
        self._upstream_done = False
        self._short_came = False  # auto: a short batch was taken in (no repeat may follow it)
        self.fresh_batches = 0
        self.delivered_batches = 0
        if resume is not None:
            self._restore(resume, read_batch)

    def next(self, timeout_s: float | None = None) -> Batch:
        """The next batch to yield; StopIteration at the end."""
        entry = self._next_auto() if self._echo is None else self._next_fixed(timeout_s)
        entry.left -= 1
        if entry.left == 0:
            self._entries.remove(entry)
        self._last = entry
        self.delivered_batches += 1
        return self._delivery(entry)

    def _delivery(self, entry: _Entry) -> Batch:
        """What one delivery of `entry` hands on: the batch itself when it is
        delivered once; else read-only views, or copies but for the last."""
        batch = entry.batch
        copy = self._copy_repeats
        if copy is not None and not (self._writable_output or any(batch.structure.torch_dtypes)):
            copy = None  # no tensors (bfloat16 leaves are): read-only views serve
        if entry.deliveries == 1 or (copy is not None and entry.left == 0):
            return batch
        return Batch(batch.structure, copy(batch.arrays) if copy is not None else read_only(batch.arrays), batch.rows)

    def stop(self) -> None:
        pass  # no threads: the upstream's stop ends it

    def join(self, timeout_s: float) -> None:
        pass

    def counters(self) -> dict[str, Any]:
        return {"fresh_batches": self.fresh_batches, "delivered_batches": self.delivered_batches}

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
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
            self._entries.append(_Entry(batch, saved["left"], saved["deliveries"]))
        self._last = self._entries[state["last"]] if state["last"] >= 0 else None
        self.fresh_batches = state["fresh_batches"]
        self.delivered_batches = state["delivered_batches"]
        self._upstream_done = state["upstream_done"]
        self._rng.bit_generator.state = state["rng"]

    # ---- fixed factor ----

    def _next_fixed(self, timeout_s: float | None) -> _Entry:
        # Hold at least two batches as soon as possible, so that a repeat never
        # follows its original; then grow by one per delivery up to `resident`.
        target = min(self._resident, 2 + self.delivered_batches)
        while not self._upstream_done and len(self._entries) < target:
            self._pull(timeout=timeout_s)
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
        # The consumer would wait: repeat a full batch, unless the short one
        # (the upstream's last) has come: nothing may follow it but the end.
        if not self._short_came and any(e.left > 0 and self._full(e.batch) for e in self._entries):
            return self._pick(lambda e: e.left > 0)
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
        self._short_came = self._short_came or not self._full(batch)
        deliveries = self._draw_count(self._echo if self._echo is not None else self._max_echo)
        entry = _Entry(batch, deliveries, deliveries)
        if len(self._entries) >= self._resident:
            self._entries.pop(0)  # auto only: the oldest gives way
        self._entries.append(entry)
        return entry

    def _full(self, batch: Batch) -> bool:
        """A batch of the full size (every batch, where there is no fixed size)."""
        return self._batch_size is None or len(batch) == self._batch_size

    def _pick(self, eligible: Callable[[_Entry], bool]) -> _Entry:
        """A resident batch other than the last one yielded, chosen with odds
        proportional to its remaining deliveries: a uniform draw over the
        pending deliveries, which also empties the buffer evenly at the end.
        A full batch is chosen while there is one: short batches go last."""
        pool = [e for e in self._entries if eligible(e)]
        pool = [e for e in pool if self._full(e.batch)] or pool
        choices = [e for e in pool if e is not self._last] or pool
        weights = np.array([e.left for e in choices], dtype=np.float64)
        return choices[int(self._rng.choice(len(choices), p=weights / weights.sum()))]

    def _draw_count(self, factor: float) -> int:
        whole = math.floor(factor)
        if self._exact:
            n, f = self.fresh_batches - 1, factor - whole  # this batch's number
            return whole + math.floor((n + 1) * f) - math.floor(n * f)
        return whole + int(self._rng.random() < factor - whole)


def check_state(spec: BatchEchoSpec, state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    """This stage's saved state, checked against the epoch's order and normalized.

    Raises:
        ValueError: a state this stage could not have saved, naming the key.
    """
    entries = state.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{where}['entries']: expected a list")
    checked_entries = []
    for i, entry in enumerate(entries):
        at = f"{where}['entries'][{i}]"
        ids = checkpoint.ids_of(checkpoint.mapping(entry, at), order, at)
        left, deliveries = checkpoint.int_at(entry, "left", at), checkpoint.int_at(entry, "deliveries", at)
        most = math.ceil(spec.echo_factor if spec.echo_factor is not None else spec.max_echo)
        if not 1 <= left <= deliveries <= most:
            raise ValueError(f"{at}: expected 1 <= left <= deliveries <= {most}, got {left} and {deliveries}")
        checked_entries.append({**ids, "left": left, "deliveries": deliveries})
    last = state.get("last")
    if not isinstance(last, (int, np.integer)) or isinstance(last, bool) or not -1 <= last < len(entries):
        raise ValueError(f"{where}['last']: expected an index of entries or -1, got {last!r}")
    rng = state.get("rng")
    if not isinstance(rng, dict):
        raise ValueError(f"{where}['rng']: expected a generator state (a dict)")
    return {
        "entries": checked_entries, "last": int(last), "rng": rng,
        "fresh_batches": checkpoint.int_at(state, "fresh_batches", where),
        "delivered_batches": checkpoint.int_at(state, "delivered_batches", where),
        "upstream_done": checkpoint.bool_at(state, "upstream_done", where),
    }
