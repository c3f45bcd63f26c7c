"""Each stage of an epoch on its own: built from its spec, driven by hand, its
state saved at several points, checked by its own ``check_state`` and loaded
into a new stage, which must go on exactly as the uninterrupted one. (The same
through EchoLoader is in test_checkpoint.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import multiprocessing
import os
import pickle
import threading
from collections import Counter
from typing import Any, Callable

import dataecho
import numpy as np
import pytest
from dataecho.examples.structure import Structure
from dataecho.pipeline.plan import plan
from dataecho.pipeline.stages import (
    augment,
    augment_kinds,
    augment_processes,
    batch_echo,
    batches,
    delivery,
    intake,
    lockstep,
    rereads,
)
from dataecho.pipeline.stages.stage import Batch
from dataecho.reading.source import EpochSource
from dataecho.workers.augment.staging import SharedBlocks
from dataecho.workers.failure import Failure
from dataecho.workers.readers import Reading
from dataecho.workers.resources import EpochResources, Seeds
from dataecho.workers.spec import default_start_method
from support import Records

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
    uninterrupted = make(None)
    reference = drain(uninterrupted)
    uninterrupted.stop()  # its threads (and processes) end with it
    uninterrupted.join(5.0)
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

    epoch = 3

    def read_rows(self, structure: Structure, rows: np.ndarray) -> tuple:
        return (np.asarray(rows, dtype=np.int64) * 10,)


def noisy(example: Any, rng: np.random.Generator) -> dict:
    return {"id": example, "noise": rng.integers(0, 1 << 30)}


AUGMENT = augment.AugmentSpec(
    augment=noisy, takes_rng=True, seed=9, rank=0, threads=2, exact=True, capacity=16, batch_size=BATCH,
    drop_last=False, prefetch=2, deterministic=True, in_order=False, declared_ragged=None, ragged_bytes=None,
    pinned_batches=0)


def test_augment_resumes_pending_resident_and_queued_rows():
    spec = AUGMENT
    pull_lock = threading.Lock()

    def make(state):
        upstream = Rows(SCALAR)
        if state is not None:  # every row below the next delivery number was taken
            upstream.position = state["taken"]
        return augment.AugmentStage(spec, upstream, SCALAR, FakeSource(), EpochResources(Seeds.of(0, 3, 0)),
                                    Failure(), lambda: None, pull_lock, resume=state)

    save_and_load_at_cuts(make, functools.partial(augment.check_state, spec), ORDER, pull_lock)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_intake_resumes_resident_and_queued_examples(num_workers):
    loader = dataecho.EchoLoader(Records(300), batch_size=8, echo_factor=1.5, shuffle_buffer=32, seed=4,
                                 deterministic=True, num_workers=num_workers)
    specs = plan(loader.config)
    structure = Structure.infer(Records(1)[0])

    def make(state):
        reading = Reading(EpochSource(specs.source, 0), specs.intake.workers, Failure(), lambda: None,
                          EpochResources(Seeds.of(specs.source.seed, 0, 0)))
        return intake.IntakeStage(specs.intake, reading, structure, [], resume=state)

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


# ---- a batch sampler's intake ----

EXAMPLES = 90  # of the batch sampler's dataset


def sampled_batches() -> list[list[int]]:
    """A batch sampler's batches: a fixed permutation cut into batches of 1 to 5."""
    order = np.random.default_rng(7).permutation(EXAMPLES).tolist()
    sizes, out = itertools.cycle([3, 1, 5, 2, 4]), []
    while order:
        size = next(sizes)
        out.append(order[:size])
        order = order[size:]
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_intake_resumes_its_queued_batches_and_the_next_to_read(num_workers):
    sampler = sampled_batches()
    assert len(sampler) > max(CUTS)
    loader = dataecho.EchoLoader(Records(EXAMPLES), batch_sampler=sampler, num_workers=num_workers)
    try:
        specs = plan(loader.config)
        assert isinstance(specs.intake, batches.BatchesSpec) and specs.reads_batches
        assert specs.intake.workers.kind == ("inline" if num_workers == 0 else "thread")
        learned: list[Structure] = []

        def make(state):
            # A resumed epoch reads the saved order and bounds (a batch sampler need not repeat itself).
            source = EpochSource(specs.source, 0, saved_order=state["order"] if state else None,
                                 saved_bounds=state["bounds"] if state else None)
            return batches.BatchesIntake(specs.intake, source, None, Failure(), lambda: None, resume=state,
                                         on_structure=learned.append)

        stage = make(None)
        if num_workers == 0:  # nothing is read until a batch is asked for (threads start at once)
            assert stage.structure is None and not learned, "learned from the first batch read"
        reference = drain(stage)
        stage.join(5.0)
        # The sampler's batches, whole and in its order; the rows are positions in the epoch's order.
        assert [leaves[0] for _, leaves in reference] == [str(b) for b in sampler], "the ids"
        assert [len(rows) for rows, _ in reference] == [len(b) for b in sampler]
        assert [r for rows, _ in reference for r in rows] == list(range(EXAMPLES))
        assert len(learned) == 1 and learned[0].paths == Structure.infer(Records(1)[0]).paths
        assert stage.counters()["fresh"] == EXAMPLES
        assert sum(w["produced"] for w in stage.counters()["workers"]) == EXAMPLES

        order = EpochSource(specs.source, 0).order
        save_and_load_at_cuts(make, functools.partial(batches.check_state, specs.intake), order)
    finally:
        loader.close()


# ---- augment in worker processes ----


def augmenters() -> list:
    """Augment worker processes of this process still running."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("dataecho-augment")]


def staged(names: list[str]) -> list[str]:
    """Those of the staging blocks ``names`` still in /dev/shm."""
    return [name for name in names if os.path.exists(os.path.join("/dev/shm", name))]


def test_augment_processes_replay_batches_and_resume_pending_and_resident_rows():
    # The thread stage's spec, its rows augmented by one worker process instead.
    spec = dataclasses.replace(AUGMENT, threads=0, processes=1, start_method=default_start_method(),
                               staged_batches=augment_processes.STAGED_BATCHES + 2)
    assert augment_kinds.augment_stage(spec) is augment_processes.AugmentProcessStage
    pull_lock, blocks = threading.Lock(), []
    before = augmenters()

    def batch_memory(count):  # Rows' batches are not in them: their leaves travel pickled
        blocks.append(SharedBlocks(count, 1 << 12))
        return blocks[-1]

    def make(state, kind=augment_processes.AugmentProcessStage, spec=spec):
        upstream = Rows(SCALAR)
        if state is not None:
            upstream.position = state["taken"]
        return kind(spec, upstream, SCALAR, FakeSource(), EpochResources(Seeds.of(0, 3, 0)), Failure(),
                    lambda: None, pull_lock, resume=state, batch_memory=batch_memory)

    threads = make(None, augment.AugmentStage, AUGMENT)
    augmented = []
    while True:
        try:
            augmented.append(threads.next(10.0))
        except StopIteration:
            break
    threads.join(5.0)
    reference = [describe(batch) for batch in augmented]
    stage = make(None)
    # A replay (a batch a state names as queued) comes first, recomputed by a worker from its rows and
    # deliveries: here every batch of the epoch, before any is handed out.
    assert [describe(stage.read_batch(batch.ids())) for batch in augmented] == reference
    assert drain(stage) == reference, "the batches thread augment gives for the same seed"
    assert [n for rows, _ in reference for n in rows] != list(range(POSITIONS)), "shuffled by the output buffer"
    assert sorted(n for rows, _ in reference for n in rows) == list(range(POSITIONS))
    assert stage.counters()["augmented"] == POSITIONS
    assert len(augmenters()) == len(before) + 1, "its worker runs until joined"
    stage.stop()
    stage.join(5.0)
    assert augmenters() == before and not staged(blocks[-1].names), "joined: no worker, no staging block left"

    save_and_load_at_cuts(make, functools.partial(augment.check_state, spec), ORDER, pull_lock)
    assert augmenters() == before
    assert not staged([name for b in blocks for name in b.names])


def test_augment_processes_read_the_intakes_batches_from_its_staging_blocks():
    loader = dataecho.EchoLoader(Records(96), batch_size=8, echo_factor=1.5, shuffle_buffer=32, seed=4,
                                 deterministic=True, num_workers=0, augment=noisy, augment_workers="process")
    specs = plan(loader.config)
    loader.close()
    assert specs.augment.kind == "process" and specs.augment.processes >= 1 and specs.augment.staged_batches > 0
    structure = Structure.infer(Records(1)[0])
    before = augmenters()

    def run(spec):
        """The augmented batches over a real intake; whether its batches lay in the staging blocks."""
        source = EpochSource(specs.source, 0)
        resources = EpochResources(Seeds.of(specs.source.seed, 0, 0))
        upstream = intake.IntakeStage(specs.intake, Reading(source, specs.intake.workers, Failure(), lambda: None,
                                                            resources), structure, [])
        blocks, in_blocks = [], []

        def batch_memory(count):
            blocks.append(upstream.share_batch_memory(count))
            return blocks[-1]

        def spied(timeout_s=None, take=upstream.next):
            batch = take(timeout_s)
            in_blocks.append(bool(blocks) and all(blocks[0].locate(leaf) is not None for leaf in batch.arrays))
            return batch

        upstream.next = spied
        kind, failure = augment_kinds.augment_stage(spec), Failure()
        stage = kind(spec, upstream, structure, source, resources, failure, lambda: None, threading.Lock(),
                     None, batch_memory)
        try:
            out = drain(stage)
            assert failure.error is None
            return out, in_blocks
        finally:
            stage.stop()
            upstream.stop()
            stage.join(5.0)
            upstream.join(5.0)
            assert not blocks or not staged(blocks[0].names)

    processes, in_blocks = run(specs.augment)
    assert in_blocks and all(in_blocks), "every batch of the echo buffer was assembled in a staging block"
    threads, _ = run(dataclasses.replace(specs.augment, threads=2, processes=0, staged_batches=0))
    assert processes == threads
    delivered = Counter(int(i) for rows, _ in processes for i in rows)
    assert set(delivered) == set(range(96)) and set(delivered.values()) == {1, 2}, "echo 1.5: once or twice"
    assert sum(delivered.values()) == 144, "exactly 1.5 deliveries per example"
    assert augmenters() == before


# ---- lockstep, on one rank ----


@pytest.fixture
def gloo_group(tmp_path):
    """A gloo process group of one rank (the lockstep stage's), destroyed after the test."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group(backend="gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class Failing(Rows):
    """Rows whose batch ``at`` raises."""

    def __init__(self, structure: Structure, at: int) -> None:
        super().__init__(structure)
        self.at, self.taken = at, 0

    def next(self, timeout_s: float | None = None) -> Batch:
        if self.taken == self.at:
            raise RuntimeError("upstream broke")
        self.taken += 1
        return super().next(timeout_s)


def test_lockstep_alone_passes_its_batches_then_repeats_recent_ones_until_the_agreement_ends_it(gloo_group):
    spec = lockstep.LockstepSpec(every=4, recent=3)
    upstream = Rows(SCALAR)
    stage = lockstep.LockstepStage(spec, upstream, gloo_group, Failure())
    assert stage.name == "lockstep" and stage.unresumable, "its state cannot be saved"
    assert stage.state() is None
    fresh = drain(Rows(SCALAR))
    out = []
    while True:
        try:
            out.append(stage.next(10.0))
        except StopIteration:
            break
    with pytest.raises(StopIteration):
        stage.next(1.0)  # over: no more agreements this epoch
    assert [describe(b) for b in out[:len(fresh)]] == fresh, "upstream's batches, in order"
    # Upstream ends after batch 20. The check at 20 posts "reading" (the end is not known yet); the
    # one at 24 reads it and posts "delivered"; the one at 28 reads that and ends the epoch, on every rank.
    assert len(out) == 28 and len(out) % spec.every == 0
    repeats = out[len(fresh):]
    recent = out[len(fresh) - spec.recent:len(fresh)]
    # The least delivered first, the oldest among equals: round robin here, every kept batch delivered once.
    expected = [recent[i % spec.recent] for i in range(len(repeats))]
    assert all(b.rows is not None and np.array_equal(b.rows, e.rows) for b, e in zip(repeats, expected)), \
        "a repeat names its rows: the delivery ledger counts it"
    assert [[a.tolist() for a in b.arrays] for b in repeats] == [[a.tolist() for a in b.arrays] for b in expected]
    assert not any(np.shares_memory(a, e) for b, c in zip(repeats, expected) for a, e in zip(b.arrays, c.arrays)), \
        "a repeat is a copy: the loop may change a batch in place"
    counters = stage.counters()
    assert counters["lockstep_repeats"] == len(repeats) == 8
    assert isinstance(counters["lockstep_wait_s"], float) and counters["lockstep_wait_s"] >= 0
    assert stage.state() is None
    stage.stop()
    stage.join(1.0)


def test_rereads_read_the_least_delivered_positions_again_counting_those_read_ahead():
    # Position 4 was never delivered (another rank's); 1, 3, 5 and 7 the fewest times.
    times = np.array([3, 1, 2, 1, 0, 1, 2, 1], dtype=np.uint16)

    def read_batch(ids: dict) -> Batch:
        return Batch(None, (ids["rows"].astype(np.int64) * 10,), ids["rows"])

    again = rereads.Rereads(read_batch, lambda: times, batch_size=2, seed=0)
    taken = []
    while len(taken) < 3:
        batch = again.take()
        if batch is not None:
            assert np.array_equal(batch.arrays[0], batch.rows.astype(np.int64) * 10), "read from its positions"
            taken.append(sorted(batch.rows.tolist()))
            np.add.at(times, batch.rows.astype(np.intp), 1)  # delivered, as the stage counts it
    again.stop()
    again.join(1.0)
    assert sorted(taken[0] + taken[1]) == [1, 3, 5, 7], "the least delivered first, those read ahead counted"
    assert all(4 not in rows and 0 not in rows for rows in taken)

    def failing(ids: dict) -> Batch:
        raise OSError("a read failed")

    broken = rereads.Rereads(failing, lambda: times, batch_size=2)
    broken.join(5.0)
    with pytest.raises(OSError, match="a read failed"):
        broken.take()


def test_lockstep_alone_stops_when_stopped_or_when_its_upstream_fails(gloo_group):
    stage = lockstep.LockstepStage(lockstep.LockstepSpec(every=4, recent=3), Rows(SCALAR), gloo_group, Failure())
    assert [describe(stage.next(10.0)) for _ in range(5)] == drain(Rows(SCALAR), 5)
    stage.stop()
    stage.stop()  # idempotent
    with pytest.raises(StopIteration):
        stage.next(1.0)
    stage.join(1.0)
    counters = stage.counters()
    assert set(counters) == {"lockstep_repeats", "lockstep_wait_s"} and counters["lockstep_repeats"] == 0

    # Stopped before its first batch: it leaves at the first agreement, and nothing is delivered.
    stopped = lockstep.LockstepStage(lockstep.LockstepSpec(every=4), Rows(SCALAR), gloo_group, Failure())
    stopped.stop()
    with pytest.raises(StopIteration):
        stopped.next(1.0)

    # A stage thread's error (recorded in the failure) makes upstream's end a stop, not this rank's end.
    for error in (None, RuntimeError("a stage thread failed")):
        failure, last = Failure(), Rows(SCALAR, start=POSITIONS - BATCH)  # one batch left
        stage = lockstep.LockstepStage(lockstep.LockstepSpec(every=4), last, gloo_group, failure)
        stage.next(10.0)
        if error is None:
            stage.next(10.0)
            assert stage.counters()["lockstep_repeats"] == 1, "its shard delivered: it repeats while the others finish"
        else:
            failure.set(error)
            with pytest.raises(StopIteration):
                stage.next(10.0)

    # Upstream's error is the consumer's, and the epoch is over after it.
    broken = lockstep.LockstepStage(lockstep.LockstepSpec(every=4), Failing(SCALAR, at=6), gloo_group, Failure())
    assert len([broken.next(10.0) for _ in range(6)]) == 6
    with pytest.raises(RuntimeError, match="upstream broke"):
        broken.next(10.0)
    with pytest.raises(StopIteration):
        broken.next(10.0)


def test_lockstep_alone_with_an_empty_upstream_ends_an_empty_epoch(gloo_group):
    upstream = Rows(SCALAR)
    upstream.position = POSITIONS  # nothing left: this (only) rank is empty, so every rank is
    stage = lockstep.LockstepStage(lockstep.LockstepSpec(), upstream, gloo_group, Failure())
    with pytest.raises(StopIteration):
        stage.next(10.0)
    assert stage.counters()["lockstep_repeats"] == 0
