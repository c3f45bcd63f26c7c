"""Iterating again: after the end of a buffer, epochs of a loader, abandoned epochs."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import numpy as np

import dataecho
from faults.common import Baseline, assert_clean, loader_options, pick_echo
from support import (
    Ledger,
    Records,
    Stream,
    check_at_most,
    check_buffer_totals,
    check_exact,
    checked_ids,
    drain,
    examples,
    id_buffer,
    join_all,
    one,
    start,
)


def reuse(rng: random.Random, variant: str, seed: int) -> None:
    """Iterating again: an ended buffer stays ended; each epoch of a loader is whole,
    after a full or an abandoned one; a spent generator gives an empty epoch."""
    baseline = Baseline()
    if variant == "buffer":
        capacity = rng.randint(1, 128)
        echo = pick_echo(rng)
        buf = id_buffer(capacity=capacity, batch_size=rng.randint(1, capacity), echo_factor=echo, seed=seed)
        n = rng.randint(0, 3 * capacity)
        ledger = Ledger()

        def produce() -> None:
            for first in range(0, n, 7):
                chunk = np.arange(first, min(first + 7, n))
                buf.put_many(examples(chunk))
                ledger.accept(chunk)
            buf.close()

        producer = start(produce, "producer")
        delivered: Counter = Counter()
        if rng.random() < 0.5:
            drain(buf, delivered)
        else:
            while True:
                try:
                    delivered.update(checked_ids(next(buf)).tolist())
                except StopIteration:
                    break
        join_all([producer], 10, "producer")
        assert producer.error is None, repr(producer.error)
        check_exact(delivered, range(n), echo)
        stats = buf.stats()
        for _ in range(3):  # an ended buffer stays ended
            assert list(buf) == []
            assert iter(buf) is buf
            for call in (lambda: next(buf), lambda: buf.next_batch(timeout=0.01), buf.next_batch):
                try:
                    call()
                    raise AssertionError("a batch after the end")
                except StopIteration:
                    pass
        assert buf.stats()["delivered"] == stats["delivered"] == sum(delivered.values())
        check_buffer_totals(buf, n, delivered)
        del buf
        return assert_clean(baseline, "after the buffer")

    options = loader_options(rng)
    worker_type = "thread"
    if variant == "process_epochs":
        worker_type = "process"
        options["num_workers"] = rng.randint(1, 2)
    n = rng.randint(1, 1200)
    source: Any = Stream(n) if variant == "iterable" else Records(n)
    if variant == "generator":
        source = (one(i) for i in range(n))
    loader = dataecho.EchoLoader(source, seed=seed, worker_type=worker_type, **options)
    echo = options["echo_factor"]
    epochs = rng.randint(2, 3)
    fresh = 0
    abandoned, closed = None, False
    for e in range(epochs):
        delivered: Counter = Counter()
        epoch = iter(loader)
        if abandoned is not None:  # starting an epoch ends the one left behind
            for _ in range(2):
                try:
                    next(abandoned)
                    raise AssertionError("a batch from an abandoned epoch after the next one started")
                except StopIteration:
                    assert closed, "an epoch ended by a later iter(loader) stopped quietly"
                except RuntimeError as error:  # never a silent end of the loop that still uses it
                    assert not closed and "ended by a later iter(loader)" in str(error), error
            abandoned = None
        if variant == "abandon" and e < epochs - 1:
            stop_after = rng.randint(0, 4)
            for i, batch in enumerate(epoch):
                if i == stop_after:
                    break
                delivered.update(checked_ids(batch).tolist())
            check_at_most(delivered, lambda i: 0 <= i < n, echo, f"abandoned epoch {e}: ")
            closed = rng.random() < 0.5
            if closed:
                loader.close()  # ended by the user: it ends quietly
            abandoned = epoch
            continue
        drain(epoch, delivered)
        for _ in range(2):  # an ended epoch stays ended
            try:
                next(epoch)
                raise AssertionError("a batch after the end of the epoch")
            except StopIteration:
                pass
        if variant == "generator" and e > 0:
            assert not delivered, "a spent generator gave examples again"
        else:
            check_exact(delivered, range(n), echo, f"epoch {e}: ")
            fresh += n
        assert_clean(baseline, f"after epoch {e}")
    if variant != "abandon":
        assert loader.stats()["fresh"] == fresh, (loader.stats()["fresh"], fresh)
