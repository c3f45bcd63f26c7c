"""What worker processes need of a loader's configuration
(``worker_type="process"``): a start method that works in a threaded process,
a bounded number of workers, a sampler whose indices can be taken in advance,
and a dataset, ``transform`` and ``worker_init_fn`` that pickle as
``Process(...)`` pickles them."""

from __future__ import annotations

import multiprocessing
from multiprocessing import context, reduction
from typing import Any

from .. import _core

__all__ = ["check_processes"]


def check_processes(config: Any) -> None:
    """worker_type="process": a start method that works, and what workers get pickles."""
    method = config.start_method
    if method == "fork":
        raise ValueError(
            "multiprocessing_context: 'fork' is unsafe in a process that runs native threads (the buffer's "
            "assembler); use 'forkserver' or 'spawn'"
        )
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"multiprocessing_context: expected one of {multiprocessing.get_all_start_methods()}, "
                         f"got {method!r}")
    if config.worker_type == "process" and config.workers > _core.MAX_WORKERS:
        raise ValueError(f"num_workers: expected at most {_core.MAX_WORKERS} worker processes, got {config.workers}")
    if config.worker_type == "process" and config.sampler is not None and not hasattr(config.sampler, "__len__"):
        raise ValueError("sampler: without __len__ it is read lazily, as positions are claimed, in this process; "
                         "worker processes take the epoch's indices at its start: give the sampler a __len__, "
                         "or use worker_type='thread'")
    names = ("dataset", "transform", "worker_init_fn") if config.worker_type == "process" else ()
    if config.augment is not None and config.augment_workers == "process":
        names += ("augment",)
    for name in names:
        _check_picklable(name, getattr(config, name))
    if config.worker_type == "process" and config.deterministic_given and not config.map_style:
        raise ValueError(
            "deterministic: worker processes each read their own shard of an iterable, which "
            "have no common order; use a map-style dataset, or worker_type='thread'"
        )


def _check_picklable(name: str, value: Any) -> None:
    """Raises a TypeError naming ``name`` if ``value`` cannot be sent to a worker process."""
    try:
        _pickled_for_a_process(value)
    except Exception as exc:  # pickling can fail with many exception types
        raise TypeError(
            f"{name}: worker_type='process' sends it to worker processes, but it cannot be pickled "
            f"({type(exc).__name__}: {exc}); define it at module level (not a lambda or a local "
            f"function), or use worker_type='thread'"
        ) from None


def _pickled_for_a_process(value: Any) -> bytes:
    """``value`` pickled as ``Process(...)`` pickles its arguments when it starts
    a worker: what pickles only by inheritance (multiprocessing locks, values,
    events, queues) is allowed, as DataLoader allows it in a dataset."""
    previous = context.get_spawning_popen()
    context.set_spawning_popen(_Starting())
    try:
        return reduction.ForkingPickler.dumps(value)
    finally:
        context.set_spawning_popen(previous)


class _Starting:
    """Stands for the process being started while the check pickles (file
    descriptors are only named, not passed)."""

    def duplicate_for_child(self, fd: int) -> int:
        return fd

    def DupFd(self, fd: int) -> int:  # noqa: N802 - the name multiprocessing calls
        return fd
