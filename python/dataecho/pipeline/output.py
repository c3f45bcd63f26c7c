"""What the training loop gets for each batch: the batch's leaves in the
structure of an example (NumPy arrays, torch tensors or JAX arrays over the
same memory; ragged leaves packed, or padded), ``collate_fn``'s result (as it
is, whatever ``output`` says), or with ``batch_size=None`` the one example
itself."""

from __future__ import annotations

from typing import Any

from ..examples.given import default_convert
from ..examples.jax_trees import to_jax
from ..examples.leaves import leaf_to_torch, padded_leaves
from ..tensors.jax_arrays import ml_dtype_view
from .plan import OutputSpec
from .stage import Batch

__all__ = ["output_of"]


def output_of(spec: OutputSpec, batch: Batch) -> Any:
    """What the loop gets for ``batch`` (see the module docstring)."""
    structure = batch.structure
    # A raw leaf (bfloat16, float8) goes to JAX as the ml_dtypes array of its bytes.
    raw = ml_dtype_view if spec.convert == "jax" else None
    if not spec.batched:  # batch_size=None: the one example, as the dataset returned it
        if spec.collate_fn is not None:
            return spec.collate_fn(structure.example(batch.arrays, 0))
        example = structure.example(batch.arrays, 0, raw=raw)
        if spec.convert == "jax":
            return to_jax(example, spec.jax_device)
        return default_convert(example) if spec.convert == "torch" else example
    if spec.collate_fn is not None:
        # Each example as the dataset returned it, arrays and tensors as views
        # of their rows of the batch (no copy), in the batch's order.
        return spec.collate_fn([structure.example(batch.arrays, i) for i in range(len(batch))])
    leaves = batch.arrays
    if spec.padding is not None:
        leaves = padded_leaves(leaves, spec.padding)
    if spec.convert == "jax":
        return to_jax(structure.unflatten(leaves, raw=raw), spec.jax_device)
    return structure.unflatten(leaves, wrap=leaf_to_torch if spec.convert == "torch" else None)
