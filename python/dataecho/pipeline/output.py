"""What the training loop gets for each batch: the batch's leaves in the
structure of an example (NumPy arrays, or torch tensors over the same memory;
ragged leaves packed, or padded), ``collate_fn``'s result, or with
``batch_size=None`` the one example itself."""

from __future__ import annotations

from typing import Any

from ..examples.given import default_convert
from ..examples.leaves import leaf_to_torch, padded_leaves
from .plan import OutputSpec
from .stage import Batch

__all__ = ["output_of"]


def output_of(spec: OutputSpec, batch: Batch) -> Any:
    """What the loop gets for ``batch`` (see the module docstring)."""
    structure = batch.structure
    if not spec.batched:  # batch_size=None: the one example, as the dataset returned it
        example = structure.example(batch.arrays, 0)
        if spec.collate_fn is not None:
            return spec.collate_fn(example)
        return default_convert(example) if spec.to_torch else example
    if spec.collate_fn is not None:
        # Each example as the dataset returned it, arrays and tensors as views
        # of their rows of the batch (no copy), in the batch's order.
        return spec.collate_fn([structure.example(batch.arrays, i) for i in range(len(batch))])
    leaves = batch.arrays
    if spec.padding is not None:
        leaves = padded_leaves(leaves, spec.padding)
    return structure.unflatten(leaves, wrap=leaf_to_torch if spec.to_torch else None)
