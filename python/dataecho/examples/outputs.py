"""What the training loop gets, by ``output=``: one :class:`Output` per
framework, each turning a batch's leaves (NumPy arrays over the loader's
memory, ragged leaves packed or padded) into that framework's values without a
copy where it can.

- ``"numpy"``: the leaves as they are (NumPy arrays; or, where a stage made them
  already, torch tensors on the device: dataecho.pipeline.stages.delivery).
- ``"torch"``: tensors over the same memory (ragged leaves as jagged nested
  tensors), as torch's ``default_convert`` gives them for one example.
- ``"jax"``: JAX arrays put on ``jax_device`` (no copy on a CPU device); a raw
  leaf (bfloat16, float8) as the ml_dtypes array of its bytes.

A new output is a class with this protocol, and one line in :data:`OUTPUTS`
(the name is checked against that list: dataecho.config.devices).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..tensors.jax_arrays import ml_dtype_view
from .given import default_convert
from .jax_trees import to_jax
from .leaves import leaf_to_torch
from .structure import Structure

__all__ = ["OUTPUTS", "JaxOutput", "NumpyOutput", "Output", "TorchOutput", "output_kind"]


class Output(Protocol):
    """One kind of output.

    Attributes:
        raw: how a raw leaf's bytes are viewed before :meth:`example` or
            :meth:`batch` (None: as the dtype torch's raw leaves carry).
        read_only: the values the loop gets over the loader's memory can be
            made read-only (NumPy arrays; JAX arrays are immutable), so that
            repeats of a batch may share its memory; torch has no read-only
            tensors, so a repeat is then a copy.
    """

    raw: Callable[[np.ndarray, str, str], Any] | None
    read_only: bool

    def example(self, example: Any) -> Any:
        """One example (``batch_size=None``), in the example's structure."""

    def batch(self, structure: Structure, leaves: Sequence[Any]) -> Any:
        """A batch: its leaves in the structure of an example."""


class NumpyOutput:
    """The leaves as they are."""

    raw = None
    read_only = True

    def example(self, example: Any) -> Any:
        return example

    def batch(self, structure: Structure, leaves: Sequence[Any]) -> Any:
        return structure.unflatten(leaves)


class TorchOutput:
    """torch tensors over the batch's memory."""

    raw = None
    read_only = False

    def example(self, example: Any) -> Any:
        return default_convert(example)

    def batch(self, structure: Structure, leaves: Sequence[Any]) -> Any:
        return structure.unflatten(leaves, wrap=leaf_to_torch)


class JaxOutput:
    """JAX arrays on ``device`` (None: JAX's default)."""

    raw = staticmethod(ml_dtype_view)
    read_only = True

    def __init__(self, device: Any = None) -> None:
        self.device = device

    def example(self, example: Any) -> Any:
        return to_jax(example, self.device)

    def batch(self, structure: Structure, leaves: Sequence[Any]) -> Any:
        return to_jax(structure.unflatten(leaves, raw=self.raw), self.device)


OUTPUTS: dict[str, Callable[..., Output]] = {
    "numpy": lambda jax_device=None: NumpyOutput(),
    "torch": lambda jax_device=None: TorchOutput(),
    "jax": JaxOutput,
}


def output_kind(name: str, jax_device: Any = None) -> Output:
    """The output ``name`` (a key of :data:`OUTPUTS`), on ``jax_device`` where it is JAX's."""
    return OUTPUTS[name](jax_device)
