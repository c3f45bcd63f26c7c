"""torch ``DataLoader``'s keywords, with DataLoader's meaning, checked and turned
into the settings dataecho runs on, so that changing the class name is enough.

``EchoLoader`` takes DataLoader's parameters in DataLoader's order, and the
rest by keyword. What dataecho does with each keyword of DataLoader's:

- ``sampler``: any iterable of dataset indices (a torch Sampler,
  ``WeightedRandomSampler``, ``DistributedSampler``, a curriculum): the reading
  order of each epoch, taken at its start and not sharded again; ``set_epoch``
  is forwarded to it. Excludes ``shuffle=True``, as in DataLoader.
- ``num_workers``: producer threads (``worker_type="thread"``, the default) or
  processes; not given, dataecho chooses (one reading thread, more while reads
  wait); 0 reads in the calling thread.
- ``collate_fn``: called with the list of a batch's examples, each as views of
  its rows of the batch (no copy); its result is yielded as it is.
- ``worker_init_fn``: called with the worker's number in each worker thread or
  process, before it reads.
- ``generator``: a torch.Generator that seeds the order when ``seed`` is None.
- ``timeout``: seconds to wait for a batch (0: for ever); then a RuntimeError.
- ``multiprocessing_context``: worker processes, started that way ("fork" is
  refused: unsafe in a process that runs native threads).
- ``prefetch_factor``: batches assembled ahead per worker.
- ``pin_memory_device``: "" or "cuda" (dataecho pins for CUDA).
- ``persistent_workers``: worker processes are kept from one epoch to the
  next (dataecho.workers.pool); thread workers are cheap to start and are
  started per epoch either way.
- ``batch_sampler``: its batches, exactly, in its order (variable sizes
  allowed); echo repeats them whole (dataecho.config.batch_sampler); excludes
  ``batch_size``, ``shuffle``, ``sampler`` and ``drop_last``, as in DataLoader;
  ``set_epoch`` is forwarded to it.

Where torch warns and goes on, so does dataecho.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from .. import _checks
from ..tensors.convert import import_torch

__all__ = ["DEFAULT_PREFETCH", "DEFAULT_WORKERS", "check_callable", "num_workers", "pin_memory", "prefetch",
           "seed", "timeout", "warn_many_workers", "worker_kind"]

DEFAULT_WORKERS = 2  # processes (and augment threads) when num_workers is not given
DEFAULT_PREFETCH = 2  # batches assembled ahead when prefetch_factor is not given


def num_workers(value: Any) -> int | None:
    """``num_workers``: an int >= 0, or None (dataecho chooses)."""
    if value is None:
        return None
    number = _checks.integer("num_workers", value, "an int >= 0")
    if number < 0:
        raise ValueError(f"num_workers: expected an int >= 0 (0 reads in the calling thread), got {number}")
    return number


def worker_kind(worker_type: Any, context: Any, workers: int | None) -> tuple[str, str | None]:
    """(worker_type, start method or None), with DataLoader's
    ``multiprocessing_context``: a start method's name or a context, meaning
    worker processes started so."""
    if worker_type is None:
        worker_type = "thread" if context is None else "process"
    worker_type = _checks.choice("worker_type", worker_type, ("thread", "process"))
    if context is None:
        return worker_type, None
    if worker_type != "process":
        raise ValueError(f"multiprocessing_context: means worker processes, but worker_type={worker_type!r}")
    if workers == 0:
        raise ValueError("multiprocessing_context: can only be used with worker processes (num_workers > 0), "
                         "as in DataLoader")
    if not isinstance(context, str):
        get = getattr(context, "get_start_method", None)
        if get is None:
            raise TypeError(f"multiprocessing_context: expected a start method's name or a multiprocessing "
                            f"context, got {type(context).__name__}")
        context = get()
    return worker_type, context


def warn_many_workers(workers: int | None, worker_type: str) -> None:
    """Warns, as DataLoader does, of more workers than this machine suggests:
    more processes than usable CPUs, or more threads than 8 per CPU (threads
    that wait on I/O may usefully outnumber the CPUs)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if workers is None or not cpus:
        return
    limit = cpus if worker_type == "process" else 8 * cpus
    if workers > limit:
        kind = "worker processes" if worker_type == "process" else "reading threads"
        warnings.warn(f"num_workers={workers}: this EchoLoader will create {workers} {kind}, more than the "
                      f"{limit} suggested on this machine ({cpus} CPUs); so many can make loading slow or freeze "
                      f"it: lower num_workers if so", UserWarning, stacklevel=4)


def prefetch(prefetch_factor: Any, workers: int | None) -> int:
    """Batches assembled ahead: DataLoader's ``prefetch_factor`` is per worker
    (``num_workers`` not given counts as ``DEFAULT_WORKERS``)."""
    if prefetch_factor is None:
        return DEFAULT_PREFETCH
    if workers == 0:
        raise ValueError("prefetch_factor: only with num_workers > 0, as in DataLoader")
    factor = _checks.positive_int("prefetch_factor", prefetch_factor, 1 << 16)
    return min(factor * (DEFAULT_WORKERS if workers is None else workers), 1 << 16)


def seed(generator: Any, value: Any) -> Any:
    """``seed``, or one drawn from DataLoader's ``generator`` when no seed is
    given; with neither, where torch is imported, one drawn from torch's
    default generator, as ``RandomSampler`` draws its seed: a script that calls
    ``torch.manual_seed(s)`` before building the loader shuffles the same way
    at every run. (None: neither, and no torch; a random seed is drawn.)"""
    if generator is None and value is None:
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "empty"):  # not imported, or part-way through its import
            return None
        return int(torch.empty((), dtype=torch.int64).random_().item()) & ((1 << 63) - 1)
    if generator is None:
        return value
    torch = import_torch()
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    if value is not None:
        return value
    # As DataLoader draws its base seed: one int64 from the generator.
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & ((1 << 63) - 1)


def timeout(value: Any) -> float | None:
    """DataLoader's ``timeout``: seconds to wait for a batch, 0 (or None) for ever."""
    return _checks.timeout(value) or None


def pin_memory(value: Any, device: Any) -> bool:
    """``pin_memory``, False with a warning where there is no CUDA (as torch
    warns and goes on). ``pin_memory_device``: "" or a CUDA device."""
    value = _checks.flag("pin_memory", value)
    if not isinstance(device, str):
        raise TypeError(f"pin_memory_device: expected a str, got {type(device).__name__}")
    if device and not device.split(":")[0] == "cuda":
        raise ValueError(f"pin_memory_device: dataecho pins memory for CUDA; expected '' or 'cuda', got {device!r}")
    if not value:
        return False
    if not import_torch().cuda.is_available():
        warnings.warn("pin_memory=True, but CUDA is not available: batch memory is not pinned", stacklevel=4)
        return False
    return True


def check_callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a callable or None, got {type(value).__name__}")
    return value
