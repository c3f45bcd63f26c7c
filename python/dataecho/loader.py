"""``EchoLoader``: data echoing for a training loop, in the three placements of Choi et al. (2019), with
fractional and adaptive echo factors, and torch ``DataLoader``'s signature.

The arguments are validated once into a :class:`dataecho.config.loader_config.LoaderConfig`, which the planner
turns into per-stage specs (:mod:`dataecho.pipeline.plan`, where the chain of stages is drawn); each
``iter(loader)`` starts a :class:`dataecho.pipeline.epoch.Epoch`, which runs that chain: readers fill the echo
buffer (the intake), batch echo, augment, echo on the device, the ranks' lockstep, and the delivery to a device;
the loop gets NumPy, torch or JAX arrays (dataecho.examples.outputs). With a ``batch_sampler`` the intake reads its
batches whole, in its order (no echo buffer), and echo repeats them whole (batch echoing).
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from typing import Any, Callable

from . import _core
from .config.loader_config import LoaderConfig, loader_config
from .examples.described import describe, described
from .examples.structure import Structure
from .pipeline.epoch import Epoch, release
from .pipeline.plan import Planner
from .pipeline.progress.job import Job
from .pipeline.progress.numbering import EpochNumbers
from .pipeline.progress.position import Envelope, LoaderPosition, envelope_of
from .pipeline.progress.replay import replayed_stages
from .pipeline.progress.resume import resumed
from .pipeline.progress.stats import Totals
from .reading.order import LoaderSampler
from .workers.pool import PROCESS_GRACE_S, WorkerPool

__all__ = ["EchoLoader"]


# The arguments, read back as attributes (as torch's DataLoader keeps its own),
# by the names they were given under.
_ATTRIBUTES: dict[str, Callable[[LoaderConfig], Any]] = {
    "num_workers": lambda c: None if c.auto_workers else c.workers,
    "batch_sampler": lambda c: c.batch_sampler,
    "timeout": lambda c: c.timeout or 0,
    "batch_size": lambda c: c.batch_size if c.batched and c.batch_sampler is None else None,
    "multiprocessing_context": lambda c: c.start_method,
    "echo_factor": lambda c: c.echo.setting,
    "echo_at": lambda c: c.echo.at,
    "max_echo": lambda c: c.echo.max_echo,
    "echo_gap": lambda c: c.echo.gap,
    "rank": lambda c: c.shard.rank,
    "world_size": lambda c: c.shard.world_size,
    **{name: (lambda c, name=name: getattr(c, name)) for name in (
        "dataset", "shuffle", "collate_fn", "pin_memory", "drop_last", "worker_init_fn",
        "prefetch_factor", "persistent_workers", "transform", "augment", "augment_workers", "shuffle_buffer", "seed",
        "deterministic", "worker_type", "output", "device", "jax_device", "ragged", "ragged_bytes", "padding",
        "device_augment")},
}


class EchoLoader:
    """Batches from a dataset or iterable, with data echoing (placements: see
    the module docstring). The positional parameters are torch
    ``DataLoader``'s, in its order and with its meaning; the rest are
    keyword-only. They read back as attributes, and cannot be set later.

    Args:
        dataset: an iterable of examples, a map-style dataset (a torch
            ``Dataset``; an ``IterableDataset`` is iterable whatever else it
            defines), or a Ray Data ``Dataset``/``DataIterator``. An example is an
            array, a number, a tensor, an object, or a dict/tuple/list of them.
        batch_size: examples per batch (1); None yields each example alone, as
            the dataset returned it (its arrays converted as ``output`` says).
        shuffle: map-style datasets: a new random order every epoch (default
            True, False with a ``sampler``). With False, batches follow the
            reading order exactly at ``echo_factor=1``.
        num_workers: producer threads or processes (and augment threads). Not
            given: one reading thread, more while reads wait; 2 processes. 0
            reads in the calling thread. No user code runs in ``iter()``: the
            workers read the first examples, which tell the structure.
        sampler, collate_fn, pin_memory, drop_last, timeout,
        worker_init_fn, multiprocessing_context, generator, prefetch_factor,
        persistent_workers, pin_memory_device: as in DataLoader;
            ``collate_fn`` gets the examples as the dataset returned them; its result is yielded as is.
        batch_sampler: as in DataLoader; its batches exactly, in its order,
            echoed whole; threads or ``num_workers=0``, no ``augment``.
        echo_factor: mean deliveries per example (or batch), a number >= 1
            (fractional: ``floor(e)`` or ``floor(e) + 1`` each), or ``"auto"``:
            repeat only while the consumer would wait, the least-delivered first.
        echo_at, max_echo, echo_gap: ``"example"``, ``"batch"`` (with ``batch_sampler``), ``"device"`` (kept on
            ``device``); with "auto", the most deliveries per example, the fewest batches between two of one.
        transform: per-example function of the workers, before the echo stage.
        augment: per-example function after the echo stage, anew on every
            repeat; called as ``augment(example, rng=...)`` where it takes
            ``rng`` (a generator keyed by seed, epoch, rank and delivery).
        device_augment: ``echo_at="device"``: ``device_augment(batch, generator)`` per batch, on the device.
        augment_workers: ``"thread"`` or ``"process"`` (no user code in the
            training process then); default: as ``worker_type``.
        shuffle_buffer: examples in the echo buffer (4096, or two batches); batches with ``echo_at="batch"`` (16).
        seed: seeds everything random; None draws one (from ``generator``
            where given), which a loaded state replaces.
        deterministic: batches that depend on (seed, epoch, rank, world_size)
            alone, whatever the workers' timing, and exact mid-epoch states.
            Default: wherever it can be (not with ``"auto"``, worker processes
            over an iterable, a Ray dataset, or a buffer below two batches).
        worker_type: ``"thread"`` or ``"process"``.
        output: ``"numpy"``, ``"torch"`` (tensors over the batch memory) or ``"jax"``
            (JAX arrays, over the batch memory on a CPU: :func:`dataecho.to_jax` says when a copy is made).
        device: a torch device; batches are copied there one batch ahead (not with ``output="jax"``).
        jax_device: with ``output="jax"``: a ``jax.Device`` or a platform name
            (``"cpu"``: its first device); None: JAX's default device.
        rank, world_size: this process's part of a data-parallel job: an equal,
            disjoint shard per rank (default: what ``torch.distributed`` says as
            each epoch starts; with ``"auto"``, the ranks echo in lockstep).
        ragged, ragged_bytes, padding: leaves of varying length (declared by
            path, or inferred) as :class:`dataecho.Ragged` or, padded, :class:`dataecho.Padded`.

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: a CUDA ``device`` without CUDA, or a ``jax_device`` not here.
        ImportError: ``output="jax"`` without jax installed.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | None = None,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        echo_factor: float | str = 2.0,
        echo_at: str | None = None,
        max_echo: float = 4.0,
        echo_gap: int = 1,
        transform: Callable[[Any], Any] | None = None,
        augment: Callable[..., Any] | None = None,
        augment_workers: str | None = None,
        shuffle_buffer: int | None = None,
        seed: int | None = None,
        deterministic: bool | None = None,
        worker_type: str | None = None,
        output: str = "numpy",
        device: Any = None,
        jax_device: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        ragged: Any = None,
        ragged_bytes: int | None = None,
        padding: int | str | None = None,
        device_augment: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        self.config: LoaderConfig = loader_config(
            dataset=dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context, generator=generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
            echo_factor=echo_factor, echo_at=echo_at, max_echo=max_echo, echo_gap=echo_gap, transform=transform,
            augment=augment, augment_workers=augment_workers, shuffle_buffer=shuffle_buffer, seed=seed,
            deterministic=deterministic, worker_type=worker_type, output=output, device=device, rank=rank,
            world_size=world_size, ragged=ragged, ragged_bytes=ragged_bytes, padding=padding, jax_device=jax_device,
            device_augment=device_augment)
        self._planner = Planner(self.config)  # the plan of its epochs, on its part of the job
        self._structure: Structure | None = None
        self._numbers = EpochNumbers()
        self._position = LoaderPosition(self._planner.plan.source)  # checkpoints: a loaded state, where an epoch left
        self._current_ref: Callable[[], Epoch | None] = lambda: None  # weakly: an epoch not iterated is collected
        self._totals = Totals()
        self._starting = threading.Lock()
        self._job = Job()  # this loader's part of a data-parallel job
        self._pool = WorkerPool() if self.config.keeps_workers else None
        self._memory = _core.BlockCache()  # the echo buffer's memory, from one epoch to the next

    # EchoLoader[Tensor] in annotations, as DataLoader[Tensor].
    __class_getitem__ = classmethod(types.GenericAlias)

    def __setattr__(self, name: str, value: Any) -> None:
        # As DataLoader: the arguments are read once; setting one later would be silently ignored.
        if (name in _ATTRIBUTES or name == "sampler") and "config" in self.__dict__:
            raise ValueError(f"{name}: cannot be set after the EchoLoader is built (as in DataLoader); "
                             f"build a new loader with {name}={value!r}")
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and name == "sampler":
            order = self._planner.plan.source.order
            return config.sampler or LoaderSampler(order, lambda: self.next_epoch, self.set_epoch)
        if config is not None and name in _ATTRIBUTES:
            return _ATTRIBUTES[name](config)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- iteration ----

    def __iter__(self) -> Epoch:
        """Starts an epoch (map-style sources: a new order from seed and epoch). An
        epoch still running ends: its iterator raises a RuntimeError if used again."""
        with self._starting:  # two threads starting epochs at once: one after the other
            current = self._current
            if current is not None:
                current.supersede()  # if it yielded nothing, it gives back its number and resume state
            _follow_job(self)
            resume = self._position.begin()  # where an epoch left part-way is forgotten once another starts
            planned = self._planner.plan
            epoch = Epoch(planned, self._numbers.next, self._structure, resume["stages"] if resume else None,
                          functools.partial(_ended, self), owner=self, pool=self._pool,
                          memory=self._memory, on_structure=functools.partial(_learned, weakref.ref(self)),
                          group=self._job.group(planned))
            self._current_ref = weakref.ref(epoch)
            self._numbers.started()
            return epoch

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next ``iter(loader)`` runs, and every later one until
        set again (see dataecho.pipeline.progress.numbering.EpochNumbers); a ``sampler`` with
        ``set_epoch`` is given the number too, and so is a ``batch_sampler`` with one.
        Called after ``iter(loader)`` but before its first batch (as Lightning
        does), it applies to that epoch; after ``load_state_dict``, see
        dataecho.pipeline.progress.position."""
        number = self._numbers.set(epoch)
        for sampler in (self.config.sampler, self.config.batch_sampler):
            set_sampler_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_sampler_epoch):
                set_sampler_epoch(number)
        _renumber(self, number)

    @property
    def next_epoch(self) -> int:
        """The number of the epoch the next ``iter(loader)`` starts."""
        return self._numbers.next

    @property
    def _current(self) -> Epoch | None:
        epoch = self._current_ref()
        return None if epoch is None or epoch.closed else epoch

    # ---- checkpoints ----

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, to resume from with ``load_state_dict`` (as
        torchdata's ``StatefulDataLoader``), taken between batches in the
        consumer's thread; after a loop left with ``break``, where that epoch
        stood. Exact wherever the order is deterministic (the default; and an
        ``augment`` that takes ``rng``); see dataecho.pipeline.checkpoint.

        Raises:
            ValueError: a loader whose position cannot be saved mid-epoch (the
                message says why).
        """
        return self._position.state(_envelope(self), self._current, self._numbers.next,
                                    functools.partial(_length, self), self.config.shard.world_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state_dict()``'s result at the next ``iter(loader)``;
        the current epoch, if any, is stopped. Any rank's state, of a job of
        this or another world size, or the list of every rank's (where a
        rank's own is needed: dataecho.pipeline.progress.resume).

        Raises:
            TypeError, ValueError: a state that is not one, or was saved by a
                loader with other arguments that decide the batches (named).
        """
        planner, checked = resumed(self._job.follow(self._planner, starting=False), state)
        self.close()
        _use(self, planner)
        if checked["structure"] is not None:
            self._structure = described(checked["structure"], "state['structure']")
        self._numbers.next = checked["epoch"]
        self._position.load(checked, state)

    def __len__(self) -> int:
        """Batches per epoch on this rank (see dataecho.pipeline.plan), on the
        part of the job ``torch.distributed`` says now where none was given."""
        planner = self._job.follow(self._planner, starting=False)
        return self._position.epoch_length(planner, self._current is not None)

    def close(self) -> None:
        """Stops the current epoch and every worker; iterating again starts a new epoch."""
        current = self._current
        if current is not None:
            current.close()
        _release(self.__dict__)

    def stats(self, flat: bool = False, prefix: str = "dataecho/") -> dict[str, Any]:
        """Counters over every epoch and the current one; ``flat=True`` for a
        metrics logger (dataecho.pipeline.progress.stats)."""
        return self._totals.stats(self._current, self._numbers.last, flat, prefix)

    def __enter__(self) -> EchoLoader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # Not at interpreter exit (`_finalizing` bound early: this module's globals may be gone):
        # atexit stopped the buffers, and worker processes end with their owner.
        if "_current_ref" in self.__dict__ and not _finalizing():
            self.close()


def _release(kept: dict[str, Any]) -> None:
    """Frees what a loader keeps between epochs (given its ``__dict__``, which a
    half-built loader may lack): persistent workers, echo-buffer memory."""
    if kept.get("_pool") is not None:
        kept["_pool"].close(PROCESS_GRACE_S)
    if kept.get("_memory") is not None:
        release(kept["_memory"])


def _envelope(loader: EchoLoader) -> Envelope:
    """The envelope of ``loader``'s states (see dataecho.pipeline.checkpoint)."""
    return envelope_of(loader.config.fingerprint(), None if loader._structure is None else describe(loader._structure))


def _length(loader: EchoLoader, epoch: int, history: list) -> int | None:
    """Batches of ``epoch`` on this rank in all, or None where not known (an
    iterable's ``__len__`` gives len(loader), but may lie: it ends no epoch)."""
    if loader._planner.plan.source.order is None:
        return None
    try:
        return loader._position.length(loader._planner, epoch, history)
    except TypeError:
        return None


def _renumber(loader: EchoLoader, number: int) -> None:
    """``set_epoch(number)``: the epoch started, if it took no batch yet, runs
    epoch ``number`` instead; else a loaded state moves to it (dataecho.pipeline.progress.position)."""
    current, position = loader._current, loader._position
    if current is not None and current.taken == 0 and current.epoch != number:
        resume = position.rebegin(number, loader._planner)
        if current.renumber(number, resume["stages"] if resume else None):
            loader._numbers.started()
    else:
        position.set_epoch(number, loader._planner)


def _follow_job(loader: EchoLoader) -> None:
    """As an epoch starts: the loader on the part of the job ``torch.distributed``
    says now (its epochs planned again where that changed, and a state loaded
    for another part loaded again for this one)."""
    planner = loader._job.follow(loader._planner)
    if planner is not loader._planner:
        _use(loader, planner)
        if loader._position.pending is not None:
            planner, checked = resumed(planner, loader._position.raw)
            _use(loader, planner)
            loader._position.load(checked, loader._position.raw)


def _use(loader: EchoLoader, planner: Planner) -> None:
    """``loader`` runs as ``planner`` plans it from now on (another part of the job, or a state's seed)."""
    loader._planner = planner
    loader.config = planner.configuration


def _learned(loader_ref: Callable[[], EchoLoader | None], structure: Structure) -> None:
    """The first examples told the structure: later epochs start from it."""
    loader = loader_ref()
    if loader is not None and loader._structure is None:
        loader._structure = structure


def _ended(loader: EchoLoader, counters: dict[str, Any], workers: list, left: dict[str, Any] | None) -> None:
    """An epoch of ``loader`` ended; ``left``: where it stood if its consumer left it part-way."""
    loader._totals.add(counters, workers)
    planner = loader._planner
    loader._position.ended(_envelope(loader), counters["epoch"], planner.shard.world_size, counters["batches"],
                           counters["state"], left, functools.partial(_replayed, planner, counters["epoch"]),
                           planner.replayable)
    if counters["batches"] == 0 and counters["state"] == "stopped":  # as if never started
        loader._numbers.give_back(counters["epoch"])
        loader._position.give_back()


def _replayed(planner: Planner, epoch: int, history: list) -> dict[str, Any] | None:
    """Where an epoch that failed stood after its last batch (dataecho.pipeline.progress.replay).

    Raises:
        ValueError: where that cannot be worked out.
    """
    if not planner.replayable:
        raise ValueError(
            "state_dict: the epoch ended on an error after some batches, and where it stood then can be worked "
            "out only for a map-style dataset read in dataecho's own order (no sampler) with deterministic "
            "reading; resume from a state saved before the error")
    return replayed_stages(planner, epoch, history)[0]
