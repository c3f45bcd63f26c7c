"""What repetition did to the data: the repetition report of ``EchoLoader.stats()``.

Every batch handed to the training loop is entered in the epoch's delivery
ledger (``_core.DeliveryLedger``) by the positions of its rows in the epoch's
reading order, as the stages carry them. From it, per epoch: how many examples
were delivered 0, 1, 2, ... times, the mean and spread of that among the
examples delivered, the fraction of distinct examples among the deliveries,
and the distance in batches between an example's consecutive deliveries (the
smallest, and the 5th percentile). Across epochs, :class:`Seen` adds each
epoch's counts to one byte per example of the dataset (its index, for a
map-style dataset; its position in the stream, for an iterable).

Memory: during an epoch, 5 bytes per example delivered in it; across epochs,
1 byte per example of the dataset, allocated zeroed so that the pages of
examples never delivered are never committed: 10^8 examples take at most
0.5 GB in an epoch and 95 MiB across epochs. Counts saturate at 255.
"""

from __future__ import annotations

import base64
import math
import zlib
from typing import Any

import numpy as np

from ... import _core

__all__ = ["GAP_QUANTILE", "Ledger", "Seen", "checked_ledger", "histogram_figures"]

GAP_QUANTILE = 0.05  # the low quantile of the distances between repeats that the report gives
_GAP_BUCKETS = len(_core.DeliveryLedger().gaps)


def histogram_figures(by_count: np.ndarray, unseen: int) -> dict[str, Any]:
    """From how many examples were delivered c times (``by_count[c]``, c >= 1)
    and how many were read but never delivered (``unseen``): the report's
    histogram (``deliveries[c]``, from 0), ``max``, ``mean`` and ``spread``
    (standard deviation) over the examples delivered."""
    counts = np.asarray(by_count, dtype=np.float64)
    counts[0] = 0
    top = int(np.flatnonzero(counts)[-1]) if counts.any() else 0
    distinct = counts.sum()
    times = np.arange(len(counts), dtype=np.float64)
    mean = float((times * counts).sum() / distinct) if distinct else 0.0
    variance = float((times * times * counts).sum() / distinct - mean * mean) if distinct else 0.0
    return {"deliveries": [int(unseen)] + [int(c) for c in by_count[1:top + 1]], "max": top, "mean": mean,
            "spread": math.sqrt(max(0.0, variance))}


class Ledger:
    """One epoch's deliveries, by position in its reading order.

    Args:
        saved: the ledger of the state a resumed epoch resumes (checked by
            :func:`checked_ledger`), or None.
    """

    def __init__(self, saved: dict[str, Any] | None = None) -> None:
        self._ledger = _core.DeliveryLedger()
        if saved is not None:
            ledger = _unpacked_ledger(saved, "state['stages']['ledger']")
            self._ledger.restore(ledger["counts"], ledger["last"], ledger["batches"], ledger["delivered"],
                                 ledger["gaps"])

    def state(self) -> dict[str, Any]:
        """The ledger, for a checkpoint (plain values: its arrays compressed into
        base64 strings, the gaps as [bucket, count] pairs)."""
        ledger = self._ledger
        used = self.extent()
        gaps = ledger.gaps
        return {"counts": _packed(ledger.counts[:used]), "last": _packed(ledger.last[:used]),
                "batches": int(ledger.batches), "delivered": int(ledger.delivered),
                "gaps": [[int(b), int(gaps[b])] for b in np.flatnonzero(gaps)]}

    def add(self, rows: np.ndarray | None) -> None:
        """One delivered batch, its rows' positions (None: a stage that does not carry them)."""
        if rows is not None:
            self._ledger.add(rows)

    @property
    def distinct(self) -> int:
        """Examples delivered at least once."""
        return self._ledger.distinct

    def extent(self) -> int:
        """One past the highest position delivered (0: none)."""
        counts = self._ledger.counts
        return int(np.flatnonzero(counts)[-1]) + 1 if counts.any() else 0

    def report(self, fresh: int) -> dict[str, Any]:
        """The epoch's repetition report; ``fresh``: the examples read in it.

        Returns:
            deliveries: ``deliveries[c]``, the examples read this epoch that
            were delivered c times (``[0]``: read ahead, never delivered);
            max, mean, spread: the most, the mean and the standard deviation
            of those counts over the examples delivered;
            distinct_fraction: distinct examples among the deliveries;
            repeats: deliveries beyond each example's first;
            gap_min, gap_p05: the distance in batches between two
            consecutive deliveries of one example, the smallest and the 5th
            percentile (exact below 256, then the power of two below; None
            without repeats).
        """
        ledger = self._ledger
        delivered, distinct = ledger.delivered, ledger.distinct
        figures = histogram_figures(ledger.by_count, max(0, fresh - distinct))
        gaps = ledger.gaps
        repeats = int(gaps.sum())
        figures.update({
            "distinct_fraction": distinct / delivered if delivered else 0.0,
            "repeats": repeats,
            "gap_min": _gap_at(gaps, 1) if repeats else None,
            "gap_p05": _gap_at(gaps, max(1, math.ceil(GAP_QUANTILE * repeats))) if repeats else None,
        })
        return figures

    def fold(self, totals: np.ndarray, order: np.ndarray | None) -> None:
        """Adds the epoch's counts to ``totals[order[position]]`` (see Seen)."""
        self._ledger.fold(totals, order)


def _packed(array: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(array).tobytes(), 6)).decode("ascii")


def _unpacked(value: Any, dtype: Any, where: str) -> np.ndarray:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a base64 string, got {type(value).__name__}")
    try:
        raw = zlib.decompress(base64.b64decode(value.encode("ascii"), validate=True))
    except (ValueError, zlib.error) as error:
        raise ValueError(f"{where}: not a packed array ({error})") from None
    if len(raw) % np.dtype(dtype).itemsize:
        raise ValueError(f"{where}: not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(raw, dtype=dtype).copy()


def checked_ledger(value: Any, where: str) -> dict[str, Any]:
    """A state's ledger (Ledger.state), checked; as saved (packed).

    Raises:
        ValueError: a value Ledger.state could not have given, naming the key.
    """
    _unpacked_ledger(value, where)
    return {key: value[key] for key in ("counts", "last", "batches", "delivered", "gaps")}


def _unpacked_ledger(value: Any, where: str) -> dict[str, Any]:
    """A state's ledger with its arrays unpacked (see checked_ledger)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a dict")
    counts = _unpacked(value.get("counts"), np.uint8, f"{where}['counts']")
    last = _unpacked(value.get("last"), np.uint32, f"{where}['last']")
    if len(counts) != len(last):
        raise ValueError(f"{where}['last']: expected one batch number per count")
    numbers = {}
    for key in ("batches", "delivered"):
        number = value.get(key)
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise ValueError(f"{where}[{key!r}]: expected an int >= 0, got {number!r:.40}")
        numbers[key] = number
    gaps = np.zeros(_GAP_BUCKETS, dtype=np.uint64)
    pairs = value.get("gaps")
    if not isinstance(pairs, list):
        raise ValueError(f"{where}['gaps']: expected a list of [bucket, count] pairs")
    for pair in pairs:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(v, int) for v in pair)
                or not 0 <= pair[0] < len(gaps) or pair[1] < 0):
            raise ValueError(f"{where}['gaps']: expected [bucket, count] pairs, got {pair!r:.40}")
        gaps[pair[0]] = pair[1]
    if numbers["delivered"] < int(counts.astype(np.int64).sum()) or (len(last) and numbers["batches"] <= last.max()):
        raise ValueError(f"{where}: its counts and batches do not agree")
    return {"counts": counts, "last": last, "gaps": gaps, **numbers}


def _gap_at(gaps: np.ndarray, rank: int) -> int:
    """The distance of the ``rank``-th smallest repeat (1-based), as its bucket's lower bound."""
    bucket = int(np.searchsorted(np.cumsum(gaps), rank))
    return int(_core.DeliveryLedger.lower_bound(bucket))


class Seen:
    """How many times each example has been delivered over the epochs that
    ended: one byte per example (see the module docstring)."""

    def __init__(self) -> None:
        self._totals = np.zeros(0, dtype=np.uint8)  # grown by doubling; examples [0, _size) are counted
        self._size = 0
        self._by_count = np.zeros(256, dtype=np.int64)

    def add(self, ledger: Ledger, order: np.ndarray | None, positions: int) -> None:
        """An ended epoch's ledger; ``order``: its dataset indices by position
        (None: the position is the example), ``positions``: how many it read."""
        needed = positions if order is None else (int(order.max()) + 1 if len(order) else 0)
        if needed > len(self._totals):
            grown = np.zeros(max(needed, 2 * len(self._totals)), dtype=np.uint8)
            grown[:len(self._totals)] = self._totals
            self._totals = grown
        self._size = max(self._size, needed)
        ledger.fold(self._totals, order)
        self._by_count = np.bincount(self._totals[:self._size], minlength=256)

    def report(self) -> dict[str, Any]:
        """Over the epochs that ended: how many examples were delivered 0, 1, 2,
        ... times in all (0: never, among the examples up to the highest index
        or position read), the most, the mean and spread, and the bytes the
        counts take."""
        figures = histogram_figures(self._by_count, int(self._by_count[0]))
        figures["bytes"] = self._totals.nbytes
        return figures
