"""One leaf of a batch, whatever its kind: a stacked array, a
:class:`~dataecho.Ragged` (packed rows), or a list of objects. Rows of it,
read-only views of it, several examples' values stacked into one, ragged ones
padded, and the leaf as torch gives it."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..tensors.convert import array_to_tensor, from_numpy, import_torch
from ..tensors.jax_arrays import aligned_empty
from ..tensors.nested import nested_from_packed
from .fields import field_value
from .given import row_of
from .ragged import Padded, Ragged

if TYPE_CHECKING:
    from .structure import Structure

__all__ = ["leaf_to_torch", "padded_leaves", "read_only", "read_only_leaf", "row_of", "stack", "stack_leaf"]

def read_only_leaf(leaf: Any) -> Any:
    """A read-only view of an array or ragged leaf; a list of objects is copied
    (a list of its own for each reader: the objects themselves are shared)."""
    if isinstance(leaf, list):
        return list(leaf)
    if isinstance(leaf, Ragged):
        return leaf.read_only()
    view = leaf.view()
    view.flags.writeable = False
    return view


def padded_leaves(leaves: Sequence[Any], padding: int | str) -> tuple[Any, ...]:
    """A batch's leaves with each ragged one padded (``"longest"``, or to a length)."""
    length = None if padding == "longest" else padding
    return tuple(leaf.padded(length) if isinstance(leaf, Ragged) else leaf for leaf in leaves)


def stack_leaf(values: list, kind: str, dtype: Any = None, row_shape: tuple[int, ...] = ()) -> Any:
    """One leaf of several examples as a batch leaf of ``kind`` ("array",
    "ragged" or "object"): stacked, packed or listed."""
    if kind == "object":
        return list(values)
    if kind == "ragged":
        return Ragged.from_rows(values, dtype, row_shape)
    # Aligned, so that JAX takes the batch without a copy (dataecho.tensors.jax_arrays).
    first = np.asarray(values[0])
    return np.stack(values, out=aligned_empty((len(values), *first.shape), first.dtype if dtype is None else dtype))


def read_only(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """Read-only views of a batch's leaves (no copy; a list of objects is a new
    list of the same objects): for memory that others will read again."""
    return tuple(read_only_leaf(leaf) for leaf in leaves)


def stack(structure: Structure, examples: list[list], where: str = "resume", batch_shapes: bool = False
          ) -> tuple[Any, ...]:
    """Flattened examples as one batch leaf per leaf (stacked arrays, packed
    ragged rows, lists of objects), converted to the structure's fields as a
    put would.

    Args:
        structure: the examples' structure.
        examples: each example's leaves (``structure.flatten``).
        where: what is stacking, for messages.
        batch_shapes: an array leaf takes the shape of the batch's first
            example (the same in all of them), not the structure's: batches
            formed by a batch sampler (buckets of one length or size) may each
            have their own, as torch's ``default_collate`` stacks them.

    Raises:
        TypeError, ValueError: a leaf that does not fit its field (named).
    """
    fields = structure.fields()
    if batch_shapes and examples:
        fields = [f if f.kind != "array" else dataclasses.replace(f, shape=_shape_of(examples[0][i], f.shape))
                  for i, f in enumerate(fields)]
    return tuple(
        stack_leaf([field_value(leaves[i], f, None, where) for leaves in examples], f.kind, f.dtype, f.shape)
        for i, f in enumerate(fields)
    )


def _shape_of(value: Any, otherwise: tuple[int, ...]) -> tuple[int, ...]:
    """A leaf value's shape; ``otherwise`` where it has none (the conversion then says what is wrong)."""
    shape = getattr(value, "shape", None)  # an array or tensor; else a number or (nested) list
    if shape is not None:
        return tuple(shape)
    try:
        return np.shape(value)
    except (TypeError, ValueError):  # nested lists of different lengths
        return otherwise


def leaf_to_torch(leaf: Any) -> Any:
    """One batch leaf as torch gives it: an array as a tensor over its memory,
    a ragged leaf as a jagged nested tensor over its memory, a
    :class:`~dataecho.examples.ragged.Padded` as one of tensors, a list as it is."""
    if isinstance(leaf, Ragged):
        return nested_from_packed(leaf.values, leaf.offsets)
    if isinstance(leaf, Padded):
        torch = import_torch()
        return Padded(from_numpy(torch, leaf.data), from_numpy(torch, leaf.lengths))
    if isinstance(leaf, list):
        return leaf
    return array_to_tensor(import_torch(), leaf, "leaf")
