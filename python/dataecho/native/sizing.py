"""A native buffer's configuration: the ``_core.BufferConfig`` fields, and the
size of the page heap that holds ragged values."""

from __future__ import annotations

import math
from typing import Any

from .. import _core

__all__ = ["MAX_PAGE_FOR_DEFAULT", "PICKLED_FLOOR", "buffer_config", "page_heap", "ragged_heap", "reorder_window"]

MAX_PAGE_FOR_DEFAULT = 1 << 16  # the largest page chosen by default (bigger examples take several)
PICKLED_FLOOR = 16 << 20  # the least ragged memory by default where objects travel pickled (worker processes)


def buffer_config(**values: Any) -> _core.BufferConfig:
    """A ``_core.BufferConfig`` with the given fields set (the rest default)."""
    config = _core.BufferConfig()
    for name, value in values.items():
        setattr(config, name, value)
    return config


def reorder_window(capacity: int, batch_size: int) -> int:
    """Deterministic intake's read-ahead (``_core.BufferConfig.window``): how
    far beyond the next example the buffer takes in producers may read, so that
    a late read holds the others back only that far. Up to four batches (as
    DataLoader prefetches two per worker), at most an eighth of the buffer (the
    shuffle keeps the rest), at least a batch; the buffer holds a batch and
    the window, as ``capacity >= 2 * batch_size`` ensures."""
    return max(batch_size, min(capacity // 8, 4 * batch_size))


def page_heap(budget_bytes: int, example_bytes: float) -> tuple[int, int]:
    """(pages, page_bytes) of a page heap for ragged values: pages of about an
    eighth of an example's ragged bytes (a power of two, 64 B to 64 KiB), so that
    the last, partly filled page of each example wastes about 6% on average, and
    as many as ``budget_bytes`` holds.

    Args:
        budget_bytes: the memory budget for ragged values.
        example_bytes: an example's ragged bytes, on average (a guess is fine).
    """
    target = max(example_bytes / 8, 1.0)
    page = 1 << max(0, round(math.log2(target)))
    page = min(max(page, _core.MIN_PAGE_BYTES), MAX_PAGE_FOR_DEFAULT)
    return max(1, min(budget_bytes // page, _core.MAX_PAGES)), page


def ragged_heap(structure: Any, capacity: int, budget_bytes: int | None, objects: str) -> tuple[int, int]:
    """(pages, page_bytes) for a buffer of ``structure``'s examples: none
    without ragged values; else pages sized from the examples the structure was
    inferred from, and ``budget_bytes`` of them. By default capacity x the
    larger of 4 x their mean and 2 x the largest: the heap's pages are touched
    only once used (dataecho's page heap takes fresh pages last), so the room
    for examples longer than the first ones costs no memory until they come.
    Shared with worker processes (``objects="pickle"``), the memory is reserved
    up front: capacity x the larger of 2 x the mean and the largest. Object
    leaves count there, as they travel pickled, as ragged bytes."""
    kinds = set(structure.kinds)
    pickled = objects == "pickle" and "object" in kinds
    if "ragged" not in kinds and not pickled:
        return 0, 0
    sample = structure.sample_bytes["ragged"] or [0]
    if pickled:
        extra = structure.sample_bytes["object"] or [256]
        sample = [a + b for a, b in zip(sample, extra)] if "ragged" in kinds else extra
    mean = max(sum(sample) / len(sample), 1.0)
    if budget_bytes is None:
        scale = (2 * mean, max(sample)) if objects == "pickle" else (4 * mean, 2 * max(sample))
        # Pickled objects get room for one of 16 MiB at least: a later string
        # longer than the first ones must not be refused where threads pass it.
        budget_bytes = max(int(capacity * max(scale)), PICKLED_FLOOR if pickled else 1 << 16)
    return page_heap(budget_bytes, mean)
