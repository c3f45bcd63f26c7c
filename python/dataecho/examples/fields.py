"""Example fields: parsing their declaration and converting values into them.

Casting rule (applied per field, before any copy):

* NumPy arrays, NumPy scalars and other array-likes (a torch CPU tensor, a list
  holding NumPy values, say) are read by ``numpy.asarray`` and accepted when
  ``numpy.can_cast(value.dtype, field_dtype, "safe")`` holds: no loss of range or
  precision (``uint8`` into ``float32`` yes, ``float64`` into ``float32`` no,
  byte order and alignment are free).
* Python ``bool``/``int``/``float``/``complex`` values, and (nested) lists or
  tuples holding only them, carry no dtype of their own (NumPy's NEP 50 calls
  them weak): they are accepted when their *kind* fits (bool into any number,
  int into integer, float or complex, float into float or complex, complex into
  complex) and every value is in the field's range: an int within the integer
  field's bounds (any size of int), a finite number still finite in a float or
  complex field (rounding is fine). ``OverflowError`` otherwise.
* The shape must match exactly; non-contiguous input is accepted and copied.
* A subarray dtype such as ``("i4", (2,))`` declares its axes as trailing axes
  of the field, as in NumPy: the field has shape ``(*shape, 2)`` and dtype ``i4``.

A field whose shape starts with ``None`` is ragged: each example has its own
number of rows of the rest of the shape (``(None,)``: token ids; ``(None, 4)``:
boxes), 0 included. A field of dtype ``object`` and shape ``()`` holds any
Python object (a ``str``, ``bytes``, ``None``), carried by reference.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

__all__ = ["Field", "field_value", "parse_fields", "to_field_array"]

# Kinds a weak Python value may be written into, by the kind of its values.
_WEAK_KINDS = {"b": "biufc", "i": "iufc", "f": "fc", "c": "c"}
# How a kind of Python value is named: its type, and the dtype NumPy reads it as.
_KIND_NAMES = {"b": "bool (bool)", "i": "int (int64)", "f": "float (float64)", "c": "complex (complex128)"}
_PY_SCALARS = (bool, int, float, complex)
_SCALAR_KINDS = {bool: "b", int: "i", float: "f", complex: "c"}
_SEQUENCES = (list, tuple)
_SEQUENCE_TYPES = frozenset(_SEQUENCES)
_PY_VALUES = (*_SEQUENCES, *_PY_SCALARS)
_MAX_EXAMPLE_BYTES = 1 << 40
# NumPy arrays have at most 64 dimensions (32 before NumPy 2); a batch adds one.
_MAX_DIMS = (64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32) - 1


@dataclass(frozen=True)
class Field:
    """One named value of an example: ``shape`` excludes the batch axis, and a
    ragged field's varying first axis too.

    Attributes:
        kind: ``"array"`` (one shape), ``"ragged"`` (a first axis whose length
            varies) or ``"object"`` (a Python object; ``shape`` is ``()``).
    """

    name: str | None
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str = "array"

    @property
    def ragged(self) -> bool:
        return self.kind == "ragged"

    @property
    def nbytes(self) -> int:
        """Bytes per example (per row of a ragged field; 0 for an object field)."""
        return 0 if self.kind == "object" else math.prod(self.shape) * self.dtype.itemsize

    def decl(self) -> tuple[tuple[int, ...], np.dtype]:
        """The native declaration of an array or ragged field (-1 first: ragged)."""
        return ((-1, *self.shape) if self.ragged else self.shape), self.dtype

    def label(self) -> str:
        return "example" if self.name is None else f"field {self.name!r}"


def parse_fields(fields: Any) -> tuple[list[Field], bool]:
    """Parses ``fields`` into a list of Field; returns (fields, single).

    Args:
        fields: a ``(shape, dtype)`` pair for plain array examples, or a mapping
            from field name to ``(shape, dtype)``; a shape starting with None
            declares a ragged field, and ``((), object)`` an object field.

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
    ragged = isinstance(shape_spec, (tuple, list)) and len(shape_spec) > 0 and shape_spec[0] is None
    shape = _parse_shape(shape_spec[1:] if ragged else shape_spec, where)
    try:
        dtype = np.dtype(dtype_spec)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: {dtype_spec!r} is not a NumPy dtype ({exc})") from None
    if dtype == np.dtype(object) and shape == () and not ragged:
        return Field(name, (), dtype, "object")
    if dtype.hasobject:
        raise TypeError(f"{where}: dtype {dtype} holds Python objects; expected a fixed-size dtype (or ((), object) "
                        f"for a field of Python objects)")
    while dtype.subdtype is not None:  # ("i4", (2,)): NumPy's trailing axes of int32
        dtype, inner = dtype.subdtype
        shape = _parse_shape(shape + inner, where)
    if dtype.itemsize == 0:
        raise ValueError(f"{where}: dtype {dtype} has no size; give one (for example 'S16')")
    if len(shape) > _MAX_DIMS:
        raise ValueError(
            f"{where}: expected at most {_MAX_DIMS} dimensions (a batch adds one to NumPy's limit of "
            f"{_MAX_DIMS + 1}), got {len(shape)}"
        )
    if ragged and len(shape) + 1 > _MAX_DIMS:
        raise ValueError(f"{where}: expected at most {_MAX_DIMS} dimensions, got {len(shape) + 1}")
    field = Field(name, shape, dtype, "ragged" if ragged else "array")
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


def field_value(value: Any, field: Field, rows: int | None, where: str) -> Any:
    """A leaf's value for a put: converted to its field (see to_field_array),
    or for an object field as it is (objects travel by reference)."""
    return value if field.kind == "object" else to_field_array(value, field, rows, where)


def to_field_array(value: Any, field: Field, rows: int | None, where: str) -> np.ndarray:
    """Converts one field's value to a C-contiguous array of the field's dtype.

    Args:
        value: the value given for the field.
        field: its declaration (an array or ragged field).
        rows: None for one example; n for n stacked examples (leading axis n;
            not for a ragged field).
        where: the call, for messages (``"put()"``).

    Returns:
        The value itself when it already fits, else a converted copy.

    Raises:
        TypeError: the value cannot be cast safely to the field's dtype.
        ValueError: wrong shape.
        OverflowError: a Python number out of the field's range.
    """
    shape = field.shape if rows is None else (rows, *field.shape)
    if field.ragged:
        shape = (_rows_of(value), *field.shape)
        if shape[0] == 0 and np.size(value) == 0 and np.ndim(value) in (1, len(shape)):
            return np.zeros(shape, dtype=field.dtype)  # no rows: no values to cast ([] reads as float64)
    if type(value) is np.ndarray:
        array = value
    else:
        if isinstance(value, _PY_VALUES):
            numbers = _python_numbers(value)
            if numbers is not None:
                return _from_python(value, *numbers, field, shape, where)
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(
                f"{where}: {field.label()} could not be read as an array: {exc}{_torch_dtype_hint(value)}"
            ) from None
        if array.dtype.hasobject:
            raise TypeError(
                f"{where}: {field.label()} expected {field.dtype} values, got {_describe(value)}"
            )
    if array.dtype != field.dtype and not np.can_cast(array.dtype, field.dtype, casting="safe"):
        raise TypeError(
            f"{where}: {field.label()} expected dtype {field.dtype}, got {array.dtype}, which "
            f"cannot be cast safely (see dataecho.examples.fields for the casting rule)"
        )
    if array.shape != shape:
        raise ValueError(f"{where}: {field.label()} expected shape {shape}, got {array.shape}")
    if array.dtype == field.dtype and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=field.dtype)


def _rows_of(value: Any) -> int:
    """The length of a ragged field's value along its first axis (-1 when it has
    none: the shape check then says what was expected)."""
    try:
        shape = np.shape(value) if not isinstance(value, list) or value else (0,)
    except (TypeError, ValueError):  # nested lists of different lengths
        return len(value) if isinstance(value, (list, tuple)) else -1
    return shape[0] if shape else -1


def _python_numbers(value: Any) -> tuple[tuple[int, ...], list, str] | None:
    """(shape, values in C order, kind) of a Python number or of (nested) lists and
    tuples of them; None when anything else is inside (a NumPy value, an array, a
    string, ...) or the nesting is ragged: NumPy's reading then decides."""
    kind = _SCALAR_KINDS.get(type(value))
    if kind is not None:  # one plain Python number: the common case, made quick
        return (), [value], kind
    level, shape = [value], []
    while True:
        types = set(map(type, level))
        if not types or not (types <= _SEQUENCE_TYPES or all(issubclass(t, _SEQUENCES) for t in types)):
            break
        lengths = set(map(len, level))
        if len(lengths) > 1:
            return None
        shape.append(lengths.pop())
        level = [item for items in level for item in items]
    kinds = set(map(_kind_of, types))
    if None in kinds:
        return None
    # The widest kind present; NumPy reads [] as float64.
    kind = "c" if "c" in kinds else "f" if "f" in kinds or not kinds else "i" if "i" in kinds else "b"
    return tuple(shape), level, kind


def _kind_of(cls: type) -> str | None:
    """The kind of a Python number's type (subclasses included, NumPy's excluded)."""
    kind = _SCALAR_KINDS.get(cls)
    if kind is None and not issubclass(cls, np.generic):
        kind = next((_SCALAR_KINDS[base] for base in _PY_SCALARS if issubclass(cls, base)), None)
    return kind


def _from_python(
    value: Any, found: tuple[int, ...], values: list, kind: str, field: Field, shape: tuple[int, ...], where: str
) -> np.ndarray:
    """``value``, weak Python numbers (see the rule above), as an array of the field."""
    dtype = field.dtype
    into = dtype.kind
    if into not in _WEAK_KINDS[kind]:
        raise TypeError(
            f"{where}: {field.label()} expected dtype {dtype}, got Python {_KIND_NAMES[kind]}, which "
            f"cannot be cast safely (see dataecho.examples.fields for the casting rule)"
        )
    if found != shape:
        raise ValueError(f"{where}: {field.label()} expected shape {shape}, got {found}")
    array = np.asarray(value)
    if array.dtype == dtype:  # NumPy reads it as the field's dtype (int64, say): nothing is lost
        return array
    if into in "iu" and kind == "i" and values:
        low, high = _int_bounds(dtype)
        smallest, largest = min(values), max(values)
        if smallest < low or largest > high:
            raise OverflowError(
                f"{where}: {field.label()} value {smallest if smallest < low else largest} is out of "
                f"range for {dtype} [{low}, {high}]"
            )
    elif into in "fc" and values:
        quick, limit = _float_limits(dtype)
        try:
            fits = not any(abs(v) >= quick for v in values)  # NaN fits; inf is checked by value
        except OverflowError:  # the modulus of a complex beyond float range
            fits = False
        culprit = None if fits else _first_beyond(values, limit)
        if culprit is not None:
            raise OverflowError(
                f"{where}: {field.label()} value {culprit!r} is out of range for {dtype} "
                f"(largest finite {float(np.finfo(dtype).max):g})"
            )
    return np.array(value, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _int_bounds(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


@functools.lru_cache(maxsize=None)
def _float_limits(dtype: np.dtype) -> tuple[float, int]:
    """(quick, limit): a number of magnitude ``limit`` or more (half an ulp above the
    largest finite value) rounds to infinity in ``dtype``; one below ``quick`` does
    not, even through the float64 that NumPy reads a Python number as first."""
    info = np.finfo(dtype)
    limit = 2**info.maxexp - 2 ** (info.maxexp - info.nmant - 2)
    return limit - 2 ** (info.maxexp - 52), limit


def _first_beyond(values: list, limit: int) -> Any:
    """The first of ``values`` with a finite part that NumPy would make infinite."""
    for value in values:
        for part in (value.real, value.imag):
            try:
                part = float(part)  # as NumPy reads it
            except OverflowError:  # an int beyond float64
                return value
            if math.isfinite(part) and abs(part) >= limit:
                return value
    return None


def _torch_dtype_hint(value: Any) -> str:
    """For a dense CPU tensor that NumPy cannot read, so of a dtype NumPy lacks
    (bfloat16, float8_*, complex32, ...): how to put it all the same."""
    if not type(value).__module__.startswith("torch") or getattr(value, "is_quantized", True):
        return ""
    if str(value.layout) != "torch.strided" or value.device.type != "cpu" or value.requires_grad:
        return ""
    bits = 8 * value.element_size()
    return (f"; a field has a NumPy dtype: declare it as int{bits} and put tensor.view(torch.int{bits}) (view "
            f"the batch back with torch.from_numpy(batch).view({value.dtype})), or use EchoLoader, which "
            f"carries {value.dtype} tensors")


def _describe(value: Any) -> str:
    if isinstance(value, numbers.Number) or value is None:
        return repr(value)
    return type(value).__name__
