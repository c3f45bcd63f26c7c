"""Examples as the native buffer's columns: one list or stacked array per
leaf, converted as a single put converts them, so that a chunk of examples
goes into the buffer with one native call."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .. import _core
from .blocks import RowBlock
from .fields import Field, to_field_array
from .structure import Structure

__all__ = ["ALONE", "FRESH_MIN_BYTES", "Columns", "Fresh", "Into", "ragged_hint", "ref_counts"]

# Leaves of at least this many bytes per example are marked fresh where they are (see Fresh): below it, holding
# one costs about what the copy it saves does (bench/bench_loaders.py: 12 KiB rows no faster held).
FRESH_MIN_BYTES = 32 << 10


class Fresh(list):
    """A column of one leaf's values (a list, as ``put_each`` takes it) that
    says which of them are *fresh*: NumPy arrays that own their memory and
    that nothing but their example holds, such as the new array a
    ``__getitem__`` returns. Nobody else can see or change a fresh array, so a
    buffer may hold it by reference instead of copying it into a slot
    (dataecho.native.hold); an array the dataset keeps (its own list of
    arrays, a cache) or views is not fresh, and is copied.

    Attributes:
        fresh: per value, whether it is fresh.
    """

    __slots__ = ("fresh",)


class Into:
    """A chunk a dataset writes straight into a buffer's slots (its
    ``read_into``), given to ``put_each`` in place of columns.

    Attributes:
        write: ``write(i, views)``: writes the chunk's row ``i`` into
            ``views``, one writable array per field over a slot's memory.
    """

    __slots__ = ("write",)

    def __init__(self, write: Any) -> None:
        self.write = write


def ref_counts(values: list) -> list[int]:
    """Each value's reference count, as compared with :data:`ALONE`."""
    return [sys.getrefcount(v) for v in values]


# What ref_counts says of an array that only its list holds: calibrated on this interpreter, whose
# reference counting of arguments and loop variables may differ from another's.
ALONE = ref_counts([np.empty(1)])[0]

class Columns:
    """Converts a list of examples to the native columns of a buffer: one per
    array or ragged leaf of ``structure``, a list of the leaves as they are
    where they already match their field (no copy), else converted as a single
    put converts them (same checks, same messages); then, where there are
    object leaves, their carrier column (dataecho.examples.objects).

    Args:
        structure: the examples' structure.
        fields: the buffer's fields, one per leaf.
        codec: carries the object leaves (the buffer's, or a worker's); None
            without object leaves.
        where: what the examples are, for messages.
        private: the buffer is this process's own, so that examples may be
            written straight into its slots (:meth:`into`).
    """

    def __init__(self, structure: Structure, fields: list[Field], codec: Any = None, where: str = "example",
                 private: bool = False) -> None:
        self.structure, self.fields, self._codec, self._where = structure, fields, codec, where
        self._decls = [f.decl() if f.kind != "object" else None for f in fields]
        self._objects = [i for i, f in enumerate(fields) if f.kind == "object"]
        self._large = {i for i, f in enumerate(fields) if f.kind == "array" and f.nbytes >= FRESH_MIN_BYTES}
        # A fresh leaf's holders: its column, and its example's container (for one-leaf examples, the
        # list of examples is the column: Structure.columns).
        self._alone = ALONE + (0 if structure.single else 1)
        # Written in place where that saves a copy: a private buffer, NumPy arrays alone, large examples.
        self.writes_into = (private and all(f.kind == "array" for f in fields) and not structure.has_raw
                            and sum(f.nbytes for f in fields) >= FRESH_MIN_BYTES)

    def of(self, examples: list | RowBlock) -> list:
        """The columns of a list of examples, or of a block of rows held as
        columns (put as they are where they match their fields)."""
        if isinstance(examples, RowBlock):
            stacked = self._stacked(examples)
            if stacked is not None:
                return stacked
            examples = list(examples)
        return self.carry([self._column(i, values) for i, values in enumerate(self.structure.columns(examples))])

    def _stacked(self, block: RowBlock) -> list | None:
        """A block's columns, or None where its rows must go one by one to be
        converted as a put converts them.

        Its rows are dicts of its columns, so columns named as the structure's
        leaves are those leaves. A column of numbers goes stacked (cast as its
        rows' Python numbers would be where its dtype differs): its rows are
        copied into slots, never held, since holding one row would keep the
        whole block alive (in Ray's object store). A column of objects goes
        as its items."""
        if list(block.columns) != self.structure.paths:
            return None
        columns: list = []
        for leaf, (field, column) in enumerate(zip(self.fields, block.columns.values())):
            if column.dtype.hasobject:
                columns.append(self._column(leaf, list(column)))
            elif field.kind != "array" or column.shape[1:] != field.shape or not np.can_cast(column.dtype, field.dtype):
                return None
            else:
                columns.append(to_field_array(column, field, len(column), "put()"))
        return self.carry(columns)

    def carry(self, columns: list) -> list:
        """Converted columns, one per leaf, as the buffer's native columns: the
        object leaves' columns in one carrier column, last."""
        if not self._objects:
            return columns
        carried = self._codec.encode(zip(*(columns[i] for i in self._objects)))
        return [c for i, c in enumerate(columns) if i not in self._objects] + [carried]

    def _column(self, leaf: int, values: list) -> Any:
        field = self.fields[leaf]
        if field.kind == "object":
            return values
        exact = _core.exact_rows(values, self._decls[leaf])
        if exact == len(values):
            return self._marked(values) if leaf in self._large else values
        if exact == 0 and field.kind == "array" and (stacked := _scalars(values, field)) is not None:
            return stacked
        return values[:exact] + [self.converted(v, leaf) for v in values[exact:]]

    def into(self, read_into: Any, indices: list[int]) -> Into:
        """The chunk of ``indices`` as ``read_into(index, out)`` writes it: ``out``
        is the example's structure over a slot's memory (where :attr:`writes_into`)."""
        unflatten = self.structure.unflatten
        return Into(lambda i, views: read_into(indices[i], unflatten(views)))

    def _marked(self, values: list) -> Fresh:
        """``values`` as a :class:`Fresh` column: counted before the new list holds them too."""
        counts = ref_counts(values)
        column = Fresh(values)
        column.fresh = [n == self._alone and type(v) is np.ndarray and v.base is None for v, n in zip(values, counts)]
        return column

    def converted(self, value: Any, leaf: int) -> np.ndarray:
        """One leaf's value converted to its field, as a put converts it; a leaf
        taken as fixed whose first axis changed says how to declare it ragged."""
        field = self.fields[leaf]
        value = self.structure.leaf(value, leaf)
        try:
            return to_field_array(value, field, None, self._where)
        except ValueError:
            hint = ragged_hint(field, value, self._where)
            if hint is None:
                raise
        raise ValueError(hint)


def ragged_hint(field: Field, value: Any, where: str = "example") -> str | None:
    """The error for a leaf taken as fixed whose first axis has another length
    here, or None when its shape differs otherwise."""
    shape = np.shape(value) if isinstance(value, (np.ndarray, list)) else ()
    if field.kind != "array" or len(shape) != len(field.shape) or not shape or shape[1:] != field.shape[1:]:
        return None
    return (f"{where}: leaf {field.name or 'example'!r} has shape {tuple(shape)} where the first examples had "
            f"{field.shape}; a leaf whose length varies is ragged: declare it with "
            f"EchoLoader(..., ragged=[{field.name or ''!r}])")


def _scalars(values: list, field: Field) -> np.ndarray | None:
    """Numbers of exactly the field's type (Python int for int64, float for
    float64, bool, or NumPy scalars of its dtype), stacked; else None."""
    if field.shape != ():
        return None
    kind = type(values[0])
    expected = _PYTHON_DTYPES.get(kind, kind if issubclass(kind, np.generic) else None)
    if expected is None or np.dtype(expected) != field.dtype or any(type(v) is not kind for v in values):
        return None
    try:
        return np.array(values, dtype=field.dtype)
    except (OverflowError, TypeError, ValueError):  # out of range: converted one by one, which says so
        return None

_PYTHON_DTYPES = {bool: np.bool_, int: np.int64, float: np.float64}
