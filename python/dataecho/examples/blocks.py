"""Consecutive examples held as columns (a block of rows, as Ray Data's NumPy
batches hold them): put into a buffer a column at a time, or iterated as rows."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

__all__ = ["RowBlock", "row_values"]

class RowBlock:
    """Consecutive rows held as columns, as Ray's NumPy batches hold them.

    Attributes:
        columns: column name -> NumPy array whose first axis is the rows.
    """

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.columns = columns
        self._rows = len(next(iter(columns.values()), ()))

    def __len__(self) -> int:
        return self._rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The rows, as dicts of column values (see the module docstring)."""
        names = list(self.columns)
        return iter([dict(zip(names, values)) for values in zip(*map(row_values, self.columns.values()))])

    def after(self, start: int) -> RowBlock:
        """The rows from ``start`` on (views of the same columns)."""
        return RowBlock({name: column[start:] for name, column in self.columns.items()})


def row_values(column: np.ndarray) -> list:
    """A column's values, one per row: Python numbers for a column of numbers
    (as ``iter_rows`` gives them), else the column's items (objects, or
    views of a tensor column's rows)."""
    return column.tolist() if column.ndim == 1 and not column.dtype.hasobject else list(column)
