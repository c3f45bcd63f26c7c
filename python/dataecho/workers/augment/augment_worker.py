"""The entry point of an augment worker process (``augment`` with
``augment_workers="process"``).

A worker maps the staging blocks the echo buffer assembles its batches in
(dataecho.workers.augment.staging), waits for tasks on its task pipe, and for each
augments the rows it names, with each delivery's generator where ``augment``
takes ``rng``, then puts every result straight into the output buffer's
shared region, numbered by its delivery (the output buffer orders them). The
first task's results (and those of a batch replayed on resume) go back to the
parent instead, pickled: they tell it the output's structure, which it needs
to make that region. Once the output is closed (the epoch stopped), the rest
of a task's results are dropped. Messages from the parent on the task pipe:

    ("blocks", epoch, names, nbytes, rng_key)         an epoch's staging blocks (first, and with
                                                      persistent workers again each epoch)
    ("task", task_id, deliveries, leaves, send_back)  rows to augment
    ("output", region, fields, structure)             the output region to put into
    None                                              exit

and to it on the result pipe: ("ready", worker, epoch), ("attached", worker, epoch),
("done", worker, task_id), ("results", worker, task_id, [(delivery, result), ...])
and ("error", worker, exception, traceback).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import _core
from ...examples.columns import Columns
from ...examples.fields import field_value
from ...examples.objects import LeafMap
from ...examples.structure import Structure
from ..life import guard, report, send
from .augment_rows import augmented, unpacked
from .delivery_rng import DeliveryRng
from .staging import BlockViews

_OK, _CLOSED = _core.Status.OK, _core.Status.CLOSED


@dataclass
class AugmentWorkerSpec:
    """What an augment worker is started with (pickled once)."""

    worker_id: int
    augment: Any
    structure: Structure  # of the upstream examples
    seed: int


def main(spec: AugmentWorkerSpec, conn: Any, lifeline: Any, tasks: Any) -> None:
    """Serves tasks until the parent sends None or goes away."""
    parent = guard(lifeline)
    if parent is None:
        return
    random.seed(spec.seed)
    np.random.seed(spec.seed % (1 << 32))
    worker = _Worker(spec, conn, parent)
    while True:
        try:
            message = tasks.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        try:
            if not worker.handle(message):
                return
        except BaseException as error:  # reported to the parent, which raises it
            report(conn, spec.worker_id, error)
            return


class _Worker:
    """One worker's mappings and output, and what it does with each message."""

    def __init__(self, spec: AugmentWorkerSpec, conn: Any, parent: int) -> None:
        self._spec, self._conn, self._parent = spec, conn, parent
        self._epoch = 0
        self._views: BlockViews | None = None
        self._rng: DeliveryRng | None = None
        self._producer: Any = None
        self._structure: Structure | None = None
        self._fields: list = []
        self._leaf_map: LeafMap | None = None
        self._columns: Columns | None = None

    def handle(self, message: tuple) -> bool:
        """Does what ``message`` asks; False once the parent is gone."""
        kind = message[0]
        if kind == "output":
            _, region, self._fields, self._structure = message
            self._leaf_map = LeafMap(self._fields, "pickle")  # object leaves travel pickled, in the carrier
            self._columns = Columns(self._structure, self._fields, self._leaf_map.codec, "augment's result")
            self._producer = _core.Producer(region, [f.decl() for f in self._leaf_map.native])
            send(self._conn, ("attached", self._spec.worker_id, self._epoch))
            return True
        if kind == "blocks":
            _, self._epoch, names, nbytes, rng_key = message
            self._producer = self._structure = self._leaf_map = self._columns = None  # the last epoch's output is gone
            self._views = BlockViews(names, nbytes)
            self._rng = DeliveryRng(*rng_key) if rng_key is not None else None
            send(self._conn, ("ready", self._spec.worker_id, self._epoch))
            return True
        _, task_id, deliveries, leaves, send_back = message
        arrays = tuple(self._views.leaf(leaf) for leaf in leaves)
        results = list(augmented(self._spec.augment, self._spec.structure, arrays, unpacked(deliveries), self._rng))
        if send_back or self._producer is None:
            send(self._conn, ("results", self._spec.worker_id, task_id, results))
            return True
        if isinstance(deliveries, tuple):  # numbered one after another: put in one native call
            status = self._put_all([result for _, result in results], deliveries[0])
        else:
            status = True
            for delivery, result in results:
                status = self._put(result, delivery)
                if not status:
                    break  # closed (the rest are dropped), or the parent is gone
        if status is None:
            return False
        send(self._conn, ("done", self._spec.worker_id, task_id))
        return True

    def _put_all(self, results: list, first: int) -> bool | None:
        """Puts results numbered ``first`` on, as columns; as :meth:`_put`."""
        columns, done = self._columns.of(results), 0
        while done < len(results):
            status, done = self._producer.put_each(columns, len(results), 1.0, first, done)
            if status == _CLOSED:
                return False
            if done < len(results) and os.getppid() != self._parent:
                return None
        return True

    def _put(self, result: Any, delivery: int) -> bool | None:
        """Puts one result, numbered by its delivery; False once the output is
        closed, None once the parent is gone."""
        leaves = self._structure.flatten(result)
        arrays = self._leaf_map.example([field_value(v, f, None, "augment's result")
                                         for v, f in zip(leaves, self._fields)])
        while True:
            status = self._producer.put(arrays, 1.0, delivery)
            if status == _OK:
                return True
            if status == _CLOSED:
                return False
            if os.getppid() != self._parent:
                return None
