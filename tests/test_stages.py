"""Each stage of an epoch on its own: built from its spec, driven by hand, its
state saved at several points, checked by its own ``check_state`` and loaded
into a new stage, which must go on exactly as the uninterrupted one. (The same
through EchoLoader is in test_checkpoint.py.)"""

from __future__ import annotations

import functools

import contextlib
import pickle
import threading
from typing import Any, Callable

import numpy as np
import pytest
from support import Records

import dataecho
from dataecho.examples.structure import Structure
from dataecho.pipeline import augment, batch_echo, delivery, intake
from dataecho.pipeline.plan import plan
from dataecho.pipeline.stage import Batch
from dataecho.reading.source import EpochSource
from dataecho.workers.failure import Failure

CUTS = (0, 1, 3, 7, 12)
POSITIONS = 80  # rows of the fake upstream's epoch: 20 batches
BATCH = 4


def drain(stage: Any, limit: int | None = None) -> list:
    """What the next batches of ``stage`` are made of (up to ``limit``), by rows."""
    out = []
    while limit is None or len(out) < limit:
        try:
            batch = stage.next(10.0)
        except StopIteration:
            break
        out.append(describe(batch))
    return out


def describe(batch: Batch) -> tuple:
    leaves = [np.asarray(leaf).tolist() for leaf in batch.arrays]
    return tuple(batch.rows.tolist()), tuple(map(str, leaves))


def save_and_load_at_cuts(make: Callable[[dict | None], Any], check: Callable[[dict, np.ndarray, str], dict],
                          order: np.ndarray, pull_lock: Any = None) -> None:
    """torchdata's save-load test, for one stage: the batches of a stage resumed
    after ``cut`` batches are those the uninterrupted stage yields after them.
    ``pull_lock``: held while the state is taken (as the epoch holds it)."""
    reference = drain(make(None))
    assert len(reference) > max(CUTS), "the epoch is longer than every cut"
    for cut in CUTS:
        stage = make(None)
        taken = drain(stage, cut)
        with pull_lock or contextlib.nullcontext():
            state = pickle.loads(pickle.dumps(stage.state()))
        stage.stop()
        stage.join(5.0)
        resumed = make(check(state, order, f"state['stages'][{stage.name!r}]"))
        assert taken + drain(resumed) == reference, f"resumed after batch {cut}"
        resumed.stop()
        resumed.join(5.0)


class Rows:
    """An upstream stage: batches of consecutive positions 0, 1, ... (the last
    one short), whose leaf is each row's id, a function of its position."""

    name = "rows"
    unresumable = None

    def __init__(self, structure: Structure, start: int = 0) -> None:
        self.structure, self.position = structure, start

    def next(self, timeout_s: float | None = None) -> Batch:
        if self.position >= POSITIONS:
            raise StopIteration
        rows = np.arange(self.position, min(self.position + BATCH, POSITIONS), dtype=np.uint64)
        self.position += len(rows)
        return self.read({"rows": rows})

    def read(self, ids: dict) -> Batch:
        rows = np.asarray(ids["rows"], dtype=np.uint64)
        return Batch(self.structure, (rows.astype(np.int64) * 10,), rows)

    def stop(self) -> None:
        pass

    def join(self, timeout_s: float) -> None:
        pass


SCALAR = Structure.infer(np.int64(0))
ORDER = np.arange(POSITIONS)


@pytest.mark.parametrize("factor", [2.0, 1.5])
def test_batch_echo_resumes_at_every_cut(factor):
    spec = batch_echo.BatchEchoSpec(resident=3, batch_size=BATCH, echo_factor=factor, max_echo=4.0, exact=True)

    def make(state):
        upstream = Rows(SCALAR)
        if state is not None:  # the upstream's batches are consecutive rows
            upstream.position = state["fresh_batches"] * BATCH
        return batch_echo.BatchEchoStage(spec, upstream, seed=5, resume=state, read_batch=upstream.read)

    save_and_load_at_cuts(make, functools.partial(batch_echo.check_state, spec), ORDER)


def test_delivery_resumes_batches_on_their_way_to_the_device():
    pytest.importorskip("torch")
    spec = delivery.DeliverySpec(device="cpu")

    def make(state):
        upstream = Rows(SCALAR)
        if state is not None:  # everything before the batches in flight was taken from upstream
            flights = state["in_flight"]
            upstream.position = int(flights[-1]["rows"][-1]) + 1 if flights else 0
        return delivery.DeliveryStage(spec, upstream, resume=state, read_batch=upstream.read)

    stage = make(None)
    stage.next()
    assert len(stage.state()["in_flight"]) == 1, "one batch is copied ahead of the one handed out"
    stage.join(1.0)
    save_and_load_at_cuts(make, functools.partial(delivery.check_state, spec), ORDER)


class FakeSource:
    """What augment reads rows again from: the positions' ids."""

    epoch, seeds = 3, [1, 2, 3, 4]

    def read_rows(self, structure: Structure, rows: np.ndarray) -> tuple:
        return (np.asarray(rows, dtype=np.int64) * 10,)


def noisy(example: Any, rng: np.random.Generator) -> dict:
    return {"id": example, "noise": rng.integers(0, 1 << 30)}


def test_augment_resumes_pending_resident_and_queued_rows():
    spec = augment.AugmentSpec(
        augment=noisy, takes_rng=True, seed=9, rank=0, threads=2, exact=True, capacity=16, batch_size=BATCH,
        drop_last=False, prefetch=2, deterministic=True, in_order=False, declared_ragged=None, ragged_bytes=None,
        pinned_batches=0)
    pull_lock = threading.Lock()

    def make(state):
        upstream = Rows(SCALAR)
        if state is not None:  # every row below the next delivery number was taken
            upstream.position = state["taken"]
        return augment.AugmentStage(spec, upstream, SCALAR, FakeSource(), Failure(), lambda: None, pull_lock,
                                    resume=state)

    save_and_load_at_cuts(make, functools.partial(augment.check_state, spec), ORDER, pull_lock)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_intake_resumes_resident_and_queued_examples(num_workers):
    loader = dataecho.EchoLoader(Records(300), batch_size=8, echo_factor=1.5, shuffle_buffer=32, seed=4,
                                 deterministic=True, num_workers=num_workers)
    specs = plan(loader.config)
    structure = Structure.infer(Records(1)[0])

    def make(state):
        source = EpochSource(specs.source, 0)
        return intake.IntakeStage(specs.intake, source, structure, [], Failure(), lambda: None, resume=state)

    order = specs.source.order.order(0)
    save_and_load_at_cuts(make, functools.partial(intake.check_state, specs.intake), order)
    loader.close()


def test_a_stage_refuses_a_state_it_could_not_have_saved():
    spec = batch_echo.BatchEchoSpec(resident=3, batch_size=BATCH, echo_factor=2.0, max_echo=4.0, exact=True)
    state = {"entries": [{"rows": np.array([1, 2]), "left": 3, "deliveries": 2}], "last": 0, "rng": {},
             "fresh_batches": 1, "delivered_batches": 0, "upstream_done": False}
    with pytest.raises(ValueError, match=r"\['entries'\]\[0\]: expected 1 <= left <= deliveries <= 2"):
        batch_echo.check_state(spec, state, ORDER, "state['stages']['batch_echo']")
    with pytest.raises(ValueError, match="in_flight"):
        delivery.check_state(delivery.DeliverySpec(device="cpu"), {"in_flight": [{"rows": np.array([POSITIONS])}]},
                             ORDER, "state['stages']['delivery']")
