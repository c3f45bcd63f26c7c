"""``len(loader)``: how many batches an epoch yields on this rank, from the
configuration alone (dataecho.pipeline.plan hands it to the epoch)."""

from __future__ import annotations

import math

from ..config.echo import exact_deliveries
from ..config.loader_config import LoaderConfig
from ..reading.order import OrderSpec

__all__ = ["batches_per_epoch"]


def batches_per_epoch(config: LoaderConfig, order: OrderSpec | None) -> int:
    """``len(loader)``: batches per epoch on this rank, for a map-style source and
    a fixed echo factor: integer, or fractional with exact echo counts
    (``deterministic=True`` or several ranks). With a batch sampler, its
    ``len()`` times the echo factor (batch echo counts, exact).

    An iterable that has ``__len__`` (a torch ``IterableDataset`` may) is taken
    at its word, as DataLoader takes it: ``len(dataset)`` examples per epoch.

    Raises:
        TypeError: an iterable source without ``__len__``, a batch sampler
            without ``len()``, or a number of batches that is random.
    """
    if order is None and not hasattr(config.dataset, "__len__"):
        raise TypeError("len(): the source is an iterable of unknown length (it has no __len__)")
    echo = config.echo
    if echo.auto or not (echo.whole or config.exact_echo):
        raise TypeError("len(): the number of batches is random with a fractional or 'auto' echo factor")
    if config.batch_sampler is not None:
        if not hasattr(config.batch_sampler, "__len__"):
            raise TypeError("len(): the batch_sampler has no len()")
        return exact_deliveries(len(config.batch_sampler), echo.factor)
    rounding = math.floor if config.drop_last else math.ceil
    examples = order.examples_per_epoch() if order is not None else len(config.dataset)
    if echo.at == "batch":
        return exact_deliveries(rounding(examples / config.batch_size), echo.factor)
    return rounding(exact_deliveries(examples, echo.factor) / config.batch_size)
