"""Which reader reads a map-style source: arrays natively
(dataecho.reading.arrays), a Hugging Face dataset through Arrow
(dataecho.reading.arrow), anything else example by example
(dataecho.reading.dataset)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import ArrayReader, source_array, tensor_arrays
from .arrow import ArrowReader
from .dataset import ExampleReader

__all__ = ["map_reader"]

def map_reader(source: Any, transform: Any, order: np.ndarray) -> ArrayReader | ArrowReader | ExampleReader:
    """The reader of a map-style ``source`` in the epoch's ``order``."""
    if transform is None:
        array = source_array(source)
        if array is not None:
            return ArrayReader([array], order)
        tensors = tensor_arrays(source)
        if tensors is not None:
            return ArrayReader(tensors, order, as_tuple=True)
        if ArrowReader.reads(source):
            return ArrowReader(source, order)
    return ExampleReader(source, transform, order)
