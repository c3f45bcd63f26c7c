"""The poison build (-DDATAECHO_POISON=ON): the core fills every slot it frees and
every batch block it takes back with 0xDB, so a batch that still views memory the
core has recycled shows rows of that byte instead of plausible data.

The test builds the extension with the option into tmp_path and runs a stress
script against it in a fresh interpreter. The payload never contains 0xDB, so a
poisoned row in a live view can only come from recycled memory. The script also
checks that recycling does poison: a batch block leased a second time must carry
0xDB in the bytes no row was gathered into (the padding between field regions,
and the rows past the end of a short batch), which stay inside the lease.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

SCRIPT = r'''
import ctypes
import sys
import threading
import time

import numpy as np
from support import PAYLOAD, batch_blocks_allocated, examples, free_slots, id_buffer, payload_of

import dataecho
from dataecho import _core

seed, seconds, site = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
assert _core.__file__.startswith(site), f"imported {_core.__file__}, not the poison build in {site}"
assert _core.POISON is True, f"{_core.__file__} was not built with DATAECHO_POISON"
POISON = _core.POISON_BYTE
assert POISON == 0xDB, POISON
rng = np.random.default_rng(seed)

# With batch_size 10 the id region (80 bytes) is followed by 48 bytes of padding.
PRODUCERS, CAPACITY, BATCH, ECHO, MAX_KEPT = 4, 48, 10, 2, 400
assert payload_of(np.arange(10_000)).max() < POISON, "the payload must never look like poison"


def single_of(ids):
    """Rows of the single-field buffer: int32s that are all non-negative (0xDBDBDBDB is not)."""
    ids = np.asarray(ids, dtype=np.int32).reshape(-1)
    return np.stack([ids, ids * 7 + 1, ids ^ 0x2A2A2A], axis=1)


def poisoned_rows(view):
    """Indices of rows (along axis 0) whose every byte is the poison byte."""
    flat = np.ascontiguousarray(view).view(np.uint8).reshape(len(view), -1)
    return np.flatnonzero((flat == POISON).all(axis=1))


def raw(address, nbytes):
    """A copy of nbytes at address; only ever called on memory inside a live lease."""
    return np.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), dtype=np.uint8).copy()


class Producers:
    """PRODUCERS threads putting interleaved ids in chunks of 1-12 until stopped;
    the last one to finish closes the buffer."""

    def __init__(self, buf, encode):
        self.buf, self.encode = buf, encode
        self.stop = threading.Event()
        self.produced = [0] * PRODUCERS
        self.errors = []
        self.left = PRODUCERS
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(p,), daemon=True) for p in range(PRODUCERS)]
        for t in self.threads:
            t.start()

    def run(self, p):
        chunk_rng = np.random.default_rng(seed + 1 + p)
        try:
            while not self.stop.is_set():
                k = int(chunk_rng.integers(1, 13))
                ids = p + PRODUCERS * np.arange(self.produced[p], self.produced[p] + k, dtype=np.int64)
                self.buf.put_many(self.encode(ids), timeout=30)
                self.produced[p] += k
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.buf.close()

    def ids(self):
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), "a producer did not finish"
        if self.errors:
            raise self.errors[0]
        return np.concatenate([p + PRODUCERS * np.arange(n, dtype=np.int64) for p, n in enumerate(self.produced)])


class Kept:
    """Views kept alive while the buffer cycles, each with a copy taken on arrival."""

    def __init__(self):
        self.items = []  # (what, view, copy)
        self.checks = 0
        self.most = 0

    def add(self, what, view):
        self.items.append((what, view, np.array(view, copy=True)))
        self.most = max(self.most, len(self.items))

    def thin(self):
        # Dropping views lets their blocks go back to the pool (poisoned) and be
        # leased again while the other kept views still point into the pool.
        if len(self.items) > MAX_KEPT:
            drop = set(rng.choice(len(self.items), size=len(self.items) // 4, replace=False).tolist())
            self.items = [item for i, item in enumerate(self.items) if i not in drop]

    def check(self, when):
        self.checks += 1
        for what, view, copy in self.items:
            bad = poisoned_rows(view) if view.ndim >= 1 and len(view) else []
            assert len(bad) == 0, (
                f"{when}: kept {what} has rows {list(bad)[:5]} full of 0x{POISON:X}: its memory was recycled while alive")
            assert np.array_equal(view, copy), f"{when}: kept {what} changed while alive"


def dict_phase(duration):
    buf = id_buffer(capacity=CAPACITY, batch_size=BATCH, echo_factor=ECHO, seed=seed, prefetch=2)
    producers = Producers(buf, examples)
    kept, delivered, blocks = Kept(), [], set()
    recycled = batches = 0
    deadline = time.monotonic() + duration
    while True:
        try:
            batch = buf.next_batch(timeout=30)
        except StopIteration:
            break
        ids, payload = batch["id"], batch["payload"]
        batches += 1
        rows = len(ids)
        assert ids.ctypes.data + BATCH * 8 <= payload.ctypes.data, "unexpected batch layout"
        bad = poisoned_rows(payload)
        assert len(bad) == 0, f"batch {batches}: payload rows {bad[:5].tolist()} full of 0x{POISON:X}"
        assert ids.min() >= 0, f"batch {batches}: id {ids.min()} (a poisoned id reads 0x{POISON:X}...)"
        assert np.array_equal(payload, payload_of(ids)), f"batch {batches}: payload does not match its ids"
        # Bytes of this lease that no row was gathered into: after the id rows up to
        # the payload region, and past the last payload row. A block leased before
        # went back to the pool through give_back, which must have poisoned it.
        unwritten = np.concatenate([
            raw(ids.ctypes.data + rows * 8, payload.ctypes.data - ids.ctypes.data - rows * 8),
            raw(payload.ctypes.data + rows * PAYLOAD, (BATCH - rows) * PAYLOAD)])
        if ids.ctypes.data in blocks:
            recycled += 1
            assert (unwritten == POISON).all(), (
                f"batch {batches}: a recycled block's unwritten bytes are not 0x{POISON:X}: "
                f"{unwritten[unwritten != POISON][:8].tolist()}")
        blocks.add(ids.ctypes.data)
        delivered.append(ids.copy())

        r = rng.random()
        if r < 0.08:
            kept.add("batch id", ids)
            kept.add("batch payload", payload)  # both fields of one batch
        elif r < 0.16:
            kept.add("payload field", payload)  # one field alone keeps the batch
        elif r < 0.24:
            kept.add("payload[2:7]", payload[2:7])
            kept.add("payload[:, 5:20]", payload[:, 5:20])
        elif r < 0.32:
            kept.add("id[::3]", ids[::3])
            kept.add("payload.T", payload.T)
        elif r < 0.36:
            kept.add("payload as uint32", payload.view(np.uint32))
        del batch, ids, payload
        kept.thin()
        if batches % 50 == 0:
            kept.check(f"after batch {batches}")
        if time.monotonic() > deadline:
            producers.stop.set()

    produced = producers.ids()
    kept.check("after the last batch")
    counts = np.bincount(np.concatenate(delivered), minlength=int(produced.max()) + 1)
    assert (counts[produced] == ECHO).all(), "an id was lost or duplicated"
    assert counts.sum() == ECHO * len(produced)
    assert free_slots(buf) == CAPACITY
    assert recycled > 100, f"only {recycled} batches came from recycled blocks"
    return (f"dict buffer: {batches} batches, {len(produced)} ids x{ECHO}, {recycled} recycled blocks "
            f"poisoned where unwritten, up to {kept.most} views kept, {kept.checks} checks of them, "
            f"{batch_blocks_allocated(buf)} blocks allocated")


def single_phase(duration):
    buf = dataecho.ShuffleBuffer(((3,), "int32"), capacity=CAPACITY, batch_size=12, echo_factor=ECHO,
                                 seed=seed + 7, prefetch=1)
    producers = Producers(buf, single_of)
    kept, delivered, batches = Kept(), [], 0
    deadline = time.monotonic() + duration
    while True:
        try:
            batch = buf.next_batch(timeout=30)
        except StopIteration:
            break
        batches += 1
        bad = poisoned_rows(batch)
        assert len(bad) == 0, f"single batch {batches}: rows {bad[:5].tolist()} full of 0x{POISON:X}"
        assert np.array_equal(batch, single_of(batch[:, 0])), f"single batch {batches}: rows do not match ids"
        delivered.append(batch[:, 0].astype(np.int64))
        r = rng.random()
        if r < 0.1:
            kept.add("array", batch)
        elif r < 0.2:
            kept.add("array[1:4]", batch[1:4])
            kept.add("array[::2, 1:]", batch[::2, 1:])
        del batch
        kept.thin()
        if batches % 50 == 0:
            kept.check(f"after single batch {batches}")
        if time.monotonic() > deadline:
            producers.stop.set()
    produced = producers.ids()
    kept.check("after the last single batch")
    counts = np.bincount(np.concatenate(delivered), minlength=int(produced.max()) + 1)
    assert (counts[produced] == ECHO).all() and counts.sum() == ECHO * len(produced), "single: lost or duplicated"
    return f"single-field buffer: {batches} batches, {len(produced)} ids x{ECHO}, up to {kept.most} views kept"


print(dict_phase(seconds * 0.7), flush=True)
print(single_phase(seconds * 0.3), flush=True)
print("poison ok", flush=True)
'''


def _build_tools_missing() -> str | None:
    if shutil.which("cmake") is None:
        return "cmake is not on PATH"
    compilers = os.environ.get("CXX", "").split()[:1] or ["c++", "g++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        return "no C++ compiler on PATH (tried $CXX, c++, g++, clang++)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_poison_build_keeps_live_batches_intact_and_poisons_recycled_blocks(tmp_path, seed):
    missing = _build_tools_missing()
    if missing:
        pytest.skip(f"{missing}: the poison build cannot be made")
    site, build = tmp_path / "site", tmp_path / "build"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "-q", "--target", str(site),
         "--config-settings=cmake.define.DATAECHO_POISON=ON", f"--config-settings=build-dir={build}", str(ROOT)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert built.returncode == 0, f"poison build failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"

    # The poison build first, so that it is the dataecho imported; then the tests,
    # for the support module the script shares with the suite.
    path = [str(site), str(TESTS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(seed), "4", str(site)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False,
    )
    assert result.returncode == 0, f"seed {seed}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "poison ok" in result.stdout, result.stdout
    print(result.stdout)  # what was checked (shown with -s)
