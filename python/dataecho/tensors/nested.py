"""Packed rows (values and offsets) as torch jagged nested tensors over the same memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .convert import from_numpy, import_torch

if TYPE_CHECKING:
    import torch

__all__ = ["nested_from_packed"]

def nested_from_packed(values: Any, offsets: Any, bounds: tuple[int, int] | None = None) -> torch.Tensor:
    """A nested tensor of layout ``torch.jagged`` whose rows are
    ``values[offsets[i]:offsets[i + 1]]``, over the same memory (no copy).

    Args:
        values: ``(total, *row_shape)``, a NumPy array or a tensor.
        offsets: ``(batch + 1,)`` int64, from 0, non-decreasing.
        bounds: (shortest, longest) row, where known (offsets on a device:
            reading them would wait for the device).
    """
    torch = import_torch()
    if bounds is None:
        # NumPy's diff and reductions on a small array cost a tenth of torch's.
        lengths = np.diff(offsets) if isinstance(offsets, np.ndarray) else offsets.diff()
        bounds = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
    if isinstance(values, np.ndarray):
        values, offsets = from_numpy(torch, values), from_numpy(torch, offsets)
    # The longest row told up front: without it torch's to_padded_tensor pads
    # to the total length (torch 2.13), and nothing needs to compute it later.
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, min_seqlen=bounds[0],
                                                  max_seqlen=bounds[1])
