"""The tree of an example: dicts, tuples (named ones included) and lists whose
leaves are arrays, numbers, torch CPU tensors or objects. A tree is described
by :class:`Node` s; this module flattens an example into its leaves (checking
its shape), transposes examples into columns, and builds a tree back from
leaves. Leaves are named by their path (``"image"``, ``"0"``,
``"meta/label"``), which is how errors refer to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..tensors.raw import raw_bytes

__all__ = ["LEAVES", "Mismatch", "Node", "as_leaf_array", "build", "columns_into", "flatten_into", "is_torch_tensor",
           "join", "key_mismatch"]

_SCALARS = (bool, int, float, np.generic)


def is_torch_tensor(value: Any) -> bool:
    # No torch import: a torch tensor's type lives in the torch package.
    return type(value).__module__.startswith("torch") and hasattr(value, "numpy")


def as_leaf_array(value: Any, path: str) -> np.ndarray:
    """A leaf as a NumPy array (no copy for arrays and CPU tensors)."""
    if isinstance(value, np.ndarray):
        return value
    if is_torch_tensor(value):
        if value.device.type != "cpu":
            raise TypeError(f"example: leaf {path!r} is a torch tensor on {value.device}; expected a CPU tensor")
        if getattr(value, "is_nested", False):
            raise TypeError(f"example: leaf {path!r} is a nested tensor, which cannot be stored; return its "
                            f"components (value.unbind()) as leaves of their own")
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


def raw_leaf(value: Any, dtype_name: str, path: str) -> np.ndarray:
    """The bytes of a later example's leaf where the first had a raw leaf (see above)."""
    if not is_torch_tensor(value) or str(value.dtype) != dtype_name:
        got = f"a {value.dtype} tensor" if is_torch_tensor(value) else f"a {type(value).__name__}"
        raise TypeError(f"example: leaf {path!r} is {got}; expected a {dtype_name} tensor, as in the first example")
    if value.device.type != "cpu":
        raise TypeError(f"example: leaf {path!r} is a torch tensor on {value.device}; expected a CPU tensor")
    return raw_bytes(value, path)


@dataclass(frozen=True)
class Node:
    # "leaf", "raw" (a leaf of a torch dtype NumPy lacks), "ragged", "object" (leaves);
    # "dict", "tuple", "list", "namedtuple" (containers)
    kind: str
    keys: tuple = ()  # dict keys, in first-seen order
    children: tuple = ()
    type_: type | None = None  # namedtuple class
    torch_dtype: str | None = None  # a raw leaf's dtype, str(dtype): "torch.bfloat16"


def key_mismatch(expected: Sequence[str], mapping: Mapping) -> tuple[list, list] | None:
    """(missing, unexpected) keys of ``mapping`` against ``expected``, or None if they match."""
    if len(mapping) == len(expected) and all(k in mapping for k in expected):
        return None
    return [k for k in expected if k not in mapping], [k for k in mapping if k not in expected]


def join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


def flatten_into(node: Node, value: Any, path: str, out: list[Any], what: str = "example",
                 keep: bool = False) -> None:
    """Appends ``value``'s leaves to ``out`` in ``node``'s order, after checking its tree shape (errors name
    ``what``); tensors become arrays, or with ``keep`` stay as they are (device tensors)."""
    where = path or "the top"
    if node.kind == "object" or (keep and node.kind in ("leaf", "raw", "ragged")):
        out.append(value)
        return
    if node.kind == "ragged":
        out.append(as_leaf_array(value, path or "example") if is_torch_tensor(value) else value)
        return
    if node.kind == "leaf":
        if isinstance(value, (Mapping, list)) or (isinstance(value, tuple)):
            raise TypeError(f"{what}: expected an array at {where!r}, got a {type(value).__name__}")
        out.append(as_leaf_array(value, path or "example") if is_torch_tensor(value) else value)
        return
    if node.kind == "raw":
        out.append(raw_leaf(value, node.torch_dtype, path or "example"))
        return
    if node.kind == "dict":
        if not isinstance(value, Mapping):
            raise TypeError(f"{what}: expected a dict at {where!r}, got a {type(value).__name__}")
        mismatch = key_mismatch(node.keys, value)
        if mismatch is not None:
            raise TypeError(f"{what}: keys differ at {where!r}: missing {mismatch[0]}, unexpected {mismatch[1]}")
        for key, child in zip(node.keys, node.children):
            flatten_into(child, value[key], join(path, key), out, what, keep)
        return
    expected = {"tuple": tuple, "list": (list, range), "namedtuple": tuple}[node.kind]
    if not isinstance(value, expected) or len(value) != len(node.children):
        got = f"a {type(value).__name__}" + (f" of length {len(value)}" if isinstance(value, (tuple, list)) else "")
        hint = ""
        if node.kind == "list" and isinstance(value, list):
            hint = (f"; a list whose length varies is a ragged leaf: declare it with "
                    f"EchoLoader(..., ragged=[{path!r}])")
        raise TypeError(
            f"{what}: expected a {node.kind} of length {len(node.children)} at {where!r}, got {got}{hint}"
        )
    names = node.keys if node.kind == "namedtuple" else [str(i) for i in range(len(node.children))]
    for name, child, item in zip(names, node.children, value):
        flatten_into(child, item, join(path, name), out, what, keep)


class Mismatch(Exception):
    """A chunk whose examples are not all of the structure's exact container types."""

CONTAINERS = {"tuple": tuple, "list": list}

LEAVES = ("leaf", "raw", "ragged", "object")


def columns_into(node: Node, values: list, out: list[list]) -> None:
    """``Structure.columns`` for examples of exactly the node's container types
    (dict, tuple, list, the namedtuple class); anything else raises Mismatch."""
    if node.kind in LEAVES:
        out.append(values)
        return
    width = len(node.children)
    if node.kind == "dict":
        for value in values:
            if type(value) is not dict or len(value) != width:
                raise Mismatch
        try:
            for key, child in zip(node.keys, node.children):
                columns_into(child, [value[key] for value in values], out)
        except KeyError:
            raise Mismatch from None
        return
    expected = node.type_ if node.kind == "namedtuple" else CONTAINERS[node.kind]
    for value in values:
        if type(value) is not expected or len(value) != width:
            raise Mismatch
    for i, child in enumerate(node.children):
        columns_into(child, [value[i] for value in values], out)


def build(node: Node, leaves: Any) -> Any:
    if node.kind in LEAVES:
        return next(leaves)
    if node.kind == "dict":
        return {key: build(child, leaves) for key, child in zip(node.keys, node.children)}
    items = [build(child, leaves) for child in node.children]
    if node.kind == "namedtuple":
        return node.type_(*items)
    return tuple(items) if node.kind == "tuple" else items
