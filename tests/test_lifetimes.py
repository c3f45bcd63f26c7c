"""Zero-copy batches and their lifetimes: a batch is a view of native memory
that stays valid and unchanged while any array of it is alive; an epoch left
running at interpreter exit lets the interpreter exit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import numpy as np
from support import (
    batch_blocks_allocated,
    child_script,
    drain_ids,
    examples,
    id_buffer,
    join_producers,
    payload_of,
    slot_stride,
    start,
    start_producers,
)

import dataecho
from dataecho import _core


def test_batches_are_views_owned_by_a_lease(seed):
    buf = id_buffer(capacity=64, batch_size=16, seed=seed)
    threads = start_producers(buf, [[np.arange(100)]])
    batch = next(iter(buf))
    ids, payload = batch["id"], batch["payload"]
    assert isinstance(ids.base, _core.BatchLease)
    assert ids.base is payload.base, "the fields of one batch share one lease"
    assert ids.flags.c_contiguous and ids.flags.writeable and not ids.flags.owndata
    # Every field region is cache-line aligned.
    assert ids.ctypes.data % 64 == 0 and payload.ctypes.data % 64 == 0
    list(buf)
    join_producers(threads)


def test_large_examples_are_page_aligned_in_batches(seed):
    buf = dataecho.ShuffleBuffer(((5000,), "uint8"), capacity=8, batch_size=4, seed=seed)
    assert slot_stride(buf) % 4096 == 0
    buf.put_many(np.zeros((8, 5000), np.uint8))
    batch = buf.next_batch(timeout=5)
    assert batch.ctypes.data % 4096 == 0
    buf.close()
    list(buf)


def test_kept_batches_stay_unchanged_while_the_buffer_keeps_cycling(seed):
    n = 20_000
    buf = id_buffer(capacity=256, batch_size=32, echo_factor=2, seed=seed)
    threads = start_producers(buf, [np.array_split(np.arange(n), 40)])
    kept, snapshots = [], []
    for batch in buf:
        kept.append(batch)
        snapshots.append((batch["id"].copy(), batch["payload"].copy()))
    join_producers(threads)
    # The pool grew instead of recycling memory that kept batches still see.
    assert batch_blocks_allocated(buf) >= len(kept)
    for batch, (ids, payload) in zip(kept, snapshots):
        np.testing.assert_array_equal(batch["id"], ids)
        np.testing.assert_array_equal(batch["payload"], payload)
        np.testing.assert_array_equal(batch["payload"], payload_of(batch["id"]))


def test_one_field_kept_alone_keeps_the_batch_alive(seed):
    buf = id_buffer(capacity=128, batch_size=16, seed=seed)
    threads = start_producers(buf, [np.array_split(np.arange(5000), 10)])
    kept = []
    for batch in buf:
        kept.append(batch["payload"])  # the dict and the id array die here
        del batch
    gc.collect()
    join_producers(threads)
    ids = np.concatenate([p[:, 0] for p in kept])
    assert len(ids) == 5000
    for payload in kept:
        # payload_of is a bijection on its first byte modulo 211 only, so check
        # each row against the pattern of the id it must have come from.
        first = payload[:, 0].astype(np.int64)
        assert np.all((payload[:, 1].astype(np.int64) - first) % 211 == 7)


def test_released_batches_are_recycled(seed):
    buf = id_buffer(capacity=256, batch_size=32, seed=seed, prefetch=2)
    threads = start_producers(buf, [np.array_split(np.arange(50_000), 50)])
    batches = drain_ids(buf)  # copies ids, drops each batch at once
    join_producers(threads)
    assert len(batches) > 1000
    # prefetch queued + one being assembled + one held by the consumer, with
    # slack for the consumer's previous batch not yet collected.
    assert batch_blocks_allocated(buf) <= 2 + 1 + 2


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_of_batches_once_kept_goes_back_to_the_system(seed):
    # 1 MiB batches (64 examples of 16 KiB): hold 300 at once, let them go, and
    # take 600 more; the pool keeps prefetch + 2 free blocks, not 300.
    rows, held, after = 64, 300, 600
    buf = dataecho.ShuffleBuffer(((16384,), "uint8"), capacity=256, batch_size=rows, prefetch=2, seed=seed)
    chunk = np.ones((rows, 16384), np.uint8)

    def produce() -> None:
        try:
            for _ in range(held + after):
                buf.put_many(chunk)
        finally:
            buf.close()

    producer = start(produce, "producer")
    batches = iter(buf)
    kept = [next(batches) for _ in range(held)]
    assert batch_blocks_allocated(buf) >= held
    holding = _resident_bytes()
    del kept
    gc.collect()
    delivered = held + sum(1 for _ in batches)
    join_producers([producer])
    assert delivered == held + after
    assert batch_blocks_allocated(buf) <= 2 + 2, "free blocks above the pool's bound were kept"
    given_back = holding - _resident_bytes()
    assert given_back >= 0.8 * held * rows * 16384, f"only {given_back >> 20} MiB given back"


def test_batches_outlive_the_buffer(seed):
    buf = id_buffer(capacity=64, batch_size=16, seed=seed)
    buf.put_many(examples(np.arange(16)))
    batch = buf.next_batch(timeout=5)
    del buf
    gc.collect()
    np.testing.assert_array_equal(np.sort(batch["id"]), np.arange(16))
    np.testing.assert_array_equal(batch["payload"], payload_of(batch["id"]))


def test_an_epoch_left_mid_batch_at_exit_lets_the_interpreter_exit():
    # The epoch's finalizer runs while the interpreter finalizes (the uncaught
    # exception's traceback keeps it alive until then): the reading threads no
    # longer run, and the batch being assembled never completes.
    script = child_script("""
        import dataecho
        from support import Records
        loader = dataecho.EchoLoader(Records(100_000, delay_s=0.002), batch_size=64, num_workers=2, seed=0)
        epoch = iter(loader)
        next(epoch), next(epoch)
        print("EXITING", flush=True)
        raise RuntimeError("uncaught at exit")
    """)
    proc = subprocess.Popen([sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "EXITING", proc.communicate(timeout=30)[1][-3000:]
        exiting = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - exiting
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "RuntimeError: uncaught at exit" in err, err[-3000:]
    assert "Fatal Python error" not in err and "Exception ignored" not in err, err[-3000:]
    assert took < 5.0, f"the interpreter took {took:.1f} s to exit"
