"""The last stage: batches on their way out of the pipeline. With ``device``,
each batch is copied to the device on a side stream one batch ahead, so that
the copy overlaps the training step (see
:class:`dataecho.pipeline.stages.device_copy.DeviceMover`); without one, batches pass
through as they are.

A ragged leaf travels as its values and offsets and becomes a jagged nested
tensor on the device (or, with ``padding``, is padded on the host first); a
list of objects stays on the host and is handed out with its batch.

Its state: ``in_flight``, the batches taken from upstream and not yet handed
out (on their way to the device), oldest first. A resumed stage reads them
again and hands them out first, with a device or without one.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...examples.leaves import leaf_to_torch, padded_leaves
from ...examples.ragged import Padded, Ragged
from ...tensors.nested import nested_from_packed
from .. import checkpoint
from .device_copy import DeviceMover
from .stage import Batch, Replay, Stage

__all__ = ["DeliverySpec", "DeliveryStage", "check_state"]

_AHEAD = 2  # batches in flight: the one handed out and the next


@dataclass(frozen=True)
class DeliverySpec:
    """Attributes:
        device: the torch device batches are copied to, or None (host batches).
        padding: with a device: ragged leaves are padded on the host first.
    """

    device: Any
    padding: int | str | None = None


class DeliveryStage:
    """Host batches in; device tensors out (or the host batches, without a device).

    Args:
        spec: the stage's settings.
        upstream: the stage whose (host) batches are handed out.
        resume: this stage's state from a checkpoint, or None.
        read_batch: reads a batch again from its ids (for ``resume``).
    """

    name = "delivery"
    unresumable = None

    def __init__(self, spec: DeliverySpec, upstream: Stage, resume: dict[str, Any] | None = None,
                 read_batch: Callable[[dict[str, np.ndarray]], Batch] | None = None) -> None:
        self._upstream = upstream
        # Unreleased copies bounded as the pinned pool is sized (dataecho.pipeline.plan): the batch
        # handed out and the next, in flight.
        self._mover = DeviceMover(spec.device, max_unreleased=_AHEAD) if spec.device is not None else None
        # Held around each use of the mover: next() runs in the consumer's thread, join() in
        # whichever thread closes the epoch (loader.close() from another thread, a finalizer).
        self._mover_lock = threading.Lock()
        self._padding = spec.padding
        # Restored from a checkpoint: batches that were on their way out, handed out first.
        self._replay = Replay(resume["in_flight"] if resume else None)
        self._read_batch = read_batch
        # Submitted, not yet handed out: each batch's ids, and its leaves' kinds
        # with what stays on the host (objects, nested tensors' row bounds).
        self._in_flight: deque[tuple[Batch, list]] = deque()
        self._exhausted = False

    def next(self, timeout_s: float | None = None) -> Batch:
        if self._mover is None:
            return self._take(timeout_s)
        while not self._exhausted and len(self._mover) < _AHEAD:
            try:
                batch = self._take(timeout_s)
            except StopIteration:
                self._exhausted = True
                break
            leaves = batch.arrays if self._padding is None else padded_leaves(batch.arrays, self._padding)
            kept = [_host(leaf) for leaf in leaves]
            host = [tensors for _, tensors, _ in kept if tensors is not None]
            with self._mover_lock:
                if self._mover.closed:  # the epoch was closed meanwhile, from another thread
                    raise StopIteration
                self._mover.submit(host, on_done=host.clear)
            self._in_flight.append((Batch(batch.structure, (), batch.rows, batch.deliveries),
                                    [(kind, extra) for kind, _, extra in kept]))
        with self._mover_lock:
            if self._mover.closed or len(self._mover) == 0:
                raise StopIteration
            taken, kept = self._in_flight.popleft()
            moved = iter(self._mover.take())
        leaves = tuple(extra if kind == "object" else _device(kind, next(moved), extra) for kind, extra in kept)
        return Batch(taken.structure, leaves, taken.rows, taken.deliveries)

    def _take(self, timeout_s: float | None) -> Batch:
        """The next host batch: a restored one first, then the upstream's."""
        if self._replay:
            return self._replay.next(self._read_batch)
        return self._upstream.next(timeout_s)

    def stop(self) -> None:
        pass  # join() closes the mover: it waits for the copies, which stop() must not

    def join(self, timeout_s: float) -> None:
        """Waits for the copies in flight and gives their host memory back.

        Never raises: the epoch joins the stages before this one after it. A
        failure (the device failed, as after a CUDA error in the training step,
        or a batch's memory could not be given back) is a RuntimeWarning; the
        training loop has seen the error that caused it.
        """
        if self._mover is None:
            return
        with self._mover_lock:  # a next() in another thread finishes its submit or take first
            try:
                self._mover.close()
            except Exception as exc:  # noqa: BLE001 - reported, and the other stages still join
                warnings.warn(f"EchoLoader: closing the device copies: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=2)

    def state(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The batches taken from upstream and not yet handed out, oldest first."""
        return {"in_flight": [batch.ids() for batch, _ in self._in_flight] + self._replay.saved()}

    def counters(self) -> dict[str, Any]:
        return {}


def check_state(spec: DeliverySpec, state: dict, order: np.ndarray, where: str) -> dict[str, Any]:
    """This stage's saved state, checked against the epoch's order and normalized.

    Raises:
        ValueError: a state this stage could not have saved, naming the key.
    """
    return {"in_flight": checkpoint.batches_at(state, "in_flight", order, where, deliveries=None)}


def _host(leaf: Any) -> tuple[str, Any, Any]:
    """(kind, the host tensors to copy or None, what stays on the host) of one leaf."""
    if isinstance(leaf, list):
        return "object", None, leaf
    if isinstance(leaf, Ragged):
        lengths = leaf.lengths
        bounds = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
        return "ragged", (leaf_to_torch(leaf.values), leaf_to_torch(leaf.offsets)), bounds
    if isinstance(leaf, Padded):
        return "padded", tuple(leaf_to_torch(leaf)), None
    return "array", leaf_to_torch(leaf), None


def _device(kind: str, tensors: Any, extra: Any) -> Any:
    """One leaf on the device, from its copied tensors."""
    if kind == "ragged":
        return nested_from_packed(*tensors, bounds=extra)  # row bounds from the host: no device sync
    if kind == "padded":
        return Padded(*tensors)
    return tensors
