"""Ctrl-C: SIGINT while blocked in put / next / an EchoLoader epoch, and
KeyboardInterrupt while an epoch starts its worker processes."""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
import traceback
from collections import Counter
from typing import Any

import numpy as np

import dataecho
from faults.common import CLEANUP_S, SIGINT_S, Baseline, assert_clean, loader_options, random_buffer
from processes import descendants
from support import (
    Records,
    check_at_most,
    check_buffer_totals,
    check_exact,
    checked_ids,
    drain,
    examples,
    free_slots,
    one,
    wait_for,
)


class InterruptOnPickle:
    """A transform whose `at`-th pickling raises KeyboardInterrupt: the 1st is the
    loader's check, the 2nd worker 0's start, the 3rd worker 1's start."""

    def __init__(self, at: int) -> None:
        self.at, self.count = at, 0

    def __reduce__(self) -> tuple:
        self.count += 1
        if self.count == self.at:
            raise KeyboardInterrupt
        return InterruptOnPickle, (self.at,)

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        return example


def start_interrupted(rng: random.Random, variant: str, seed: int) -> None:
    """Ctrl-C while an epoch starts its worker processes (after the first has
    started): the workers already started are stopped before the interrupt
    reaches the loop."""
    workers = rng.randint(2, 3)
    at = rng.randint(3, workers + 1)  # worker at - 2 fails to start; those before it run
    loader = dataecho.EchoLoader(
        Records(5000), batch_size=8, num_workers=workers, worker_type="process", transform=InterruptOnPickle(at), seed=seed
    )
    try:
        iter(loader)
        raise AssertionError("no KeyboardInterrupt")
    except KeyboardInterrupt:
        pass
    left = descendants()
    # (Whatever the outcome, the stray workers end by themselves within a second.)
    wait_for(lambda: not descendants(), CLEANUP_S)
    assert not left, f"worker processes still running after the interrupted start: {left}"


class Interrupter:
    """Sends SIGINT to this process after `delay_s`, from a helper thread."""

    def __init__(self, delay_s: float) -> None:
        # Python's own handler, even where SIGINT came in ignored (a job started
        # in the background by a shell without job control).
        self._previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sent_at: float | None = None
        self._thread = threading.Timer(delay_s, self._send)
        self._thread.start()

    def _send(self) -> None:
        self.sent_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    def latency(self) -> float:
        caught = time.monotonic()
        self._thread.join(5)
        assert self.sent_at is not None, "interrupted before SIGINT was sent"
        return caught - self.sent_at

    def join(self) -> None:
        self._thread.cancel()
        self._thread.join(5)
        signal.signal(signal.SIGINT, self._previous)


def sigint_buffer(rng: random.Random, variant: str, seed: int) -> None:
    """SIGINT while blocked in put / put_many / next_batch / a for loop: KeyboardInterrupt
    within SIGINT_S, nothing accepted lost, and the buffer still works."""
    buf, echo = random_buffer(rng, seed, 1, 64)
    capacity = buf.capacity
    delivered: Counter = Counter()
    resident = 0
    if variant == "for":  # the loop takes what the buffer releases, then waits for more
        resident = rng.randint(buf.initial, capacity)
        buf.put_many(examples(np.arange(resident)))
    step = rng.randint(1, 2 * capacity)
    interrupter = Interrupter(rng.uniform(0.03, 0.2))
    latency = None
    try:
        # Puts of ids 0, 1, 2, ... until one blocks (the buffer is full, nobody reads).
        if variant == "put":
            for i in itertools.count():
                buf.put(one(i))
        elif variant == "put_timeout":
            for i in itertools.count():
                buf.put(one(i), timeout=30)
        elif variant == "put_many":
            for first in itertools.count(0, step):
                buf.put_many(examples(np.arange(first, first + step)))
        elif variant == "next":
            buf.next_batch()
        else:
            drain(buf, delivered)
        raise AssertionError("the blocked call returned")
    except KeyboardInterrupt:
        latency = interrupter.latency()
    finally:
        interrupter.join()
    assert latency < SIGINT_S, f"KeyboardInterrupt {latency:.3f} s after SIGINT"
    # Ids went in in order, so what was accepted is exactly the first `fresh`
    # (put_many puts a prefix), wherever the interrupt struck.
    accepted = list(range(buf.stats()["fresh"]))
    if variant in ("next", "for"):
        assert len(accepted) == resident, (len(accepted), resident)
        # The buffer still works: more input, then everything accepted comes out.
        more = np.arange(1_000_000, 1_000_000 + min(rng.randint(0, capacity), free_slots(buf)))
        if len(more):
            buf.put_many(examples(more))
        accepted += more.tolist()
    buf.close()
    drain(buf, delivered)
    check_exact(delivered, accepted, echo)
    check_buffer_totals(buf, len(accepted), delivered)


def sigint_loader(rng: random.Random, variant: str, seed: int) -> None:
    """SIGINT during an EchoLoader epoch (thread or process workers, the loop waiting or
    busy): KeyboardInterrupt within SIGINT_S, the epoch stopped, and the next epoch whole."""
    baseline = Baseline()
    worker_type, mode = variant.split("_")
    options = loader_options(rng)
    if worker_type == "process":
        options["num_workers"] = rng.randint(1, 3)
    if options.get("echo_at") != "batch":
        options["shuffle_buffer"] = options["batch_size"] * rng.randint(1, 3)
    n = rng.randint(200, 600)
    # waiting: reads are slow, so the loop waits in next(); busy: the loop's own step is slow.
    source = Records(n, delay_s=rng.uniform(0.003, 0.02) if mode == "waiting" else 0.0)
    step_s = 0.0 if mode == "waiting" else rng.uniform(0.001, 0.01)
    loader = dataecho.EchoLoader(source, seed=seed, worker_type=worker_type, **options)
    delivered: Counter = Counter()
    epoch = iter(loader)
    delivered.update(checked_ids(next(epoch)).tolist())  # the workers are up (see start_interrupted)
    interrupter = Interrupter(rng.uniform(0.02, 0.2))
    latency = None
    in_next = False
    try:
        drain(epoch, delivered, step_s)
        # The epoch was quicker than the signal: wait for it in short sleeps. A
        # signal that lands after the handler's last check and before a sleep's
        # system call begins is handled only when that sleep ends.
        deadline = time.monotonic() + 2 * SIGINT_S
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise AssertionError("no KeyboardInterrupt")
    except KeyboardInterrupt as exc:
        latency = interrupter.latency()
        in_next = any(f.name == "__next__" for f in traceback.extract_tb(exc.__traceback__))
    finally:
        interrupter.join()
    assert latency < SIGINT_S, f"KeyboardInterrupt {latency:.3f} s after SIGINT"
    check_at_most(delivered, lambda i: 0 <= i < n, options["echo_factor"])
    del epoch
    if not in_next:
        loader.close()  # Ctrl-C came in the loop's own code: stopping is the loop's job
    # Ctrl-C inside next() stops the epoch's threads and processes by itself.
    assert_clean(baseline, "after Ctrl-C")
    # And the loader is good for another, complete epoch.
    source.delay_s = 0.0
    delivered = Counter()
    drain(loader, delivered)
    check_exact(delivered, range(n), options["echo_factor"], "the epoch after Ctrl-C: ")
    assert_clean(baseline, "after the epoch that followed Ctrl-C")
