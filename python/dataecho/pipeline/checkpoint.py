"""EchoLoader checkpoints: the envelope of what ``state_dict()`` holds, its
check, and the pieces every stage's own check is made of.

A state is made of Python ints, floats, strings, bools, None, lists and dicts
alone (:func:`plain`): JSON, ``torch.load`` with ``weights_only=True``,
``torch.distributed.checkpoint`` and Orbax take it as it is. Examples are
named by position, never stored:

    format   "dataecho.EchoLoader/5"; a state of another format is refused
    epoch    the epoch to resume (or to start, when ``stages`` is None)
    history  how the epoch was delivered so far (dataecho.pipeline.progress.replay):
             ``[[world_size, batches], ...]``, one pair per job that delivered
             a part of it, the last this one; [] at the epoch's start
    config   the arguments that decide the sequence of batches (seed, rank,
             world_size, the source's length, the sampler's and batch
             sampler's types, batch_size, echo_factor, echo_at,
             shuffle_buffer, shuffle, drop_last, deterministic, max_echo, and
             whether augment takes an rng); a loader loads only a state whose
             values are its own, and a mismatch names the argument
    structure  the examples' structure (dataecho.examples.described), or None
             if no example was read yet: a resumed loader takes it from here
             rather than from the first examples it reads
    stages   None: the epoch starts from its beginning. Else {stage name: state}
             where the epoch stood between two batches (see
             dataecho.pipeline.plan). Each stage's module says what its state
             holds, restores it, and checks it (``check_state``): intake
             (dataecho.pipeline.stages.intake, or with a batch sampler
             dataecho.pipeline.stages.batches), batch_echo, augment, delivery. An
             iterable source read by threads saves ``{"intake": {"skip": n}}`` alone.

An iterable that can restart part-way (dataecho.reading.restart) also saves,
under ``stages["intake"]["restart"]``, ``{"position": p, "state": s}``: its own
state ``s`` before position ``p`` of the epoch's iteration, where ``p`` is at or
before the earliest position the state names (``next_seq``, or ``skip``, where
it names none). A resume restarts it there and reads from ``p`` on, instead of
from its start; ``s`` is whatever the iterable's ``state_of`` returned.

A map-style source read in a sampler's (or batch sampler's) order saves that
order, under ``stages["intake"]["order"]``, and where a stateful sampler stood
once it gave it, under ``stages["intake"]["sampler"]`` (dataecho.reading.stateful);
a stateful map-style dataset's own ``state_dict()`` goes under the state's
``"dataset"``. These two are kept as their owners gave them.

The epoch's delivery ledger (dataecho.pipeline.progress.repetition) goes
under ``stages["ledger"]``: each position's deliveries and last batch (packed,
compressed) and the gaps between repeats, so that a resumed epoch's repetition
report counts what was delivered before the state too. A state resumed on
another rank or world size, or moved to another epoch, starts its ledger anew.

A batch is named by ``{"rows": positions}``, and after augment also by
``"deliveries"`` (each row's delivery number, the key of its generator). A
stage restores its own batches that were on their way downstream when the
state was taken, and yields them first.

Size: about 20 bytes per resident example (at most ``shuffle_buffer``), 8 or 16
per row of each batch in flight, and a few hundred more. On resume, resident
examples and the rows of queued batches are read (and transformed, and
augmented) again; an iterable's examples are named by their position in its
iteration, which is then read again up to ``next_seq`` (from ``restart``'s
position where there is one).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..examples.described import described
from .progress.repetition import checked_ledger

__all__ = ["FORMAT", "Iterated", "StateCheck", "array_at", "at", "batches_at", "bool_at", "check_state", "compact",
           "dict_at", "earliest", "history_of", "ids_of", "int_at", "mapping", "named_rows", "plain", "prune",
           "read_to_named", "sampler_at", "with_restart"]

FORMAT = "dataecho.EchoLoader/5"

# A stage's check, bound to its spec: (its saved state, the epoch's order, where, for messages) -> the
# state normalized.
StateCheck = Callable[[dict, np.ndarray, str], dict]


def check_state(state: Any, fingerprint: dict[str, Any], checks: dict[str, StateCheck],
                order_of: Callable[[int, np.ndarray | None], np.ndarray | None], mode: str | None
                ) -> dict[str, Any]:
    """Validates a state for a loader.

    Args:
        state: what ``state_dict()`` returned.
        fingerprint: the loader's ``LoaderConfig.fingerprint()``.
        checks: per stage an exact state of this loader holds, its check.
        order_of: the reading order of a map-style source in an epoch, given
            the order the state saved (a sampler's) or None; None for iterables.
        mode: how the loader takes states mid-epoch (dataecho.pipeline.plan.Plan.checkpoint).

    Returns the state normalized (plain ints, arrays of fixed dtypes).

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
    _check_fingerprint(state.get("config"), fingerprint)
    epoch = int_at(state, "epoch", "state")
    structure = state.get("structure")
    if structure is not None:
        described(structure, "state['structure']")  # checked here; the loader takes it from the description
    out = {"format": FORMAT, "epoch": epoch, "config": dict(fingerprint), "stages": None, "structure": structure,
           "history": []}
    stages = state.get("stages")
    if stages is None:
        return out
    if not isinstance(stages, dict):
        raise ValueError("state['stages']: expected a dict or None")
    out["history"] = history_of(state.get("history"), "state['history']")
    if not out["history"] or out["history"][-1][0] != fingerprint["world_size"]:
        raise ValueError(f"state['history']: expected its last job to have this state's world_size "
                         f"({fingerprint['world_size']}), got {out['history']!r:.120}")
    intake = dict_at(stages, "intake", "state['stages']")
    if mode == "skip":
        out["stages"] = {"intake": {"skip": int_at(intake, "skip", at("intake"))}}
    else:
        saved = array_at(intake, "order", np.int64, at("intake")) if "order" in intake else None
        order = order_of(epoch, saved)
        if order is None:  # an iterable: its examples are named by position, up to where intake had read
            order = Iterated(int_at(intake, "next_seq", at("intake")))
        if set(stages) - {"ledger"} != set(checks):
            raise ValueError(f"state['stages']: expected the stages {list(checks)}, got {sorted(stages)}")
        out["stages"] = {name: check(dict_at(stages, name, "state['stages']"), order, at(name))
                         for name, check in checks.items()}
    if "ledger" in stages:
        out["stages"]["ledger"] = checked_ledger(stages["ledger"], "state['stages']['ledger']")
    if "restart" in intake:
        out["stages"]["intake"]["restart"] = _restart(intake["restart"], earliest(out["stages"]))
    return out


def _restart(restart: Any, most: int) -> dict[str, Any]:
    """A restartable iterable's saved state (see the module docstring), at a
    position no later than ``most``, the earliest the checked state names."""
    where = f"{at('intake')}['restart']"
    restart = mapping(restart, where)
    if "state" not in restart:
        raise ValueError(f"{where}: expected the iterable's state under 'state'")
    return {"position": int_at(restart, "position", where, at_most=most), "state": restart["state"]}


def history_of(value: Any, where: str) -> list[list[int]]:
    """A state's ``history`` (see the module docstring), checked.

    Raises:
        ValueError: not a list of ``[world_size >= 1, batches >= 0]`` pairs.
    """
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(item, (list, tuple)) and len(item) == 2
            and all(isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) for n in item)
            and item[0] >= 1 and item[1] >= 0 for item in value):
        raise ValueError(f"{where}: expected a list of [world_size, batches] pairs, got {value!r:.120}")
    return [[int(world), int(batches)] for world, batches in value]


def plain(value: Any) -> Any:
    """``value`` in plain values (dicts, lists, str, int, float, bool, None), as
    JSON keeps them: arrays become lists, NumPy scalars Python numbers."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    return value


class Iterated:
    """An iterable's order up to where its intake had read (``length``
    positions): each example's index is its position. No array of them is
    made, so that a state of a long stream costs what its named rows cost."""

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, positions: Any) -> np.ndarray:
        return np.asarray(positions)


def _check_fingerprint(saved: Any, fingerprint: dict[str, Any]) -> None:
    if not isinstance(saved, dict):
        raise ValueError("state['config']: expected a dict")
    for key, value in fingerprint.items():
        if saved.get(key) != value:
            hint = ("; to resume a job on another number of ranks, pass the list of every rank's state_dict() "
                    "to load_state_dict on every new rank") if key in ("rank", "world_size") else ""
            raise ValueError(
                f"state: saved with {key}={saved.get(key)!r}, but this loader has {key}={value!r}; "
                f"a state resumes only a loader with the same arguments that decide its batches{hint}"
            )


# ---- pieces of the stages' checks ----


def named_rows(stages: dict[str, Any]) -> set[int]:
    """Every position a (checked) state names: resident examples and the rows
    of batches on their way, in any stage: what a resumed epoch reads again."""
    found: set[int] = set()
    for rows in _named(stages):
        found.update(rows.tolist())
    return found


def earliest(stages: dict[str, Any]) -> int:
    """The earliest position of an iterable's iteration that a state (taken,
    or checked) needs read again: the first it names, else where reading stood
    (the intake's ``next_seq``, or ``skip``)."""
    intake = stages["intake"]
    first = int(intake["skip"] if "skip" in intake else intake["next_seq"])
    for rows in _named(stages):
        if len(rows):
            first = min(first, int(rows.min()))
    return first


def with_restart(stages: dict[str, Any] | None, marks: Any) -> dict[str, Any] | None:
    """An epoch's state (``{stage name: state}``, or None) with, under the
    intake's, where its iterable can restart (see the module docstring), given
    the epoch's ``Marks`` (dataecho.reading.restart), or None."""
    mark = marks.at_or_before(earliest(stages)) if stages is not None and marks is not None else None
    if mark is not None:
        stages["intake"]["restart"] = {"position": mark.position, "state": mark.state}
    return stages


def read_to_named(stages: dict[str, Any] | None) -> dict[str, Any] | None:
    """An iterable's epoch state (``{stage name: state}``, or None) whose
    intake has ended: its ``next_seq`` set to just after the last position any
    stage names (an ended assembler no longer says how far it read), which is
    as far as a resume must read the iterable again."""
    if stages is not None and stages["intake"].get("ended"):
        stages["intake"]["next_seq"] = max((int(rows.max()) + 1 for rows in _named(stages) if len(rows)), default=0)
    return stages


def prune(marks: Any, state: Callable[[], dict[str, Any]]) -> None:
    """Drops the ``Marks`` (or None) that no state can need any more, once they
    are many: those before the earliest position ``state()`` (the epoch's state
    now) names; the latest at or before it stays."""
    if marks is not None and marks.crowded:
        marks.forget_before(earliest(state()))


def _named(value: Any) -> Any:
    """The arrays of positions a state names (its ``rows`` and ``positions``), wherever they are."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("rows", "positions") and isinstance(item, np.ndarray):
                yield item
            elif key != "restart":  # the iterable's own state, opaque
                yield from _named(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _named(item)


def ended_intake(next_seq: int, queued: list) -> dict[str, Any]:
    """The state of an intake resumed after its end: nothing resident, every
    position up to ``next_seq`` read, ``queued`` batches still to replay."""
    empty = np.zeros(0, dtype=np.uint64)
    return {"batches": 0, "rng_state": 0, "next_seq": next_seq, "available": 0, "positions": empty,
            "indices": empty.astype(np.int64), "echoes": empty.astype(np.uint32), "queued": queued, "ended": True}


def compact(indices: Any) -> np.ndarray:
    """Indices to save (an order) in the smallest unsigned dtype that holds them."""
    indices = np.asarray(indices)
    top = int(indices.max()) if len(indices) else 0
    return indices.astype(np.uint32 if top < (1 << 32) else np.uint64)


def at(name: str) -> str:
    """Where stage ``name``'s state is, for messages."""
    return f"state['stages'][{name!r}]"


def dict_at(state: dict, key: str, where: str) -> dict:
    return mapping(state.get(key), f"{where}[{key!r}]")


def mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a dict")
    return value


def int_at(state: dict, key: str, where: str, at_most: int = (1 << 64) - 1) -> int:
    """An int in [0, at_most] (by default what the native 64-bit counters hold)."""
    value = state.get(key)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value <= at_most:
        raise ValueError(f"{where}[{key!r}]: expected an int in [0, {at_most}], got {value!r}")
    return int(value)


def sampler_at(state: dict, where: str) -> dict:
    """A stateful sampler's state (dataecho.reading.stateful): its own and its
    iterator's ``state_dict()``, under "sampler" and "iterator", as it gave them."""
    value = state.get("sampler")
    if not isinstance(value, dict) or not value or set(value) - {"sampler", "iterator"}:
        raise ValueError(f"{where}['sampler']: expected a dict of a sampler's and its iterator's state_dict(), "
                         f"got {value!r:.120}")
    return value


def bool_at(state: dict, key: str, where: str) -> bool:
    value = state.get(key)
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}[{key!r}]: expected True or False, got {value!r}")
    return bool(value)


def array_at(state: dict, key: str, dtype: Any, where: str) -> np.ndarray:
    value = np.asarray(state.get(key))
    if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer) or value.size == 0):
        raise ValueError(f"{where}[{key!r}]: expected a 1-d integer array")
    if value.size and value.min() < 0:
        raise ValueError(f"{where}[{key!r}]: negative values")
    if value.size and int(value.max()) > np.iinfo(dtype).max:
        raise ValueError(f"{where}[{key!r}]: values beyond {np.iinfo(dtype).max}")
    return value.astype(dtype)


def ids_of(ids: dict, order: np.ndarray, where: str, deliveries: bool | None = False) -> dict[str, np.ndarray]:
    """A batch's names: ``rows`` (positions in the order) and, where
    ``deliveries`` is True (required) or None (optional), ``deliveries``."""
    out = {"rows": array_at(ids, "rows", np.uint64, where)}
    if len(out["rows"]) and out["rows"].max() >= len(order):
        raise ValueError(f"{where}['rows']: positions beyond the epoch's order")
    if deliveries or (deliveries is None and "deliveries" in ids):
        out["deliveries"] = array_at(ids, "deliveries", np.uint64, where)
        if len(out["deliveries"]) != len(out["rows"]):
            raise ValueError(f"{where}: rows and deliveries differ in length")
    if "deliveries" in out and len(np.unique(out["deliveries"])) != len(out["deliveries"]):
        raise ValueError(f"{where}['deliveries']: a delivery twice in one batch")
    return out


def batches_at(state: dict, key: str, order: np.ndarray, where: str, deliveries: bool | None = False) -> list:
    """A list of batches' names (see :func:`ids_of`)."""
    batches = state.get(key)
    if not isinstance(batches, (list, tuple)):
        raise ValueError(f"{where}[{key!r}]: expected a list of batches")
    return [ids_of(mapping(b, f"{where}[{key!r}][{i}]"), order, f"{where}[{key!r}][{i}]", deliveries)
            for i, b in enumerate(batches)]
