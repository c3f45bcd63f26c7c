"""Batch memory that augment worker processes can read: blocks in named shared
memory (``/dev/shm``), handed to the echo buffer's batch pool, which assembles
its batches there first (it takes the blocks it was given before any of its
own). A batch in one of them reaches a worker as a block number, an offset and
a shape: the worker reads the rows where the buffer wrote them, without a copy
and without pickling. (A batch that came out of the pool's own memory, a
ragged leaf's values, and object leaves travel pickled instead.)

Synchronization: a worker reads a batch only between the task that names it
and its "done", and the training process keeps the batch (its lease on the
block) until that "done" arrives; the pool recycles a block only once nothing
holds its lease, so no block is written while a worker reads it. The pipe that
carries the task and the "done" orders the two processes' accesses.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from typing import Any

import numpy as np

__all__ = ["BlockViews", "SharedBlocks", "describe_leaf"]

_DIR = "/dev/shm"


class SharedBlocks:
    """``count`` blocks of ``nbytes`` in named shared memory, mapped here.

    The names are removed (:meth:`unlink`) as soon as every worker has mapped
    them, so that nothing is left in ``/dev/shm`` however the processes end.
    """

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.names = [f"dataecho-staging-{os.getpid()}-{secrets.token_hex(6)}-{i}" for i in range(count)]
        self._maps: list[mmap.mmap] = []
        try:
            for name in self.names:
                fd = os.open(os.path.join(_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, nbytes)
                    self._maps.append(mmap.mmap(fd, nbytes))
                finally:
                    os.close(fd)
        except BaseException:
            self.unlink()
            raise
        self._starts = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in self._maps]

    def pointers(self) -> list[tuple[int, int]]:
        """(address, bytes) of each block, for the batch pool."""
        return [(start, self.nbytes) for start in self._starts]

    def locate(self, array: np.ndarray) -> tuple[int, int] | None:
        """(block, offset) of an array whose bytes lie in one block, else None."""
        start = array.__array_interface__["data"][0]
        low, high = _byte_bounds(array, start)
        for block, base in enumerate(self._starts):
            if base <= low and high <= base + self.nbytes:
                return block, start - base
        return None

    def unlink(self) -> None:
        """Removes the names (the mappings stay until closed); idempotent."""
        for name in self.names:
            try:
                os.unlink(os.path.join(_DIR, name))
            except FileNotFoundError:
                pass


def _byte_bounds(array: np.ndarray, start: int) -> tuple[int, int]:
    """The lowest and one past the highest address ``array``'s elements take
    (``start``: the address of its first element)."""
    if array.flags.c_contiguous:  # a batch leaf, nearly always
        return start, start + array.nbytes
    if array.size == 0:
        return start, start
    extent = [(n - 1) * s for n, s in zip(array.shape, array.strides)]
    low = start + sum(e for e in extent if e < 0)
    return low, start + sum(e for e in extent if e > 0) + array.itemsize


def describe_leaf(leaf: Any, blocks: SharedBlocks) -> tuple:
    """How one batch leaf reaches a worker: ``("block", block, offset, shape,
    dtype, strides)`` where its bytes lie in a staging block, else the leaf
    itself (pickled): ``("leaf", value)``."""
    if isinstance(leaf, np.ndarray) and not leaf.dtype.hasobject:
        found = blocks.locate(leaf)
        if found is not None:
            return ("block", *found, leaf.shape, leaf.dtype.str, leaf.strides)
    return ("leaf", leaf)


class BlockViews:
    """A worker's read-only mappings of the staging blocks, by name."""

    def __init__(self, names: list[str], nbytes: int) -> None:
        self.buffers = []
        for name in names:
            with open(os.path.join(_DIR, name), "rb") as f:
                self.buffers.append(mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_READ))

    def leaf(self, described: tuple) -> Any:
        """The leaf ``describe_leaf`` described: a read-only view of a block, or the leaf."""
        if described[0] == "leaf":
            return described[1]
        _, block, offset, shape, dtype, strides = described
        return np.ndarray(shape, np.dtype(dtype), buffer=self.buffers[block], offset=offset, strides=strides)
