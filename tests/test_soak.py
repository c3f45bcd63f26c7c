"""Soak: a minute of the whole surface at once, with echo on, and nothing may grow.

Rounds repeat until the time is up: several producer threads put (put_many and
single puts) into a ShuffleBuffer while one consumer iterates, with echo 2 and
echo 1.5, keeping each batch a little while before dropping it; EchoLoader
epochs with thread workers (example and batch echoing, with and without
augment); and, every few rounds, an epoch with worker processes. Every round is
accounted for exactly, per id. Resident memory, threads (native ones included),
open file descriptors and /dev/shm segments are measured after a warm-up round
and again at the end: memory may grow by at most 4 MiB, the rest not at all.

The soak runs for 60 s by default (CI); set DATAECHO_SOAK_SECONDS for a longer
one, which raises the test's own time limits to match:

    DATAECHO_SOAK_SECONDS=1800 python -m pytest tests/test_soak.py -s
"""

from __future__ import annotations

import collections
import ctypes
import faulthandler
import gc
import os
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from processes import native_threads, shm_segments, worker_processes
from support import Records, check_exact, checked_ids, drain, examples, free_slots, id_buffer, one, payload_of

import dataecho

SOAK_S = float(os.environ.get("DATAECHO_SOAK_SECONDS", "60"))
RSS_GROWTH_LIMIT = 4 << 20
PROCESS_EPOCH_EVERY = 4  # rounds
WARM_UP_S = 6.0  # allocator arenas and pools reach their working size
WAIT_S = 10.0  # the longest any single put or next_batch may block


# ---- what is measured ----


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _trim_heap() -> None:
    """Returns free heap pages to the OS (glibc), so that RSS measures memory in
    use rather than what the allocator keeps cached from the last round."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def snapshot(settle_s: float = 3.0) -> dict:
    """Resources after the last round's threads, processes and batches are gone.

    Threads and processes end asynchronously (a daemon thread returns after its
    loop notices the stop): wait up to `settle_s` for the counts to stop moving."""
    gc.collect()
    deadline = time.monotonic() + settle_s
    previous = None
    while True:
        gc.collect()
        # Every OS thread counts, the buffers' assemblers included; only this
        # process's segments (other processes on the machine may have their own).
        current = (len(native_threads()), open_fds(), tuple(shm_segments(os.getpid())), len(worker_processes()))
        if current == previous or time.monotonic() > deadline:
            break
        previous = current
        time.sleep(0.1)
    _trim_heap()
    return {
        "rss": rss_bytes(),
        "threads": current[0],
        "fds": current[1],
        "shm": list(current[2]),
        "workers": current[3],
    }


# ---- one round of each workload ----


def buffer_round(echo: float, seed: int, n: int, producers: int = 3, keep: int = 4) -> int:
    """Producers put ids 0..n-1 (each thread its share, in put_many chunks and
    single puts); one consumer iterates, keeping `keep` batches alive a while.
    Returns the examples delivered, after exact accounting."""
    buf = id_buffer(capacity=512, batch_size=32, echo_factor=echo, seed=seed)
    shares = np.array_split(np.arange(n), producers)
    errors: list[BaseException] = []
    remaining = [producers]
    lock = threading.Lock()

    def produce(ids: np.ndarray, worker: int) -> None:
        try:
            rng = np.random.default_rng([seed, worker])
            start = 0
            while start < len(ids):
                size = int(rng.integers(1, 200))
                chunk = ids[start : start + size]
                start += size
                if size < 8:
                    for i in chunk:
                        buf.put(one(i), timeout=WAIT_S)
                else:
                    buf.put_many(examples(chunk), timeout=WAIT_S)
        except BaseException as exc:  # reported by the consumer
            errors.append(exc)
        finally:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                buf.close()

    threads = [
        threading.Thread(target=produce, args=(share, w), name=f"soak-producer-{w}", daemon=True)
        for w, share in enumerate(shares)
    ]
    for t in threads:
        t.start()
    seen: Counter = Counter()
    kept: collections.deque = collections.deque(maxlen=keep)  # batches kept briefly, then dropped
    delivered = 0
    while True:
        try:
            batch = buf.next_batch(timeout=WAIT_S)
        except StopIteration:
            break
        ids = checked_ids(batch)
        seen.update(ids.tolist())
        delivered += len(ids)
        kept.append(batch)
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a producer thread did not finish"
    if errors:
        raise errors[0]
    for batch in kept:  # still intact after later batches were assembled
        checked_ids(batch)
    kept.clear()

    check_exact(seen, range(n), echo, "an example was lost, invented or echoed wrongly: ")
    stats = buf.stats()
    assert stats["fresh"] == n and stats["delivered"] == delivered == sum(seen.values())
    assert stats["resident"] == 0 and free_slots(buf) == buf.capacity
    return delivered


def bump(example):
    return {"id": example["id"], "payload": example["payload"] + 1}


def loader_round(echo, echo_at: str, augment, seed: int, n: int, epochs: int = 2) -> int:
    """EchoLoader epochs with thread workers; exact accounting per epoch."""
    loader = dataecho.EchoLoader(
        Records(n), batch_size=64, echo_factor=echo, echo_at=echo_at, augment=augment,
        shuffle_buffer=1024 if echo_at == "example" else 8, num_workers=2, seed=seed,
    )
    delivered = 0
    with loader:
        for _ in range(epochs):
            seen: Counter = Counter()
            for batch in loader:
                ids = batch["id"]
                expected = payload_of(ids) + (1 if augment else 0)  # bytes below 211: no wrap-around
                np.testing.assert_array_equal(batch["payload"], expected)
                seen.update(ids.tolist())
            check_exact(seen, range(n), echo, f"echo {echo} at {echo_at}: ")
            delivered += sum(seen.values())
        assert loader.stats()["delivered"] == delivered
    return delivered


def process_round(seed: int, n: int) -> int:
    """One epoch with worker processes writing into shared memory."""
    loader = dataecho.EchoLoader(
        Records(n), batch_size=64, echo_factor=2, num_workers=2, worker_type="process", seed=seed
    )
    with loader:
        seen: Counter = Counter()
        for batch in loader:
            seen.update(checked_ids(batch).tolist())
    assert sorted(seen) == list(range(n)) and set(seen.values()) == {2}
    return sum(seen.values())


def ragged_round(seed: int, n: int, worker_type: str) -> int:
    """Ragged values and objects (support.ragged_one) through a page budget of
    1 MiB, with thread or process workers; every leaf checked against its id."""
    loader = dataecho.EchoLoader(
        Records(n, form="ragged"), batch_size=64, echo_factor=2, num_workers=2, worker_type=worker_type,
        shuffle_buffer=512, ragged_bytes=1 << 20, seed=seed,
    )
    with loader:
        seen: Counter = Counter()
        drain(loader, seen)
    check_exact(seen, range(n), 2, f"ragged, {worker_type} workers: ")
    return sum(seen.values())


def one_round(r: int, moved: Counter) -> None:
    moved["buffer, echo 2"] += buffer_round(2, seed=r, n=20_000)
    moved["buffer, echo 1.5"] += buffer_round(1.5, seed=r, n=20_000)
    moved["loader threads, example echo"] += loader_round(2, "example", None, seed=r, n=3000)
    moved["loader threads, example echo 1.5 + augment"] += loader_round(1.5, "example", bump, seed=r, n=3000)
    moved["loader threads, batch echo"] += loader_round(2, "batch", None, seed=r, n=3000, epochs=1)
    moved["loader threads, ragged values and objects"] += ragged_round(seed=r, n=1500, worker_type="thread")
    if r % PROCESS_EPOCH_EVERY == 0:
        moved["loader processes"] += process_round(seed=r, n=3000)
        moved["loader processes, ragged values and objects"] += ragged_round(seed=r, n=1500, worker_type="process")


# ---- the soak ----


def _arm_stack_dump(request, seconds: float) -> None:
    """A soak longer than the default runs past pytest's faulthandler_timeout
    (set for ordinary tests): move the all-thread stack dump past it."""
    configured = float(request.config.getini("faulthandler_timeout") or 0)
    if configured and seconds > configured:
        faulthandler.dump_traceback_later(seconds, file=sys.stderr)
        request.addfinalizer(faulthandler.cancel_dump_traceback_later)


@pytest.mark.slow  # deselect with -m "not slow"; plain `python -m pytest` (CI) runs it
@pytest.mark.timeout(max(120.0, SOAK_S + 60))
def test_soak_nothing_is_lost_corrupted_or_leaked(request):
    _arm_stack_dump(request, SOAK_S + 45)
    moved: Counter = Counter()
    # Warm-up: allocator arenas and pools, the forkserver, lazy imports.
    warm_up = time.monotonic()
    rounds = 0
    while rounds < 2 or time.monotonic() - warm_up < WARM_UP_S:
        one_round(rounds, moved)
        rounds += 1
    moved.clear()
    start = snapshot()
    began = time.monotonic()
    soaked, peak = 0, start["rss"]
    while time.monotonic() - began < SOAK_S:
        one_round(rounds + soaked, moved)
        soaked += 1
        peak = max(peak, rss_bytes())
    elapsed = time.monotonic() - began
    end = snapshot()

    growth = end["rss"] - start["rss"]
    report = (
        f"soak {elapsed:.0f} s, {soaked} rounds, {sum(moved.values()):,} examples delivered "
        f"({', '.join(f'{k}: {v:,}' for k, v in moved.items())}); "
        f"RSS {start['rss'] / 2**20:.1f} -> {end['rss'] / 2**20:.1f} MiB (growth {growth / 2**20:+.2f} MiB, "
        f"peak {peak / 2**20:.1f}); threads {start['threads']} -> {end['threads']}; "
        f"fds {start['fds']} -> {end['fds']}; shm {len(start['shm'])} -> {len(end['shm'])}; "
        f"worker processes {start['workers']} -> {end['workers']}"
    )
    print(report)
    request.node.user_properties.append(("soak", report))
    assert soaked >= 1
    assert end["threads"] <= start["threads"], f"threads grew: {report}"
    assert end["fds"] <= start["fds"], f"file descriptors grew: {report}"
    assert set(end["shm"]) <= set(start["shm"]), f"/dev/shm segments left: {report}"
    assert end["workers"] == 0, f"worker processes left: {report}"
    assert growth <= RSS_GROWTH_LIMIT, f"RSS grew by more than 4 MiB: {report}"
