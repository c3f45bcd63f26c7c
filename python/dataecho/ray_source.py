"""Ray Data as the upstream of an EchoLoader.

A Ray ``Dataset``, or the ``DataIterator`` that ``ray.train.get_dataset_shard``
returns on each training worker, is read row by row: the preprocessing runs on
the Ray cluster, and echoing happens next to the accelerator, in the training
process. Each epoch iterates the dataset again. Rows are dicts of column values,
so batches are dicts of stacked columns. Ray's row order is not deterministic
unless the dataset's ``DataContext.execution_options.preserve_order`` is set.
"""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["RayRows", "is_ray_data"]


def is_ray_data(source: Any) -> bool:
    """A Ray Data Dataset or DataIterator (without importing ray)."""
    return type(source).__module__.startswith("ray.data") and callable(getattr(source, "iter_rows", None))


class RayRows:
    """An iterable over the rows of a Ray Dataset or DataIterator."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data.iter_rows())

    def __repr__(self) -> str:
        return f"RayRows({type(self.data).__name__})"
