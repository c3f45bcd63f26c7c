"""An echo buffer's part of a stage's state, the same for the intake's buffer
and the augment stage's output buffer: its counters (``batches``,
``rng_state``, ``next_seq``, ``available``), ``ended``, and its resident rows
with the echoes each has left (named by position, or by delivery number)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from ... import _core
from ...examples.structure import Structure
from ...native.echo_buffer import NativeBuffer
from .. import checkpoint

__all__ = ["SNAPSHOT_KEYS", "checked_counters", "put_resident", "restored", "saved"]

SNAPSHOT_KEYS = ("batches", "rng_state", "next_seq", "available")
_RESIDENT_PUT_S = 10.0  # how long a resumed resident example may wait for room (there is none to wait for)


def saved(snap: _core.Snapshot) -> dict[str, Any]:
    """The snapshot's counters and ``ended``, as plain values."""
    return {**{key: int(getattr(snap, key)) for key in SNAPSHOT_KEYS}, "ended": bool(snap.ended)}


def restored(state: dict[str, Any], seqs: np.ndarray, echoes: np.ndarray) -> _core.Snapshot:
    """The snapshot a buffer resumes from: ``state``'s counters, and its
    resident rows (``seqs``) with the echoes each has left."""
    snap = _core.Snapshot()
    for key in SNAPSHOT_KEYS:
        setattr(snap, key, state[key])
    snap.seqs, snap.echoes = seqs, echoes
    return snap


def checked_counters(state: dict[str, Any], where: str) -> dict[str, Any]:
    """The counters and ``ended`` of a saved state, each checked for its type.

    Raises:
        ValueError: a missing or mistyped key, named with ``where``.
    """
    checked: dict[str, Any] = {key: checkpoint.int_at(state, key, where) for key in SNAPSHOT_KEYS}
    checked["ended"] = checkpoint.bool_at(state, "ended", where)
    return checked


def put_resident(buffer: NativeBuffer, structure: Structure, read: Callable[[int], Any], positions: np.ndarray,
                 threads: int) -> None:
    """Resume: reads the resident examples at ``positions`` again (on up to
    ``threads`` threads) and puts them with their numbers, before any reader
    starts (a buffer restored from a snapshot waits for all of them).

    Raises:
        RuntimeError: one does not fit the buffer's ragged memory.
    """
    positions = sorted(int(p) for p in positions)
    if not positions:
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(positions))) as pool:
        for position, example in zip(positions, pool.map(read, positions)):
            try:
                # Nothing is drawn before every resident example is back: a put
                # that cannot go in soon never will.
                buffer.put_values(structure.flatten(example), timeout_s=_RESIDENT_PUT_S, seq=position)
            except TimeoutError:
                raise RuntimeError(
                    f"load_state_dict: the resident example at position {position} does not fit the resumed "
                    f"echo buffer (its ragged values need more than ragged_bytes="
                    f"{buffer.stats()['pages'] * buffer.page_bytes}); raise ragged_bytes") from None
