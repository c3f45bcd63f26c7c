"""torch ``DataLoader``'s keywords, with DataLoader's meaning, turned into
``EchoLoader``'s own arguments, so that changing the class name is enough.

Each keyword of DataLoader's that dataecho takes over (``dataset``,
``num_workers``, ``prefetch_factor``, ``generator``, ``multiprocessing_context``,
``timeout``, ``pin_memory_device``, ``batch_sampler``) is checked here and
resolved into the native names (``source``, ``workers``, ``prefetch``,
``seed``, ``worker_type``/``start_method``); giving both names of one setting
is an error. Where torch warns and goes on, so does dataecho.

The keywords dataecho acts on itself:

- ``sampler``: any iterable of dataset indices (a torch Sampler,
  ``WeightedRandomSampler``, ``DistributedSampler``, a curriculum): the reading
  order of each epoch, taken at its start and not sharded again; ``set_epoch``
  is forwarded to it. Excludes ``shuffle=True``, as in DataLoader.
- ``collate_fn``: called with the list of a batch's examples, each as views of
  its rows of the batch (no copy); its result is yielded as it is.
- ``worker_init_fn``: called with the worker's number in each worker thread or
  process, before it reads.
- ``generator``: a torch.Generator that seeds the order when ``seed`` is None.
- ``timeout``: seconds to wait for a batch (0: for ever); then a RuntimeError.
- ``multiprocessing_context``: worker processes, started that way.
- ``pin_memory_device``: "" or "cuda" (dataecho pins for CUDA).
- ``persistent_workers``: worker processes are kept from one epoch to the
  next (dataecho.workers.pool); thread workers are cheap to start and are
  started per epoch either way.
- ``batch_sampler``: refused; dataecho forms the batches itself.
"""

from __future__ import annotations

import warnings
from typing import Any

from .. import _checks
from ..tensors.convert import import_torch

__all__ = ["DEFAULT_WORKERS", "resolve"]

DEFAULT_WORKERS = 2
DEFAULT_PREFETCH = 2


def resolve(a: dict[str, Any]) -> dict[str, Any]:
    """``a``: EchoLoader's keywords as given (DataLoader's names included).
    Returns them in dataecho's names only, with the defaults filled in."""
    a = dict(a)
    a["source"] = _one_of(a, "source", "dataset", "dataset is DataLoader's name for the source")
    if a["source"] is None:
        raise TypeError("source: expected a dataset or an iterable, got None")
    if a.pop("batch_sampler") is not None:
        raise ValueError(
            "batch_sampler: not supported: dataecho forms batches itself, drawing from its shuffle buffer so that "
            "repeats of an example land in different batches; give `sampler` for the reading order, and batch_size"
        )
    a["workers"] = _workers(a)
    a["auto_workers"] = a["workers"] is None  # chosen by dataecho.config.loader_config
    a["workers"] = DEFAULT_WORKERS if a["workers"] is None else a["workers"]
    a["worker_type"], a["start_method"] = _worker_type(a)
    a["prefetch"] = _prefetch(a)
    a["persistent_workers"] = _checks.flag("persistent_workers", a["persistent_workers"])
    if a["persistent_workers"] and a["workers"] == 0:
        raise ValueError("persistent_workers: needs num_workers > 0 (workers to keep), as in DataLoader")
    a["seed"] = _seed(a.pop("generator"), a["seed"])
    a["timeout"] = _timeout(a["timeout"])
    a["pin_memory"] = _pin_memory(a["pin_memory"], a.pop("pin_memory_device"))
    for name in ("collate_fn", "worker_init_fn"):
        if a[name] is not None and not callable(a[name]):
            raise TypeError(f"{name}: expected a callable or None, got {type(a[name]).__name__}")
    return a


def _one_of(a: dict[str, Any], name: str, alias: str, why: str) -> Any:
    value, other = a.pop(name), a.pop(alias)
    if value is not None and other is not None:
        raise TypeError(f"{name} and {alias}: give one ({why})")
    return other if value is None else value


def _workers(a: dict[str, Any]) -> int | None:
    workers, num_workers = a.pop("workers"), a.pop("num_workers")
    if workers is not None and num_workers is not None:
        raise TypeError("workers and num_workers: give one (num_workers is DataLoader's name for workers)")
    name = "num_workers" if num_workers is not None else "workers"
    value = num_workers if num_workers is not None else workers
    if value is None:
        return None
    number = _checks.integer(name, value, "an int >= 0")
    if number < 0:
        raise ValueError(f"{name}: expected an int >= 0 (0 reads in the calling thread), got {number}")
    return number


def _worker_type(a: dict[str, Any]) -> tuple[Any, Any]:
    """(worker_type, start_method), with DataLoader's ``multiprocessing_context``:
    a start method's name or a context, meaning worker processes started so."""
    worker_type, method, context = a.pop("worker_type"), a.pop("start_method"), a.pop("multiprocessing_context")
    if context is None:
        return ("thread" if worker_type is None else worker_type), method
    if method is not None:
        raise TypeError("start_method and multiprocessing_context: give one")
    if worker_type not in (None, "process"):
        raise ValueError(f"multiprocessing_context: means worker processes, but worker_type={worker_type!r}")
    if a["workers"] == 0:
        raise ValueError("multiprocessing_context: can only be used with worker processes (num_workers > 0), "
                         "as in DataLoader")
    if not isinstance(context, str):
        get = getattr(context, "get_start_method", None)
        if get is None:
            raise TypeError(f"multiprocessing_context: expected a start method's name or a multiprocessing "
                            f"context, got {type(context).__name__}")
        context = get()
    return "process", context


def _prefetch(a: dict[str, Any]) -> int:
    """Batches assembled ahead; DataLoader's ``prefetch_factor`` is per worker."""
    prefetch, factor = a["prefetch"], a.pop("prefetch_factor")
    if factor is None:
        return DEFAULT_PREFETCH if prefetch is None else prefetch
    if prefetch is not None:
        raise TypeError("prefetch and prefetch_factor: give one (prefetch_factor is per worker, as in DataLoader)")
    if a["workers"] == 0:
        raise ValueError("prefetch_factor: only with num_workers > 0, as in DataLoader (use prefetch for "
                         "batches assembled ahead)")
    return _checks.positive_int("prefetch_factor", factor, 1 << 16) * a["workers"]


def _seed(generator: Any, seed: Any) -> Any:
    """``seed``, or one drawn from DataLoader's ``generator`` when no seed is given."""
    if generator is None:
        return seed
    torch = import_torch()
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
    if seed is not None:
        return seed
    # As DataLoader draws its base seed: one int64 from the generator.
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()) & ((1 << 63) - 1)


def _timeout(value: Any) -> float | None:
    """DataLoader's ``timeout``: seconds to wait for a batch, 0 (or None) for ever."""
    return _checks.timeout(value) or None


def _pin_memory(pin_memory: Any, device: Any) -> bool:
    """``pin_memory``, False with a warning where there is no CUDA (as torch
    warns and goes on). ``pin_memory_device``: "" or a CUDA device."""
    pin_memory = _checks.flag("pin_memory", pin_memory)
    if not isinstance(device, str):
        raise TypeError(f"pin_memory_device: expected a str, got {type(device).__name__}")
    if device and not device.split(":")[0] == "cuda":
        raise ValueError(f"pin_memory_device: dataecho pins memory for CUDA; expected '' or 'cuda', got {device!r}")
    if not pin_memory:
        return False
    if not import_torch().cuda.is_available():
        warnings.warn("pin_memory=True, but CUDA is not available: batch memory is not pinned", stacklevel=5)
        return False
    return True
