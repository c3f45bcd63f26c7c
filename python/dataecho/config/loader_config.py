"""``EchoLoader``'s configuration: every argument validated once, here.

:func:`loader_config` checks the arguments (each error names its argument and
says what was expected) and returns a frozen :class:`LoaderConfig`, which the
rest of the pipeline reads without checking again. Limits come from the native
module (``_core.MAX_ECHO``, ``_core.MAX_CAPACITY``).
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from .. import _checks, _core
from ..reading.chunking import CHUNK
from ..reading.ray import RayRows, is_ray_data
from ..reading.sharding import Shard, resolve_shard
from ..tensors.convert import import_torch
from ..workers.processes import check_picklable, default_start_method
from .dataloader import DEFAULT_WORKERS as DEFAULT_THREADS
from .dataloader import resolve

__all__ = ["LoaderConfig", "is_map_style", "loader_config", "reads_in_order"]

DEFAULT_EXAMPLES = 4096  # shuffle_buffer with echo_at="example"
DEFAULT_BATCHES = 16  # ... with echo_at="batch"


def is_map_style(source: Any) -> bool:
    """A dataset read by index: ``__len__`` and ``__getitem__`` (not a str or bytes)."""
    return hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(source, (str, bytes))


@dataclass(frozen=True)
class LoaderConfig:
    """The validated arguments of an ``EchoLoader`` (see its docstring), plus
    what follows from them."""

    source: Any
    batch_size: int
    echo_factor: float | str
    echo_at: str
    transform: Callable[[Any], Any] | None
    augment: Callable[..., Any] | None
    shuffle_buffer: int
    workers: int
    shuffle: bool
    seed: int
    drop_last: bool
    prefetch: int
    max_echo: float
    output: str
    pin_memory: bool
    device: Any
    worker_type: str
    start_method: str | None
    deterministic: bool
    shard: Shard
    sampler: Any = None
    collate_fn: Callable[[list], Any] | None = None
    worker_init_fn: Callable[[int], None] | None = None
    timeout: float | None = None
    persistent_workers: bool = False
    auto_workers: bool = False  # workers=None with threads: one, more while reads wait (dataecho.workers.threads)
    ragged: frozenset[str] | None = None  # leaf paths declared ragged
    ragged_bytes: int | None = None  # the page heap's budget (None: sized from the first examples)
    padding: int | str | None = None  # None (packed), "longest" or a length

    @property
    def map_style(self) -> bool:
        return is_map_style(self.source)

    @property
    def in_order(self) -> bool:
        """Batches hold the examples in reading order: the buffers draw first in,
        first out (see :func:`reads_in_order`)."""
        return reads_in_order(self.shuffle, self.echo_factor, self.source, self.worker_type)

    @property
    def chunk(self) -> int:
        """Positions of a map-style order a worker claims at a time (dataecho.reading.chunking)."""
        return min(CHUNK, self.batch_size)

    @property
    def augment_threads(self) -> int:
        """Threads that run ``augment``: ``workers`` (at least one), or 2 when it was not given."""
        return DEFAULT_THREADS if self.auto_workers else max(1, self.workers)

    @property
    def exact_echo(self) -> bool:
        """Echo counts by position (exactly floor(n * e) deliveries of n examples):
        deterministic order needs them, and so do equal batch counts on every rank."""
        return self.deterministic or self.shard.world_size > 1

    @property
    def augment_takes_rng(self) -> bool:
        """``augment`` accepts an ``rng`` keyword: it is given a generator per delivery."""
        return self.augment is not None and accepts_keyword(self.augment, "rng")

    def fingerprint(self) -> dict[str, Any]:
        """What decides the sequence of batches, besides the source's contents:
        a checkpoint resumes only a loader with the same values."""
        return {
            "seed": self.seed,
            "rank": self.shard.rank,
            "world_size": self.shard.world_size,
            "length": len(self.source) if self.map_style else None,
            "sampler": None if self.sampler is None else type(self.sampler).__name__,
            "batch_size": self.batch_size,
            "echo_factor": self.echo_factor,
            "echo_at": self.echo_at,
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "deterministic": self.deterministic,
            "max_echo": self.max_echo,
            "augment": "none" if self.augment is None else "rng" if self.augment_takes_rng else "own randomness",
        }


def loader_config(**arguments: Any) -> LoaderConfig:
    """Validates ``EchoLoader``'s arguments (its keywords, by name; DataLoader's
    names are resolved first, see dataecho.config.dataloader).

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: a ``device`` that is not available here.
    """
    a = resolve(arguments)
    worker_type = _checks.choice("worker_type", a["worker_type"], ("thread", "process"))
    source = _check_source(a["source"], worker_type)
    batch_size = _checks.positive_int("batch_size", a["batch_size"])
    echo_at = _checks.choice("echo_at", a["echo_at"], ("example", "batch"))
    for name in ("transform", "augment"):
        if a[name] is not None and not callable(a[name]):
            raise TypeError(f"{name}: expected a callable or None, got {type(a[name]).__name__}")
    deterministic = _checks.flag("deterministic", a["deterministic"])
    shard = resolve_shard(a["rank"], a["world_size"])
    # Ranks must agree on the epoch's permutation: a common seed.
    seed = _checks.seed(0 if a["seed"] is None and shard.world_size > 1 else a["seed"])
    echo_factor = _check_echo(a["echo_factor"], deterministic, shard)
    sampler, shuffle = _check_sampler(a["sampler"], a["shuffle"], source)
    # shuffle=False at echo 1: batches in reading order, which deterministic intake gives.
    in_order = reads_in_order(shuffle, echo_factor, source, worker_type)
    shuffle_buffer = _check_shuffle_buffer(a["shuffle_buffer"], batch_size, echo_at, a["augment"] is not None,
                                           deterministic, in_order)
    deterministic = deterministic or in_order
    # workers not given: threads start with one reader (see dataecho.workers.threads); processes, as declared, 2.
    auto_workers = a["auto_workers"] and worker_type == "thread"
    config = LoaderConfig(
        source=source, batch_size=batch_size, echo_factor=echo_factor, echo_at=echo_at,
        transform=a["transform"], augment=a["augment"], shuffle_buffer=shuffle_buffer,
        workers=1 if auto_workers else _check_workers(a["workers"], worker_type), shuffle=shuffle, seed=seed,
        drop_last=_checks.flag("drop_last", a["drop_last"]),
        prefetch=_checks.positive_int("prefetch", a["prefetch"], 1 << 16),
        max_echo=_checks.real("max_echo", a["max_echo"], 1.0, _core.MAX_ECHO),
        output=_checks.choice("output", a["output"], ("numpy", "torch")), pin_memory=a["pin_memory"],
        device=_check_device(a["device"]), worker_type=worker_type,
        start_method=a["start_method"], deterministic=deterministic, shard=shard, sampler=sampler,
        collate_fn=a["collate_fn"], worker_init_fn=a["worker_init_fn"], timeout=a["timeout"],
        persistent_workers=a["persistent_workers"], auto_workers=auto_workers,
        ragged=_check_ragged(a["ragged"]),
        ragged_bytes=None if a["ragged_bytes"] is None else _checks.positive_int("ragged_bytes", a["ragged_bytes"]),
        padding=_check_padding(a["padding"]),
    )
    if config.collate_fn is not None and config.device is not None:
        raise ValueError("collate_fn: its result is yielded as it is, so `device` cannot move it; "
                         "move the batch in the loop (batch.to(device)), as with DataLoader")
    if worker_type == "process":
        config = _check_processes(config)
    return config


def reads_in_order(shuffle: bool, echo_factor: float | str, source: Any, worker_type: str) -> bool:
    """``shuffle=False`` at echo 1 yields the reading order exactly, where there is
    one: a map-style source, or an iterable read by one thread (worker processes
    each iterate their own shard)."""
    return not shuffle and echo_factor == 1 and (is_map_style(source) or worker_type == "thread")


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` can be called with the keyword ``name`` (named, or **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == name and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )


def _check_source(source: Any, worker_type: str) -> Any:
    if is_ray_data(source):
        if worker_type == "process":
            raise ValueError(
                "worker_type: a Ray dataset is read in this process (Ray runs its preprocessing); "
                "use worker_type='thread'"
            )
        source = RayRows(source)
    if not (is_map_style(source) or isinstance(source, Iterable)):
        raise TypeError(
            f"source: expected an iterable or a map-style dataset (__len__ and __getitem__), "
            f"got {type(source).__name__}"
        )
    return source


def _check_shuffle_buffer(value: Any, batch_size: int, echo_at: str, augment: bool, deterministic: bool,
                          in_order: bool) -> int:
    given = value is not None
    if given:
        value = _checks.positive_int("shuffle_buffer", value, _core.MAX_CAPACITY)
    else:
        value = DEFAULT_BATCHES if echo_at == "batch" else DEFAULT_EXAMPLES
    if echo_at == "example" and value < batch_size:
        raise ValueError(f"shuffle_buffer: {value} examples cannot hold a batch of {batch_size}")
    if echo_at == "example" and (in_order or (deterministic and not given)):
        # Room for the reorder window (below); in order nothing is mixed, so its size is free.
        value = min(max(value, 2 * batch_size), _core.MAX_CAPACITY)
    if echo_at == "example" and (deterministic or in_order) and value < 2 * batch_size:
        # Examples that arrive ahead of their turn wait in slots (up to a batch of
        # them) beside the resident ones: with less room, intake could stall.
        raise ValueError(
            f"shuffle_buffer: with {'deterministic=True' if deterministic else 'shuffle=False (in order)'}, "
            f"expected at least 2 * batch_size = {2 * batch_size} "
            f"examples (a batch's worth may wait out of order beside the resident ones), got {value}"
        )
    # An epoch's native buffers hold at most MAX_CAPACITY examples each:
    # shuffle_buffer examples (echo_at="example"), 2 batches (echo_at="batch"),
    # 4 (the output of augment).
    held = 4 if augment else 2 if echo_at == "batch" else 1
    if batch_size * held > _core.MAX_CAPACITY:
        raise ValueError(
            f"batch_size: expected at most {_core.MAX_CAPACITY // held} (a buffer of this epoch holds "
            f"{held} batches, at most {_core.MAX_CAPACITY} examples), got {batch_size}"
        )
    return value


def _check_ragged(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"ragged: expected leaf paths, such as ['input_ids', 'meta/boxes'], got {value!r}")
    paths = list(value)
    for path in paths:
        if not isinstance(path, str):
            raise TypeError(f"ragged: expected leaf paths (str: dict keys and positions joined by '/'), got {path!r}")
    return frozenset(paths)


def _check_padding(value: Any) -> int | str | None:
    if value is None or value == "longest":
        return value
    if isinstance(value, str):
        raise ValueError(f"padding: expected None, 'longest' or a length, got {value!r}")
    return _checks.positive_int("padding", value)


def _check_echo(value: Any, deterministic: bool, shard: Shard) -> float | str:
    echo_factor = _checks.echo_factor(value)
    if echo_factor == "auto" and (deterministic or shard.world_size > 1):
        why = "deterministic=True" if deterministic else f"world_size={shard.world_size}"
        raise ValueError(
            f"echo_factor: 'auto' adapts to timing, so its batches (and their number per rank) "
            f"cannot be fixed in advance as {why} needs; give a number"
        )
    return echo_factor


def _check_workers(workers: int, worker_type: str) -> int:
    if workers > 1024:
        raise ValueError(f"workers: expected at most 1024, got {workers}")
    if workers == 0 and worker_type == "process":
        raise ValueError("workers: 0 reads in the calling thread; worker processes need workers >= 1")
    return workers


def _check_sampler(sampler: Any, shuffle: Any, source: Any) -> tuple[Any, bool]:
    """(sampler, shuffle): ``shuffle`` defaults to True, or False with a sampler,
    which decides the order itself (as in DataLoader, the two exclude each other)."""
    if sampler is None:
        return None, True if shuffle is None else _checks.flag("shuffle", shuffle)
    if shuffle:
        raise ValueError("sampler: decides the order itself, so shuffle=True cannot be given with it "
                         "(as in DataLoader)")
    if not is_map_style(source):
        raise ValueError("sampler: needs a map-style source (__len__ and __getitem__), as in DataLoader")
    if not isinstance(sampler, Iterable):
        raise TypeError(f"sampler: expected a torch Sampler or an iterable of indices, got {type(sampler).__name__}")
    return sampler, False


def _check_device(device: Any) -> Any:
    """A torch device that exists here, checked now rather than at the first batch."""
    if device is None:
        return None
    torch = import_torch()
    try:
        device = torch.device(device)
    except (TypeError, ValueError, RuntimeError) as exc:  # ValueError: an index beyond int64
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected a 'cpu' or 'cuda' device (batches are copied on CUDA streams), "
                         f"got {device}; move batches to other devices in the loop")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device: {device} needs CUDA, and torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"device: {device}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _check_processes(config: LoaderConfig) -> LoaderConfig:
    """worker_type="process": a start method that works, and what workers get pickles."""
    method = config.start_method
    if method is None:
        method = default_start_method()
    elif not isinstance(method, str):
        raise TypeError(f"start_method: expected None or a str, got {method!r}")
    elif method == "fork":
        raise ValueError(
            "start_method: 'fork' is unsafe in a process that runs native threads (the buffer's "
            "assembler); use 'forkserver' or 'spawn'"
        )
    elif method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"start_method: expected one of {multiprocessing.get_all_start_methods()}, got {method!r}")
    if config.workers > _core.MAX_WORKERS:
        raise ValueError(f"workers: expected at most {_core.MAX_WORKERS} worker processes, got {config.workers}")
    check_picklable("source", config.source)
    check_picklable("transform", config.transform)
    check_picklable("worker_init_fn", config.worker_init_fn)
    if config.deterministic and not config.map_style:
        raise ValueError(
            "deterministic: worker processes each read their own shard of an iterable, which "
            "have no common order; use a map-style source, or worker_type='thread'"
        )
    return dataclasses.replace(config, start_method=method)
