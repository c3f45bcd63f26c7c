"""Holding by reference: the one place that decides which values a native
buffer holds instead of copying them into a slot.

A held value's array is kept alive by the buffer, each batch is gathered
straight from it (one copy per example instead of two), and it is let go with
the batch that holds the example's last echo. The binding carries out what
this policy decides, for each put:

* Which fields: those of ``HOLD_MIN_BYTES`` or more per example (the core lays
  out a reference beside each of their slots). Below that the copy costs less
  than the bookkeeping: bench/bench_hold.py measures the crossover. A buffer
  shared with worker processes holds nothing: pointers mean nothing there.
* Which values, by mode:

  - ``"sources"`` (EchoLoader's): rows of an in-memory source array given as
    (array, indices), whose batches are gathered straight from the source,
    which is never changed; and the *fresh* values of a dataset's examples of
    ``FRESH_MIN_BYTES`` or more (dataecho.examples.columns.Fresh: arrays that
    own their memory and that nothing else holds, such as what a
    ``__getitem__`` returns new), copied once, into their batch: a dataset of
    150 KiB examples 1.6x, of 1 MiB 2x (bench/bench_loaders.py). What a dataset
    keeps or views is copied into slots. Memory-mapped sources are copied
    (but with ``True``).
  - ``"auto"`` (ShuffleBuffer's): also the arrays of one example each that
    ``put`` hands over (and list columns of ``put_each``); stacked arrays are
    copied, so that no stacked array stays alive for the sake of one row.
  - ``True``: stacked arrays too (each until the last echo of its last row:
    best for views of memory that lives anyway, such as a dataset array).
  - ``False``: everything is copied.

* An array of one example that views memory more than twice its own size (a
  row of a stacked batch, a view into a large block) is copied: holding it
  would keep all of that memory alive for one example.
* A held array handed over is made read-only while it is held, so that a write
  through it raises, and writeable again once the buffer lets go of it (its
  examples' last echoes gathered, a put that failed, or the buffer gone) if it
  was writeable when handed over; the binding does both (cpp/bindings/held.hpp).
  A source array of (array, indices) is left as it is. A held array's memory
  must not be changed through another view (or a torch tensor that shares it)
  until the example's last echo is delivered.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..examples.columns import Fresh

__all__ = ["HOLD_MIN_BYTES", "HoldPolicy", "holds_little_more"]

HOLD_MIN_BYTES = 8192


def holds_little_more(array: Any) -> bool:
    """Whether holding ``array`` keeps little more than its own bytes alive: it
    owns its memory, or views an array or buffer at most twice its size. An
    owner whose size cannot be read (a torch tensor) counts as small."""
    if not isinstance(array, np.ndarray):
        return True
    base = array.base
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if base is None:
        return True
    if isinstance(base, np.ndarray):
        return base.nbytes <= 2 * array.nbytes
    try:
        return memoryview(base).nbytes <= 2 * array.nbytes
    except TypeError:
        return True


class HoldPolicy:
    """What one buffer holds (see the module docstring).

    Args:
        mode: ``"sources"``, ``"auto"``, True or False.
        shared: the buffer is shared with worker processes (nothing is held).

    Attributes:
        min_bytes: fields of at least this many bytes per example are holdable
            (0: none); the buffer's ``hold_min_bytes``.
    """

    def __init__(self, mode: bool | str, shared: bool = False) -> None:
        self.mode = mode if not shared else False
        self.min_bytes = HOLD_MIN_BYTES if self.mode is not False else 0
        self.holdable: list[int] = []  # native field indices, set once the buffer exists

    def example(self, values: list) -> list[bool] | None:
        """For ``put`` of one example (one value per native field): per
        holdable field, whether its value is held; None: nothing is."""
        if not self.holdable or self.mode not in ("auto", True):
            return None
        decided = [holds_little_more(values[f]) for f in self.holdable]
        return decided if any(decided) else None

    def stacked(self) -> list[bool] | None:
        """For ``put_many`` of stacked arrays: held with ``True`` only."""
        if not self.holdable or self.mode is not True:
            return None
        return [True] * len(self.holdable)

    def columns(self, columns: list) -> list | None:
        """For ``put_each``: per holdable field, True (the column's array holds
        every row: stacked, or the source of (array, indices)), False, or one
        bool per row of a list column; None: nothing is held."""
        if not self.holdable or self.mode is False:
            return None
        decided: list = []
        for f in self.holdable:
            column = columns[f]
            if isinstance(column, tuple):  # (source array, indices): the source is never changed
                decided.append(self.mode is True or not isinstance(column[0], np.memmap))
            elif isinstance(column, Fresh) and self.mode == "sources":  # what nobody else holds or sees
                decided.append(column.fresh)
            elif isinstance(column, list):
                decided.append([self.mode != "sources" and holds_little_more(v) for v in column])
            else:  # stacked rows
                decided.append(self.mode is True)
        return decided if any(d if isinstance(d, bool) else any(d) for d in decided) else None
