"""EchoLoader checkpoints: what ``state_dict()`` holds, and its checks.

A state is a dict of ints, bools, dicts and NumPy arrays (picklable;
``torch.save`` takes it as it is). Examples are named, never stored:

    format   "dataecho.EchoLoader/2"; a state of another format is refused
    epoch    the epoch to resume (or to start, when ``stages`` is None)
    config   the arguments that decide the sequence of batches (seed, rank,
             world_size, the source's length, batch_size, echo_factor, echo_at,
             shuffle_buffer, shuffle, drop_last, deterministic, max_echo, and
             whether augment takes an rng); a loader loads only a state whose
             values are its own, and a mismatch names the argument
    stages   None: the epoch starts from its beginning. Else {stage name: state}
             where the epoch stood between two batches (see dataecho.pipeline.chain):

    intake           map-style sources (deterministic=True): the echo buffer's
                     batch counter ``batches``, RNG counter ``rng_state``, intake
                     position ``next_seq`` (every position of the epoch's order
                     below it was read), ``available``; each resident example's
                     position, dataset index and remaining echo count
                     (``positions``, ``indices``, ``echoes``), in reservoir order;
                     ``queued``: the batches assembled but not yet taken; ``ended``.
                     Iterable sources: ``skip``, the examples taken from the
                     iterator; on resume the source is iterated again from its
                     start and these are dropped (resident examples are not
                     restored).
    batch_echo       its resident batches (``rows``, deliveries ``left`` of
                     ``deliveries``), the last one yielded, its counters and
                     its generator's state.
    augment          ``taken``: rows taken from upstream (the next delivery
                     number); ``output``: its output buffer's state (resident
                     rows named by delivery number), or None before it exists
                     (once resumed, the state it is to be restored from);
                     ``pending``: each row taken and not yet in a batch, by
                     delivery number and position; ``queued``: output batches
                     assembled but not yet taken.
    *_replay         ``queued``: restored batches not yet yielded.
    device           ``in_flight``: batches on their way to the device.

A batch is named by ``{"rows": positions}``, and after augment also by
``"deliveries"`` (each row's delivery number, the key of its generator).

Size: about 20 bytes per resident example (at most ``shuffle_buffer``), 8 or 16
per row of each batch in flight, and a few hundred more. On resume, resident
examples and the rows of queued batches are read (and transformed, and
augmented) again.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["FORMAT", "check_state"]

FORMAT = "dataecho.EchoLoader/2"
_BUFFER_KEYS = ("batches", "rng_state", "next_seq", "available")


def check_state(state: Any, fingerprint: dict[str, Any], names: list[str],
                order_of: Callable[[int], np.ndarray | None]) -> dict[str, Any]:
    """Validates a state for a loader.

    Args:
        state: what ``state_dict()`` returned.
        fingerprint: the loader's ``LoaderConfig.fingerprint()``.
        names: the stage names an exact state of this loader holds.
        order_of: the reading order of a map-style source in an epoch (None for iterables).

    Returns:
        The state normalized (plain ints, arrays of fixed dtypes).

    Raises:
        TypeError, ValueError: the state is not one of this loader's, saying why.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state: expected a dict from EchoLoader.state_dict(), got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(
            f"state: expected format {FORMAT!r}, got {state.get('format')!r}; a state saved by another "
            "version of dataecho cannot be resumed by this one"
        )
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise ValueError("state['config']: expected a dict")
    for key, value in fingerprint.items():
        if saved.get(key) != value:
            raise ValueError(
                f"state: saved with {key}={saved.get(key)!r}, but this loader has {key}={value!r}; "
                "a state resumes only a loader with the same arguments that decide its batches"
            )
    epoch = _int(state, "epoch", "state")
    out = {"format": FORMAT, "epoch": epoch, "config": dict(fingerprint), "stages": None}
    stages = state.get("stages")
    if stages is None:
        return out
    if not isinstance(stages, dict):
        raise ValueError("state['stages']: expected a dict or None")
    order = order_of(epoch)
    if order is None:
        out["stages"] = {"intake": {"skip": _int(_dict(stages, "intake", "state['stages']"), "skip", _at("intake"))}}
        return out
    unknown = set(stages) - set(names) - {"device"}
    missing = set(names) - set(stages)
    if unknown or missing:
        raise ValueError(f"state['stages']: expected the stages {names}, got {sorted(stages)}")
    out["stages"] = {name: _CHECKS[name](_dict(stages, name, "state['stages']"), order, _at(name)) for name in stages}
    return out


def _check_intake(state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    checked: dict[str, Any] = {key: _int(state, key, where) for key in _BUFFER_KEYS}
    checked["ended"] = _bool(state, "ended", where)
    positions = _array(state, "positions", np.uint64, where)
    echoes = _array(state, "echoes", np.uint32, where)
    indices = _array(state, "indices", np.int64, where)
    if not (len(positions) == len(echoes) == len(indices)):
        raise ValueError(f"{where}: positions, indices and echoes differ in length")
    if (len(positions) and positions.max() >= checked["next_seq"]) or checked["next_seq"] > len(order):
        raise ValueError(f"{where}: positions beyond the epoch's order")
    if len(np.unique(positions)) != len(positions):
        raise ValueError(f"{where}['positions']: a resident example is listed twice")
    if not np.array_equal(order[positions.astype(np.int64)], indices):
        raise ValueError(f"{where}: the resident examples' indices do not match this epoch's order")
    if len(echoes) and echoes.min() == 0:
        raise ValueError(f"{where}['echoes']: every resident example has an echo left")
    if checked["available"] > len(positions):
        raise ValueError(f"{where}['available']: more than the resident examples")
    checked.update(positions=positions, echoes=echoes, indices=indices, queued=_batches(state, "queued", order, where))
    return checked


def _check_batch_echo(state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    entries = state.get("entries")
    if not isinstance(entries, list):
        raise ValueError(f"{where}['entries']: expected a list")
    checked_entries = []
    for i, entry in enumerate(entries):
        at = f"{where}['entries'][{i}]"
        ids = _ids(_mapping(entry, at), order, at)
        left, deliveries = _int(entry, "left", at), _int(entry, "deliveries", at)
        if not 1 <= left <= deliveries:
            raise ValueError(f"{at}: expected 1 <= left <= deliveries, got {left} and {deliveries}")
        checked_entries.append({**ids, "left": left, "deliveries": deliveries})
    last = state.get("last")
    if not isinstance(last, (int, np.integer)) or isinstance(last, bool) or not -1 <= last < len(entries):
        raise ValueError(f"{where}['last']: expected an index of entries or -1, got {last!r}")
    rng = state.get("rng")
    if not isinstance(rng, dict):
        raise ValueError(f"{where}['rng']: expected a generator state (a dict)")
    return {
        "entries": checked_entries, "last": int(last), "rng": rng,
        "fresh_batches": _int(state, "fresh_batches", where),
        "delivered_batches": _int(state, "delivered_batches", where),
        "upstream_done": _bool(state, "upstream_done", where),
    }


def _check_augment(state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    taken = _int(state, "taken", where)
    pending = _ids(_dict(state, "pending", where), order, f"{where}['pending']", deliveries=True)
    if len(pending["deliveries"]) and pending["deliveries"].max() >= taken:
        raise ValueError(f"{where}['pending']: delivery numbers beyond 'taken'")
    output = state.get("output")
    if output is not None:
        at = f"{where}['output']"
        output = _dict(state, "output", where)
        checked = {key: _int(output, key, at) for key in _BUFFER_KEYS}
        checked["ended"] = _bool(output, "ended", at)
        resident = _array(output, "deliveries", np.uint64, at)
        echoes = _array(output, "echoes", np.uint32, at)
        if len(resident) != len(echoes) or (len(echoes) and echoes.min() == 0):
            raise ValueError(f"{at}: expected an echo left for each resident row")
        if not set(resident.tolist()) <= set(pending["deliveries"].tolist()) or checked["next_seq"] > taken:
            raise ValueError(f"{at}: resident rows that are not pending")
        if checked["available"] > len(resident):
            raise ValueError(f"{at}['available']: more than the resident rows")
        output = {**checked, "deliveries": resident, "echoes": echoes}
    return {"taken": taken, "output": output, "pending": pending,
            "queued": _batches(state, "queued", order, where, deliveries=True)}


def _check_replay(state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    return {"queued": _batches(state, "queued", order, where, deliveries=None)}


def _check_device(state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    return {"in_flight": _batches(state, "in_flight", order, where, deliveries=None)}


_CHECKS = {"intake": _check_intake, "intake_replay": _check_replay, "batch_echo": _check_batch_echo,
           "augment": _check_augment, "augment_replay": _check_replay, "final_replay": _check_replay,
           "device": _check_device}


# ---- pieces ----


def _at(name: str) -> str:
    return f"state['stages'][{name!r}]"


def _dict(state: dict, key: str, where: str) -> dict:
    return _mapping(state.get(key), f"{where}[{key!r}]")


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a dict")
    return value


def _int(state: dict, key: str, where: str) -> int:
    value = state.get(key)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{where}[{key!r}]: expected an int >= 0, got {value!r}")
    return int(value)


def _bool(state: dict, key: str, where: str) -> bool:
    value = state.get(key)
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}[{key!r}]: expected True or False, got {value!r}")
    return bool(value)


def _array(state: dict, key: str, dtype: Any, where: str) -> np.ndarray:
    value = np.asarray(state.get(key))
    if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer) or value.size == 0):
        raise ValueError(f"{where}[{key!r}]: expected a 1-d integer array")
    if value.size and value.min() < 0:
        raise ValueError(f"{where}[{key!r}]: negative values")
    return value.astype(dtype)


def _ids(ids: dict, order: np.ndarray, where: str, deliveries: bool | None = False) -> dict[str, np.ndarray]:
    """A batch's names: ``rows`` (positions in the order) and, where
    ``deliveries`` is True (required) or None (optional), ``deliveries``."""
    out = {"rows": _array(ids, "rows", np.uint64, where)}
    if len(out["rows"]) and out["rows"].max() >= len(order):
        raise ValueError(f"{where}['rows']: positions beyond the epoch's order")
    if deliveries or (deliveries is None and "deliveries" in ids):
        out["deliveries"] = _array(ids, "deliveries", np.uint64, where)
        if len(out["deliveries"]) != len(out["rows"]):
            raise ValueError(f"{where}: rows and deliveries differ in length")
    return out


def _batches(state: dict, key: str, order: np.ndarray, where: str, deliveries: bool | None = False) -> list:
    batches = state.get(key)
    if not isinstance(batches, (list, tuple)):
        raise ValueError(f"{where}[{key!r}]: expected a list of batches")
    return [_ids(_mapping(b, f"{where}[{key!r}][{i}]"), order, f"{where}[{key!r}][{i}]", deliveries)
            for i, b in enumerate(batches)]
