"""echo_factor="auto": repeats fill in only while the consumer would wait."""

from __future__ import annotations

import threading
import time

import numpy as np
from support import counts, drain_ids, free_slots, id_buffer, join_producers, one, start_producers


def test_fast_upstream_keeps_the_achieved_factor_near_one(seed):
    n = 20_000
    buf = id_buffer(capacity=1024, batch_size=64, echo_factor="auto", max_echo=4.0, seed=seed)
    threads = start_producers(buf, [np.array_split(np.arange(n), 200)])
    batches = []
    for batch in buf:
        batches.append(batch["id"].copy())
        time.sleep(0.0005)  # a training step: the consumer is the slower side
    join_producers(threads)
    seen = counts(batches)
    assert sorted(seen) == list(range(n)), "every fresh example is delivered"
    stats = buf.stats()
    assert stats["echo_factor_achieved"] < 1.1, stats


def test_slow_upstream_raises_the_factor_toward_max_echo(seed):
    n, max_echo = 400, 3.0
    buf = id_buffer(capacity=256, batch_size=16, echo_factor="auto", max_echo=max_echo, seed=seed, initial=16)

    def produce():
        for i in range(n):
            buf.put(one(i))
            time.sleep(0.002)  # a slow read: 500 examples/s
        buf.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    batches = drain_ids(buf)  # a consumer that never waits on purpose
    thread.join(10)
    seen = counts(batches)
    assert sorted(seen) == list(range(n)), "every fresh example is delivered at least once"
    assert max(seen.values()) <= max_echo
    stats = buf.stats()
    assert stats["echo_factor_achieved"] > 0.75 * max_echo, stats
    assert free_slots(buf) == 256


def test_auto_never_repeats_within_a_batch_while_enough_are_resident(seed):
    # A producer well ahead of the consumer keeps hundreds of examples resident.
    # (With fewer than batch_size resident, a waiting consumer gets a batch with
    # a repeat rather than wait: that is what "auto" promises.)
    buf = id_buffer(capacity=512, batch_size=32, echo_factor="auto", max_echo=2.0, seed=seed)
    threads = start_producers(buf, [np.array_split(np.arange(5000), 50)])
    batches = []
    for batch in buf:
        batches.append(batch["id"].copy())
        time.sleep(0.0002)
    join_producers(threads)
    assert all(len(np.unique(b)) == len(b) for b in batches)
    assert max(counts(batches).values()) <= 2
