"""Many producers at once: exact per-id accounting under contention."""

from __future__ import annotations

import numpy as np
import pytest
from support import counts, drain_ids, free_slots, id_buffer, join_producers, start_producers


@pytest.mark.parametrize("producers,echo", [(4, 1), (8, 2)])
def test_a_million_examples_from_many_producers_exact_accounting(producers, echo, seed):
    n = 1_000_000
    buf = id_buffer(capacity=4096, batch_size=256, echo_factor=echo, seed=seed)
    # Interleave ids across producers so that their examples race for slots.
    per_thread = [np.array_split(np.arange(p, n, producers), 200) for p in range(producers)]
    threads = start_producers(buf, per_thread)
    batches = drain_ids(buf)
    join_producers(threads, timeout_s=60)

    seen = counts(batches)
    assert len(seen) == n and min(seen) == 0 and max(seen) == n - 1
    assert set(seen.values()) == {echo}
    assert buf.stats()["delivered"] == n * echo
    assert free_slots(buf) == 4096


def test_single_example_puts_from_many_threads(seed):
    threads_n, per_thread = 8, 5000
    buf = id_buffer(capacity=64, batch_size=16, echo_factor=1, seed=seed)
    chunks = [[np.array([t * per_thread + i]) for i in range(per_thread)] for t in range(threads_n)]
    threads = start_producers(buf, chunks)
    batches = drain_ids(buf)
    join_producers(threads, timeout_s=60)
    seen = counts(batches)
    assert sorted(seen) == list(range(threads_n * per_thread))
    assert set(seen.values()) == {1}
