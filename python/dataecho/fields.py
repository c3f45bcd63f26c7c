"""Example fields: parsing their declaration and converting values into them.

Casting rule (applied per field, before any copy):

* NumPy arrays, NumPy scalars and other array-likes (a torch CPU tensor, say) are
  accepted when ``numpy.can_cast(value.dtype, field_dtype, "safe")`` holds: no
  loss of range or precision (``uint8`` into ``float32`` yes, ``float64`` into
  ``float32`` no, byte order and alignment are free).
* Python ``bool``/``int``/``float``/``complex`` values, and lists or tuples of
  them, carry no dtype of their own (NumPy's NEP 50 calls them weak): they are
  accepted when their *kind* fits (bool into any number, int into integer, float
  or complex, float into float or complex, complex into complex) and, for
  integer fields, when every value is in range (``OverflowError`` otherwise).
* The shape must match exactly; non-contiguous input is accepted and copied.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

__all__ = ["Field", "parse_fields", "to_field_array"]

# Kinds a weak Python value may be written into, by the kind NumPy infers for it.
_WEAK_KINDS = {"b": "biufc", "i": "iufc", "u": "iufc", "f": "fc", "c": "c"}
_PY_SCALARS = (bool, int, float, complex)
_MAX_EXAMPLE_BYTES = 1 << 40


@dataclass(frozen=True)
class Field:
    """One named array of an example: ``shape`` excludes the batch axis."""

    name: str | None
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def label(self) -> str:
        return "example" if self.name is None else f"field {self.name!r}"


def parse_fields(fields: Any) -> tuple[list[Field], bool]:
    """Parses ``fields`` into a list of Field; returns (fields, single).

    Args:
        fields: a ``(shape, dtype)`` pair for plain array examples, or a mapping
            from field name to ``(shape, dtype)``.

    Returns:
        The fields in declaration order, and whether examples are plain arrays.

    Raises:
        TypeError, ValueError: naming the offending field and value.
    """
    if isinstance(fields, Mapping):
        if not fields:
            raise ValueError("fields: expected at least one field, got an empty mapping")
        parsed = []
        for name, spec in fields.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"fields: field names must be non-empty str, got {name!r}")
            parsed.append(_parse_one(name, spec, f"fields[{name!r}]"))
        return parsed, False
    return [_parse_one(None, fields, "fields")], True


def _parse_one(name: str | None, spec: Any, where: str) -> Field:
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise TypeError(f"{where}: expected a (shape, dtype) pair, got {spec!r}")
    shape_spec, dtype_spec = spec
    shape = _parse_shape(shape_spec, where)
    try:
        dtype = np.dtype(dtype_spec)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: {dtype_spec!r} is not a NumPy dtype ({exc})") from None
    if dtype.hasobject:
        raise TypeError(f"{where}: dtype {dtype} holds Python objects; expected a fixed-size dtype")
    if dtype.itemsize == 0:
        raise ValueError(f"{where}: dtype {dtype} has no size; give one (for example 'S16')")
    field = Field(name, shape, dtype)
    if field.nbytes > _MAX_EXAMPLE_BYTES:
        raise ValueError(f"{where}: {field.nbytes} bytes per example is more than the limit of 1 TiB")
    return field


def _parse_shape(shape_spec: Any, where: str) -> tuple[int, ...]:
    if isinstance(shape_spec, (tuple, list)):
        dims = list(shape_spec)
    else:
        dims = [shape_spec]
    shape = []
    for axis, dim in enumerate(dims):
        if isinstance(dim, bool):
            raise TypeError(f"{where}: dimension {axis} must be an int, got {dim!r}")
        try:
            value = operator.index(dim)
        except TypeError:
            raise TypeError(f"{where}: dimension {axis} must be an int, got {dim!r}") from None
        if value <= 0:
            raise ValueError(f"{where}: dimension {axis} must be positive, got {value}")
        shape.append(value)
    return tuple(shape)


def to_field_array(value: Any, field: Field, rows: int | None, where: str) -> np.ndarray:
    """Converts one field's value to a C-contiguous array of the field's dtype.

    Args:
        value: the value given for the field.
        field: its declaration.
        rows: None for one example; n for n stacked examples (leading axis n).
        where: the call, for messages (``"put()"``).

    Returns:
        The value itself when it already fits, else a converted copy.

    Raises:
        TypeError: the value cannot be cast safely to the field's dtype.
        ValueError: wrong shape.
        OverflowError: a Python integer out of the field's range.
    """
    shape = field.shape if rows is None else (rows, *field.shape)
    if type(value) is np.ndarray:
        array = value
        weak = False
    else:
        weak = isinstance(value, _PY_SCALARS) or (
            isinstance(value, (list, tuple)) and not isinstance(value, np.ndarray)
        )
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"{where}: {field.label()} could not be read as an array: {exc}") from None
        if array.dtype.hasobject:
            raise TypeError(
                f"{where}: {field.label()} expected {field.dtype} values, got {_describe(value)}"
            )
    if array.dtype != field.dtype and not _castable(array, field, weak, where):
        raise TypeError(
            f"{where}: {field.label()} expected dtype {field.dtype}, got {array.dtype}, which "
            f"cannot be cast safely (see dataecho.fields for the casting rule)"
        )
    if array.shape != shape:
        raise ValueError(f"{where}: {field.label()} expected shape {shape}, got {array.shape}")
    if array.dtype == field.dtype and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=field.dtype)


def _castable(array: np.ndarray, field: Field, weak: bool, where: str) -> bool:
    dtype = field.dtype
    if not weak:
        return bool(np.can_cast(array.dtype, dtype, casting="safe"))
    if dtype.kind not in _WEAK_KINDS.get(array.dtype.kind, ""):
        return False
    if dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise OverflowError(
                f"{where}: {field.label()} value {low if low < info.min else high} is out of "
                f"range for {dtype} [{info.min}, {info.max}]"
            )
    return True


def _describe(value: Any) -> str:
    if isinstance(value, numbers.Number) or value is None:
        return repr(value)
    return type(value).__name__
