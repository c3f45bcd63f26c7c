"""Augmenting rows of a batch, the same in a thread of the training process
and in an augment worker process: each row as an example of the upstream
structure (read-only views of the batch; a leaf of a torch dtype NumPy lacks
as a tensor of its own), handed to ``augment`` with the generator of its
delivery number where ``augment`` takes ``rng``."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from ...errors import stop_iteration_error
from ...examples.leaves import read_only, row_of
from ...examples.structure import Structure
from .delivery_rng import DeliveryRng

__all__ = ["augmented", "unpacked"]


def augmented(augment: Callable[..., Any], structure: Structure, arrays: tuple, deliveries: np.ndarray,
              rng: DeliveryRng | None) -> Iterator[tuple[int, Any]]:
    """(delivery, augment's result) for each row of the batch leaves ``arrays``.

    Raises:
        RuntimeError: ``augment`` raised StopIteration (not the end of anything).
    """
    views = read_only(arrays)  # an in-place change must not reach a repeat of the example
    for row, delivery in enumerate(deliveries.tolist()):
        example = structure.unflatten([row_of(v, row) for v in views], copy_raw=True)
        try:
            yield delivery, augment(example) if rng is None else augment(example, rng=rng.at(delivery))
        except StopIteration as stop:  # not this generator's end: an error (see Failure.set)
            raise stop_iteration_error(stop, "augment") from stop


def unpacked(deliveries: tuple | np.ndarray) -> np.ndarray:
    """A task's delivery numbers as an array: they come as one, or as
    ``(first, count)`` where they run on one by one (a batch taken from upstream)."""
    if isinstance(deliveries, tuple):
        first, count = deliveries
        return np.arange(first, first + count, dtype=np.uint64)
    return deliveries
