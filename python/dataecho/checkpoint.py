"""EchoLoader checkpoints: what ``state_dict()`` holds, and its checks.

A state is a dict of ints, bools and NumPy arrays (picklable; ``torch.save``
takes it as it is). Examples are named, never stored:

    format        "dataecho.EchoLoader/1"
    epoch         the epoch to resume (or to start, when ``position`` is None)
    seed, rank, world_size, length
                  must match the loader that loads it (length: of a map-style source)
    position      None: the epoch starts from its beginning. For map-style sources
                  (``deterministic=True``), where the epoch stood between two batches:
        next_seq      every position of the epoch's order below it was read
        batches, rng_state, available
                      the echo buffer's batch counter, RNG counter and reservoir bookkeeping
        positions, indices, echoes
                      each resident example: its position in the epoch's order, its
                      dataset index and its remaining echo count, in reservoir order
        queued        batches assembled but not yet yielded: each row's position
        ended         nothing more is assembled; only ``queued`` is left
                  For iterable sources:
        skip          examples taken from the iterator; on resume the source is
                      iterated again from its start and these are read and dropped.
                      Resident examples (their remaining echoes) are not restored.

Size: 20 bytes per resident example (at most ``shuffle_buffer``), 8 per row of
the batches in flight (``prefetch`` and one or two more), and about 500 more.
On resume, resident examples and queued rows are read again (and transformed)
by index before the first batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FORMAT", "check_state"]

FORMAT = "dataecho.EchoLoader/1"
_BUFFER_KEYS = ("batches", "rng_state", "next_seq", "available")


def _int(state: dict, key: str, where: str = "state") -> int:
    value = state.get(key)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{where}[{key!r}]: expected an int >= 0, got {value!r}")
    return int(value)


def _array(state: dict, key: str, dtype: Any, where: str) -> np.ndarray:
    value = np.asarray(state.get(key))
    if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer) or value.size == 0):
        raise ValueError(f"{where}[{key!r}]: expected a 1-d integer array")
    if value.size and value.min() < 0:
        raise ValueError(f"{where}[{key!r}]: negative values")
    return value.astype(dtype)


def check_state(state: Any, expect: dict[str, Any], order: np.ndarray | None) -> dict[str, Any]:
    """Validates a state for a loader described by `expect` (seed, rank,
    world_size, length); `order` is the epoch's reading order of a map-style
    source (None for iterables), against which positions are checked. Returns
    the state normalized (plain ints, arrays of fixed dtypes)."""
    if not isinstance(state, dict):
        raise TypeError(f"state: expected a dict from EchoLoader.state_dict(), got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"state: expected format {FORMAT!r}, got {state.get('format')!r}")
    for key, value in expect.items():
        if state.get(key) != value:
            raise ValueError(
                f"state: saved with {key}={state.get(key)!r}, but this loader has {key}={value!r}; "
                "a state resumes only the same source, seed and shard"
            )
    out = {"format": FORMAT, "epoch": _int(state, "epoch"), **expect, "position": None}
    position = state.get("position")
    if position is None:
        return out
    if not isinstance(position, dict):
        raise ValueError("state['position']: expected a dict or None")
    where = "state['position']"
    if order is None:
        out["position"] = {"skip": _int(position, "skip", where)}
        return out
    checked: dict[str, Any] = {key: _int(position, key, where) for key in _BUFFER_KEYS}
    checked["ended"] = bool(position.get("ended", False))
    positions = _array(position, "positions", np.uint64, where)
    echoes = _array(position, "echoes", np.uint32, where)
    indices = _array(position, "indices", np.int64, where)
    if not (len(positions) == len(echoes) == len(indices)):
        raise ValueError(f"{where}: positions, indices and echoes differ in length")
    if (len(positions) and positions.max() >= checked["next_seq"]) or checked["next_seq"] > len(order):
        raise ValueError(f"{where}: positions beyond the epoch's order")
    if not np.array_equal(order[positions.astype(np.int64)], indices):
        raise ValueError(f"{where}: the resident examples' indices do not match this epoch's order")
    if len(echoes) and echoes.min() == 0:
        raise ValueError(f"{where}['echoes']: every resident example has an echo left")
    queued = position.get("queued")
    if not isinstance(queued, (list, tuple)):
        raise ValueError(f"{where}['queued']: expected a list of arrays")
    queued = [_array({"rows": q}, "rows", np.uint64, f"{where}['queued']") for q in queued]
    if any(len(q) and q.max() >= len(order) for q in queued):
        raise ValueError(f"{where}['queued']: positions beyond the epoch's order")
    checked.update(positions=positions, echoes=echoes, indices=indices, queued=queued)
    out["position"] = checked
    return out
