"""An example's leaves as the dataset returned them.

A batch stores every leaf as an array: a Python ``int`` becomes a 0-d int64
row, a tensor its bytes. Where user code expects the examples themselves (a
``collate_fn``, ``batch_size=None``), each row is given back in the kind the
first example held there: torch's ``DataLoader`` hands ``collate_fn`` what
``__getitem__`` returned, and the idioms written for it (``torch.tensor([y
for _, y in examples])``, ``len(x)``) depend on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tensors.convert import from_numpy, import_torch
from .ragged import Ragged

__all__ = ["GIVEN", "as_given", "default_convert", "given_kind", "row_of"]

# What a leaf held in the first example: how its rows are given back.
GIVEN = ("array", "python", "numpy", "tensor", "list", "raw", "object")


def given_kind(value: Any) -> str:
    """The kind of a first example's leaf value, one of ``GIVEN`` (a raw leaf's is set by its caller)."""
    if isinstance(value, np.ndarray):
        return "array" if not value.dtype.hasobject else "object"
    if isinstance(value, np.generic):
        return "numpy"
    if isinstance(value, (bool, int, float, complex)):
        return "python"
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        return "tensor"
    if isinstance(value, (list, range)):
        return "list"
    return "object"


def row_of(leaf: Any, i: int) -> Any:
    """Row ``i`` of a batch leaf: a view for arrays and ragged leaves, the object itself for a list."""
    if isinstance(leaf, list):
        return leaf[i]
    return leaf[i] if isinstance(leaf, Ragged) else leaf[i, ...]


def as_given(row: Any, given: str) -> Any:
    """A row of a batch leaf (from :func:`row_of`) in the kind ``given``: a view
    where the kind has one (arrays, tensors), a new value where it has not
    (numbers, lists)."""
    if given == "python":
        return row.item()
    if given == "numpy":
        return row[()]
    if given == "list":
        return row.tolist()
    if given == "tensor":
        return from_numpy(import_torch(), _contiguous(row))
    return row  # an array (a view), an object, or a raw leaf's bytes (Structure.unflatten makes the tensor)


def default_convert(value: Any) -> Any:
    """One unbatched example as torch's ``default_convert`` gives it
    (``batch_size=None`` with ``output="torch"``): NumPy arrays of numbers and
    NumPy scalars as tensors, the rest (Python numbers, strings, tensors) as
    they are, through dicts, tuples (which become lists, as torch's do) and lists."""
    if isinstance(value, dict):
        return {key: default_convert(item) for key, item in value.items()}
    if isinstance(value, tuple):
        items = [default_convert(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else items  # a list, as torch's gives
    if isinstance(value, list):
        return [default_convert(item) for item in value]
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc":
        torch = import_torch()
        return from_numpy(torch, _contiguous(value)) if isinstance(value, np.ndarray) else torch.as_tensor(value)
    return value


def _contiguous(array: np.ndarray) -> np.ndarray:
    """``array`` in C order, its shape kept (``np.ascontiguousarray`` makes a
    0-d array 1-d: a tensor the dataset returned as shape () would come as (1,))."""
    return array if array.flags.c_contiguous else array.copy(order="C")
