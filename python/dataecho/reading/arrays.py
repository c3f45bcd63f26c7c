"""Rows of arrays read with no Python per example: a NumPy array or memmap (or
any buffer with a leading example axis), or a torch ``TensorDataset`` of CPU
tensors, without ``transform``. The native put copies row ``order[p]`` straight
into a slot, or holds it by reference (dataecho.native.hold), and the batch is
gathered straight from it."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..examples.columns import Columns
from ..examples.fields import to_field_array
from .chunking import Chunk

__all__ = ["ArrayReader", "rows_contiguous", "source_array", "tensor_arrays"]

def source_array(source: Any) -> np.ndarray | None:
    """``source`` as an array whose rows the native put can copy from: a NumPy
    array or memmap, or an object with the buffer protocol, of at least one
    dimension and a plain dtype; else None."""
    if isinstance(source, np.ndarray):
        array = source
    else:
        try:
            array = np.asarray(memoryview(source))
        except (TypeError, ValueError):
            return None
    if array.ndim < 1 or array.dtype.hasobject or array.dtype.itemsize == 0:
        return None
    if array.ndim == 1 and array.dtype.kind in "US":
        return None  # examples are NumPy strings, which batches list as DataLoader does (object leaves)
    return array


def tensor_arrays(source: Any) -> list[np.ndarray] | None:
    """A torch ``TensorDataset``'s CPU tensors as the arrays over their memory,
    where each has a NumPy dtype; else None."""
    tensors = getattr(source, "tensors", None)
    if type(source).__name__ != "TensorDataset" or not isinstance(tensors, tuple) or not tensors:
        return None
    arrays = []
    for tensor in tensors:
        try:
            array = tensor.detach().numpy()  # refuses a GPU tensor or a dtype NumPy lacks (bfloat16)
        except (TypeError, RuntimeError, AttributeError):
            return None
        if source_array(array) is None:
            return None
        arrays.append(array)
    return arrays


def rows_contiguous(array: np.ndarray) -> bool:
    """Whether each row's own bytes are C-contiguous (the rows may be strided):
    what the native put needs to copy rows straight from the array."""
    expected = array.itemsize
    for size, stride in zip(reversed(array.shape[1:]), reversed(array.strides[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class ArrayReader:
    """Rows of arrays, copied natively from the arrays into the slots: one array
    (examples are its rows), or a torch ``TensorDataset``'s tensors (examples
    are tuples of their rows)."""

    def __init__(self, arrays: list[np.ndarray], order: np.ndarray, as_tuple: bool = False) -> None:
        self._arrays, self._order, self._tuple = arrays, order, as_tuple
        self._direct = [rows_contiguous(array) for array in arrays]

    def one(self, position: int) -> Any:
        i = int(self._order[position])
        rows = tuple(array[i] for array in self._arrays)
        return rows if self._tuple else rows[0]

    def chunks(self, first: int, count: int, columns: Columns) -> Iterator[Chunk]:
        # Checked by the order; contiguous, as the native gather reads them (a rank's shard is a strided view).
        indices = np.ascontiguousarray(self._order[first:first + count], dtype=np.int64)
        count = len(indices)  # fewer where a lazily read order ends before
        if not count:
            return
        yield first, count, [
            (array, indices) if direct
            else to_field_array(np.take(array, indices, axis=0), field, count, "put()")
            for array, direct, field in zip(self._arrays, self._direct, columns.fields)
        ]
