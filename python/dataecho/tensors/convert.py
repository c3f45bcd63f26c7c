"""NumPy arrays as torch tensors without a copy.

torch is imported on first use (:func:`import_torch`), never when this module
is imported, so ``import dataecho`` works without torch installed.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["array_to_tensor", "from_numpy", "import_torch", "map_tree", "to_torch", "tree_leaves"]

# torch.from_numpy warns (once per process) that a read-only array gives a
# tensor that must not be written; to_torch documents that instead.
_READ_ONLY_WARNING = "The given NumPy array is not writable"


def import_torch() -> Any:
    """torch, imported now; an ImportError that says how to install it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "dataecho needs torch: pip install 'dataecho[torch]'"
        ) from exc
    return torch


def map_tree(fn: Callable[[Any, str], Any], tree: Any, path: str) -> Any:
    """Applies ``fn(leaf, path)`` to every leaf; dicts, tuples (named ones
    included) and lists keep their structure and key order."""
    if isinstance(tree, dict):
        return {key: map_tree(fn, value, f"{path}[{key!r}]") for key, value in tree.items()}
    if isinstance(tree, tuple):
        items = [map_tree(fn, value, f"{path}[{i}]") for i, value in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, list):
        return [map_tree(fn, value, f"{path}[{i}]") for i, value in enumerate(tree)]
    return fn(tree, path)


def tree_leaves(tree: Any) -> list[Any]:
    out: list[Any] = []
    map_tree(lambda leaf, _: out.append(leaf), tree, "")
    return out


def to_torch(tree: Any) -> Any:
    """Wraps a batch tree of NumPy arrays as torch tensors, without copying.

    Each tensor shares memory with its array and keeps the array (and so the
    batch lease that owns the memory) alive. A read-only array gives a tensor
    that must not be written to: torch has no read-only tensors, and a write
    would change the batch in place (or fault, for read-only pages).

    Args:
        tree: an ndarray, or dicts, tuples and lists nested of ndarrays.

    Returns:
        The same structure (dicts in key order, named tuples keep their type)
        with a tensor for each array.

    Raises:
        TypeError: a leaf is not an ndarray, or its dtype has no torch
            equivalent (bytes, str, object, structured, datetime, ...); the
            message names the leaf's path, e.g. ``tree['image']``.
        ValueError: an array has negative strides or non-native byte order,
            which torch cannot view without a copy; named the same way.
        ImportError: torch is not installed.
    """
    torch = import_torch()
    return map_tree(lambda leaf, path: array_to_tensor(torch, leaf, path), tree, "tree")


def array_to_tensor(torch: Any, array: Any, path: str) -> torch.Tensor:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"to_torch(): {path}: expected a numpy.ndarray, got {type(array).__name__}")
    if array.dtype.fields is not None or array.dtype.kind not in "biufc":
        raise TypeError(f"to_torch(): {path}: torch has no dtype for numpy {array.dtype!r}")
    try:
        return from_numpy(torch, array)
    except TypeError as exc:  # a numeric dtype this torch build lacks (uint16 before 2.3)
        raise TypeError(f"to_torch(): {path}: torch has no dtype for numpy {array.dtype!r} ({exc})") from None
    except ValueError as exc:  # negative strides, byte-swapped
        raise ValueError(f"to_torch(): {path}: cannot view this array without a copy: {exc}") from None


def from_numpy(torch: Any, array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy``, without its warning for a read-only array (the
    callers document that such a tensor must not be written)."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
        return torch.from_numpy(array)
