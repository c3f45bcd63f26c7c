"""The epoch rule: which epoch number the next ``iter(loader)`` runs."""

from __future__ import annotations

from typing import Any

from ... import _checks

__all__ = ["EpochNumbers"]

class EpochNumbers:
    """The epoch rule: which epoch number the next ``iter(loader)`` runs.

    Until ``set_epoch`` is first called, each epoch started takes the next
    number (0, 1, 2, ...). Once it is called (``DistributedSampler``'s
    convention: at the start of each epoch, the same number on every rank), the
    number is what was set, and an extra ``iter()`` (a peek at one batch) does
    not move it, so the ranks of a data-parallel job stay on one permutation.
    An epoch left before its first batch does not count (Lightning calls
    ``iter()`` once to check a loader, then again for its first epoch).

    Attributes:
        next: the number the next epoch runs.
        last: the number of the epoch started last (0 before any).
    """

    def __init__(self) -> None:
        self.next, self.last, self._set = 0, 0, False

    def set(self, epoch: Any) -> int:
        number = _checks.integer("epoch", epoch, "an int >= 0")
        if number < 0:
            raise ValueError(f"epoch: expected an int >= 0, got {number}")
        self.next, self._set = number, True
        return number

    def started(self) -> None:
        """The epoch numbered ``next`` has started."""
        self.last = self.next
        if not self._set:
            self.next += 1

    def give_back(self, number: int) -> None:
        """Epoch ``number`` ended before its first batch (a tool checking that
        the loader iterates): the next ``iter()`` runs it again, unless a later
        one has started or ``set_epoch`` decided."""
        if not self._set and self.next == number + 1:
            self.next = number
