"""Echo on the device (``echo_at="device"``): each fresh example crosses to the
device once, is kept there in a buffer of ``shuffle_buffer`` rows
(dataecho.pipeline.stages.device_rows), and every batch is gathered there by
index, so that a repeat costs the host nothing but choosing its row, and the
link nothing but that row's index. A ``device_augment`` then runs on each
gathered batch with a generator on the device: every repeat is augmented anew,
on the device (echo before augmentation).

The choice of rows follows the host's echo buffer rules (shuffle_buffer.hpp)
on small host arrays, one entry per row:

- a fixed factor: each example is delivered ``floor(e)`` or ``floor(e) + 1``
  times (by its position, as the host's exact counts: ``exact``; else drawn);
  the buffer fills to a quarter before the first batch and grows by a batch
  per batch; a batch is drawn uniformly among the resident examples without
  repeating one (but where fewer than a batch remain, at the epoch's end);
- ``"auto"``: the examples not yet delivered first; where fewer than a batch
  are there and no fresh batch is ready, the least-delivered of those whose
  budget (``max_echo``) is not spent, delivered at least ``echo_gap`` batches
  ago; a full buffer gives way by its most-delivered examples.

Each batch's rows are then shuffled, and named by their positions (``rows``),
as the host's are: the delivery ledger, the repetition report and the ranks'
lockstep read them. The stage runs in the consumer's thread: fresh batches are
copied on a side stream a batch ahead of need (dataecho.pipeline.stages.device_fresh)
and written into their rows on the consumer's stream, as are the gathers.

Its state (exact checkpoints): the resident examples by position, with their
rows (slots), counts and arrival numbers, the batches delivered, the generator's state and
the fresh batch taken ahead (``pending``); a resumed stage reads them again,
copies them back to the device, and goes on choosing exactly as the
uninterrupted one would.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...config.echo import counts_at
from ...tensors.convert import import_torch
from .. import checkpoint
from .device_fresh import FreshBatches
from .device_rows import DeviceRows
from .stage import Batch, Stage

__all__ = ["DeviceEchoSpec", "DeviceEchoStage", "check_state"]


@dataclass(frozen=True)
class DeviceEchoSpec:
    """What the device echo stage needs (built by dataecho.pipeline.plan).

    Attributes:
        device: the torch device the examples are kept on.
        capacity: examples kept (``shuffle_buffer``); the buffer has a batch more rows.
        batch_size: rows per batch.
        echo_factor: mean deliveries per example, or None for "auto".
        max_echo, gap: "auto"'s budget per example, and fewest batches between two deliveries of one.
        exact: the fractional part by position (exact counts), not drawn.
        drop_last: a short last batch is dropped.
        augment: ``device_augment(batch, generator)``, or None.
        unresumable: why no state can be taken mid-epoch, or None.
        paced: "auto" read in the loop's thread (``num_workers=0``): a fresh batch is read only where
            the time the loop spent outside ``next()`` pays for it (as the host's paced reading).
        in_order: ``shuffle=False`` at echo 1: batches in reading order (the oldest first), as the host's.
        inline: the loop's thread reads (``num_workers=0``): no fresh batch is taken ahead of need.
    """

    device: Any
    capacity: int
    batch_size: int
    echo_factor: float | None
    max_echo: float
    gap: int
    exact: bool
    drop_last: bool
    augment: Callable[[Any, Any], Any] | None = None
    unresumable: str | None = None
    paced: bool = False
    in_order: bool = False
    inline: bool = False


class DeviceEchoStage:
    """Host batches of fresh examples in; echoed batches, on the device, out.

    Args:
        spec: the stage's settings.
        upstream: the stage whose (fresh, host) batches are kept.
        seed: the draws' seed; ``augment_seed`` keys each batch's device generator.
        resume: this stage's state from a checkpoint, or None.
        read_batch: reads examples again from their positions (for ``resume``).
        backend: the device copies' backend (dataecho.pipeline.stages.device_copy), None: the device's.
    """

    name = "device_echo"

    def __init__(self, spec: DeviceEchoSpec, upstream: Stage, seed: int, augment_seed: int,
                 resume: dict[str, Any] | None = None,
                 read_batch: Callable[[dict[str, np.ndarray]], Batch] | None = None, backend: Any = None) -> None:
        self._spec, self._augment_seed = spec, augment_seed
        self.unresumable = spec.unresumable
        # Read ahead where readers do: the loop's thread would read the next batch itself (num_workers=0).
        self._fresh = FreshBatches(spec.device, upstream, not spec.inline, self._check,
                                   resume["pending"] if resume else None, read_batch, backend)
        self._lock = threading.Lock()  # around the rows: join() may come from another thread
        slots = spec.capacity + spec.batch_size  # a fresh batch always has rows to go to
        self._rows: DeviceRows | None = None  # made with the first batch, which tells the leaves
        self._structure: Any = None
        self._left = np.zeros(slots, np.int64)  # deliveries still owed (budget left, "auto"); 0: a free row
        self._times = np.zeros(slots, np.int64)  # deliveries so far
        self._last = np.full(slots, -1, np.int64)  # the batch of the last delivery
        self._arrival = np.zeros(slots, np.int64)  # fresh number: in order, the oldest first
        self._position = np.zeros(slots, np.uint64)
        self._rng = np.random.default_rng(seed)
        self._done = self._stopped = False
        self._credit = self._burst_s = 0.0  # paced: seconds of steps less those of reading; the longest read
        self._returned: float | None = None  # when the last batch was handed out
        self.fresh = self.batches = self.evicted = self.augmented = 0
        if resume is not None:
            self._restore(resume, read_batch)

    # ---- batches ----

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._stopped:
            raise StopIteration
        if self._returned is not None:  # paced: the step just taken pays for reading (a burst ahead at most)
            self._credit = min(self._credit + time.perf_counter() - self._returned, self._burst_s)
        chosen = self._choose_auto(timeout_s) if self._spec.echo_factor is None else self._choose_fixed(timeout_s)
        if not self._spec.in_order:
            chosen = chosen[self._rng.permutation(len(chosen))]
        with self._lock:
            if self._rows is None or self._stopped:
                raise StopIteration
            leaves = self._rows.gather(chosen)
        positions = self._position[chosen]
        np.add.at(self._times, chosen, 1)  # a row twice in a batch (the epoch's end) counts twice
        self._last[chosen] = self.batches
        np.subtract.at(self._left, chosen, 1)  # 0: the row is free (the gather above is queued before any write)
        self.batches += 1
        self._fresh.ahead()  # the next fresh batch's copy runs while the loop steps
        if self._spec.augment is not None:
            leaves = _augmented(self._spec.augment, self._structure, leaves, self._augment_seed, self.batches - 1)
            self.augmented += len(positions)
        self._returned = time.perf_counter()
        return Batch(self._structure, tuple(leaves), positions)

    def _choose_fixed(self, timeout_s: float | None) -> np.ndarray:
        spec, size = self._spec, self._spec.batch_size
        initial = min(spec.capacity, max(spec.capacity // 4, size))
        target = min(spec.capacity, initial + self.batches * size)
        while not self._done and np.count_nonzero(self._left) < target:
            self._pull(timeout_s)
        owed = int(self._left.sum())
        rows = size if not self._done else min(size, owed)
        if rows == 0 or (rows < size and spec.drop_last):
            raise StopIteration
        picks, left = [], self._left.copy()
        while rows:  # a round over every resident example before any repeats in the batch (epoch's end only)
            # Draws index the rows in row order: a resumed stage puts each example back in its row (slots).
            eligible = np.flatnonzero(left > 0)
            if spec.in_order:  # the oldest first
                eligible = eligible[np.argsort(self._arrival[eligible], kind="stable")]
            count = min(rows, len(eligible))
            drawn = np.arange(count) if spec.in_order else self._rng.choice(len(eligible), count, replace=False)
            taken = eligible[drawn]
            left[taken] -= 1
            picks.append(taken)
            rows -= len(taken)
        return np.concatenate(picks)

    def _choose_auto(self, timeout_s: float | None) -> np.ndarray:
        spec, size = self._spec, self._spec.batch_size
        while not self._done and self.batches == 0 and np.count_nonzero(self._left) < 2 * size:
            self._pull(timeout_s)  # the first batch: as soon as two batches are in
        while not self._done and self._undelivered().size < size and self._fresh_now():
            pass
        while True:
            fresh = self._undelivered()
            chosen = fresh[self._rng.choice(len(fresh), size, replace=False)] if len(fresh) > size else fresh
            if self._done:  # the input is over: no more repeats
                if len(chosen) == 0 or (len(chosen) < size and spec.drop_last):
                    raise StopIteration
                return chosen
            repeats = self._repeatable()[:size - len(chosen)]
            if len(chosen) + len(repeats) == size:
                return np.concatenate([chosen, repeats])
            self._pull(timeout_s)  # nothing more to repeat: wait for fresh examples

    def _fresh_now(self) -> bool:
        """Takes a fresh batch in without making the step wait: one ready now
        (readers read ahead), or paced, one read while the steps have paid for
        the reading so far, give or take one burst (the intake reads until its
        buffer is full: several batches at once, then none): over time the
        loop's thread reads for as long as it steps, and repeats fill the rest."""
        if not self._spec.paced:
            return self._pull(0.0)
        if self._credit < -self._burst_s:
            return False
        started = time.perf_counter()
        pulled = self._pull(None)
        spent = time.perf_counter() - started
        self._burst_s = max(spent, 0.9 * self._burst_s)  # the longest recent read, forgotten slowly
        self._credit -= spent
        return pulled

    def _undelivered(self) -> np.ndarray:
        return np.flatnonzero((self._left > 0) & (self._times == 0))

    def _repeatable(self) -> np.ndarray:
        """Delivered examples with budget left, delivered ``gap`` batches ago or more:
        the least-delivered first, ties at random."""
        rows = np.flatnonzero((self._left > 0) & (self._times > 0) & (self._last <= self.batches - self._spec.gap))
        return rows[np.lexsort((self._rng.random(len(rows)), self._times[rows]))]

    # ---- fresh examples ----

    def _pull(self, timeout_s: float | None) -> bool:
        """Takes one fresh batch in; False at the input's end, or with
        ``timeout_s=0`` where none is ready."""
        try:
            taken = self._fresh.take(timeout_s)
        except TimeoutError:
            if timeout_s == 0.0:
                return False
            raise
        if taken is None:
            self._done = True
            return False
        batch, device = taken
        self._take_in(batch, device, self._counts(batch))
        return True

    def _check(self, batch: Batch) -> None:
        """A fresh batch, before its copy: the first tells the leaves; a leaf that cannot be kept is refused."""
        with self._lock:
            if self._stopped:
                raise StopIteration
            if self._rows is None:
                self._structure = batch.structure
                self._rows = DeviceRows(self._spec.device, len(self._left), batch.structure.paths)
            self._rows.check_host(batch.arrays)

    def _counts(self, batch: Batch) -> np.ndarray:
        """Deliveries owed (budget, with "auto") to each example of a fresh batch."""
        spec = self._spec
        if spec.exact and spec.echo_factor is not None:  # by position: exactly floor(n * f) extra of n
            return counts_at(batch.rows, spec.echo_factor)
        factor = spec.echo_factor if spec.echo_factor is not None else spec.max_echo
        whole = math.floor(factor)
        return whole + (self._rng.random(len(batch.rows)) < factor - whole).astype(np.int64)

    def _take_in(self, batch: Batch, device: list[Any], counts: np.ndarray, saved: dict[str, Any] | None = None
                 ) -> None:
        """Writes a fresh batch (its rows: positions; its leaves on the device) into the first free rows, owed
        ``counts``; restored (``saved``: its slots, arrival numbers, times and last batches), into its own."""
        n = len(batch.rows)
        if n == 0:
            return
        with self._lock:
            if self._stopped:
                raise StopIteration
            if self._spec.echo_factor is None:
                self._make_room(n)
            free = np.flatnonzero(self._left == 0)[:n] if saved is None else saved["slots"]
            self._rows.write(free, device)
        self._left[free] = counts
        self._times[free] = 0 if saved is None else saved["times"]
        self._last[free] = -1 if saved is None else saved["last"]
        self._arrival[free] = self.fresh + np.arange(n) if saved is None else saved["arrival"]
        self._position[free] = np.asarray(batch.rows, dtype=np.uint64)
        self.fresh = max(self.fresh, int(self._arrival[free].max()) + 1)

    def _make_room(self, n: int) -> None:
        """"auto": a full buffer gives way to ``n`` fresh examples by its
        most-delivered ones (the oldest among equals); their unspent budget is counted evicted."""
        over = np.count_nonzero(self._left) + n - self._spec.capacity
        if over <= 0:
            return
        delivered = np.flatnonzero((self._left > 0) & (self._times > 0))
        out = delivered[np.lexsort((self._arrival[delivered], -self._times[delivered]))][:over]
        self.evicted += int(self._left[out].sum())
        self._left[out] = 0

    # ---- the stage's life ----

    def stop(self) -> None:
        self._stopped = True  # no threads: the next call ends

    def join(self, timeout_s: float) -> None:
        """Waits for the copies in flight and gives the device memory back.

        Never raises: a failure (the device failed, as after a CUDA error in
        the training step) is a RuntimeWarning; the loop has seen its cause.
        """
        with self._lock:
            self._stopped = True
            try:
                self._fresh.close()
            except Exception as exc:  # noqa: BLE001 - reported; the other stages still join
                warnings.warn(f"EchoLoader: closing the device echo's copies: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=2)
            finally:
                if self._rows is not None:
                    self._rows.release()

    def counters(self) -> dict[str, Any]:
        memory = {"resident": int(np.count_nonzero(self._left)), "rows": len(self._left),
                  "bytes": self._rows.nbytes if self._rows is not None else 0, "evicted": self.evicted}
        return {"device_memory": memory, "augmented": self.augmented}

    def state(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        if self.unresumable is not None:
            return None
        rows = np.flatnonzero(self._left)
        return {"positions": self._position[rows].copy(), "slots": rows.astype(np.uint32),
                "left": self._left[rows].astype(np.uint32),
                "times": self._times[rows].astype(np.uint32), "last": self._last[rows].copy(),
                "arrival": self._arrival[rows].astype(np.uint64), "fresh": self.fresh, "batches": self.batches,
                "evicted": self.evicted, "upstream_done": self._done, "rng": self._rng.bit_generator.state,
                "pending": self._fresh.saved()}

    def _restore(self, state: dict[str, Any], read_batch: Callable[[dict[str, np.ndarray]], Batch]) -> None:
        self.batches, self.evicted, self._done = state["batches"], state["evicted"], state["upstream_done"]
        positions, size = state["positions"], self._spec.batch_size
        for start in range(0, len(positions), size):  # a batch at a time, through the same copies
            part = slice(start, start + size)
            batch = read_batch({"rows": positions[part]})
            saved = {key: state[key][part].astype(np.int64) for key in ("slots", "arrival", "times", "last")}
            self._take_in(batch, self._fresh.copy(batch), state["left"][part].astype(np.int64), saved)
        self.fresh = state["fresh"]
        self._rng.bit_generator.state = state["rng"]


def _augmented(augment: Callable[[Any, Any], Any], structure: Any, leaves: list[Any], seed: int,
               batch: int) -> list[Any]:
    """``device_augment`` on a batch's leaves, with a device generator keyed by (seed, epoch, rank: ``seed``) and
    the batch's number, so that a batch's augmentation follows from the seed and the batch alone (and resumes)."""
    torch = import_torch()
    generator = torch.Generator(device=leaves[0].device)
    key = np.random.SeedSequence([seed, batch]).generate_state(1, np.uint64)[0]
    generator.manual_seed(int(key) >> 1)
    found = structure.flatten(augment(structure.unflatten(leaves), generator), "device_augment", keep=True)
    for leaf, path in zip(found, structure.paths):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"device_augment: expected a tensor at {path or 'the top'!r}, got {type(leaf).__name__}")
    return found


def check_state(spec: DeviceEchoSpec, state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    """This stage's saved state, checked against the epoch's order and normalized.

    Raises:
        ValueError: a state this stage could not have saved, naming the key.
    """
    positions = checkpoint.array_at(state, "positions", np.uint64, where)
    if len(positions) > spec.capacity + spec.batch_size or (len(positions) and positions.max() >= len(order)):
        raise ValueError(f"{where}['positions']: more than the buffer holds, or beyond the epoch's order")
    arrays = {key: checkpoint.array_at(state, key, dtype, where)
              for key, dtype in (("slots", np.uint32), ("left", np.uint32), ("times", np.uint32),
                                 ("arrival", np.uint64))}
    slots = arrays["slots"]
    if len(np.unique(slots)) != len(slots) or (len(slots) and slots.max() >= spec.capacity + spec.batch_size):
        raise ValueError(f"{where}['slots']: a row twice, or beyond the buffer's {spec.capacity + spec.batch_size}")
    last = np.asarray(state.get("last"))
    if last.ndim != 1 or not np.issubdtype(last.dtype, np.integer) or (last.size and last.min() < -1):
        raise ValueError(f"{where}['last']: expected a 1-d integer array of batch numbers (-1: none)")
    if any(len(a) != len(positions) for a in (*arrays.values(), last)) or (len(positions) and arrays["left"].min() < 1):
        raise ValueError(f"{where}: positions, slots, left, times, last and arrival differ in length, "
                         f"or a left below 1")
    if not isinstance(state.get("rng"), dict):
        raise ValueError(f"{where}['rng']: expected a generator state (a dict)")
    return {"positions": positions, **arrays, "last": last.astype(np.int64), "rng": state["rng"],
            "pending": checkpoint.batches_at(state, "pending", order, where),
            **{key: checkpoint.int_at(state, key, where) for key in ("fresh", "batches", "evicted")},
            "upstream_done": checkpoint.bool_at(state, "upstream_done", where)}
