"""A running buffer, or an epoch, used in a forked child."""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from collections import Counter
from typing import Any, Callable

import numpy as np

import dataecho
from faults.common import loader_options, random_buffer
from support import (
    Ledger,
    Records,
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


def in_forked_child(check: Callable[[], None]) -> None:
    """Runs `check` in a forked child; raises its failure here. The child must
    finish within 10 s (no deadlock)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 0
        try:
            check()
            message = b"ok"
        except BaseException:
            message, code = traceback.format_exc().encode(), 1
        try:
            os.write(write_end, message[-8000:])
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + 10
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
        raise AssertionError("the forked child hung")
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0 and message == "ok", f"in the forked child:\n{message}"


def expect_fork_error(call: Callable[[], Any], what: str) -> None:
    try:
        call()
    except RuntimeError as exc:
        assert "forked child" in str(exc), f"{what}: {exc}"
        return
    raise AssertionError(f"{what} worked in a forked child")


def fork_scenario(rng: random.Random, variant: str, seed: int) -> None:
    """A forked child gets a clear RuntimeError from the parent's running buffer and
    exits; the parent's buffer goes on and delivers everything."""
    if variant == "loader":
        return fork_loader(rng, seed)
    buf, echo = random_buffer(rng, seed, 1, 128)
    capacity = buf.capacity
    ledger = Ledger()
    delivered: Counter = Counter()
    quota = rng.randint(1, 400)

    def produce(p: int) -> None:
        for first in range(p * 10_000_000, p * 10_000_000 + quota, 4):
            chunk = np.arange(first, min(first + 4, p * 10_000_000 + quota))
            buf.put_many(examples(chunk))
            ledger.accept(chunk)

    def consume() -> None:
        drain(buf, delivered)

    count = 0 if variant == "idle" else rng.randint(1, 3)
    producers = [start(lambda p=p: produce(p), f"producer-{p}") for p in range(count)]
    consumer = start(consume, "consumer") if variant == "consumer" else None
    if variant == "idle":
        k = rng.randint(0, capacity)
        buf.put_many(examples(np.arange(k)))
        ledger.accept(range(k))
    time.sleep(rng.uniform(0.0, 0.05))
    operations = rng.sample(["put", "put_many", "next_batch", "next", "stats", "for"], rng.randint(1, 6))

    def child() -> None:
        calls = {
            "put": lambda: buf.put(one(-1), timeout=1),
            "put_many": lambda: buf.put_many(examples([-1, -2]), timeout=1),
            "next_batch": lambda: buf.next_batch(timeout=1),
            "next": lambda: next(buf),
            "stats": buf.stats,
            "for": lambda: [b for b in buf],
        }
        for name in operations:
            expect_fork_error(calls[name], name)
        buf.close()  # only marks it; the parent's buffer is not the child's to stop
        # A buffer made in the child works in the child.
        fresh = id_buffer(capacity=8, batch_size=3, echo_factor=2, seed=seed)
        fresh.put_many(examples(np.arange(5)))
        fresh.close()
        got: Counter = Counter()
        drain(fresh, got)
        check_exact(got, range(5), 2, "a buffer made in the child: ")

    in_forked_child(child)

    # The parent's buffer keeps working: every example comes out, exactly.
    def finish() -> None:
        join_all(producers, 20, "producers after fork")
        for p in producers:
            assert p.error is None, f"{p.name}: {p.error!r}"
        buf.put(one(-7))
        ledger.accept([-7])
        buf.close()

    if consumer is None:
        closer = start(finish, "closer")
        drain(buf, delivered)
        join_all([closer], 20, "closer")
        if closer.error is not None:
            raise closer.error
    else:
        finish()
        join_all([consumer], 20, "consumer after fork")
        assert consumer.error is None, repr(consumer.error)
    check_exact(delivered, ledger.ids, echo)
    check_buffer_totals(buf, len(ledger), delivered)


def fork_loader(rng: random.Random, seed: int) -> None:
    """Fork during an epoch: the parent's epoch fails clearly in the child, a new epoch
    there is whole, and the parent's epoch is whole too."""
    options = loader_options(rng)
    n = rng.randint(1, 1500)
    loader = dataecho.EchoLoader(Records(n), seed=seed, **options)
    epoch = iter(loader)
    delivered: Counter = Counter()
    stop_after = rng.randint(1, 4)
    for taken, batch in enumerate(epoch, 1):
        delivered.update(checked_ids(batch).tolist())
        if taken == stop_after:
            break

    def child() -> None:
        expect_fork_error(lambda: next(epoch), "next() on the parent's epoch")
        # A new epoch in the child builds its own buffer and threads.
        try:
            loader.close()
        except RuntimeError as exc:
            assert "forked child" in str(exc), exc
        got: Counter = Counter()
        drain(loader, got)
        check_exact(got, range(n), options["echo_factor"], "an epoch in the child: ")

    in_forked_child(child)
    for batch in epoch:
        delivered.update(checked_ids(batch).tolist())
    check_exact(delivered, range(n), options["echo_factor"], "the parent's epoch: ")
