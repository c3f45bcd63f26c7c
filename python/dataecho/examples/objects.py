"""Leaves that are Python objects (a ``str``, ``bytes``, ``None``, anything that
is not an array): how they travel through the native buffer with their example.

The native buffer stores bytes only, so an example's objects ride in one extra
field, the *carrier*, in one of two ways:

* ``"key"`` (producers are threads of this process): by reference. The objects
  of an example go into a table under a new key, and the carrier holds the key
  (8 bytes). A batch's objects are looked up by key, in the batch's order, so
  each example's values stay with its arrays through every echo. The native
  buffer reports the keys of the examples whose slots it freed (their last
  echo delivered, or evicted), and the table drops them then: it holds at most
  the examples resident in the buffer.
* ``"pickle"`` (worker processes): the objects of an example are pickled once,
  by the worker, into a ragged ``uint8`` carrier; each delivery unpickles them.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, Iterable, Sequence

import numpy as np

from .fields import Field
from .ragged import Ragged

__all__ = ["LeafMap", "ObjectCodec"]

_CARRIER = "__objects__"


class ObjectCodec:
    """Carries the object leaves of examples in one native field.

    Args:
        mode: ``"key"`` or ``"pickle"`` (see the module docstring).
    """

    def __init__(self, mode: str) -> None:
        if mode not in ("key", "pickle"):
            raise ValueError(f"mode: expected 'key' or 'pickle', got {mode!r}")
        self.mode = mode
        self._table: dict[int, tuple] = {}
        self._keys = itertools.count(1)  # next() is atomic under the GIL: producer threads share it

    @property
    def field(self) -> Field:
        """The carrier's field."""
        if self.mode == "key":
            return Field(_CARRIER, (), np.dtype(np.uint64))
        return Field(_CARRIER, (), np.dtype(np.uint8), "ragged")

    @property
    def held(self) -> int:
        """Examples whose objects the table holds (``"key"``)."""
        return len(self._table)

    def encode_one(self, objects: tuple) -> np.ndarray:
        """The carrier value of one example's objects."""
        if self.mode == "pickle":
            return _pickled(objects)
        key = next(self._keys)
        self._table[key] = objects
        return np.array(key, dtype=np.uint64)

    def encode(self, rows: Iterable[tuple]) -> Any:
        """The carrier column of several examples' objects (for ``put_each``)."""
        if self.mode == "pickle":
            return [_pickled(objects) for objects in rows]
        keys = []
        for objects in rows:
            key = next(self._keys)
            self._table[key] = objects
            keys.append(key)
        return np.array(keys, dtype=np.uint64)

    def decode(self, carrier: Any) -> list[tuple]:
        """Each row's objects, from a batch's carrier (keys, or (values, offsets))."""
        if self.mode == "key":
            table = self._table
            return [table[key] for key in carrier.tolist()]
        values, offsets = carrier
        data = values.tobytes()
        bounds = offsets.tolist()
        return [pickle.loads(data[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]

    def release(self, keys: Sequence[int]) -> None:
        """Drops the objects of examples the buffer no longer holds (``"key"``)."""
        table = self._table
        for key in keys.tolist() if isinstance(keys, np.ndarray) else keys:
            table.pop(key, None)

    def empty_carrier(self, rows: int) -> Any:
        """A carrier of ``rows`` rows that names no objects (for a batch copy,
        whose objects are handed over as they are)."""
        if self.mode == "key":
            return np.zeros(rows, dtype=np.uint64)
        return np.zeros(0, dtype=np.uint8), np.zeros(rows + 1, dtype=np.int64)


class LeafMap:
    """A buffer's fields, one per leaf, against its native fields: array and
    ragged fields as they are, the object fields in one carrier after them.
    Converts puts into native form, and native batches back into one entry per
    field: an array, a :class:`~dataecho.examples.ragged.Ragged`, a list of objects.

    Args:
        fields: one per leaf.
        mode: how object fields travel (see :class:`ObjectCodec`).
    """

    def __init__(self, fields: Sequence[Field], mode: str) -> None:
        self.kinds = [f.kind for f in fields]
        self.codec = ObjectCodec(mode) if "object" in self.kinds else None
        self.native = [f for f in fields if f.kind != "object"] + ([self.codec.field] if self.codec else [])

    def example(self, values: Sequence[Any]) -> list:
        """One example's converted values (objects as they are) in native form."""
        if self.codec is None:
            return list(values)
        native = [v for v, kind in zip(values, self.kinds) if kind != "object"]
        return [*native, self.codec.encode_one(tuple(v for v, kind in zip(values, self.kinds) if kind == "object"))]

    def columns(self, columns: Sequence[Any]) -> list:
        """Columns of ``put_each``, one per field, in native form."""
        if self.codec is None:
            return list(columns)
        native = [c for c, kind in zip(columns, self.kinds) if kind != "object"]
        return [*native, self.codec.encode(zip(*(c for c, kind in zip(columns, self.kinds) if kind == "object")))]

    def leaves(self, native: Sequence[Any], released: Any = None) -> tuple[Any, ...]:
        """A native batch as one entry per field; ``released``: the keys of the
        examples the buffer freed meanwhile (their objects are dropped)."""
        codec = self.codec
        if codec is None and "ragged" not in self.kinds:
            return tuple(native)
        objects: Any = iter(())
        if codec is not None:
            rows = codec.decode(native[-1])
            if codec.mode == "key" and released is not None:
                codec.release(released)
            objects = iter([list(column) for column in zip(*rows)])
        items = iter(native)
        return tuple(next(objects) if kind == "object" else
                     Ragged.of_batch(*next(items)) if kind == "ragged" else next(items) for kind in self.kinds)

    def for_copy(self, leaves: Sequence[Any]) -> list:
        """A batch's leaves in native form for a copy (object lists are copied
        as lists, so their carrier names nothing)."""
        native = [(leaf.values, leaf.offsets) if kind == "ragged" else leaf
                  for leaf, kind in zip(leaves, self.kinds) if kind != "object"]
        return native + ([self.codec.empty_carrier(len(leaves[0]))] if self.codec else [])

    def copied(self, leaves: Sequence[Any], native: Sequence[Any]) -> tuple[Any, ...]:
        """The copy of ``leaves`` from its native copy."""
        items = iter(native)
        return tuple(list(leaf) if kind == "object"
                     else Ragged.of_batch(*next(items)) if kind == "ragged"
                     else next(items)
                     for leaf, kind in zip(leaves, self.kinds))


def _pickled(objects: tuple) -> np.ndarray:
    return np.frombuffer(pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
