"""Consumers that break the one-consumer, one-epoch rule: a second thread taking
batches from the same epoch, and an iterator whose epoch a later iter(loader)
ended. Each gets a RuntimeError that says so; the epoch that goes on is exact."""

from __future__ import annotations

import random
from collections import Counter

import dataecho
from faults.common import Baseline, assert_clean, loader_options
from support import Records, check_exact, drain, join_all, start, take_refused

SECOND = "another thread is already taking batches"
STALE = "ended by a later iter(loader)"


def _options(rng: random.Random, worker_type: str, echo_at: str | None = None) -> dict[str, Any]:
    options = loader_options(rng, augment=False if worker_type == "process" else None)  # augment: threads only
    if worker_type == "process":
        options["num_workers"] = rng.randint(1, 2)
    if echo_at == "batch":
        options["echo_at"], options["shuffle_buffer"] = "batch", rng.randint(1, 12)
    elif echo_at == "example":
        options.pop("echo_at", None)
        options["shuffle_buffer"] = options["batch_size"] + rng.randint(0, 6 * options["batch_size"] + 40)
    return options


def second_consumer(rng: random.Random, variant: str, seed: int) -> None:
    """Two or three threads take batches from one epoch at once: those that find
    another inside next() get the RuntimeError and try again; between them they
    see every example exactly as often as one consumer would."""
    baseline = Baseline()
    worker_type, echo_at = variant.split("_")
    options = _options(rng, worker_type, echo_at)
    n = rng.randint(1, 1500)
    loader = dataecho.EchoLoader(Records(n), seed=seed, worker_type=worker_type, **options)
    epoch = iter(loader)
    refused: list[str] = []
    consumers = [start(lambda: take_refused(epoch, refused), f"consumer-{i}") for i in range(rng.randint(2, 3))]
    join_all(consumers, 60, "consumers")
    errors = [c.error for c in consumers if c.error is not None]
    assert not errors, f"a consumer failed: {errors[0]!r}"
    assert all(SECOND in r for r in refused), refused[:3]
    delivered: Counter = Counter()
    for ids in (ids for c in consumers for ids in c.result):
        delivered.update(ids.tolist())
    check_exact(delivered, range(n), options["echo_factor"], f"{len(refused)} refusals: ")
    del epoch
    loader.close()
    assert_clean(baseline, "after the epoch")


def stale_iterator(rng: random.Random, variant: str, seed: int) -> None:
    """An iterator whose epoch a later iter(loader) ended raises the RuntimeError
    at every later next(), never a quiet StopIteration; zip(loader, loader) raises
    it too; the newest epoch is whole."""
    baseline = Baseline()
    worker_type = "process" if variant == "process" else "thread"
    options = _options(rng, worker_type)
    n = rng.randint(1, 1200)
    loader = dataecho.EchoLoader(Records(n), seed=seed, worker_type=worker_type, **options)
    if variant == "zip":
        try:
            for _ in zip(loader, loader):
                raise AssertionError("zip(loader, loader) yielded a pair")
            raise AssertionError("zip(loader, loader) ended quietly")
        except RuntimeError as error:
            assert STALE in str(error), error
    else:
        first = iter(loader)
        ended = False
        for _ in range(rng.randint(0, 3)):
            try:
                next(first)
            except StopIteration:
                ended = True
                break
        newest = iter(loader)
        if not ended:  # a loop still using it is told, every time it asks
            for _ in range(2):
                try:
                    next(first)
                    raise AssertionError("a batch from an epoch a later iter(loader) ended")
                except RuntimeError as error:
                    assert STALE in str(error), error
        delivered: Counter = Counter()
        drain(newest, delivered)
        check_exact(delivered, range(n), options["echo_factor"], "the newest epoch: ")
        del first, newest
    delivered = Counter()
    drain(iter(loader), delivered)
    check_exact(delivered, range(n), options["echo_factor"], "the epoch after: ")
    loader.close()
    assert_clean(baseline, "after the epochs")
