"""Reading a map-style source in chunks: what the producers (threads, worker
processes, or the caller's thread with ``workers=0``) do per example, amortized.

A producer claims up to ``CHUNK`` consecutive positions of the epoch's order at
once, reads them, converts them column by column (one list or stacked array per
leaf), and puts them with one native call, which copies every row into its slot
without the GIL. How a chunk is read depends on the source:

* a NumPy array or memmap (or any buffer with a leading example axis), or a
  torch ``TensorDataset`` of CPU tensors, without ``transform``: no Python per
  example; the native put holds row ``order[p]`` of an in-memory array of 8 KiB
  or more per row by reference, and the batch is gathered straight from it,
  and copies smaller rows, and a memmap's, straight into a slot
  (:class:`ArrayReader`; dataecho.buffer, "Holding");
* a Hugging Face ``datasets.Dataset`` (Arrow-backed), without ``transform``:
  one Arrow ``take`` per chunk, converted to NumPy columns; leaves have the
  Arrow column's type, as declared in the dataset's features
  (:class:`ArrowReader`);
* anything else: ``__getitems__(indices)`` once per chunk where the source has
  it (torch's batched-fetch convention), else ``source[i]`` per example, then
  ``transform`` per example (:class:`ExampleReader`).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np

from . import _core
from .fields import Field, to_field_array
from .ragged import Ragged
from .ray_source import RowBlock, RowIterator
from .stage import stop_iteration_error
from .structure import Structure

__all__ = ["CHUNK", "Columns", "chunked", "claimed", "map_reader", "ragged_hint", "rows_contiguous", "source_array",
           "tensor_arrays"]

CHUNK = 64  # positions claimed at a time
SLICE_S = 0.01  # examples read one by one are put at least this often, however slow they are

# A chunk to put: (sequence number of its first row, rows, one column per field;
# see _core.Buffer.put_each for the forms a column takes).
Chunk = tuple[int, int, list]


class Columns:
    """Converts a list of examples to the native columns of a buffer: one per
    array or ragged leaf of ``structure``, a list of the leaves as they are
    where they already match their field (no copy), else converted as a single
    put converts them (same checks, same messages); then, where there are
    object leaves, their carrier column (dataecho.objects).

    Args:
        structure: the examples' structure.
        fields: the buffer's fields, one per leaf.
        codec: carries the object leaves (the buffer's, or a worker's); None
            without object leaves.
    """

    def __init__(self, structure: Structure, fields: list[Field], codec: Any = None) -> None:
        self.structure, self.fields, self._codec = structure, fields, codec
        self._decls = [f.decl() if f.kind != "object" else None for f in fields]
        self._objects = [i for i, f in enumerate(fields) if f.kind == "object"]

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
            return values
        if exact == 0 and field.kind == "array" and (stacked := _scalars(values, field)) is not None:
            return stacked
        return values[:exact] + [self.converted(v, leaf) for v in values[exact:]]

    def converted(self, value: Any, leaf: int) -> np.ndarray:
        """One leaf's value converted to its field, as a put converts it; a leaf
        taken as fixed whose first axis changed says how to declare it ragged."""
        field = self.fields[leaf]
        value = self.structure.leaf(value, leaf)
        try:
            return to_field_array(value, field, None, "example")
        except ValueError:
            hint = ragged_hint(field, value)
            if hint is None:
                raise
        raise ValueError(hint)


def ragged_hint(field: Field, value: Any) -> str | None:
    """The error for a leaf taken as fixed whose first axis has another length
    here, or None when its shape differs otherwise."""
    shape = np.shape(value) if isinstance(value, (np.ndarray, list)) else ()
    if field.kind != "array" or len(shape) != len(field.shape) or not shape or shape[1:] != field.shape[1:]:
        return None
    return (f"example: leaf {field.name or 'example'!r} has shape {tuple(shape)} where the first examples had "
            f"{field.shape}; a leaf whose length varies is ragged: declare it with "
            f"EchoLoader(..., ragged=[{field.name or ''!r}])")


def claimed(claim_range: Any, chunk: int, reader: Any, columns: Columns) -> Iterator[Chunk]:
    """The chunks of the positions a worker claims, ``chunk`` at a time (or the
    reader's own ``claim``, where larger), from a buffer's ``claim_range`` (in
    this process or a worker's), until all are claimed."""
    chunk = max(chunk, getattr(reader, "claim", 0))
    while True:
        first, count = claim_range(chunk)
        if count == 0:
            return
        yield from reader.chunks(first, count, columns)


def chunked(iterator: Iterator[Any], first_seq: int = 0, blocks: bool = False) -> Iterator[tuple[int, list | RowBlock]]:
    """An iterable source's examples in chunks: (number of the first, up to
    CHUNK examples read within SLICE_S), numbered from ``first_seq``; with
    ``blocks`` (a put without transform), from an iterator that hands them out
    in blocks (dataecho.ray_source), a block each."""
    seq = first_seq
    if blocks and isinstance(iterator, RowIterator):
        for block in iterator.blocks():
            yield seq, block
            seq += len(block)
        return
    while True:
        examples, started = [], time.perf_counter()
        for example in iterator:
            examples.append(example)
            if len(examples) == CHUNK or time.perf_counter() - started > SLICE_S:
                break
        if not examples:
            return
        yield seq, examples
        seq += len(examples)


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


def source_array(source: Any) -> np.ndarray | None:
    """``source`` as an array whose rows the native put can copy from: a NumPy
    array or memmap, or an object with the buffer protocol, of at least one
    dimension and a plain dtype; else None."""
    if isinstance(source, np.ndarray):
        array = source
    else:
        try:
            array = np.asarray(memoryview(source))
        except (TypeError, ValueError):
            return None
    if array.ndim < 1 or array.dtype.hasobject or array.dtype.itemsize == 0:
        return None
    return array


def tensor_arrays(source: Any) -> list[np.ndarray] | None:
    """A torch ``TensorDataset``'s CPU tensors as the arrays over their memory,
    where each has a NumPy dtype; else None."""
    tensors = getattr(source, "tensors", None)
    if type(source).__name__ != "TensorDataset" or not isinstance(tensors, tuple) or not tensors:
        return None
    arrays = []
    for tensor in tensors:
        try:
            array = tensor.detach().numpy()  # refuses a GPU tensor or a dtype NumPy lacks (bfloat16)
        except (TypeError, RuntimeError, AttributeError):
            return None
        if source_array(array) is None:
            return None
        arrays.append(array)
    return arrays


def rows_contiguous(array: np.ndarray) -> bool:
    """Whether each row's own bytes are C-contiguous (the rows may be strided):
    what the native put needs to copy rows straight from the array."""
    expected = array.itemsize
    for size, stride in zip(reversed(array.shape[1:]), reversed(array.strides[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


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


class ExampleReader:
    """``source[i]`` per example (or ``__getitems__`` per chunk), then ``transform``."""

    def __init__(self, source: Any, transform: Any, order: np.ndarray) -> None:
        self._source, self._transform, self._order = source, transform, order
        self._getitems = getattr(source, "__getitems__", None)
        self._quick = False  # per-example reads measured fast (see chunks)
        self._reader_name = "source" if transform is None else "source or transform"

    def one(self, position: int) -> Any:
        """The example at ``position`` of the order, transformed."""
        try:
            example = self._source[int(self._order[position])]
        except StopIteration as stop:  # not the end of anything: an error (see Failure.set)
            raise stop_iteration_error(stop, "source") from stop
        return self._transformed(example)

    def chunks(self, first: int, count: int, columns: Columns) -> Iterator[Chunk]:
        """Positions [first, first + count), read and converted, in chunks."""
        indices = self._order[first:first + count].tolist()
        if self._getitems is not None:
            try:
                examples = list(self._getitems(indices))
            except StopIteration as stop:
                raise stop_iteration_error(stop, "source") from stop
            if len(examples) != count:
                raise ValueError(f"source: __getitems__ returned {len(examples)} examples for {count} indices")
            if self._transform is not None:
                examples = [self._transformed(e) for e in examples]
            yield first, count, columns.of(examples)
            return
        started = time.perf_counter()
        for seq, examples in self._quick_read(indices, first) if self._quick else chunked(self._read(indices), first):
            # Quick when a whole chunk reads in under half the slice.
            self._quick = (time.perf_counter() - started) * CHUNK < SLICE_S / 2 * len(examples)
            yield seq, len(examples), columns.of(examples)
            started = time.perf_counter()

    def _read(self, indices: list[int]) -> Iterator[Any]:
        """The examples at ``indices``, transformed, one by one."""
        source, transform = self._source, self._transform
        try:
            for i in indices:
                example = source[i]
                yield example if transform is None else transform(example)
        except StopIteration as stop:
            raise stop_iteration_error(stop, self._reader_name) from stop

    def _quick_read(self, indices: list[int], first: int) -> Iterator[tuple[int, list]]:
        """``_read``'s examples in one chunk, by one list comprehension: no clock per example."""
        source, transform = self._source, self._transform
        try:
            examples = [source[i] for i in indices] if transform is None else [transform(source[i]) for i in indices]
        except StopIteration as stop:
            raise stop_iteration_error(stop, self._reader_name) from stop
        yield first, examples

    def _transformed(self, example: Any) -> Any:
        try:
            return example if self._transform is None else self._transform(example)
        except StopIteration as stop:
            raise stop_iteration_error(stop, "transform") from stop


class ArrayReader:
    """Rows of arrays, copied natively from the arrays into the slots: one array
    (examples are its rows), or a torch ``TensorDataset``'s tensors (examples
    are tuples of their rows)."""

    def __init__(self, arrays: list[np.ndarray], order: np.ndarray, as_tuple: bool = False) -> None:
        self._arrays, self._order, self._tuple = arrays, order, as_tuple
        self._direct = [rows_contiguous(array) for array in arrays]

    def one(self, position: int) -> Any:
        i = int(self._order[position])
        rows = tuple(array[i] for array in self._arrays)
        return rows if self._tuple else rows[0]

    def chunks(self, first: int, count: int, columns: Columns) -> Iterator[Chunk]:
        indices = np.asarray(self._order[first:first + count], dtype=np.int64)  # checked by epoch_order
        yield first, count, [
            (array, indices) if direct
            else to_field_array(np.take(array, indices, axis=0), field, count, "put()")
            for array, direct, field in zip(self._arrays, self._direct, columns.fields)
        ]


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
        self._ragged = _varying(dataset, [f.name for f in self._view[:0].schema if _column_kind(f.type) == "ragged"])

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
        read = self._read(self._order[first:first + count])
        if list(read) != columns.structure.paths:
            raise ValueError(f"source: columns {list(read)} differ from the first example's {columns.structure.paths}")
        yield first, count, columns.carry([_converted(value, field, count)
                                           for value, field in zip(read.values(), columns.fields)])

    def _read(self, indices: np.ndarray) -> dict[str, Any]:
        table = self._view[indices.tolist()]
        return {name: _from_arrow(name, table.column(name), len(indices), name in self._ragged)
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


def _varying(dataset: Any, names: list[str]) -> set[str]:
    """Which of the list columns ``names`` hold lists of different lengths, over
    the whole table: the offsets alone are read, not the values."""
    import pyarrow.compute as pc

    varying = set()
    for name in names:
        lengths = pc.min_max(pc.list_value_length(dataset.data.column(name)))
        if lengths["min"].as_py() != lengths["max"].as_py():
            varying.add(name)
    return varying


def _from_arrow(name: str, column: Any, rows: int, ragged: bool) -> Any:
    """An Arrow column as one array of ``rows`` rows, a Ragged (``ragged``: the
    outermost lists, of any length), or a list (strings, bytes)."""
    array = column.combine_chunks()
    if _column_kind(array.type) == "object":
        return array.to_pylist()
    if not ragged:
        return _to_numpy(name, array, [rows])
    if array.null_count:
        raise ValueError(f"source: column {name!r} holds missing values (None)")
    offsets = array.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]  # a slice's offsets start where it does
    values = _to_numpy(name, array.flatten(), [int(offsets[-1])])
    return Ragged(values, offsets)


def _to_numpy(name: str, array: Any, shape: list[int]) -> np.ndarray:
    """An Arrow array of numbers or equal-length (nested) lists of them as one
    array of shape ``shape`` (its rows) and the lists' lengths."""
    import pyarrow as pa

    while not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type)):
        if pa.types.is_fixed_size_list(array.type):
            width = array.type.list_size
        else:
            lengths = np.diff(array.offsets.to_numpy())
            if len(lengths) and (lengths != lengths[0]).any():
                raise ValueError(f"source: column {name!r} holds lists of different lengths "
                                 f"({lengths.min()} to {lengths.max()}) below its first level; only a leaf's "
                                 f"first axis may vary")
            width = int(lengths[0]) if len(lengths) else 0
        array = array.flatten()
        shape.append(width)
    if array.null_count:
        raise ValueError(f"source: column {name!r} holds missing values (None)")
    return array.to_numpy(zero_copy_only=False).reshape(shape)
