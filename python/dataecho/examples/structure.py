"""The structure of an example: a tree of dicts, tuples and lists whose leaves
are arrays, ragged arrays or Python objects, inferred from the first examples
and checked on every later one.

Leaves may be NumPy arrays or scalars, Python ``bool``/``int``/``float``, or
torch CPU tensors. A batch has the same structure with each leaf stacked along a
new leading axis. Leaves are named by their path (``"image"``, ``"0"``,
``"meta/label"``), which is how errors refer to them.

A leaf whose first axis has different lengths in the first examples (token ids,
a varying number of boxes), or a list of numbers whose length varies, is
*ragged*: each example keeps its own length and a batch packs them
(dataecho.examples.ragged). So is a leaf whose path is declared ragged. A list of
numbers of one length stays a list of leaves, as torch's default collate treats
it. A leaf that is not an array (a ``str``, ``bytes``, ``None``, any object) is
an *object* leaf: it rides along by reference and comes out as a list per batch.

A tensor of a dtype NumPy lacks (``torch.bfloat16``, ``float8_*``,
``complex32``, ...) is a *raw* leaf: it is stored as its bytes, an unsigned
integer of the same item size (bfloat16 as uint16), and ``unflatten`` gives it
back as a tensor of its dtype over the same memory, bit for bit, whatever the
other leaves become. Every later example must have a tensor of that dtype there.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from ..tensors.raw import raw_bytes, raw_to_tensor
from .fields import Field
from .given import as_given, given_kind, row_of
from .tree import (LEAVES, Mismatch, Node, as_leaf_array, build, columns_into, flatten_into, is_torch_tensor, join,
                   key_mismatch)

__all__ = ["Structure"]


class Structure:
    """A tree shape plus, for each leaf, its path, kind, shape and dtype.

    Attributes:
        paths: leaf paths, in flattening order.
        specs: ``(shape, dtype)`` per leaf, from the examples it was inferred
            from (a ragged leaf's shape without its first axis; an object
            leaf's ``((), object)``); a raw leaf's dtype is the unsigned integer
            that stores its bytes.
        kinds: per leaf, ``"array"``, ``"ragged"`` or ``"object"``.
        given: per leaf, what the first example held there (see ``GIVEN``):
            how :meth:`example` gives a row back as the dataset returned it.
        torch_dtypes: per leaf, a raw leaf's torch dtype (``"torch.bfloat16"``),
            else None.
        sample_bytes: per example it was inferred from, the bytes of its ragged
            leaves' values and of its object leaves pickled: what sizes the
            page heap (dataecho.native.sizing.page_heap).
    """

    def __init__(self, root: Node, paths: list[str], specs: list[tuple[tuple[int, ...], np.dtype]],
                 torch_dtypes: list[str | None] | None = None, kinds: list[str] | None = None,
                 given: list[str] | None = None):
        self._root = root
        self.paths = paths
        self.specs = specs
        self.torch_dtypes = torch_dtypes or [None] * len(paths)
        self.kinds = kinds or ["array"] * len(paths)
        self.given = given or ["array"] * len(paths)
        self.sample_bytes: dict[str, list[int]] = {"ragged": [], "object": []}
        self._has_raw = any(name is not None for name in self.torch_dtypes)
        self._leaf_nodes = [Node("raw", torch_dtype=name) if name is not None
                            else Node("leaf" if kind == "array" else kind)
                            for name, kind in zip(self.torch_dtypes, self.kinds)]

    @classmethod
    def infer(cls, example: Any, others: Sequence[Any] = (), ragged: Collection[str] | None = None,
              strict: bool = True) -> Structure:
        """Infers the structure of ``example`` and, where given, of the examples
        after it (leaves whose first axis varies among them are ragged).

        Args:
            example: the first example.
            others: more examples of the same source, to tell ragged leaves.
            ragged: paths of leaves declared ragged, whatever the examples show.
            strict: a declared path that is not a leaf here raises (else it is
                left for another structure: ``augment``'s output).

        Raises:
            TypeError: a tensor that cannot be stored (quantized, sparse), a dict
                key that is not a str, or examples whose trees differ.
            ValueError: a declared ragged path that is not a leaf with a first
                axis, or a leaf whose shapes differ other than in the first axis.
        """
        return _Inference(ragged, strict).run(cls, [example, *others])

    @property
    def root(self) -> Node:
        """The tree's top node (see dataecho.examples.tree)."""
        return self._root

    @property
    def has_raw(self) -> bool:
        """Some leaf is a torch dtype NumPy lacks (bfloat16, say), stored as raw bits."""
        return self._has_raw

    @property
    def single(self) -> bool:
        """True when the example is one leaf (no dict, tuple or list around it)."""
        return self._root.kind in LEAVES

    def fields(self) -> list[Field]:
        """One buffer field per leaf, named by its path.

        Zero-sized dimensions are not allowed in a buffer; such a leaf is reported
        with its path.
        """
        for path, (shape, _) in zip(self.paths, self.specs):
            if 0 in shape:
                raise ValueError(f"example: leaf {path or 'example'!r} has an empty dimension {shape}")
        # Rows are copied into batch memory anyway: in native byte order, which torch and JAX
        # take (big-endian leaves, from FITS files or network-order records, are swapped as
        # they are copied). A ShuffleBuffer's declared fields keep the byte order declared.
        return [Field(path or None, shape, dtype if dtype.isnative else dtype.newbyteorder("="), kind)
                for path, (shape, dtype), kind in zip(self.paths, self.specs, self.kinds)]

    def flatten(self, example: Any, what: str = "example", keep: bool = False) -> list[Any]:
        """The leaves of ``example`` in order, after checking its tree shape
        (errors name ``what``; with ``keep``, tensors are not made arrays).

        Leaf shapes and dtypes are checked when the leaves are put into a buffer.

        Raises:
            TypeError: the tree shape differs (naming the path and both shapes).
        """
        leaves: list[Any] = []
        flatten_into(self._root, example, "", leaves, what, keep)
        return leaves

    def columns(self, examples: list) -> list[list]:
        """The leaves of ``examples``, one list per leaf, in flattening order:
        ``flatten`` of each example, transposed. Leaves are not converted (see
        ``leaf``).

        Raises:
            TypeError: an example's tree shape differs (as ``flatten``).
        """
        out: list[list] = []
        try:
            columns_into(self._root, examples, out)
            return out
        except Mismatch:  # flatten each: the first that differs raises, naming the path
            return [list(column) for column in zip(*(self.flatten(e) for e in examples))]

    def leaf(self, value: Any, index: int) -> Any:
        """A value of leaf ``index`` from ``columns`` as ``flatten`` would give it."""
        out: list[Any] = []
        flatten_into(self._leaf_nodes[index], value, self.paths[index], out)
        return out[0]

    def unflatten(self, leaves: Sequence[Any], wrap: Callable[[Any], Any] | None = None,
                  copy_raw: bool = False, raw: Callable[[Any, str, str], Any] | None = None) -> Any:
        """Builds the tree back from leaves in flattening order.

        Args:
            leaves: one array (or batch of arrays, or tensor) per leaf.
            wrap: maps each leaf (``to_torch``, say), raw leaves excepted.
            copy_raw: raw leaves get memory of their own, for code that may
                write to them; by default they view their leaf's memory.
            raw: how a raw leaf is given back, ``raw(bits, dtype_name, path)``
                (for JAX: an ml_dtypes array); by default a torch tensor.

        Returns:
            The tree, with each raw leaf a torch tensor of its dtype (see
            above), or what ``raw`` gives.
        """
        if self._has_raw:
            raw = raw or (lambda bits, name, _: raw_to_tensor(bits, name, copy_raw))
            leaves = [
                raw(leaf, name, path or "example") if name is not None else leaf if wrap is None else wrap(leaf)
                for leaf, name, path in zip(leaves, self.torch_dtypes, self.paths)
            ]
            wrap = None
        it = iter(leaves if wrap is None else map(wrap, leaves))
        return build(self._root, it)

    def example(self, leaves: Sequence[Any], i: int, raw: Callable[[Any, str, str], Any] | None = None) -> Any:
        """Row ``i`` of a batch's leaves as the dataset returned it: a Python
        number as a Python number, a NumPy scalar as one, a tensor as a tensor
        (over the batch memory), an array as a view, a list of numbers as a
        list, an object as itself (what ``collate_fn`` is given); ``raw``: as
        for :meth:`unflatten`."""
        return self.unflatten([as_given(row_of(leaf, i), given) for leaf, given in zip(leaves, self.given)],
                              raw=raw)


def _first_leaf(value: Any, path: str) -> tuple[np.ndarray, str | None]:
    """A leaf of the example a structure is inferred from, as an array, and its
    torch dtype when it is a raw leaf (else None)."""
    if not is_torch_tensor(value) or value.device.type != "cpu":
        return as_leaf_array(value, path), None  # which refuses a tensor on another device
    try:
        return value.detach().numpy(), None
    except TypeError:  # a dtype NumPy lacks, or not a dense tensor: raw_bytes tells which
        return raw_bytes(value, path), str(value.dtype)


_NUMBERS = (bool, int, float, complex, np.generic)


class _Inference:
    """Infers a structure from the first examples, column by column (see
    Structure.infer): every path is looked at in all of them at once."""

    def __init__(self, ragged: Collection[str] | None, strict: bool = True) -> None:
        self.strict = strict
        if isinstance(ragged, str) or (ragged is not None and not isinstance(ragged, Collection)):
            raise TypeError(f"ragged: expected a collection of leaf paths (['input_ids', 'meta/boxes']), "
                            f"got {ragged!r}")
        self.declared = set(ragged or ())
        for path in self.declared:
            if not isinstance(path, str):
                raise TypeError(f"ragged: leaf paths are str ('input_ids', 'meta/boxes', '0'), got {path!r}")
        self.paths: list[str] = []
        self.specs: list[tuple[tuple[int, ...], np.dtype]] = []
        self.torch_dtypes: list[str | None] = []
        self.kinds: list[str] = []
        self.given: list[str] = []
        self.sizes: dict[str, list[list[int]]] = {"ragged": [], "object": []}  # per leaf, per example

    def run(self, cls: type, examples: list) -> Structure:
        root = self.visit(examples, "")
        missing = sorted(self.declared - {p for p, k in zip(self.paths, self.kinds) if k == "ragged"})
        if missing and (self.strict or set(missing) & set(self.paths)):
            raise ValueError(f"ragged: {missing} are not leaves of the example with a first axis; its leaves are "
                             f"{[p or '' for p in self.paths]} (paths join dict keys and positions with '/')")
        if not self.kinds:
            raise TypeError("example: it holds no leaves (an empty container)")
        structure = cls(root, self.paths, self.specs, self.torch_dtypes, self.kinds, self.given)
        structure.sample_bytes = {kind: [sum(column) for column in zip(*sizes)] if sizes else []
                                  for kind, sizes in self.sizes.items()}
        return structure

    def visit(self, values: list, path: str) -> Node:
        first = values[0]
        if isinstance(first, Mapping):
            keys = tuple(first)
            for key in keys:
                if not isinstance(key, str):
                    raise TypeError(f"example: dict keys must be str, got {key!r} at {path or 'the top'!r}")
            for value in values[1:]:
                mismatch = key_mismatch(keys, value) if isinstance(value, Mapping) else ([], [])
                if mismatch is not None:
                    raise TypeError(f"example: the first examples differ at {path or 'the top'!r}: {_kinds(values)}")
            return Node("dict", keys, tuple(self.visit([v[k] for v in values], join(path, k)) for k in keys))
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            self.same_length(values, path)
            children = tuple(self.visit([v[i] for v in values], join(path, f)) for i, f in enumerate(first._fields))
            return Node("namedtuple", tuple(first._fields), children, type(first))
        if isinstance(first, tuple) or (isinstance(first, (list, range)) and not self.list_is_leaf(values, path)):
            self.same_length(values, path)
            kind = "tuple" if isinstance(first, tuple) else "list"  # a range is collated per position, as a list
            return Node(kind, (), tuple(self.visit([v[i] for v in values], join(path, str(i)))
                                         for i in range(len(first))))
        return self.leaf(values, path)

    def list_is_leaf(self, values: list, path: str) -> bool:
        """A list is one (ragged or object) leaf where it is declared ragged or
        its length varies among the examples; else a list of leaves."""
        return path in self.declared or len({len(v) if isinstance(v, (list, range)) else -1 for v in values}) > 1

    def same_length(self, values: list, path: str) -> None:
        def kind(v: Any) -> type:
            return list if isinstance(v, range) else type(v)  # a range stands for a list of ints

        if any(kind(v) is not kind(values[0]) or len(v) != len(values[0]) for v in values):
            raise TypeError(f"example: the first examples differ at {path or 'the top'!r}: {_kinds(values)}")

    def leaf(self, values: list, path: str) -> Node:
        name = path or "example"
        arrays = [_array_of(v, name) for v in values]
        if any(a is None for a in arrays):  # a str, bytes, None, another object: carried as it is
            if path in self.declared:
                raise ValueError(f"ragged: leaf {name!r} holds {_kinds(values)}, not arrays")
            self.sizes["object"].append([len(_pickled(v)) for v in values])
            return self.add(path, ((), np.dtype(object)), None, "object", Node("object"), values[0])
        if any(t is not None for _, t in arrays):
            shapes = {a.shape for a, _ in arrays}
            if path in self.declared or len(shapes) > 1:
                raise ValueError(f"example: leaf {name!r} is a tensor of a dtype NumPy lacks ({arrays[0][1]}) "
                                 f"whose length varies; ragged leaves need a NumPy dtype (convert it in transform)")
            return self.add(path, (arrays[0][0].shape, arrays[0][0].dtype), arrays[0][1], "array",
                            Node("raw", torch_dtype=arrays[0][1]), "raw")
        arrays = [a for a, _ in arrays]
        shapes = {a.shape for a in arrays}
        if path not in self.declared and len(shapes) == 1:
            return self.add(path, (arrays[0].shape, arrays[0].dtype), None, "array", Node("leaf"), values[0])
        rows = {a.shape[1:] for a in arrays}
        if any(a.ndim == 0 for a in arrays) or len(rows) > 1:
            raise ValueError(f"example: leaf {name!r} has shapes {sorted(shapes)} in the first examples; only a "
                             f"leaf's first axis may vary (a ragged leaf)")
        filled = [a.dtype for a in arrays if a.size] or [arrays[0].dtype]
        self.sizes["ragged"].append([a.nbytes for a in arrays])
        return self.add(path, (rows.pop(), np.result_type(*filled)), None, "ragged", Node("ragged"), values[0])

    def add(self, path: str, spec: tuple, torch_dtype: str | None, kind: str, node: Node, first: Any = None) -> Node:
        self.given.append(given_kind(first))
        self.paths.append(path)
        self.specs.append(spec)
        self.torch_dtypes.append(torch_dtype)
        self.kinds.append(kind)
        return node


def _array_of(value: Any, path: str) -> tuple[np.ndarray, str | None] | None:
    """A leaf value of the first examples as (array, raw torch dtype or None),
    or None for an object (anything but an array, a number, a CPU tensor, or a
    list of numbers)."""
    if is_torch_tensor(value) and getattr(value, "is_nested", False):
        raise TypeError(f"example: leaf {path!r} is a nested tensor, which cannot be stored; return its "
                        f"components (value.unbind()) as leaves of their own, or one tensor whose first axis "
                        f"varies (a ragged leaf)")
    if isinstance(value, (np.str_, np.bytes_)):
        return None  # a string, as DataLoader's collate lists it
    if isinstance(value, (np.ndarray, *_NUMBERS)) or is_torch_tensor(value):
        array, torch_dtype = _first_leaf(value, path)
        return None if array.dtype.hasobject else (array, torch_dtype)
    if isinstance(value, range):
        return np.arange(value.start, value.stop, value.step, dtype=np.int64), None
    if isinstance(value, list) and all(isinstance(v, _NUMBERS) for v in value):
        array = np.asarray(value) if value else np.zeros(0, dtype=np.int64)
        low, high = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
        beyond = [v for v in value if isinstance(v, int) and not low <= v <= high] if array.dtype.hasobject else []
        if beyond:  # NumPy keeps them as Python objects, which no field stores: as a fixed leaf's, an overflow
            raise OverflowError(f"example: leaf {path!r} value {beyond[0]} is out of range for int64 [{low}, {high}]")
        return array, None
    if hasattr(value, "__array_interface__") or hasattr(value, "__array__"):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise TypeError(f"example: leaf {path!r} is a {kind}, which holds an array without being one; convert it "
                        f"in transform (numpy.asarray(value): a PIL image gives its pixels, (height, width, "
                        f"channels) uint8), so that batches stack it")
    return None


def _pickled(value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # not picklable: only a worker process would need it to be
        return b""


def _kinds(values: list) -> str:
    return ", ".join(type(v).__name__ + (f" of {len(v)}" if isinstance(v, (list, tuple)) else "") for v in values[:4])
