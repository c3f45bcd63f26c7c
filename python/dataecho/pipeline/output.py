"""What the training loop gets for each batch: the batch's leaves in the
structure of an example, as the output kind makes them (NumPy arrays, torch
tensors or JAX arrays over the same memory: dataecho.examples.outputs; ragged
leaves packed, or padded), ``collate_fn``'s result (as it is, whatever
``output`` says), or with ``batch_size=None`` the one example itself."""

from __future__ import annotations

from typing import Any

from ..examples.leaves import padded_leaves
from .plan import OutputSpec
from .stages.stage import Batch

__all__ = ["output_of"]


def output_of(spec: OutputSpec, batch: Batch) -> Any:
    """What the loop gets for ``batch`` (see the module docstring)."""
    structure, kind = batch.structure, spec.kind
    if not spec.batched:  # batch_size=None: the one example, as the dataset returned it
        if spec.collate_fn is not None:
            return spec.collate_fn(structure.example(batch.arrays, 0))
        return kind.example(structure.example(batch.arrays, 0, raw=kind.raw))
    if spec.collate_fn is not None:
        # Each example as the dataset returned it, arrays and tensors as views
        # of their rows of the batch (no copy), in the batch's order.
        return spec.collate_fn([structure.example(batch.arrays, i) for i in range(len(batch))])
    leaves = batch.arrays
    if spec.padding is not None:
        leaves = padded_leaves(leaves, spec.padding)
    return kind.batch(structure, leaves)
