"""Random small timeouts on put / put_many / next_batch against full and empty buffers."""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from typing import Iterator

import numpy as np

import dataecho
from faults.common import TIMEOUT_SLACK_S, random_buffer
from support import (
    Ledger,
    check_buffer_totals,
    check_exact,
    checked_ids,
    drain,
    examples,
    free_slots,
    join_all,
    one,
    start,
)


def put_until_timeout(buf: dataecho.ShuffleBuffer, ledger: Ledger, ids: Iterator[int], t: float) -> None:
    """put(timeout=t) until one times out (checked against t); puts that got in are accepted."""
    for _ in range(100_000):
        i = next(ids)
        started = time.monotonic()
        try:
            buf.put(one(i), timeout=t)
        except TimeoutError:
            check_took(time.monotonic() - started, t, "put on a full buffer")
            return
        ledger.accept([i])
    raise AssertionError("put never timed out")


def put_many_within(buf: dataecho.ShuffleBuffer, chunk: np.ndarray, t: float) -> tuple[int, float | None]:
    """put_many(timeout=t) of the ids in `chunk`: how many got in, and how long the
    call took if it timed out (None if it did not)."""
    started = time.monotonic()
    try:
        buf.put_many(examples(chunk), timeout=t)
    except TimeoutError as exc:
        return exc.examples_put, time.monotonic() - started
    return len(chunk), None


def check_took(took: float, t: float, what: str) -> None:
    assert took >= t - 1e-3, f"{what}: timed out after {took:.4f} s, before its timeout {t}"
    assert took <= t + TIMEOUT_SLACK_S, f"{what}: timed out after {took:.3f} s, timeout {t}"


def next_until_timeout(buf: dataecho.ShuffleBuffer, delivered: Counter, t: float) -> None:
    """next_batch(timeout=t) until one times out (checked against t)."""
    while True:
        started = time.monotonic()
        try:
            batch = buf.next_batch(timeout=t)
        except TimeoutError:
            return check_took(time.monotonic() - started, t, "next_batch")
        delivered.update(checked_ids(batch).tolist())


def small_timeout(rng: random.Random) -> float:
    return rng.choice([0.0, round(rng.uniform(0.001, 0.02), 4), round(rng.uniform(0.02, 0.15), 3)])


def timeout_scenario(rng: random.Random, variant: str, seed: int) -> None:
    """Small timeouts against full and empty buffers: TimeoutError within the timeout
    plus TIMEOUT_SLACK_S (never before it), examples_put exact, and the buffer goes on."""
    buf, echo = random_buffer(rng, seed, 1, 64)
    capacity = buf.capacity
    if variant == "mixed":
        return timeout_mixed(rng, buf, echo)
    ledger = Ledger()
    delivered: Counter = Counter()
    ids = itertools.count()
    if variant == "next":
        # Nothing there, then fewer examples than the first batch needs: both time out.
        next_until_timeout(buf, delivered, small_timeout(rng))
        below = [next(ids) for _ in range(rng.randint(0, buf.initial - 1))]
        if below:
            buf.put_many(examples(below))
        ledger.accept(below)
        next_until_timeout(buf, delivered, small_timeout(rng))
        assert not delivered
    for _ in range(rng.randint(2, 5)):
        if variant == "next":
            # Input up to what is surely free (nobody else puts), then the consumer
            # takes batches until none is ready in time.
            chunk = [next(ids) for _ in range(min(rng.randint(1, capacity), free_slots(buf)))]
            if chunk:
                buf.put_many(examples(chunk), timeout=10)
            ledger.accept(chunk)
            next_until_timeout(buf, delivered, small_timeout(rng))
            continue
        if variant == "put":
            put_until_timeout(buf, ledger, ids, small_timeout(rng))
        else:
            # Full, then maybe a batch or two out (an unknown number of slots
            # freed), then more than may fit: examples_put must say what got in.
            put_until_timeout(buf, ledger, ids, 0.02)
            for _ in range(rng.randint(0, 2)):
                delivered.update(checked_ids(buf.next_batch(timeout=10)).tolist())
            chunk = np.array([next(ids) for _ in range(rng.randint(1, 2 * capacity + 2))])
            fresh = buf.stats()["fresh"]
            t = small_timeout(rng)
            put, took = put_many_within(buf, chunk, t)
            if took is not None:
                check_took(took, t, "put_many")
                assert 0 <= put < len(chunk), put
            assert buf.stats()["fresh"] - fresh == put, ("examples_put", put, buf.stats()["fresh"] - fresh)
            ledger.accept(chunk[:put])
        # The buffer still works after the timeout: a batch comes out.
        delivered.update(checked_ids(buf.next_batch(timeout=10)).tolist())
    buf.close()
    drain(buf, delivered)
    check_exact(delivered, ledger.ids, echo)
    check_buffer_totals(buf, len(ledger), delivered)


def timeout_mixed(rng: random.Random, buf: dataecho.ShuffleBuffer, echo: float) -> None:
    """Producers and a consumer that all use small timeouts and retry."""
    ledger = Ledger()
    delivered: Counter = Counter()
    quota = rng.randint(50, 1500)
    timeouts: list[tuple[float, float]] = []  # (timeout, took) of every expired call

    def produce(p: int, prng: random.Random) -> None:
        first = p * 10_000_000
        while first < p * 10_000_000 + quota:
            chunk = np.arange(first, min(first + prng.randint(1, 8), p * 10_000_000 + quota))
            t = small_timeout(prng)
            put, took = put_many_within(buf, chunk, t)
            if took is not None:
                timeouts.append((t, took))
            ledger.accept(chunk[:put])
            first += put

    def consume(prng: random.Random) -> None:
        while True:
            t = small_timeout(prng)
            started = time.monotonic()
            try:
                batch = buf.next_batch(timeout=t)
            except TimeoutError:
                timeouts.append((t, time.monotonic() - started))
                if prng.random() < 0.1:
                    time.sleep(0.01)  # let the producers fill up and time out too
                continue
            except StopIteration:
                return
            delivered.update(checked_ids(batch).tolist())

    producers = [
        start(lambda p=p, prng=random.Random(rng.random()): produce(p, prng), f"producer-{p}")
        for p in range(rng.randint(1, 3))
    ]
    consumer = start(lambda prng=random.Random(rng.random()): consume(prng), "consumer")
    join_all(producers, 30, "producers")
    for p in producers:
        assert p.error is None, f"{p.name}: {p.error!r}"
    buf.close()
    join_all([consumer], 30, "consumer")
    assert consumer.error is None, repr(consumer.error)
    slow = [(t, round(took, 3)) for t, took in timeouts if not t - 1e-3 <= took <= t + TIMEOUT_SLACK_S]
    assert not slow, f"timeouts outside [t, t + {TIMEOUT_SLACK_S}]: {slow[:5]}"
    check_exact(delivered, ledger.ids, echo)
    check_buffer_totals(buf, len(ledger), delivered)
