"""The structure of an example: a tree of dicts, tuples and lists whose leaves
are arrays, inferred from the first example and checked on every later one.

Leaves may be NumPy arrays or scalars, Python ``bool``/``int``/``float``, or
torch CPU tensors. A batch has the same structure with each leaf stacked along a
new leading axis. Leaves are named by their path (``"image"``, ``"0"``,
``"meta/label"``), which is how errors refer to them.

A tensor of a dtype NumPy lacks (``torch.bfloat16``, ``float8_*``,
``complex32``, ...) is a *raw* leaf: it is stored as its bytes, an unsigned
integer of the same item size (bfloat16 as uint16), and ``unflatten`` gives it
back as a tensor of its dtype over the same memory, bit for bit, whatever the
other leaves become. Every later example must have a tensor of that dtype there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .torch_support import raw_bytes, raw_to_tensor

__all__ = ["Structure", "key_mismatch", "read_only"]

_SCALARS = (bool, int, float, np.generic)


def _is_torch_tensor(value: Any) -> bool:
    # No torch import: a torch tensor's type lives in the torch package.
    return type(value).__module__.startswith("torch") and hasattr(value, "numpy")


def as_leaf_array(value: Any, path: str) -> np.ndarray:
    """A leaf as a NumPy array (no copy for arrays and CPU tensors)."""
    if isinstance(value, np.ndarray):
        return value
    if _is_torch_tensor(value):
        if value.device.type != "cpu":
            raise TypeError(f"example: leaf {path!r} is a torch tensor on {value.device}; expected a CPU tensor")
        try:
            return value.detach().numpy()
        except TypeError as exc:  # a dtype NumPy lacks (bfloat16, say): allowed only where the first example had it
            raise TypeError(f"example: leaf {path!r} is a {value.dtype} tensor, which NumPy cannot read ({exc}), "
                            f"where the first example had a NumPy dtype") from None
    if isinstance(value, _SCALARS):
        return np.asarray(value)
    raise TypeError(
        f"example: leaf {path!r} is a {type(value).__name__}; expected an array, a number or a torch tensor"
    )


def _raw_leaf(value: Any, dtype_name: str, path: str) -> np.ndarray:
    """The bytes of a later example's leaf where the first had a raw leaf (see above)."""
    if not _is_torch_tensor(value) or str(value.dtype) != dtype_name:
        got = f"a {value.dtype} tensor" if _is_torch_tensor(value) else f"a {type(value).__name__}"
        raise TypeError(f"example: leaf {path!r} is {got}; expected a {dtype_name} tensor, as in the first example")
    if value.device.type != "cpu":
        raise TypeError(f"example: leaf {path!r} is a torch tensor on {value.device}; expected a CPU tensor")
    return raw_bytes(value, path)


@dataclass(frozen=True)
class _Node:
    kind: str  # "leaf", "raw" (a leaf of a torch dtype NumPy lacks), "dict", "tuple", "list", "namedtuple"
    keys: tuple = ()  # dict keys, in first-seen order
    children: tuple = ()
    type_: type | None = None  # namedtuple class
    torch_dtype: str | None = None  # a raw leaf's dtype, str(dtype): "torch.bfloat16"


class Structure:
    """A tree shape plus, for each leaf, its path, shape and dtype.

    Attributes:
        paths: leaf paths, in flattening order.
        specs: ``(shape, dtype)`` per leaf, from the example it was inferred from;
            a raw leaf's dtype is the unsigned integer that stores its bytes.
        torch_dtypes: per leaf, a raw leaf's torch dtype (``"torch.bfloat16"``),
            else None.
    """

    def __init__(self, root: _Node, paths: list[str], specs: list[tuple[tuple[int, ...], np.dtype]],
                 torch_dtypes: list[str | None] | None = None):
        self._root = root
        self.paths = paths
        self.specs = specs
        self.torch_dtypes = torch_dtypes or [None] * len(paths)
        self._has_raw = any(name is not None for name in self.torch_dtypes)
        self._leaf_nodes = [_Node("leaf") if name is None else _Node("raw", torch_dtype=name)
                            for name in self.torch_dtypes]

    @classmethod
    def infer(cls, example: Any) -> Structure:
        """Infers the structure of ``example``.

        Raises:
            TypeError: a leaf is neither an array, a number nor a CPU tensor, is
                a tensor that cannot be stored (quantized, sparse), or a dict
                key is not a str.
        """
        paths: list[str] = []
        specs: list[tuple[tuple[int, ...], np.dtype]] = []
        torch_dtypes: list[str | None] = []

        def visit(value: Any, path: str) -> _Node:
            if isinstance(value, Mapping):
                keys = tuple(value)
                for key in keys:
                    if not isinstance(key, str):
                        raise TypeError(f"example: dict keys must be str, got {key!r} at {path or 'the top'!r}")
                return _Node("dict", keys, tuple(visit(value[k], _join(path, k)) for k in keys))
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                children = tuple(visit(v, _join(path, f)) for f, v in zip(value._fields, value))
                return _Node("namedtuple", tuple(value._fields), children, type(value))
            if isinstance(value, (tuple, list)):
                kind = "tuple" if isinstance(value, tuple) else "list"
                return _Node(kind, (), tuple(visit(v, _join(path, str(i))) for i, v in enumerate(value)))
            array, torch_dtype = _first_leaf(value, path or "example")
            if array.dtype.hasobject:
                raise TypeError(f"example: leaf {path or 'example'!r} holds Python objects ({array.dtype})")
            paths.append(path)
            specs.append((array.shape, array.dtype))
            torch_dtypes.append(torch_dtype)
            return _Node("leaf") if torch_dtype is None else _Node("raw", torch_dtype=torch_dtype)

        root = visit(example, "")
        if not paths:
            raise TypeError("example: it holds no arrays")
        return cls(root, paths, specs, torch_dtypes)

    @property
    def single(self) -> bool:
        """True when the example is one array (no dict, tuple or list around it)."""
        return self._root.kind in ("leaf", "raw")

    def fields(self) -> Any:
        """The ShuffleBuffer ``fields`` declaration for this structure.

        Zero-sized dimensions are not allowed in a buffer; such a leaf is reported
        with its path.
        """
        for path, (shape, _) in zip(self.paths, self.specs):
            if 0 in shape:
                raise ValueError(f"example: leaf {path or 'example'!r} has an empty dimension {shape}")
        if self.single:
            return self.specs[0]
        return {path: spec for path, spec in zip(self.paths, self.specs)}

    def flatten(self, example: Any) -> list[Any]:
        """The leaves of ``example`` in order, after checking its tree shape.

        Leaf shapes and dtypes are checked when the leaves are put into a buffer.

        Raises:
            TypeError: the tree shape differs (naming the path and both shapes).
        """
        leaves: list[Any] = []
        _flatten(self._root, example, "", leaves)
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
            _columns(self._root, examples, out)
            return out
        except _Mismatch:  # flatten each: the first that differs raises, naming the path
            return [list(column) for column in zip(*(self.flatten(e) for e in examples))]

    def leaf(self, value: Any, index: int) -> Any:
        """A value of leaf ``index`` from ``columns`` as ``flatten`` would give it."""
        out: list[Any] = []
        _flatten(self._leaf_nodes[index], value, self.paths[index], out)
        return out[0]

    def unflatten(self, leaves: Sequence[Any], wrap: Callable[[Any], Any] | None = None,
                  copy_raw: bool = False) -> Any:
        """Builds the tree back from leaves in flattening order.

        Args:
            leaves: one array (or batch of arrays, or tensor) per leaf.
            wrap: maps each leaf (``to_torch``, say), raw leaves excepted.
            copy_raw: raw leaves get memory of their own, for code that may
                write to them; by default they view their leaf's memory.

        Returns:
            The tree, with each raw leaf a torch tensor of its dtype (see above).
        """
        if self._has_raw:
            leaves = [
                raw_to_tensor(leaf, name, copy_raw) if name is not None else leaf if wrap is None else wrap(leaf)
                for leaf, name in zip(leaves, self.torch_dtypes)
            ]
            wrap = None
        it = iter(leaves if wrap is None else map(wrap, leaves))
        return _build(self._root, it)


def key_mismatch(expected: Sequence[str], mapping: Mapping) -> tuple[list, list] | None:
    """(missing, unexpected) keys of ``mapping`` against ``expected``, or None if they match."""
    if len(mapping) == len(expected) and all(k in mapping for k in expected):
        return None
    return [k for k in expected if k not in mapping], [k for k in mapping if k not in expected]


def read_only(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Read-only views of ``arrays`` (no copy): for memory that others will read again."""
    views = []
    for array in arrays:
        view = array.view()
        view.flags.writeable = False
        views.append(view)
    return tuple(views)


def _first_leaf(value: Any, path: str) -> tuple[np.ndarray, str | None]:
    """A leaf of the example a structure is inferred from, as an array, and its
    torch dtype when it is a raw leaf (else None)."""
    if not _is_torch_tensor(value) or value.device.type != "cpu":
        return as_leaf_array(value, path), None  # which refuses a tensor on another device
    try:
        return value.detach().numpy(), None
    except TypeError:  # a dtype NumPy lacks, or not a dense tensor: raw_bytes tells which
        return raw_bytes(value, path), str(value.dtype)


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


def _flatten(node: _Node, value: Any, path: str, out: list[Any]) -> None:
    where = path or "the top"
    if node.kind == "leaf":
        if isinstance(value, (Mapping, list)) or (isinstance(value, tuple)):
            raise TypeError(f"example: expected an array at {where!r}, got a {type(value).__name__}")
        out.append(as_leaf_array(value, path or "example") if _is_torch_tensor(value) else value)
        return
    if node.kind == "raw":
        out.append(_raw_leaf(value, node.torch_dtype, path or "example"))
        return
    if node.kind == "dict":
        if not isinstance(value, Mapping):
            raise TypeError(f"example: expected a dict at {where!r}, got a {type(value).__name__}")
        mismatch = key_mismatch(node.keys, value)
        if mismatch is not None:
            raise TypeError(f"example: keys differ at {where!r}: missing {mismatch[0]}, unexpected {mismatch[1]}")
        for key, child in zip(node.keys, node.children):
            _flatten(child, value[key], _join(path, key), out)
        return
    expected = {"tuple": tuple, "list": list, "namedtuple": tuple}[node.kind]
    if not isinstance(value, expected) or len(value) != len(node.children):
        got = f"a {type(value).__name__}" + (f" of length {len(value)}" if isinstance(value, (tuple, list)) else "")
        raise TypeError(
            f"example: expected a {node.kind} of length {len(node.children)} at {where!r}, got {got}"
        )
    names = node.keys if node.kind == "namedtuple" else [str(i) for i in range(len(node.children))]
    for name, child, item in zip(names, node.children, value):
        _flatten(child, item, _join(path, name), out)


class _Mismatch(Exception):
    """A chunk whose examples are not all of the structure's exact container types."""


_CONTAINERS = {"tuple": tuple, "list": list}


def _columns(node: _Node, values: list, out: list[list]) -> None:
    """``Structure.columns`` for examples of exactly the node's container types
    (dict, tuple, list, the namedtuple class); anything else raises _Mismatch."""
    if node.kind in ("leaf", "raw"):
        out.append(values)
        return
    width = len(node.children)
    if node.kind == "dict":
        for value in values:
            if type(value) is not dict or len(value) != width:
                raise _Mismatch
        try:
            for key, child in zip(node.keys, node.children):
                _columns(child, [value[key] for value in values], out)
        except KeyError:
            raise _Mismatch from None
        return
    expected = node.type_ if node.kind == "namedtuple" else _CONTAINERS[node.kind]
    for value in values:
        if type(value) is not expected or len(value) != width:
            raise _Mismatch
    for i, child in enumerate(node.children):
        _columns(child, [value[i] for value in values], out)


def _build(node: _Node, leaves: Any) -> Any:
    if node.kind == "leaf" or node.kind == "raw":
        return next(leaves)
    if node.kind == "dict":
        return {key: _build(child, leaves) for key, child in zip(node.keys, node.children)}
    items = [_build(child, leaves) for child in node.children]
    if node.kind == "namedtuple":
        return node.type_(*items)
    return tuple(items) if node.kind == "tuple" else items
