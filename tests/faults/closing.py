"""close() while puts wait on a full buffer, or while the consumer waits."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Callable

import numpy as np

import dataecho
from faults.common import RELEASE_S, pick_echo, random_buffer
from support import (
    Ledger,
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


def fill(buf: dataecho.ShuffleBuffer, ledger: Ledger, first_id: int) -> int:
    """Puts until two puts in a row time out (the buffer is full, and the
    assembler has nothing left to free); returns the next unused id."""
    i, misses = first_id, 0
    while misses < 2:
        try:
            buf.put(one(i), timeout=0.03)
        except TimeoutError:
            misses += 1
            continue
        ledger.accept([i])
        i, misses = i + 1, 0
    return i


def blocked_put(buf: dataecho.ShuffleBuffer, ledger: Ledger, how: str, first_id: int, rows: int) -> Callable[[], None]:
    """A put that will block on the full buffer; what gets in goes to the ledger."""
    timeout = 60.0 if how == "put_timeout" or (how == "put_many" and rows % 2) else None

    def put() -> None:
        if how == "put_many":
            chunk = np.arange(first_id, first_id + rows)
            try:
                buf.put_many(examples(chunk), timeout=timeout)
            except (dataecho.BufferClosed, TimeoutError) as exc:
                ledger.accept(chunk[: exc.examples_put])
                raise
            ledger.accept(chunk)
        else:
            buf.put(one(first_id), timeout=timeout)
            ledger.accept([first_id])

    return put


def close_put(rng: random.Random, variant: str, seed: int) -> None:
    """close() while puts wait on a full buffer: each is released within RELEASE_S
    with BufferClosed (put_many: with what got in), and everything accepted comes out."""
    buf, echo = random_buffer(rng, seed, 1, 48)
    capacity = buf.capacity
    ledger = Ledger()
    fill(buf, ledger, 0)
    waiters = []
    for w in range(rng.randint(1, 6)):
        how = variant if variant != "consume_first" else rng.choice(["put", "put_timeout", "put_many"])
        rows = rng.randint(1, 2 * capacity + 2)
        waiters.append(start(blocked_put(buf, ledger, how, 1_000_000 * (w + 1), rows), f"waiter-{how}-{w}"))
    delivered: Counter = Counter()
    if variant == "consume_first":  # some waiters get through before the close
        time.sleep(rng.uniform(0.0, 0.05))
        for _ in range(rng.randint(1, 3)):
            try:  # with no more input coming, the buffer may hold back what it has
                delivered.update(checked_ids(buf.next_batch(timeout=0.5)).tolist())
            except TimeoutError:
                break
    time.sleep(rng.uniform(0.03, 0.15))
    blocked = [w for w in waiters if w.is_alive()]
    closed_at = time.monotonic()
    if rng.random() < 0.5:
        buf.close()
    else:
        join_all([start(buf.close, "closer")], 2, "close()")
    join_all(waiters, 2 + RELEASE_S, "blocked puts after close()")
    for w in waiters:
        if w.error is None:
            continue  # it got in (before the close, or racing it): counted in the ledger
        assert isinstance(w.error, dataecho.BufferClosed), f"{w.name}: {w.error!r}"
    late = {w.name: round(w.ended_at - closed_at, 3) for w in blocked if w.ended_at - closed_at > RELEASE_S}
    assert not late, f"waiters released later than {RELEASE_S} s after close(): {late}"
    assert blocked or variant == "consume_first", "no put was blocked when close() came"
    try:
        buf.put(one(-1))
        raise AssertionError("put after close() was accepted")
    except dataecho.BufferClosed:
        pass
    drain(buf, delivered)
    check_exact(delivered, ledger.ids, echo)
    check_buffer_totals(buf, len(ledger), delivered)


def close_iter(rng: random.Random, variant: str, seed: int) -> None:
    """close() while the consumer waits (empty, below `initial`, or drained of what
    the buffer releases): iteration delivers the rest and ends within RELEASE_S."""
    capacity = rng.randint(1, 96)
    batch_size = rng.randint(1, capacity)
    echo = pick_echo(rng)
    buf = id_buffer(capacity=capacity, batch_size=batch_size, echo_factor=echo, prefetch=rng.randint(1, 3), seed=seed)
    initial = buf.initial
    if variant == "empty":
        k = 0
    elif variant == "below_initial":
        k = rng.randint(0, initial - 1)
    else:  # the consumer takes what the buffer releases, then waits for more input
        k = rng.randint(initial, capacity)
    delivered: Counter = Counter()

    def consume() -> None:
        if variant == "next_timeout":
            while True:
                try:
                    batch = buf.next_batch(timeout=60)
                except StopIteration:
                    return
                delivered.update(checked_ids(batch).tolist())
        drain(buf, delivered)

    consumer = start(consume, "consumer")
    ids = np.arange(k)
    if k and rng.random() < 0.5:
        buf.put_many(examples(ids))
    else:
        for i in ids:
            buf.put(one(int(i)))
    time.sleep(rng.uniform(0.03, 0.15))
    assert consumer.is_alive(), f"iteration ended before close(): {consumer.error!r}"
    closed_at = time.monotonic()
    if rng.random() < 0.5:
        buf.close()
    else:
        join_all([start(buf.close, "closer")], 2, "close()")
    join_all([consumer], 2 + RELEASE_S, "the blocked consumer after close()")
    assert consumer.error is None, repr(consumer.error)
    took = consumer.ended_at - closed_at
    assert took <= RELEASE_S, f"iteration ended {took:.3f} s after close()"
    check_exact(delivered, range(k), echo)
    check_buffer_totals(buf, k, delivered)
