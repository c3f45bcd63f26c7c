"""The demo's cache files, written whole or not at all: each goes to a temporary
name in its own directory and is renamed into place, so that a reader never
finds half a file where a first run was interrupted or two runs build the cache
at once. A reader still checks what it loads (a cache left by an older version
may be cut short) and has the cache rebuilt when it is not whole."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import numpy as np

__all__ = ["npy_bytes", "npz_bytes", "write_whole"]


def write_whole(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically: readers see the old file (or none)
    until the new one is complete.

    Args:
        path: the file to write; its directory must exist.
        data: its whole contents.
    """
    # Unique per writer, so that two runs never write into one temporary; in
    # the same directory, so that os.replace is a rename and not a copy.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # left only where the write or the rename failed


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` as the bytes of the ``.npy`` file ``np.save`` would write."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def npz_bytes(**arrays: np.ndarray) -> bytes:
    """``arrays`` as the bytes of the ``.npz`` file ``np.savez`` would write."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()
