"""Worker processes whose owner, or who themselves, end unexpectedly: the owner
killed by SIGKILL (its workers, the forkserver and the resource tracker must
follow), and a worker that exits before finishing its share, whatever its status."""

from __future__ import annotations

import random
from collections import Counter

import dataecho
from faults.common import Baseline, assert_clean, loader_options
from faults.producer_errors import drain_until
from support import ExitAt, Records, check_at_most, kill_owner

OWNER_S = 3.0  # the owner's processes are gone within this after it is killed


def owner_killed(rng: random.Random, variant: str, seed: int) -> None:
    """SIGKILL of the process that owns an epoch with worker processes, while they
    wait for a free slot, sit in user code, or read an iterable: nothing it started
    runs on after OWNER_S."""
    options = loader_options(rng, augment=False)
    options.pop("augment", None)
    options["persistent_workers"] = rng.random() < 0.5
    source = "Stream(10**6)" if variant == "iterable" else "Records(10**6)"
    stall_s = 60.0 if variant == "map_in_user_code" else 0.0
    args = ", ".join(f"{key}={value!r}" for key, value in options.items())
    left = kill_owner(
        f"{source}, {args}, worker_type='process', transform=Stall({stall_s}), seed={seed}",
        settle_s=rng.uniform(0.3, 1.0), within_s=OWNER_S,
    )
    assert not left, f"still running {OWNER_S} s after the owner was killed: {left}"


def worker_exit(rng: random.Random, variant: str, seed: int) -> None:
    """A worker process ends at a random record by os._exit(0), os._exit(3) or
    SIGKILL: the loop gets an error naming the worker, never a hang or a short
    epoch, and nothing is left behind."""
    baseline = Baseline()
    n = rng.randint(200, 3000)
    at = rng.randrange(1, n)  # record 0 is read by the owner, to learn the structure
    status = {"status0": 0, "status3": 3, "kill": None}[variant]
    options = loader_options(rng, augment=False)
    options.pop("augment", None)
    options["num_workers"] = rng.randint(1, 3)
    options["persistent_workers"] = rng.random() < 0.5  # a pool that lost a worker is reaped too
    loader = dataecho.EchoLoader(Records(n), transform=ExitAt(at, status), worker_type="process", seed=seed,
                                 **options)
    delivered: Counter = Counter()
    error = drain_until(loader, delivered, RuntimeError)
    assert error is not None, f"the epoch ended without an error ({sum(delivered.values())} deliveries of {n})"
    expected = "killed by SIGKILL" if status is None else f"exited (status {status}) before finishing its share"
    assert expected in str(error), error
    check_at_most(delivered, lambda i: 0 <= i < n and i != at, options["echo_factor"])
    del error
    assert_clean(baseline, "after the error reached the consumer")
    loader.close()
