"""A batch (or any tree of leaves) as JAX arrays: :func:`to_jax`, what
``EchoLoader(output="jax")`` gives and what users of ``ShuffleBuffer`` or of
NumPy batches call themselves."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tensors.convert import map_tree
from ..tensors.jax_arrays import import_jax, put_arrays, resolve_device
from .ragged import JaxRagged, Ragged

__all__ = ["to_jax"]


class _Put:
    """Where an array put with the others goes back in the tree."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def to_jax(tree: Any, device: Any = None) -> Any:
    """A batch as JAX arrays, without a copy where JAX can take the memory.

    Every NumPy array is put on ``device`` in one ``jax.device_put``. On a CPU
    device the JAX array then views the batch memory and keeps it alive (the
    batch's lease with it) for as long as it lives; JAX never writes to it. A
    copy is made where the device is not a CPU, where JAX changes the dtype
    (64-bit leaves become 32-bit unless ``jax_enable_x64``) and where the
    memory is not aligned to 64 bytes (batch memory always is):
    dataecho.tensors.jax_arrays says why.

    Args:
        tree: a batch: dicts, tuples (named ones included) and lists nested,
            whose leaves are NumPy arrays or scalars (bfloat16 and float8 as
            ml_dtypes arrays), :class:`dataecho.Ragged`, :class:`dataecho.Padded`,
            tensors (taken through DLPack: the bfloat16 leaves of
            ``output="numpy"``), JAX arrays, or objects.
        device: a ``jax.Device`` or a platform name (``"cpu"``: its first
            device); None: JAX's default device.

    Returns:
        The same structure with each array a ``jax.Array``, each Ragged a
        :class:`dataecho.JaxRagged` (values and offsets), each Padded one of
        JAX arrays; objects (``str``, ``bytes``, ``None``, ...), Python
        numbers and lists of them as they are.

    Raises:
        TypeError: an array of a dtype JAX has no type for (str, object,
            structured, ...) or a tensor JAX cannot take; the message names
            its path, e.g. ``tree['name']``. A bad ``device``, named.
        RuntimeError: no JAX device of that platform here.
        ImportError: jax is not installed.
    """
    jax = import_jax()
    device = resolve_device(device, "to_jax(): device")
    staged = _Staged(jax, device)
    tree = map_tree(staged.take, tree, "tree")
    if not staged.host:
        return tree
    put = put_arrays(staged.host, device, staged.paths)
    return map_tree(lambda leaf, _: put[leaf.index] if isinstance(leaf, _Put) else leaf, tree, "tree")


class _Staged:
    """The host arrays of a tree, gathered to be put in one call; each leaf
    taken is replaced by where its array will be (:class:`_Put`). A class, not
    a closure: a recursive closure is a reference cycle, which would keep the
    arrays (and their batches) alive until the cyclic collector ran."""

    def __init__(self, jax: Any, device: Any) -> None:
        self.jax, self.device = jax, device
        self.host: list[Any] = []
        self.paths: list[str] = []

    def take(self, leaf: Any, path: str) -> Any:
        jax, device = self.jax, self.device
        if isinstance(leaf, Ragged):
            return JaxRagged(self.take(leaf.values, f"{path}.values"), self.take(leaf.offsets, f"{path}.offsets"))
        if isinstance(leaf, (np.ndarray, np.generic)):
            self.host.append(leaf)
            self.paths.append(path)
            return _Put(len(self.host) - 1)
        if isinstance(leaf, jax.Array):
            return leaf if device is None else jax.device_put(leaf, device)
        if hasattr(leaf, "__dlpack__"):  # a torch tensor, say
            return _from_dlpack(jax, leaf, device, path)
        return leaf


def _from_dlpack(jax: Any, leaf: Any, device: Any, path: str) -> Any:
    """A tensor as a JAX array through DLPack (over its memory where JAX can
    take it), then on ``device``."""
    try:
        array = jax.dlpack.from_dlpack(leaf)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:  # e.g. a tensor that requires grad
        raise TypeError(f"to_jax(): {path}: JAX cannot take this {type(leaf).__name__} ({exc})") from None
    return array if device is None else jax.device_put(array, device)
