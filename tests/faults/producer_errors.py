"""An exception in a producer (source, transform, iterable or augment) at a
random record, and an error that stops an epoch while an augment still runs."""

from __future__ import annotations

import gc
import random
import time
import traceback
from collections import Counter
from typing import Any

import dataecho
from faults.common import (
    Augment,
    Baseline,
    Transform,
    assert_clean,
    augment_record,
    loader_options,
    pick_echo,
    raised_in,
)
from support import InjectedFault, Records, Stream, check_at_most, drain

_FAULT_FRAME = {
    "source": "read_record",
    "transform": "transform_record",
    "iterable": "generate_records",
    "iterable_transform": "transform_record",
    "augment": "augment_record",
}


def drain_until(loader: Any, delivered: Counter, expected: type) -> BaseException | None:
    """Drains the loader's epoch into `delivered`; the `expected` exception it
    ended with, or None if it ended without one."""
    try:
        drain(loader, delivered)
    except expected as exc:
        return exc
    return None


def producer_error(rng: random.Random, variant: str, seed: int, worker_type: str) -> None:
    """source, transform or augment raises at a random record: the exception reaches
    the loop with the frame that raised it, what came before is intact, and the
    epoch's threads and processes are gone."""
    baseline = Baseline()
    n = rng.randint(1, 2500)
    fail_at = rng.randrange(n)
    options = loader_options(rng, augment=True if variant == "augment" else None)
    if worker_type == "process":
        options["num_workers"] = rng.randint(1, 3)
    if variant in ("source", "transform"):
        source: Any = Records(n, fail_at=fail_at if variant == "source" else None)
    else:
        source = Stream(n, fail_at=fail_at if variant == "iterable" else None)
    if variant in ("transform", "iterable_transform") or rng.random() < 0.3:
        options["transform"] = Transform(fail_at if "transform" in variant else None)
    if variant == "augment":
        options["augment"] = Augment(fail_at)
    loader = dataecho.EchoLoader(source, seed=seed, worker_type=worker_type, **options)
    delivered: Counter = Counter()
    error = drain_until(loader, delivered, InjectedFault)
    assert error is not None, f"the epoch ended without the fault injected at record {fail_at}"
    assert str(fail_at) in str(error), error
    assert raised_in(error, _FAULT_FRAME[variant]), (
        f"the traceback lacks {_FAULT_FRAME[variant]}: {traceback.format_exception(error)}"
    )
    # Everything delivered before the error: intact (checked per batch), real ids,
    # never the faulty one, and no more often than the echo factor allows.
    check_at_most(delivered, lambda i: 0 <= i < n and i != fail_at, options["echo_factor"])
    assert loader.stats()["delivered"] == sum(delivered.values())
    del error
    assert_clean(baseline, "after the error reached the consumer")
    loader.close()
    loader.close()


def user_stop_iteration(rng: random.Random, variant: str, seed: int) -> None:
    """source, transform or augment raises StopIteration at a random record (a
    next() on an exhausted iterator in user code): the loop gets a RuntimeError
    caused by it, never a silent end of the epoch short of examples."""
    baseline = Baseline()
    worker_type, where = variant.split("_")
    n = rng.randint(1, 2500)
    fail_at = rng.randrange(n)
    options = loader_options(rng, augment=True if where == "augment" else None)
    if worker_type == "process":
        options["num_workers"] = rng.randint(1, 3)
    source = Records(n, fail_at=fail_at if where == "source" else None, fail_with="stop")
    if where == "transform":
        options["transform"] = Transform(fail_at, fail_with="stop")
    if where == "augment":
        options["augment"] = Augment(fail_at, fail_with="stop")
    loader = dataecho.EchoLoader(source, seed=seed, worker_type=worker_type, **options)
    delivered: Counter = Counter()
    error = drain_until(loader, delivered, RuntimeError)
    assert error is not None, (
        f"the epoch ended without an error ({sum(delivered.values())} deliveries of {n} records; "
        f"StopIteration injected at record {fail_at})"
    )
    assert "StopIteration" in str(error) and isinstance(error.__cause__, StopIteration), repr(error)
    assert str(fail_at) in str(error.__cause__), error.__cause__
    check_at_most(delivered, lambda i: 0 <= i < n and i != fail_at, options["echo_factor"])
    del error
    assert_clean(baseline, "after the error reached the consumer")
    loader.close()


class SlowAugment:
    """An augment that takes `delay_s` per example."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        time.sleep(self.delay_s)
        return augment_record(example, None)


def augment_after_abort(rng: random.Random, variant: str, seed: int) -> None:
    """An error stops the epoch while an augment thread is still on its first
    example: nothing of the epoch runs on after the error reached the loop."""
    baseline = Baseline()
    fail_s = rng.uniform(0.25, 0.35)  # record 0 is quick; record 1 fails after this
    loader = dataecho.EchoLoader(
        Records(100, fail_at=1, fail_after_s=fail_s), batch_size=1, shuffle_buffer=1, echo_factor=pick_echo(rng),
        num_workers=rng.randint(1, 2), shuffle=False, augment=SlowAugment(fail_s + 0.3), seed=seed,
    )
    enabled = gc.isenabled()
    gc.disable()  # the epoch sits in a reference cycle; only the cyclic GC would stop what it leaves
    try:
        try:
            drain(loader, Counter())
            raise AssertionError("no error")
        except InjectedFault:
            pass
        time.sleep(0.6)
        left = baseline.leftovers()
    finally:
        if enabled:
            gc.enable()
    assert not left, f"still running after the error reached the loop: {left}"
