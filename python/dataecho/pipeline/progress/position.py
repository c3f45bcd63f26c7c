"""Where a loader stands, for its checkpoints: the loaded state its next epoch
resumes, where an epoch left part-way (a loop left with ``break``, or an
error), and the running epoch's history (dataecho.pipeline.progress.replay); and from
them, ``state_dict()``'s result.

Rules, as torchdata's ``StatefulDataLoader`` keeps them:

- a state taken once every batch of an epoch was delivered, before its
  iterator said so (where Lightning's epoch-end checkpoint takes it), is the
  next epoch's start: nothing of that epoch is left to resume;
- a loaded mid-epoch state, then ``set_epoch(n)`` of another epoch: the same
  position of epoch ``n`` (as StatefulDataLoader reads its sampler's epoch),
  where it can be worked out, else epoch ``n`` from its start, with a warning;
- after an error mid-epoch, the state is where the last batch delivered left
  the epoch (worked out from the history), not the epoch's start: an
  emergency checkpoint repeats nothing already trained on;
- a stateful map-style dataset's own ``state_dict()`` is kept under
  "dataset", taken as the state is, and loaded as a state is.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from ...reading.stateful import is_stateful, state_of
from ..checkpoint import FORMAT, plain
from ..plan import Planner
from .replay import resumed_length
from .resume import for_epoch

__all__ = ["LoaderPosition"]

# A state's envelope, given (epoch, stages, history).
Envelope = Callable[[int, Any, list], dict[str, Any]]


def envelope_of(fingerprint: dict[str, Any], structure: Any) -> Envelope:
    """The envelope of a loader's states (see dataecho.pipeline.checkpoint)."""
    return lambda epoch, stages, history: {"format": FORMAT, "epoch": epoch, "config": fingerprint,
                                           "structure": structure, "history": history, "stages": stages}


class LoaderPosition:
    """What a loader keeps between epochs for its checkpoints (see the module docstring).

    Attributes:
        pending: a checked state loaded for the next epoch, or None.
        running: the checked state the epoch started last resumed, or None.
    """

    def __init__(self, source: Any = None) -> None:
        # A map-style source's dataset, whose own state a state keeps where it is stateful (dataecho.reading.stateful).
        dataset = source.dataset if source is not None and source.order is not None else None
        self._dataset = dataset if is_stateful(dataset) else None
        self.pending: dict[str, Any] | None = None
        self.raw: Any = None  # the pending state as given to load_state_dict
        self.running: dict[str, Any] | None = None  # the checked state the running epoch resumed, or None
        self._left: dict[str, Any] | Callable[[], dict[str, Any]] | None = None
        self._history: list[list[int]] = []  # the running epoch's, before its first batch
        self._lengths: dict[tuple, int] = {}

    def load(self, checked: dict[str, Any], raw: Any) -> None:
        """A state was loaded: ``checked`` for this rank, from ``raw`` as given
        (kept, to be loaded again should the job's part change before the epoch starts).
        A stateful dataset's state in it is loaded now, before any worker starts
        from the dataset."""
        self.pending, self.raw, self._left = checked, raw, None
        if self._dataset is not None and checked.get("dataset") is not None:
            self._dataset.load_state_dict(checked["dataset"])

    def epoch_length(self, planner: Planner, running: bool) -> int:
        """``len(loader)``: the next epoch's batches (the running one's if
        ``running``), counting those an epoch resumed under another world size
        had before (see :meth:`length`)."""
        state = self.pending if self.pending is not None else self.running if running else None
        if state is not None and state["stages"] is not None:
            return self.length(planner, state["epoch"], state["history"])
        return planner.plan.batches_per_epoch()

    def begin(self) -> dict[str, Any] | None:
        """An epoch starts: the checked state it resumes (the pending one), or None."""
        self.running, self.pending, self._left = self.pending, None, None
        self._history = self.running["history"] if self.running is not None else []  # [] at an epoch boundary
        return self.running

    def rebegin(self, number: int, planner: Planner) -> dict[str, Any] | None:
        """The epoch started last, before its first batch, runs epoch ``number``
        instead (``set_epoch`` after ``iter()``): the state it resumes then."""
        self.pending = self.running
        self.set_epoch(number, planner)
        return self.begin()

    def give_back(self) -> None:
        """The epoch started last ended before its first batch: its resume is pending again."""
        if self.running is not None and self.pending is None:
            self.pending = self.running
        self.running = None

    def history(self, world_size: int, taken: int) -> list[list[int]]:
        """The running epoch's history once it took ``taken`` batches on this job."""
        before = self._history
        if not before:
            return [[world_size, taken]]
        return before[:-1] + [[world_size, before[-1][1] + taken]]

    def set_epoch(self, number: int, planner: Planner) -> None:
        """``set_epoch(number)`` with a state pending: one at an epoch boundary
        starts epoch ``number``; a mid-epoch one is moved to epoch ``number``
        (see the module docstring)."""
        pending = self.pending
        if pending is None or pending["epoch"] == number:
            return
        if pending["stages"] is None:
            self.pending = {**pending, "epoch": number}
            return
        moved = for_epoch(planner, pending, number)
        if moved is None:
            warnings.warn(
                f"set_epoch({number}): the state loaded stood mid-way through epoch {pending['epoch']}, and that "
                f"position cannot be worked out for epoch {number} (an iterable, a sampler's order, or batches "
                f"written in place): epoch {number} starts from its beginning", UserWarning, stacklevel=3)
            moved = {**pending, "epoch": number, "stages": None, "history": []}
        self.pending = moved

    def ended(self, envelope: Envelope, epoch: int, world_size: int, taken: int, state: str,
              left: dict[str, Any] | None, replay: Callable[[list], Any], replayable: bool) -> None:
        """An epoch ended: where it stood if its consumer left it part-way
        (``left``); stopped or failed mid-epoch otherwise, where its last batch
        left it, worked out by ``replay`` from its history when a state is asked
        for (failed: always, refusing where it cannot; stopped: where it can)."""
        history = self.history(world_size, taken)
        if left is not None:
            self._left = envelope(epoch, left, history)
        elif state == "failed" and not (taken or self._history):
            self._left = envelope(epoch, None, [])  # failed before its first batch: it starts again
        elif state == "failed" or (state == "stopped" and (taken or self._history) and replayable):
            self._left = lambda: envelope(epoch, replay(history), history)

    def state(self, envelope: Envelope, current: Any, next_epoch: int, length: Callable[[int, list], int | None],
              world_size: int) -> dict[str, Any]:
        """``state_dict()``'s result (see the module docstring), in plain values.

        Raises:
            ValueError: a position that cannot be saved (the message says why).
        """
        if self.pending is not None:
            state = self.pending
        elif current is None and self._left is not None:
            state = self._left() if callable(self._left) else self._left
            self._left = state
        elif current is not None and (stages := current.state()) is not None:
            state = envelope(current.epoch, stages, self.history(world_size, current.taken))
        else:
            state = envelope(current.epoch if current is not None else next_epoch, None, [])
        if state["stages"] is not None and _spent(state, length(state["epoch"], state["history"])):
            state = envelope(state["epoch"] + 1, None, [])
        out = plain({key: value for key, value in state.items() if key not in ("length", "dataset")})
        if self._dataset is not None:  # as it stands now, as the dataset gives it
            out["dataset"] = state_of(self._dataset)
        return out

    def length(self, planner: Planner, epoch: int, history: list[list[int]]) -> int:
        """Batches of ``epoch`` on this rank in all, across its ``history`` (an
        epoch resumed under another world size has its own count).

        Raises:
            TypeError: where the number of batches is not known (see Plan.batches_per_epoch).
        """
        if len(history) <= 1:
            return planner.plan.batches_per_epoch()
        for known in (self.pending, self.running):  # worked out as it was loaded
            if (known is not None and known.get("length") is not None and known["epoch"] == epoch
                    and known["history"][:-1] == history[:-1]):
                return known["length"]
        key = (epoch, planner.seed, planner.shard, tuple(map(tuple, history[:-1])))
        if key not in self._lengths:
            self._lengths[key] = resumed_length(planner, epoch, history)
        return self._lengths[key]


def _spent(state: dict[str, Any], length: int | None) -> bool:
    """Every batch of the state's epoch was delivered: by the count where it is
    known, else by the stages holding nothing more and the intake at its end."""
    if length is not None:
        return sum(batches for _, batches in state["history"]) >= length
    stages = state["stages"]
    intake = stages.get("intake", {})
    if "bounds" in intake:  # a batch sampler's, read whole: at its end once every batch was handed out
        ended = intake["next_batch"] >= len(intake["bounds"]) - 1
    else:
        ended = intake.get("ended") and not len(intake.get("positions", ()))
    if not ended or intake.get("queued"):
        return False
    augment = stages.get("augment") or {}
    pending = augment.get("pending") or {}
    return not ((stages.get("batch_echo") or {}).get("entries") or augment.get("queued")
                or len(pending.get("deliveries", ())) or (stages.get("delivery") or {}).get("in_flight"))
