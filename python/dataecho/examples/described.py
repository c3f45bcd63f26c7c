"""A :class:`~dataecho.examples.structure.Structure` as plain values (str, int,
bool, lists and dicts), for a checkpoint: a loader that resumes in a new
process takes the structure from the state instead of learning it again from
the first examples of the resumed epoch, which may not show it (short token
sequences only, a leaf of one length there that varies elsewhere).

A named tuple's class is named by its module and qualified name and imported
again; a dtype by its ``str`` (``"<i8"``, ``"|O"``).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from .given import GIVEN
from .structure import Structure
from .tree import LEAVES, Node

__all__ = ["describe", "described"]

_CONTAINERS = ("dict", "tuple", "list", "namedtuple")
_KINDS = ("array", "ragged", "object")


def describe(structure: Structure) -> dict[str, Any]:
    """``structure`` as plain values (see the module docstring)."""
    return {
        "tree": _node(structure.root),
        "paths": list(structure.paths),
        "shapes": [list(shape) for shape, _ in structure.specs],
        "dtypes": [np.dtype(dtype).str for _, dtype in structure.specs],
        "torch_dtypes": list(structure.torch_dtypes),
        "kinds": list(structure.kinds),
        "given": list(structure.given),
        "sample_bytes": {kind: [int(n) for n in sizes] for kind, sizes in structure.sample_bytes.items()},
    }


def described(value: Any, where: str) -> Structure:
    """The structure ``describe`` gave ``value`` for.

    Raises:
        ValueError: ``value`` is not such a description (``where`` names it).
    """
    try:
        structure = _structure(value, where)
    except (KeyError, TypeError, AttributeError, ImportError) as exc:
        raise ValueError(f"{where}: not the description of an example's structure ({type(exc).__name__}: {exc})") \
            from None
    return structure


def _structure(value: dict, where: str) -> Structure:
    if not isinstance(value, dict):
        raise TypeError(f"expected a dict, got {type(value).__name__}")
    paths, kinds, given = list(value["paths"]), list(value["kinds"]), list(value["given"])
    torch_dtypes = list(value["torch_dtypes"])
    specs = [(tuple(int(n) for n in shape), np.dtype(dtype)) for shape, dtype in zip(value["shapes"], value["dtypes"])]
    lengths = {len(paths), len(kinds), len(given), len(torch_dtypes), len(specs)}
    if len(lengths) != 1 or not paths:
        raise ValueError(f"{where}: its leaves' lists differ in length, or are empty")
    if any(k not in _KINDS for k in kinds) or any(g not in GIVEN for g in given):
        raise ValueError(f"{where}['kinds'/'given']: unknown kinds")
    if any(not isinstance(p, str) for p in paths) or any(t is not None and not isinstance(t, str)
                                                         for t in torch_dtypes):
        raise ValueError(f"{where}['paths'/'torch_dtypes']: expected str")
    if any(dtype.hasobject != (kind == "object") for (_, dtype), kind in zip(specs, kinds)):
        raise ValueError(f"{where}['dtypes']: only object leaves hold objects")
    root = _tree(value["tree"])
    if _leaf_count(root) != len(paths):
        raise ValueError(f"{where}['tree']: has another number of leaves than 'paths'")
    structure = Structure(root, paths, specs, torch_dtypes, kinds, given)
    structure.sample_bytes = {kind: [int(n) for n in value["sample_bytes"].get(kind, [])]
                              for kind in ("ragged", "object")}
    return structure


def _node(node: Node) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": node.kind}
    if node.kind in LEAVES:
        if node.torch_dtype is not None:
            out["torch_dtype"] = node.torch_dtype
        return out
    out["children"] = [_node(child) for child in node.children]
    if node.kind in ("dict", "namedtuple"):
        out["keys"] = list(node.keys)
    if node.kind == "namedtuple":
        out["type"] = f"{node.type_.__module__}:{node.type_.__qualname__}"
    return out


def _tree(value: dict) -> Node:
    kind = value["kind"]
    if kind in LEAVES:
        return Node(kind, torch_dtype=value.get("torch_dtype"))
    if kind not in _CONTAINERS:
        raise TypeError(f"unknown node kind {kind!r}")
    children = tuple(_tree(child) for child in value["children"])
    keys = tuple(str(key) for key in value.get("keys", ()))
    if kind in ("dict", "namedtuple") and len(keys) != len(children):
        raise TypeError("keys and children differ in number")
    type_ = _named_tuple(value["type"]) if kind == "namedtuple" else None
    return Node(kind, keys, children, type_)


def _named_tuple(name: str) -> type:
    module, _, qualname = name.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not (isinstance(found, type) and issubclass(found, tuple) and hasattr(found, "_fields")):
        raise TypeError(f"{name} is not a named tuple class")
    return found


def _leaf_count(node: Node) -> int:
    return 1 if node.kind in LEAVES else sum(_leaf_count(child) for child in node.children)
