"""``batch_sampler``: batches formed by a sampler (buckets by length, token
budgets: batches of varying size), with DataLoader's rules, and the rules that
follow from echoing them whole.

- As in DataLoader: it yields lists of dataset indices, one list per batch; it
  excludes ``batch_size`` (other than its default 1), ``shuffle``, ``sampler``
  and ``drop_last``, and needs a map-style dataset.
- Echo repeats whole batches (``echo_at="batch"``, its default here): example
  echoing would mix an example's repeats into new batches, breaking the
  sampler's, and so would ``augment``, which re-forms batches of a fixed size.
- Worker threads or ``num_workers=0`` read the batches, not worker processes:
  a batch sampler's batches are read whole and handed on in the sampler's
  order, which processes (filling the echo buffer example by example) do not do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..reading.source import is_map_style

__all__ = ["check_batch_sampler", "check_with_batch_sampler", "default_echo_at"]


def check_batch_sampler(batch_sampler: Any, batch_size: Any, shuffle: Any, sampler: Any, drop_last: Any,
                        dataset: Any) -> Any:
    """``batch_sampler`` as given (None if not), checked against the arguments it excludes.

    Raises:
        ValueError: one of the arguments DataLoader refuses with it, or an iterable dataset.
        TypeError: not an iterable (of lists of indices).
    """
    if batch_sampler is None:
        return None
    if batch_size != 1 or shuffle or sampler is not None or drop_last:
        # DataLoader's own message, word for word.
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    if not is_map_style(dataset):
        raise ValueError("batch_sampler: needs a map-style dataset (__len__ and __getitem__), as in DataLoader")
    if not isinstance(batch_sampler, Iterable):
        raise TypeError(f"batch_sampler: expected a torch BatchSampler or an iterable of lists of indices, "
                        f"got {type(batch_sampler).__name__}")
    return batch_sampler


def default_echo_at(echo_at: Any, batch_sampler: Any) -> Any:
    """``echo_at`` as given; not given, ``"batch"`` with a batch sampler, else ``"example"``."""
    if echo_at is not None:
        return echo_at
    return "example" if batch_sampler is None else "batch"


def check_with_batch_sampler(config: Any, echo_at: Any) -> None:
    """What else a loader with a ``batch_sampler`` may have, given its
    configuration and ``echo_at`` as it was given.

    Raises:
        ValueError: an argument that would break the sampler's batches, or
            worker processes (named).
    """
    if config.batch_sampler is None:
        return
    if echo_at == "example" and not config.echo.once:
        raise ValueError(
            "echo_at: 'example' repeats examples in new batches, which would break batch_sampler's batches; "
            "with a batch_sampler, echo repeats whole batches (echo_at='batch', the default with it), or give "
            "echo_factor=1"
        )
    if config.augment is not None:
        raise ValueError(
            "augment: cannot be used with batch_sampler: augment re-forms batches of a fixed size from the "
            "echoed examples, which would break the sampler's batches; augment in `transform` (once per read) "
            "or in `collate_fn` (anew on every delivery, repeats included)"
        )
    if config.worker_type == "process":
        raise ValueError(
            "worker_type: worker processes do not read a batch_sampler's batches: those are read whole and handed "
            "on in the sampler's order by threads, while processes fill the echo buffer example by example; use "
            "threads (worker_type='thread', the default, without multiprocessing_context) or num_workers=0"
        )
