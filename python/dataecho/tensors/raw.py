"""torch dtypes NumPy lacks (bfloat16, float8_*, complex32, ...).

A leaf of such a dtype travels as its bytes: a NumPy array of the unsigned
integer of the same item size (bfloat16 as uint16), viewed back as the torch
dtype on the way out. Both directions are views: the bits are kept exactly
and nothing is copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .convert import from_numpy, import_torch

if TYPE_CHECKING:
    import torch

__all__ = ["raw_bytes", "raw_to_tensor"]

# The torch integer dtype of each item size: what a raw leaf's bytes are viewed as.
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def raw_bytes(tensor: torch.Tensor, path: str) -> np.ndarray:
    """The bytes of a CPU tensor whose dtype NumPy lacks, as a NumPy array.

    Args:
        tensor: a dense CPU tensor (bfloat16, float8_e4m3fn, complex32, ...).
        path: the leaf's path, for messages.

    Returns:
        An array of the unsigned integer of the tensor's item size (uint16 for
        bfloat16), of its shape and strides, over its memory (no copy; a
        conjugate or negative view is resolved first, which copies).

    Raises:
        TypeError: the tensor is quantized (its bytes are not its values without
            its scale and zero point), not dense, or its items have no integer
            of their size; the message names the leaf.
    """
    torch = import_torch()
    what = f"example: leaf {path!r} is a {tensor.dtype} tensor"
    expected = "expected a dtype that NumPy has or whose bytes are its values (bfloat16, float8_*, complex32, ...)"
    # Checked before any view: viewing a quantized tensor as integers crashes torch 2.13.
    if tensor.is_quantized:
        raise TypeError(f"{what}, whose values need its scale and zero point; {expected}: give "
                        f"tensor.dequantize(), or tensor.int_repr() and the scale as leaves of their own")
    if tensor.layout != torch.strided:
        raise TypeError(f"example: leaf {path!r} is a {tensor.layout} tensor; expected a dense tensor "
                        f"(tensor.to_dense())")
    size = tensor.element_size()
    if size not in _INT_OF_SIZE:
        raise TypeError(f"{what} of {size}-byte items; {expected}")
    tensor = tensor.detach().resolve_conj().resolve_neg()
    try:
        ints = tensor.view(getattr(torch, _INT_OF_SIZE[size]))
    except RuntimeError as exc:
        raise TypeError(f"{what} whose bytes torch cannot view as integers ({exc}); {expected}") from None
    return ints.numpy().view(f"u{size}")


def raw_to_tensor(leaf: Any, dtype_name: str, copy: bool = False) -> torch.Tensor:
    """A leaf stored by :func:`raw_bytes` as a tensor of its own dtype again.

    Args:
        leaf: the unsigned integer array (or NumPy scalar) of its bytes, or a
            tensor of them (on a device, say).
        dtype_name: the torch dtype, as ``str(dtype)`` gives it (``"torch.bfloat16"``).
        copy: give the tensor its own memory; else it views ``leaf``'s memory
            (and keeps it alive), read-only or not: torch has no read-only
            tensors, so such a tensor must not be written to.

    Returns:
        A tensor of ``dtype_name``, bit for bit the bytes of ``leaf``.
    """
    torch = import_torch()
    if isinstance(leaf, (np.ndarray, np.generic)):
        ints = np.asarray(leaf).view(f"i{leaf.dtype.itemsize}")  # signed: torch < 2.3 has no uint16/32/64
        leaf = from_numpy(torch, ints.copy() if copy else ints)
    elif copy:
        leaf = leaf.clone()
    return leaf.view(getattr(torch, dtype_name.rpartition(".")[2]))
