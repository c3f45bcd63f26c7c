"""``EchoLoader``'s configuration: every argument validated once, here.

:func:`loader_config` checks the arguments (each error names its argument and
says what was expected) and returns a frozen :class:`LoaderConfig`, which
``EchoLoader`` and the planner (dataecho.pipeline.plan) read without checking
again; stages get small specs of their own from the planner. Limits come from
the native module (``_core.MAX_ECHO``, ``_core.MAX_CAPACITY``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from .. import _checks, _core
from ..reading.ray import RayRows, is_ray_data
from ..reading.sharding import Shard, resolve_shard
from ..reading.source import in_fixed_order, is_map_style
from ..workers.spec import default_start_method
from . import dataloader
from .batch_sampler import check_batch_sampler, check_with_batch_sampler, default_echo_at
from .device_echo import check_device_echo
from .devices import check_output
from .echo import Echo
from .process_checks import check_processes

__all__ = ["DEFAULT_BATCHES", "DEFAULT_EXAMPLES", "LoaderConfig", "loader_config"]

DEFAULT_EXAMPLES = 4096  # shuffle_buffer with echo_at="example"
DEFAULT_BATCHES = 16  # ... with echo_at="batch"


@dataclass(frozen=True)
class LoaderConfig:
    """The validated arguments of an ``EchoLoader`` (see its docstring), plus
    the rules that follow from them, each written once here.

    Attributes beyond the arguments:
        workers: producer threads or processes (``num_workers``, resolved).
        auto_workers: ``num_workers`` was not given and threads read: one
            reading thread, more while reads wait (dataecho.workers.thread_readers).
        prefetch: batches assembled ahead (from ``prefetch_factor``).
        start_method: for worker processes.
        shard: this process's part of a data-parallel job.
    """

    dataset: Any
    batch_size: int
    batched: bool  # False for batch_size=None: each example is yielded alone (batches of one inside)
    shuffle: bool
    sampler: Any
    collate_fn: Callable[[list], Any] | None
    pin_memory: bool
    drop_last: bool
    timeout: float | None
    worker_init_fn: Callable[[int], None] | None
    persistent_workers: bool
    echo: Echo
    transform: Callable[[Any], Any] | None
    augment: Callable[..., Any] | None
    augment_workers: str  # "thread" or "process": where augment runs
    shuffle_buffer: int
    shuffle_buffer_given: bool  # else the default, which the planner may size down (see dataecho.pipeline.plan)
    seed: int
    seed_given: bool  # ``seed`` was given; else it was drawn, and a loaded state's seed replaces it
    deterministic: bool
    deterministic_given: bool  # deterministic=True was asked for (not only chosen by default)
    worker_type: str
    workers: int
    auto_workers: bool
    prefetch: int
    prefetch_factor: int | None
    start_method: str | None
    output: str
    device: Any  # torch's (dataecho.config.devices)
    shard: Shard
    shard_given: bool  # rank and world_size were given; else torch.distributed decides as each epoch starts
    ragged: frozenset[str] | None = None  # leaf paths declared ragged
    ragged_bytes: int | None = None  # the page heap's budget (None: sized from the first examples)
    padding: int | str | None = None  # None (packed), "longest" or a length
    batch_sampler: Any = None  # forms the batches (dataecho.config.batch_sampler); batch_size is then 1, unused
    jax_device: Any = None  # with output="jax": a jax.Device, or None (JAX's default device)
    device_augment: Callable[[Any, Any], Any] | None = None  # echo_at="device": (batch, generator) on the device

    @property
    def map_style(self) -> bool:
        return is_map_style(self.dataset)

    @property
    def keeps_workers(self) -> bool:
        """Worker processes (reading, or augmenting) kept from one epoch to the next."""
        augmenting = self.augment is not None and self.augment_workers == "process"
        return self.persistent_workers and (self.worker_type == "process" or augmenting)

    @property
    def in_order(self) -> bool:
        """Batches hold the examples in reading order: the buffers draw first in,
        first out (see :func:`_reads_in_order`)."""
        return _reads_in_order(self.shuffle, self.echo, self.dataset, self.worker_type)

    @property
    def exact_echo(self) -> bool:
        """Echo counts by position (exactly floor(n * e) deliveries of n examples):
        deterministic order needs them, and so do equal batch counts on every rank."""
        return (self.deterministic or self.shard.world_size > 1) and not self.echo.auto

    @property
    def exact_checkpoint(self) -> bool:
        """A state taken mid-epoch names every example: a source read in a
        deterministic order (an iterable's examples are named by their position
        in the iteration, and read again up to there on resume)."""
        return self.deterministic and (self.map_style or self.worker_type == "thread")

    @property
    def augment_takes_rng(self) -> bool:
        """``augment`` accepts an ``rng`` keyword: it is given a generator per delivery."""
        return self.augment is not None and _checks.accepts_keyword(self.augment, "rng")

    def with_shard(self, shard: Shard) -> LoaderConfig:
        """This configuration on another part of a data-parallel job (found as
        an epoch starts, where ``rank``/``world_size`` were not given): several
        ranks share one seed (0 where none was given), as at construction."""
        seed = 0 if shard.world_size > 1 and not self.seed_given else self.seed
        return dataclasses.replace(self, shard=shard, seed=seed)

    def with_seed(self, seed: Any) -> LoaderConfig:
        """This configuration with a loaded state's ``seed`` in place of a drawn one.

        Raises:
            TypeError, ValueError: not a seed (named as the state's key).
        """
        return dataclasses.replace(self, seed=_checks.seed(seed, "state['config']['seed']"))

    @property
    def replayable(self) -> bool:
        """Where an epoch stands after any number of batches follows from the
        seed, the epoch, the rank and the world size alone, without its
        examples: a map-style source in dataecho's own order (no sampler),
        read deterministically, with an ``augment`` keyed by delivery if any
        (dataecho.pipeline.progress.replay)."""
        return (self.exact_checkpoint and self.map_style and self.sampler is None and self.batch_sampler is None
                and (self.augment is None or self.augment_takes_rng))

    def fingerprint(self) -> dict[str, Any]:
        """What decides the sequence of batches, besides the source's contents:
        a checkpoint resumes only a loader with the same values."""
        return {
            "seed": self.seed,
            "rank": self.shard.rank,
            "world_size": self.shard.world_size,
            "length": len(self.dataset) if self.map_style else None,
            "sampler": None if self.sampler is None else type(self.sampler).__name__,
            "batch_sampler": None if self.batch_sampler is None else type(self.batch_sampler).__name__,
            "batch_size": self.batch_size if self.batched else None,
            "echo_factor": self.echo.setting,
            "echo_at": self.echo.at,
            "shuffle_buffer": self.shuffle_buffer,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "deterministic": self.deterministic,
            "max_echo": self.echo.max_echo,
            "augment": "none" if self.augment is None else "rng" if self.augment_takes_rng else "own randomness",
            "device_augment": None if self.device_augment is None else "given",  # None: as states without it
        }


def loader_config(*, dataset: Any, batch_size: Any, shuffle: Any, sampler: Any, batch_sampler: Any,
                  num_workers: Any, collate_fn: Any, pin_memory: Any, drop_last: Any, timeout: Any,
                  worker_init_fn: Any, multiprocessing_context: Any, generator: Any, prefetch_factor: Any,
                  persistent_workers: Any, pin_memory_device: Any, echo_factor: Any, echo_at: Any, max_echo: Any,
                  echo_gap: Any, transform: Any, augment: Any, augment_workers: Any, shuffle_buffer: Any, seed: Any,
                  deterministic: Any, worker_type: Any, output: Any, device: Any, rank: Any, world_size: Any,
                  ragged: Any, ragged_bytes: Any, padding: Any, jax_device: Any, device_augment: Any) -> LoaderConfig:
    """Validates ``EchoLoader``'s arguments, as given (see its docstring).

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: a ``device`` or ``jax_device`` that is not available here.
        ImportError: ``output="jax"`` without jax installed.
    """
    workers = dataloader.num_workers(num_workers)
    worker_type, start_method = dataloader.worker_kind(worker_type, multiprocessing_context, workers)
    start_method = start_method or (default_start_method() if "process" in (worker_type, augment_workers) else None)
    dataset = _check_dataset(dataset, worker_type)
    batch_sampler = check_batch_sampler(batch_sampler, batch_size, shuffle, sampler, drop_last, dataset)
    batch_size, batched = _check_batch_size(batch_size, drop_last)
    asked = None if deterministic is None else _checks.flag("deterministic", deterministic)
    shard = resolve_shard(rank, world_size)
    seed, seed_given = _check_seed(seed, generator, shard)
    echo = _check_echo(Echo.of(echo_factor, default_echo_at(echo_at, batch_sampler), max_echo, echo_gap),
                       asked is True)
    # A batch sampler decides the order (shuffle False, as in DataLoader).
    sampler, shuffle = _check_sampler(sampler, False if batch_sampler is not None else shuffle, dataset)
    # shuffle=False at echo 1: batches in reading order, which deterministic intake gives.
    in_order = _reads_in_order(shuffle, echo, dataset, worker_type)
    deterministic = in_order or _deterministic(asked, echo, dataset, worker_type, shuffle_buffer, batch_size)
    augment = dataloader.check_callable("augment", augment)
    new_buffer = _check_shuffle_buffer(shuffle_buffer, batch_size, echo, augment is not None, deterministic, in_order)
    persistent_workers = _check_persistent(persistent_workers, workers)
    # num_workers not given: threads start with one reader (see dataecho.workers.thread_readers); processes, 2.
    auto_workers = workers is None and worker_type == "thread"
    output, device, jax_device = check_output(output, device, jax_device, pin_memory, collate_fn)
    config = LoaderConfig(
        dataset=dataset, batch_size=batch_size, batched=batched, shuffle=shuffle, sampler=sampler,
        collate_fn=dataloader.check_callable("collate_fn", collate_fn),
        pin_memory=dataloader.pin_memory(pin_memory, pin_memory_device),
        drop_last=_checks.flag("drop_last", drop_last), timeout=dataloader.timeout(timeout),
        worker_init_fn=dataloader.check_callable("worker_init_fn", worker_init_fn),
        persistent_workers=persistent_workers, echo=echo,
        transform=dataloader.check_callable("transform", transform), augment=augment,
        augment_workers=_check_augment_workers(augment_workers, worker_type),
        shuffle_buffer=new_buffer, shuffle_buffer_given=shuffle_buffer is not None, seed=seed, seed_given=seed_given,
        deterministic=deterministic,
        deterministic_given=asked is True, worker_type=worker_type,
        workers=1 if auto_workers else _check_workers(workers, worker_type), auto_workers=auto_workers,
        prefetch=dataloader.prefetch(prefetch_factor, workers), prefetch_factor=prefetch_factor,
        start_method=start_method, output=output, device=device, shard=shard, shard_given=rank is not None,
        ragged=_check_ragged(ragged),
        ragged_bytes=None if ragged_bytes is None else _checks.positive_int("ragged_bytes", ragged_bytes),
        padding=_check_padding(padding), batch_sampler=batch_sampler, jax_device=jax_device,
    )
    check_with_batch_sampler(config, echo_at)
    if worker_type == "process" or (augment is not None and config.augment_workers == "process"):
        check_processes(config)
    dataloader.warn_many_workers(workers, worker_type)
    return check_device_echo(config, device_augment)  # echo_at="device": what goes with it


def _check_seed(seed: Any, generator: Any, shard: Shard) -> tuple[int, bool]:
    """(seed, given): the seed, or one drawn from ``generator``; with neither,
    0 with several ranks, which must agree on the epoch's permutation (torch's
    default generator may differ per process), else one drawn from torch's
    default generator or at random."""
    given = seed is not None
    if seed is None and generator is None and shard.world_size > 1:
        return 0, given
    return _checks.seed(dataloader.seed(generator, seed)), given


def _check_persistent(value: Any, workers: int | None) -> bool:
    if _checks.flag("persistent_workers", value) and workers == 0:
        raise ValueError("persistent_workers: needs num_workers > 0 (workers to keep), as in DataLoader")
    return bool(value)


def _check_augment_workers(value: Any, worker_type: str) -> str:
    """Where ``augment`` runs: by default where reading does."""
    return worker_type if value is None else _checks.choice("augment_workers", value, ("thread", "process"))


def _check_batch_size(batch_size: Any, drop_last: Any) -> tuple[int, bool]:
    """(batch size, batched): ``batch_size=None`` yields examples one by one (batches of one inside)."""
    if batch_size is not None:
        return _checks.positive_int("batch_size", batch_size), True
    if drop_last:
        raise ValueError("drop_last: batch_size=None disables automatic batching, so drop_last=True has no batch "
                         "to drop (as in DataLoader)")
    return 1, False


def _deterministic(asked: bool | None, echo: Echo, dataset: Any, worker_type: str, shuffle_buffer: Any,
                   batch_size: int) -> bool:
    """``deterministic``: as given, or by default wherever it can be: the
    batches then depend on the seed alone, whatever the workers' timing (as a
    DataLoader given a seeded generator), and a state can be taken mid-epoch.
    Not with ``echo_factor="auto"`` (timing decides by design), worker processes
    over an iterable (each reads its own shard), a Ray dataset (whose row order
    may change between reads), or a shuffle buffer too small for the reorder
    window (2 batches)."""
    if asked is not None:
        return asked
    too_small = (echo.per_example and isinstance(shuffle_buffer, int)  # batches resident with echo_at="batch"
                 and shuffle_buffer < 2 * batch_size)
    iterable_ok = worker_type == "thread" and in_fixed_order(dataset)
    return not echo.auto and not too_small and (is_map_style(dataset) or iterable_ok)


def _reads_in_order(shuffle: bool, echo: Echo, dataset: Any, worker_type: str) -> bool:
    """``shuffle=False`` at echo 1 yields the reading order exactly, where there is
    one: a map-style source, or an iterable read by one thread (worker processes
    each iterate their own shard)."""
    return not shuffle and echo.once and (is_map_style(dataset) or worker_type == "thread")


def _check_dataset(dataset: Any, worker_type: str) -> Any:
    if dataset is None:
        raise TypeError("dataset: expected a dataset or an iterable, got None")
    if is_ray_data(dataset):
        if worker_type == "process":
            raise ValueError(
                "worker_type: a Ray dataset is read in this process (Ray runs its preprocessing); "
                "use worker_type='thread'"
            )
        dataset = RayRows(dataset)
    if not (is_map_style(dataset) or isinstance(dataset, Iterable)):
        raise TypeError(
            f"dataset: expected an iterable or a map-style dataset (__len__ and __getitem__), "
            f"got {type(dataset).__name__}"
        )
    return dataset


def _check_shuffle_buffer(value: Any, batch_size: int, echo: Echo, augment: bool, deterministic: bool,
                          in_order: bool) -> int:
    given = value is not None
    if given:
        value = _checks.positive_int("shuffle_buffer", value, _core.MAX_CAPACITY)
    elif echo.per_example:
        # Room for two batches, so that a batch larger than the default is not refused.
        value = min(max(DEFAULT_EXAMPLES, 2 * batch_size), _core.MAX_CAPACITY)
    else:
        value = DEFAULT_BATCHES
    if echo.per_example and value < batch_size:
        raise ValueError(f"shuffle_buffer: {value} examples cannot hold a batch of {batch_size}")
    if echo.per_example and (in_order or (deterministic and not given)):
        # Room for the reorder window (below); in order nothing is mixed, so its size is free.
        value = min(max(value, 2 * batch_size), _core.MAX_CAPACITY)
    if echo.per_example and (deterministic or in_order) and value < 2 * batch_size:
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
    held = 4 if augment else 1 if echo.per_example else 2
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


def _check_echo(echo: Echo, deterministic: bool) -> Echo:
    if echo.auto and deterministic:
        raise ValueError("echo_factor: 'auto' adapts to timing, so its batches cannot be fixed in advance as "
                         "deterministic=True needs; give a number")
    return echo


def _check_workers(workers: int | None, worker_type: str) -> int:
    if workers is None:
        return dataloader.DEFAULT_WORKERS
    if workers > 1024:
        raise ValueError(f"num_workers: expected at most 1024, got {workers}")
    if workers == 0 and worker_type == "process":
        raise ValueError("num_workers: 0 reads in the calling thread; worker processes need num_workers >= 1")
    return workers


def _check_sampler(sampler: Any, shuffle: Any, dataset: Any) -> tuple[Any, bool]:
    """(sampler, shuffle): ``shuffle`` defaults to True, or False with a sampler,
    which decides the order itself (as in DataLoader, the two exclude each other)."""
    if sampler is None:
        return None, True if shuffle is None else _checks.flag("shuffle", shuffle)
    if shuffle:
        raise ValueError("sampler: decides the order itself, so shuffle=True cannot be given with it "
                         "(as in DataLoader)")
    if not is_map_style(dataset):
        raise ValueError("sampler: needs a map-style dataset (__len__ and __getitem__), as in DataLoader")
    if not isinstance(sampler, Iterable):
        raise TypeError(f"sampler: expected a torch Sampler or an iterable of indices, got {type(sampler).__name__}")
    return sampler, False
