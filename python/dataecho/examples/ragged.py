"""Ragged leaves in a batch: rows of different lengths, packed.

A leaf whose first axis varies from example to example (token ids ``(n,)``,
boxes ``(n, 4)``, audio ``(n, channels)``; ``n`` may be 0) comes in a batch as a
:class:`Ragged`: every row's values one after another (``values``, shape
``(total, *row_shape)``) and ``offsets``, ``batch + 1`` int64 boundaries, so
that row ``i`` is ``values[offsets[i]:offsets[i + 1]]``. Nothing is padded and
nothing is copied: both arrays view the batch memory. This is the layout that
variable-length attention kernels take (``cu_seqlens``) and that torch's
jagged nested tensors are made of (:meth:`Ragged.to_torch`).

:meth:`Ragged.padded` gives the rows padded to the longest (or to a given
length) as a :class:`Padded`: the padded array and each row's length, with a
mask. ``EchoLoader(padding=...)`` delivers every ragged leaf that way.
"""

from __future__ import annotations

import operator
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from ..tensors.jax_arrays import aligned_empty, import_jax
from ..tensors.nested import nested_from_packed

__all__ = ["JaxRagged", "Padded", "Ragged"]

class Padded(NamedTuple):
    """Rows padded to one length, and their own lengths.

    Attributes:
        data: ``(batch, length, *row_shape)``: row ``i`` in ``data[i, :lengths[i]]``,
            the rest filled with the padding value.
        lengths: ``(batch,)`` int64.
    """

    data: Any
    lengths: Any

    @property
    def mask(self) -> Any:
        """``(batch, length)`` bool: True where ``data`` holds a row's values
        (an attention mask); a NumPy array, a tensor or a JAX array, like ``data``."""
        positions = np.arange(self.data.shape[1]) if isinstance(self.data, np.ndarray) else _arange_like(self.data)
        return positions[None, :] < self.lengths[:, None]

    def __repr__(self) -> str:
        return f"Padded(data={_describe(self.data)}, lengths={_describe(self.lengths)})"


class JaxRagged(NamedTuple):
    """A ragged leaf as JAX arrays: the rows packed, as in :class:`Ragged`.

    A named tuple, so a JAX pytree: ``jax.jit``, ``jax.tree.map`` and
    ``jax.device_put`` take it as it is. Its ``values`` change length from
    batch to batch, so a jitted function retraces for each new total; pad
    (``EchoLoader(padding=length)``) where shapes must stay fixed.

    Attributes:
        values: ``(total, *row_shape)``: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.
        offsets: ``(batch + 1,)``, from 0 to ``total`` (int32 unless ``jax_enable_x64``).
    """

    values: Any
    offsets: Any

    @property
    def num_segments(self) -> int:
        """The number of rows (a Python int: static under ``jax.jit``)."""
        return self.offsets.shape[0] - 1

    @property
    def lengths(self) -> Any:
        """Each row's length, ``(batch,)``."""
        return import_jax().numpy.diff(self.offsets)

    @property
    def segment_ids(self) -> Any:
        """``(total,)``: the row each value belongs to, as
        ``jax.ops.segment_sum(values, segment_ids, num_segments)`` takes them
        (sorted, so ``indices_are_sorted=True`` holds)."""
        jnp = import_jax().numpy
        rows = jnp.arange(self.num_segments, dtype=self.offsets.dtype)
        return jnp.repeat(rows, self.lengths, total_repeat_length=self.values.shape[0])

    def __repr__(self) -> str:
        return f"JaxRagged(values={_describe(self.values)}, offsets={_describe(self.offsets)})"


class Ragged:
    """A batch of rows of different lengths, packed (see the module docstring).

    Args:
        values: ``(total, *row_shape)``, the rows one after another.
        offsets: ``(batch + 1,)`` int64, non-decreasing, from 0 to ``total``.

    Raises:
        ValueError: offsets that do not describe ``values``.
    """

    __slots__ = ("values", "offsets")

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        values, offsets = np.asarray(values), np.asarray(offsets)
        if values.ndim < 1:
            raise ValueError(f"Ragged: values must have a first axis of rows, got shape {values.shape}")
        if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) < 1:
            raise ValueError(f"Ragged: offsets must be one-dimensional int64, got {offsets.dtype} {offsets.shape}")
        if offsets[0] != 0 or offsets[-1] != len(values) or (len(offsets) > 1 and (np.diff(offsets) < 0).any()):
            raise ValueError(f"Ragged: offsets must rise from 0 to {len(values)} (the rows of values)")
        self.values, self.offsets = values, offsets

    @classmethod
    def of_batch(cls, values: np.ndarray, offsets: np.ndarray) -> Ragged:
        """A Ragged over a pack whose offsets are known to be right (a batch the
        buffer assembled, or views of a Ragged): no check, which would cost more
        than the rest of a batch's delivery (tens of microseconds)."""
        ragged = object.__new__(cls)
        ragged.values, ragged.offsets = values, offsets
        return ragged

    @classmethod
    def from_rows(cls, rows: Sequence[Any], dtype: Any = None, row_shape: tuple[int, ...] | None = None) -> Ragged:
        """Packs ``rows`` (arrays or lists of one row shape) into new memory."""
        arrays = [np.asarray(row, dtype=dtype) for row in rows]
        if row_shape is None:
            row_shape = arrays[0].shape[1:] if arrays else ()
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        if not arrays:
            return cls(np.zeros((0, *row_shape), dtype=dtype), offsets)
        parts = [a.reshape(len(a), *row_shape) for a in arrays]
        # Aligned, so that JAX takes the values without a copy (dataecho.tensors.jax_arrays).
        values = aligned_empty((int(offsets[-1]), *row_shape), np.result_type(*parts) if dtype is None else dtype)
        return cls(np.concatenate(parts, out=values), offsets)

    @property
    def lengths(self) -> np.ndarray:
        """Each row's length, ``(batch,)`` int64."""
        return np.diff(self.offsets)

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one row of a row (``()`` for token ids, ``(4,)`` for boxes)."""
        return self.values.shape[1:]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        """Row ``i``: a view of its values."""
        i = operator.index(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"Ragged: row {i} out of range for {len(self)} rows")
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def padded(self, length: int | None = None, value: Any = 0) -> Padded:
        """The rows padded to ``length`` (default: the longest), in new memory.

        Args:
            length: the padded length; a row longer than it raises.
            value: what fills the padding.

        Returns:
            ``Padded(data, lengths)``, with ``.mask``.

        Raises:
            ValueError: a row is longer than ``length``.
        """
        lengths = self.lengths
        longest = int(lengths.max()) if len(lengths) else 0
        if length is None:
            length = longest
        elif longest > length:
            row = int(np.argmax(lengths))
            raise ValueError(f"padded(): row {row} has {longest} rows, more than length={length}")
        data = aligned_empty((len(self), length, *self.row_shape), self.dtype)  # for JAX, as in from_rows
        data.fill(value)
        if len(self.values):
            # The mask's True cells, in C order, are the packed values' places.
            data[np.arange(length)[None, :] < lengths[:, None]] = self.values
        return Padded(data, lengths)

    def to_torch(self) -> Any:
        """A torch nested tensor of layout ``torch.jagged`` over the same memory
        (values and offsets shared, no copy)."""
        return nested_from_packed(self.values, self.offsets)

    def read_only(self) -> Ragged:
        """The same rows through read-only views (no copy)."""
        values, offsets = self.values.view(), self.offsets.view()
        values.flags.writeable = offsets.flags.writeable = False
        return Ragged.of_batch(values, offsets)

    def copy(self) -> Ragged:
        return Ragged.of_batch(self.values.copy(), self.offsets.copy())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ragged):
            return NotImplemented
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.values, other.values)

    __hash__ = None  # type: ignore[assignment]  # mutable, as arrays

    def __repr__(self) -> str:
        lengths = self.lengths
        shown = ", ".join(str(n) for n in lengths[:8]) + (", ..." if len(lengths) > 8 else "")
        rows = "n" if not self.row_shape else f"n, {', '.join(map(str, self.row_shape))}"
        return f"Ragged({len(self)} rows of ({rows}) {self.dtype}, lengths [{shown}], {len(self.values)} in all)"


def _describe(value: Any) -> str:
    shape = tuple(getattr(value, "shape", ()))
    return f"{type(value).__name__} {shape} {getattr(value, 'dtype', '')}".rstrip()


def _arange_like(data: Any) -> Any:
    """The positions of ``data``'s second axis, in its own library: torch's
    (on its device), or JAX's (a JAX array, or a tracer inside ``jax.jit``)."""
    if type(data).__module__.startswith("torch"):
        import torch

        return torch.arange(data.shape[1], device=data.device)
    return import_jax().numpy.arange(data.shape[1])
