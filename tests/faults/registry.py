"""Every kind of scenario: kind -> (function, variants). A scenario is named
``kind:variant``; its function takes (random.Random(seed), variant, seed)."""

from __future__ import annotations

import random
from typing import Callable

from faults.close_storm import close_storm
from faults.closing import close_iter, close_put
from faults.consumers import second_consumer, stale_iterator
from faults.ctrl_c import sigint_buffer, sigint_loader, start_interrupted
from faults.deletion import delete_buffer, delete_loader, put_many_cycle
from faults.exiting import exit_scenario
from faults.fork import fork_scenario
from faults.owners import owner_killed, worker_exit
from faults.producer_errors import augment_after_abort, producer_error, user_stop_iteration
from faults.reuse import reuse
from faults.timeouts import timeout_scenario

SCENARIOS: dict[str, tuple[Callable[[random.Random, str, int], None], list[str]]] = {
    "error_thread": (
        lambda rng, variant, seed: producer_error(rng, variant, seed, "thread"),
        ["source", "transform", "iterable", "iterable_transform", "augment"],
    ),
    "error_process": (
        lambda rng, variant, seed: producer_error(rng, variant, seed, "process"),
        ["source", "transform", "iterable"],
    ),
    "stop_iteration": (
        user_stop_iteration,
        ["thread_source", "thread_transform", "thread_augment", "process_source", "process_transform"],
    ),
    "owner_killed": (owner_killed, ["map_in_put", "map_in_user_code", "iterable"]),
    "worker_exit": (worker_exit, ["status0", "status3", "kill"]),
    "second_consumer": (
        second_consumer, ["thread_example", "thread_batch", "process_example", "process_batch"],
    ),
    "stale_iterator": (stale_iterator, ["thread", "process", "zip"]),
    "close_put": (close_put, ["put", "put_timeout", "put_many", "consume_first"]),
    "close_iter": (close_iter, ["empty", "below_initial", "drained", "next_timeout"]),
    "close_storm": (close_storm, ["put", "put_many", "mixed"]),
    "delete_buffer": (delete_buffer, ["strong", "weak", "unclosed"]),
    "delete_loader": (delete_loader, ["thread", "process"]),
    "put_many_cycle": (put_many_cycle, ["timeout", "closed"]),
    "start_interrupted": (start_interrupted, ["second_worker"]),
    "augment_after_abort": (augment_after_abort, ["thread"]),
    "sigint_buffer": (sigint_buffer, ["put", "put_timeout", "put_many", "next", "for"]),
    "sigint_loader": (sigint_loader, ["thread_waiting", "thread_busy", "process_waiting", "process_busy"]),
    "exit": (
        exit_scenario,
        [
            f"{v}_{m}"
            for v in ("put", "consumer", "loader_thread", "loader_thread_consumer", "loader_process")
            for m in ("normal", "exception")
        ],
    ),
    "fork": (fork_scenario, ["idle", "producers", "consumer", "loader"]),
    "reuse": (reuse, ["buffer", "epochs", "abandon", "iterable", "generator", "process_epochs"]),
    "timeout": (timeout_scenario, ["put", "put_many", "next", "mixed"]),
}
