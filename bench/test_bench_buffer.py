"""Microbenchmarks of ShuffleBuffer's operations beside the same operations of the baselines.

Run with ``pytest bench/ --benchmark-only``. Each group times one operation on
the same examples for every contestant: dataecho, the hand-written queue + list
buffer of ``bench_buffer.run_baseline``, and where it has the operation, torch's
``DataLoader`` over the shuffle-buffer dataset of ``compare.py``. Times are per
round of ``N`` examples (``extra_info`` has ns per example); lower is better.
Every benchmark checks its result: each example arrives, and comes out exactly
the expected number of times.

Every source row starts with its id (8 bytes, little-endian), so a batch's ids
are ``batch[:, :8].view("<u8")``.
"""

from __future__ import annotations

import queue
import random

import numpy as np
import pytest

import bench_buffer
import compare
import dataecho

pytest.importorskip("pytest_benchmark")

N = 2048  # examples per round
BATCH = 256
ECHO = 2
ROUNDS = 20
WARMUP_ROUNDS = 2  # the first rounds fault in fresh memory (slow on virtual machines)
SIZES = {"64 B": 64, "12 KiB": 12288}
# put_many rows per call: as in bench_buffer.CASES, at most N.
CHUNKS = {c.label: min(c.chunk, N) for c in bench_buffer.CASES if c.label in SIZES}

torch_data = compare.torch_data  # None without torch


@pytest.fixture(scope="module", params=list(SIZES), ids=[s.replace(" ", "") for s in SIZES])
def size(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def src(size: str) -> np.ndarray:
    """N random rows of the size, each starting with its id."""
    rows = np.random.default_rng(0).integers(0, 256, (N, SIZES[size]), dtype=np.uint8)
    rows[:, :8] = np.arange(N, dtype="<u8").view(np.uint8).reshape(N, 8)
    return rows


def ids_of(batch) -> np.ndarray:
    """The ids of a batch's rows (a copy)."""
    return np.ascontiguousarray(np.asarray(batch)[:, :8]).view("<u8").ravel()


def check_queue(inbox: queue.Queue) -> None:
    """Every example came through the queue exactly once, and nothing more."""
    assert_each(ids_of(np.stack([inbox.get_nowait() for _ in range(N)])), 1)
    assert inbox.empty()


def assert_each(ids: list[np.ndarray] | np.ndarray, times: int) -> None:
    """Every id in ``range(N)`` occurs exactly ``times`` times."""
    counts = np.bincount(np.concatenate(ids) if isinstance(ids, list) else ids, minlength=N)
    assert len(counts) == N and (counts == times).all(), f"ids off: {np.flatnonzero(counts != times)[:10]}"


def new_buffer(size: str, echo: float = 1.0) -> dataecho.ShuffleBuffer:
    # capacity N: a round's puts never wait for a consumer.
    return dataecho.ShuffleBuffer(((SIZES[size],), "uint8"), capacity=N, batch_size=BATCH, echo_factor=echo, seed=0)


def drain_and_check(buf: dataecho.ShuffleBuffer, echo: int = 1) -> None:
    buf.close()
    assert_each([ids_of(b) for b in buf], echo)


def timed(benchmark, target, **kwargs):
    """``benchmark.pedantic`` with this file's rounds; returns the last round's result."""
    return benchmark.pedantic(target, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, **kwargs)


def per_example(benchmark) -> None:
    benchmark.extra_info["examples_per_round"] = N
    if benchmark.stats:  # None under --benchmark-disable
        benchmark.extra_info["ns_per_example"] = benchmark.stats.stats.median / N * 1e9


# ---- put: one example per call ----


def test_put_dataecho(benchmark, size, src):
    benchmark.group = f"put: {N} examples of {size}, one call each"
    rows = list(src)

    def put_all(buf):
        for row in rows:
            buf.put(row)

    timed(benchmark, put_all, setup=lambda: ((new_buffer(size),), {}), teardown=drain_and_check)
    per_example(benchmark)


def test_put_baseline(benchmark, size, src):
    benchmark.group = f"put: {N} examples of {size}, one call each"
    rows = list(src)

    def put_all(inbox):
        for row in rows:
            inbox.put(row)

    timed(benchmark, put_all, setup=lambda: ((queue.Queue(maxsize=N),), {}), teardown=check_queue)
    per_example(benchmark)


# ---- put_many: stacked examples per call ----


def test_put_many_dataecho(benchmark, size, src):
    benchmark.group = f"put_many: {N} examples of {size}, {CHUNKS[size]} per call"
    chunks = np.split(src, N // CHUNKS[size])

    def put_all(buf):
        for chunk in chunks:
            buf.put_many(chunk)

    timed(benchmark, put_all, setup=lambda: ((new_buffer(size),), {}), teardown=drain_and_check)
    per_example(benchmark)


def test_put_many_baseline(benchmark, size, src):
    """The hand-written pipeline takes examples one row at a time, whatever their source."""
    benchmark.group = f"put_many: {N} examples of {size}, {CHUNKS[size]} per call"
    chunks = np.split(src, N // CHUNKS[size])

    def put_all(inbox):
        for chunk in chunks:
            for row in chunk:
                inbox.put(row)

    timed(benchmark, put_all, setup=lambda: ((queue.Queue(maxsize=N),), {}), teardown=check_queue)
    per_example(benchmark)


def test_put_many_memcpy_floor(benchmark, size, src):
    """The copy any put_many does: np.copyto of the same chunks into preallocated slots."""
    benchmark.group = f"put_many: {N} examples of {size}, {CHUNKS[size]} per call"
    chunks = np.split(src, N // CHUNKS[size])
    slots = np.zeros_like(src)

    def copy_all():
        start = 0
        for chunk in chunks:
            np.copyto(slots[start : start + len(chunk)], chunk)
            start += len(chunk)

    timed(benchmark, copy_all, setup=lambda: slots.fill(0))
    assert_each(ids_of(slots), 1)
    per_example(benchmark)


# ---- iteration: all batches of N examples, each delivered ECHO times ----


def test_iterate_dataecho(benchmark, size, src):
    """All batches of a filled, closed buffer; its assembler may have prefetched the first batches
    (``prefetch=2``) before the clock starts, as it does in a running pipeline."""
    benchmark.group = f"iterate: {N} examples of {size} x echo {ECHO}, batch {BATCH}"

    def filled():
        buf = new_buffer(size, ECHO)
        buf.put_many(src)
        buf.close()
        return (buf,), {}

    ids = timed(benchmark, lambda buf: [ids_of(b) for b in buf], setup=filled)
    assert_each(ids, ECHO)
    per_example(benchmark)


def baseline_batches(entries: list[list], batch_size: int, rng: random.Random) -> list[np.ndarray]:
    """The assembler of ``bench_buffer.run_baseline``, on a filled list and without the queues.

    Args:
        entries: ``[row, deliveries left]`` for every example; emptied.
        batch_size: rows per batch.
        rng: the random source of the picks.

    Returns:
        The ids of every batch.
    """
    out = []
    while entries:
        out.append(ids_of(np.stack(bench_buffer.draw_batch(entries, batch_size, rng))))
    return out


def test_iterate_baseline(benchmark, size, src):
    benchmark.group = f"iterate: {N} examples of {size} x echo {ECHO}, batch {BATCH}"
    rng = random.Random(0)
    ids = timed(benchmark, baseline_batches, setup=lambda: (([[row, ECHO] for row in src], BATCH, rng), {}))
    assert_each(ids, ECHO)
    per_example(benchmark)


@pytest.mark.skipif(torch_data is None, reason="torch is not installed")
def test_iterate_torch_dataloader(benchmark, size, src):
    """DataLoader(num_workers=0) over compare.ShuffleBufferDataset: the shuffle and the collate."""
    benchmark.group = f"iterate: {N} examples of {size} x echo {ECHO}, batch {BATCH}"

    def loader():
        dataset = compare.ShuffleBufferDataset(src, capacity=N, echo=ECHO, cycle=False)
        return (torch_data.DataLoader(dataset, batch_size=BATCH, num_workers=0),), {}

    ids = timed(benchmark, lambda dl: [ids_of(b.numpy()) for b in dl], setup=loader)
    assert_each(ids, ECHO)
    per_example(benchmark)
