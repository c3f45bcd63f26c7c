"""A Hugging Face ``datasets.Dataset`` (Arrow-backed) read through its Arrow
table, without ``transform``: one Arrow ``take`` per chunk, converted to NumPy
columns; leaves have the dtypes the dataset's own numpy and torch formats give
(integers int64, floats float32)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..examples.columns import Columns
from ..examples.fields import Field, to_field_array
from ..examples.ragged import Ragged
from .chunking import Chunk

__all__ = ["ArrowReader"]

class ArrowReader:
    """A Hugging Face ``datasets.Dataset`` read through its Arrow table: one
    ``take`` per chunk (which follows the dataset's own indices, after a
    ``shuffle`` or ``select``), each column converted at once: numbers and
    fixed-length lists to one NumPy array, variable-length lists (sequence
    features: token ids) to packed values and offsets (a ragged leaf), strings
    and bytes to a list (an object leaf)."""

    claim = 512  # positions per take: a take costs ~0.1 ms however few rows it has

    def __init__(self, dataset: Any, order: np.ndarray) -> None:
        self._view = dataset.with_format("arrow", columns=dataset.format.get("columns"))
        self._order = order
        self._levels = {field.name: _list_lengths(dataset.data.column(field.name))
                        for field in self._view[:0].schema if _column_kind(field.type) != "object"}
        self._ragged = {name for name, levels in self._levels.items() if levels and levels[0][0] != levels[0][1]}

    @staticmethod
    def reads(source: Any) -> bool:
        """An Arrow-backed dataset whose columns are numbers, lists of them (the
        outermost of any length), strings or bytes, in a format that only turns
        its rows into arrays (no transform of its own, such as
        ``with_transform``, no dtype or other option)."""
        if not (type(source).__module__.startswith("datasets.") and hasattr(source, "with_format")
                and hasattr(source, "features")):
            return False
        form = getattr(source, "format", None) or {}
        if form.get("type") not in _PLAIN_FORMATS or form.get("output_all_columns") or any(
                value is not None for value in (form.get("format_kwargs") or {}).values()):
            return False
        try:
            schema = source.with_format("arrow", columns=source.format.get("columns"))[:0].schema
        except Exception:  # not the Dataset this reader knows: read it example by example
            return False
        kinds = [_column_kind(field.type) for field in schema]
        return len(schema) > 0 and None not in kinds and any(kind != "object" for kind in kinds)

    def ragged_columns(self) -> set[str]:
        """The columns of lists whose lengths vary (anywhere in the table, not
        only in the first rows): ragged leaves."""
        return set(self._ragged)

    def one(self, position: int) -> dict[str, Any]:
        columns = self._read(np.asarray(self._order[position:position + 1]))
        return {name: column[0] for name, column in columns.items()}

    def chunks(self, first: int, count: int, columns: Columns) -> Iterator[Chunk]:
        indices = np.asarray(self._order[first:first + count])
        count = len(indices)  # fewer where a lazily read order ends before
        if not count:
            return
        read = self._read(indices)
        if list(read) != columns.structure.paths:
            raise ValueError(f"source: columns {list(read)} differ from the first example's {columns.structure.paths}")
        yield first, count, columns.carry([_converted(value, field, count)
                                           for value, field in zip(read.values(), columns.fields)])

    def _read(self, indices: np.ndarray) -> dict[str, Any]:
        table = self._view[indices.tolist()]
        return {name: _from_arrow(name, table.column(name), len(indices), self._levels.get(name, []))
                for name in table.column_names}

_PLAIN_FORMATS = (None, "python", "numpy", "np", "torch", "pt", "arrow", "pa")


def _column_kind(arrow_type: Any) -> str | None:
    """"array" (numbers, fixed-length lists of them), "ragged" (a list of any
    length of those), "object" (strings, bytes), or None (not read natively)."""
    import pyarrow as pa

    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_binary(arrow_type) \
            or pa.types.is_large_binary(arrow_type):
        return "object"
    kind = "array"
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        kind, arrow_type = "ragged", arrow_type.value_type
    while pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        arrow_type = arrow_type.value_type
    numeric = pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type)
    return kind if numeric else None


def _converted(value: Any, field: Field, rows: int) -> Any:
    """A column read from Arrow, converted to its field as a put converts it."""
    if field.kind == "object":
        return value
    if field.kind == "ragged":
        if not isinstance(value, Ragged):
            raise ValueError(f"source: column {field.name!r} changed from lists of any length to fixed rows")
        rows_field = Field(field.name, field.shape, field.dtype)
        return to_field_array(value.values, rows_field, len(value.values), "example"), value.offsets
    return to_field_array(value, field, rows, "example")


def _list_lengths(column: Any) -> list[tuple[int, int]]:
    """The shortest and longest list at each list level of an Arrow column, over
    the whole table (the offsets alone are read, not the values), missing lists
    (None) left out; ``(0, 0)`` for a level that holds no list at all.

    The table decides, not the rows read: a chunk (or a first example) whose rows
    are all empty holds no list at the level below them, yet its leaf must have
    the same inner shape as every other chunk's (COCO's boxes: an image without
    any is ``(0, 4)``). An empty row adds no list to the level below, so it does
    not count there."""
    import pyarrow as pa
    import pyarrow.compute as pc

    levels = []
    while pa.types.is_list(column.type) or pa.types.is_large_list(column.type) \
            or pa.types.is_fixed_size_list(column.type):
        span = pc.min_max(pc.list_value_length(column))
        levels.append((span["min"].as_py() or 0, span["max"].as_py() or 0))
        column = pc.list_flatten(column)
    return levels


def _from_arrow(name: str, column: Any, rows: int, levels: list[tuple[int, int]]) -> Any:
    """An Arrow column as one array of ``rows`` rows, a Ragged (where the lengths
    of its outermost lists vary over the table), or a list (strings, bytes).

    Args:
        name: The column's name, for errors.
        column: The column's rows that were read.
        rows: How many rows were read.
        levels: The table's list lengths at each level (``_list_lengths``).

    Raises:
        ValueError: A row or a list in it is missing (None), or lists below the
            outermost level differ in length.
    """
    array = column.combine_chunks()
    if _column_kind(array.type) == "object":
        return array.to_pylist()
    _refuse_missing(name, array)
    if not levels or levels[0][0] == levels[0][1]:
        return _to_numpy(name, array, [rows], levels)
    offsets = array.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]  # a slice's offsets start where it does
    values = _to_numpy(name, array.flatten(), [int(offsets[-1])], levels[1:])
    return Ragged(values, offsets)


def _to_numpy(name: str, array: Any, shape: list[int], levels: list[tuple[int, int]]) -> np.ndarray:
    """An Arrow array of numbers or equal-length (nested) lists of them, with no
    missing row, as one array of shape ``shape`` (its rows) followed by the
    lengths of the lists at ``levels``, one width each over the whole table."""
    _refuse_missing(name, array)
    for shortest, longest in levels:
        if shortest != longest:
            raise ValueError(f"source: column {name!r} holds lists of different lengths "
                             f"({shortest} to {longest}) below its first level; only a leaf's "
                             f"first axis may vary")
        array = array.flatten()
        _refuse_missing(name, array)
        shape.append(shortest)
    return _as_formatted(array.to_numpy(zero_copy_only=False).reshape(shape))


def _as_formatted(values: np.ndarray) -> np.ndarray:
    """A column as the dataset's own ``numpy`` and ``torch`` formats give it
    (what ``DataLoader(ds.with_format("torch"))`` yields): integers as int64
    (``input_ids`` stored as int32, an ``attention_mask`` as int8: a loss
    asks for int64 targets), floats as float32; bools, and uint64, which no
    int64 holds, as they are. Unlike those formats, uint8 stays uint8: pixels
    and raw bytes, which would take 8 times the memory and copies as int64.
    A dtype of the user's own is a format option (``with_format("torch",
    dtype=...)``): the dataset then casts its rows itself."""
    if values.dtype.kind in "iu" and values.dtype not in (np.int64, np.uint64, np.uint8):
        return values.astype(np.int64)
    if values.dtype.kind == "f" and values.dtype != np.float32:
        return values.astype(np.float32)
    return values


def _refuse_missing(name: str, array: Any) -> None:
    """Raises ValueError if ``array`` holds a missing value (None): a missing row
    has no length or value to stand for it, whatever its type."""
    if array.null_count:
        raise ValueError(f"source: column {name!r} holds missing values (None)")
