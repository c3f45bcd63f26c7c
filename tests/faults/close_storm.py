"""close() from 8 threads at once, with producers and a consumer running."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import Counter

import numpy as np

import dataecho
from faults.common import RELEASE_S, random_buffer
from support import Ledger, check_buffer_totals, check_exact, checked_ids, examples, join_all, one, start


def close_storm(rng: random.Random, variant: str, seed: int) -> None:
    """8 threads call close() at once while producers put and a consumer reads: no
    error, producers released promptly, and exactly what was accepted comes out."""
    buf, echo = random_buffer(rng, seed, 2, 256)
    ledger = Ledger()

    def produce(p: int, prng: random.Random) -> None:
        for first in itertools.count(p * 10_000_000, 16):
            if variant == "put" or (variant == "mixed" and prng.random() < 0.5):
                buf.put(one(first))
                ledger.accept([first])
            else:
                chunk = np.arange(first, first + prng.randint(1, 16))
                try:
                    buf.put_many(examples(chunk))
                except dataecho.BufferClosed as exc:
                    ledger.accept(chunk[: exc.examples_put])
                    raise
                ledger.accept(chunk)

    delivered: Counter = Counter()
    step_s = rng.choice([0.0, 0.0, 0.0005, 0.002])

    def consume() -> None:
        for batch in buf:
            delivered.update(checked_ids(batch).tolist())
            if step_s:
                time.sleep(step_s)

    producers = [
        start(lambda p=p, prng=random.Random(rng.random()): produce(p, prng), f"producer-{p}")
        for p in range(rng.randint(1, 4))
    ]
    consumer = start(consume, "consumer")
    barrier = threading.Barrier(8)
    twice = [rng.random() < 0.3 for _ in range(8)]

    def close(again: bool) -> float:
        barrier.wait(5)
        buf.close()
        closed_at = time.monotonic()
        if again:
            buf.close()
        assert buf.closed
        return closed_at

    time.sleep(rng.uniform(0.01, 0.2))
    closers = [start(lambda again=again: close(again), f"closer-{c}") for c, again in enumerate(twice)]
    join_all(closers, 5, "closers")
    for c in closers:
        assert c.error is None, f"{c.name}: {c.error!r}"
    closed_at = min(c.result for c in closers)  # the first close() to return
    join_all(producers, 2, "producers after close()")
    for p in producers:
        assert isinstance(p.error, dataecho.BufferClosed), f"{p.name}: {p.error!r}"
        assert p.ended_at - closed_at <= RELEASE_S, f"{p.name} released {p.ended_at - closed_at:.3f} s after close()"
    join_all([consumer], 10, "the consumer after close()")
    assert consumer.error is None, repr(consumer.error)
    assert len(ledger) > 0
    check_exact(delivered, ledger.ids, echo)
    check_buffer_totals(buf, len(ledger), delivered)
