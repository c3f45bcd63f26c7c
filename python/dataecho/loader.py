"""``EchoLoader``: data echoing for a training loop, in the three placements of
Choi et al. (2019), with fractional and adaptive echo factors.

The arguments are validated once into a :class:`dataecho.config.loader_config.LoaderConfig`;
each ``iter(loader)`` starts an :class:`dataecho.pipeline.epoch.Epoch`, whose chain of
stages (:mod:`dataecho.pipeline.chain`) is::

    source -> [producers: read, transform] -> echo buffer (native)
           -> [batch echoing]                   (echo_at="batch")
           -> [augment threads] -> output buffer (augment given)
           -> batches as NumPy arrays or torch tensors, on `device`
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

from . import _core
from .config.loader_config import LoaderConfig, loader_config
from .examples.structure import Structure
from .pipeline.chain import stage_names
from .pipeline.checkpoint import FORMAT, check_state
from .pipeline.epoch import Epoch
from .pipeline.numbering import EpochNumbers
from .pipeline.stats import Totals
from .reading.order import LoaderSampler, batches_per_epoch, epoch_order
from .workers.pool import WorkerPool
from .workers.processes import PROCESS_GRACE_S

__all__ = ["EchoLoader"]


# DataLoader's attributes that tools read (Lightning, Accelerate), by their names.
_DATALOADER_NAMES: dict[str, Callable[[Any], Any]] = {
    "dataset": lambda loader: loader.config.source,
    "num_workers": lambda loader: loader.config.workers,
    "sampler": lambda loader: loader.config.sampler or LoaderSampler(loader),
    "batch_sampler": lambda loader: None,
    "prefetch_factor": lambda loader: None,
}


class EchoLoader:
    """Batches from a dataset or iterable, with data echoing.

    Echoing repeats data already in the pipeline so that a training step that is
    faster than the input pipeline trains on reshuffled repeats instead of
    waiting. Where to echo (Choi et al., 2019):

    * after augmentation: put augmentation in ``transform``;
    * before augmentation (nearly as good as fresh data in the paper): put
      reading and decoding in ``transform``, augmentation in ``augment``, which
      runs anew on every repeat;
    * batch echoing: ``echo_at="batch"`` repeats whole batches.

    Args:
        source: (DataLoader's ``dataset``) an iterable of examples, a map-style
            dataset (``__len__`` and ``__getitem__``; a torch ``Dataset``), or a Ray
            Data ``Dataset``/``DataIterator`` (see dataecho.reading.ray). An example
            is an array, a number, a torch CPU tensor, or a dict/tuple/list of them.
        batch_size: examples per batch.
        echo_factor: mean deliveries per example (or per batch), a number >= 1
            (fractional factors repeat ``floor(e)`` or ``floor(e) + 1`` times);
            or ``"auto"``: repeat only while the consumer would otherwise wait,
            up to about ``max_echo`` times.
        echo_at: ``"example"`` or ``"batch"``.
        transform: per-example function run by the producers, before the echo
            stage (read, decode, ...).
        augment: per-example function run after the echo stage, by worker
            threads: every repeat is augmented anew; it may change the example.
            One that accepts ``rng`` is called as ``augment(example, rng=...)``
            with a ``numpy.random.Generator`` keyed by (seed, epoch, rank,
            delivery): its batches are then a function of the seed, resumable.
        shuffle_buffer: examples resident in the echo buffer (default 4096); with
            ``echo_at="batch"``, batches resident in the batch buffer (default 16).
        workers: (DataLoader's ``num_workers``) producer threads or processes (and
            augment threads). Not given: one reading thread, more while reads wait
            (dataecho.workers.threads), 2 processes. 0 reads in the calling thread.
        shuffle: map-style sources: a new random order every epoch (default
            True, False with a ``sampler``). With False the reading order is the
            dataset's (or the sampler's), which batches follow exactly at
            ``echo_factor=1``; with more, the echo buffer spreads repeats apart.
        seed: seeds the order, the shuffle, the echo draws and ``augment``'s
            generators; None draws one.
        drop_last: drop the last batch of an epoch if it is short.
        prefetch: batches assembled ahead of the consumer (default 2; or
            DataLoader's ``prefetch_factor`` times ``workers``).
        max_echo: cap on deliveries per example (batch) when echo_factor="auto".
        output: ``"numpy"`` or ``"torch"`` (tensors that share the batch memory;
            a leaf of a dtype NumPy lacks, ``bfloat16``, is a tensor with either).
        pin_memory: batch memory is page-locked, allocated once; without CUDA
            a warning, and unpinned memory (as DataLoader).
        device: a torch device; each batch is copied there on a side stream,
            one batch ahead, so the copy overlaps the training step.
        worker_type: ``"thread"`` or ``"process"``: producer processes for a
            CPU-bound Python ``source``/``transform``, writing examples straight
            into the echo buffer in shared memory. ``source`` and ``transform``
            must pickle; every worker iterates an iterable source, reading its
            shard by ``dataecho.get_worker_info()`` or torch's, as under
            DataLoader. Started per epoch, or once (``persistent_workers=True``).
        start_method: for processes: ``"forkserver"`` (default where available)
            or ``"spawn"``; ``"fork"`` is refused (unsafe with native threads).
        deterministic: the batches are a function of (seed, epoch, rank,
            world_size) alone, whatever the workers and their timing: examples
            enter the echo buffer in reading order (a reorder window of
            ``batch_size``), fractional echo counts follow their position. Not
            with ``echo_factor="auto"``; ``augment`` without ``rng`` stays random.
        ragged, ragged_bytes, padding: leaves whose first axis varies in length
            (declared by path, ``["input_ids", "meta/boxes"]``, or inferred from
            the first examples and Hugging Face sequence features) come as a
            :class:`dataecho.Ragged`, or a jagged nested tensor with torch, whose
            values take at most ``ragged_bytes`` in the echo buffer; with
            ``padding`` (``"longest"`` or a length) as :class:`dataecho.Padded`.
            Leaves that are not arrays (a ``str``, ``None``) come as lists.
        rank, world_size: this process's part of a data-parallel job (default:
            from ``torch.distributed``). Each rank reads a disjoint shard of a
            map-style dataset, of equal size (as ``DistributedSampler``), and
            yields as many batches; shuffling and echoing are local to the rank.
            The ``seed`` must be the same on every rank (None means 0 then).

    DataLoader's other keywords (``sampler``, ``collate_fn``, ...) keep their
    meaning (see dataecho.config.dataloader). The arguments can be read back as
    attributes (``loader.batch_size``; all as ``loader.config``), under
    DataLoader's names too: ``dataset``, ``num_workers``, ``sampler`` (the given
    one, or a view of the loader's order whose ``set_epoch`` reaches the loader).

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: a CUDA ``device`` without CUDA.
    """

    def __init__(
        self,
        source: Any = None,
        batch_size: int = 256,
        echo_factor: float | str = 2.0,
        echo_at: str = "example",
        transform: Callable[[Any], Any] | None = None,
        augment: Callable[..., Any] | None = None,
        shuffle_buffer: int | None = None,
        workers: int | None = None,
        shuffle: bool | None = None,
        seed: int | None = None,
        drop_last: bool = False,
        prefetch: int | None = None,
        max_echo: float = 4.0,
        output: str = "numpy",
        pin_memory: bool = False,
        device: Any = None,
        worker_type: str | None = None,
        start_method: str | None = None,
        deterministic: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        *,
        ragged: Any = None,
        ragged_bytes: int | None = None,
        padding: int | str | None = None,
        dataset: Any = None,
        num_workers: int | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        collate_fn: Callable[[list], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        prefetch_factor: int | None = None,
        generator: Any = None,
        timeout: float = 0,
        multiprocessing_context: Any = None,
        pin_memory_device: str = "",
        persistent_workers: bool = False,
    ) -> None:
        arguments = dict(locals())
        del arguments["self"]
        self.config: LoaderConfig = loader_config(**arguments)
        self._structure: Structure | None = None
        self._numbers = EpochNumbers()
        self._resume: dict[str, Any] | None = None  # from load_state_dict, for the next epoch
        # Weakly: an epoch nobody iterates any more is collected, and stops.
        self._current_ref: Callable[[], Epoch | None] = lambda: None
        self._totals = Totals()
        self._starting = threading.Lock()
        self._pool = WorkerPool() if self.config.persistent_workers and self.config.worker_type == "process" else None
        self._memory = _core.BlockCache()  # the echo buffer's memory, from one epoch to the next

    def __getattr__(self, name: str) -> Any:
        # The validated arguments, read as attributes (as torch's DataLoader keeps
        # its own), under DataLoader's names too.
        config = self.__dict__.get("config")
        if config is not None and name in _DATALOADER_NAMES:
            return _DATALOADER_NAMES[name](self)
        if config is not None and name in LoaderConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- iteration ----

    def __iter__(self) -> Epoch:
        """Starts an epoch (map-style sources: a new order from seed and epoch). An
        epoch still running ends: its iterator raises a RuntimeError if used again."""
        with self._starting:  # two threads starting epochs at once: one after the other
            current = self._current
            if current is not None:
                current.supersede()  # if it yielded nothing, it gives back its number and resume state
            resume, self._resume = self._resume, None
            epoch = Epoch(self.config, self._numbers.next, self._structure, resume["stages"] if resume else None,
                          functools.partial(_ended, self, resume), owner=self, pool=self._pool,
                          memory=self._memory)
            self._structure = self._structure or epoch.structure
            self._current_ref = weakref.ref(epoch)
            self._numbers.started()
            return epoch

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch the next ``iter(loader)`` runs, and every later one until
        set again (see dataecho.pipeline.numbering.EpochNumbers); a ``sampler`` with
        ``set_epoch`` is given the number too."""
        number = self._numbers.set(epoch)
        set_sampler_epoch = getattr(self.config.sampler, "set_epoch", None)
        if callable(set_sampler_epoch):
            set_sampler_epoch(number)

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
        consumer's thread. Exact for map-style sources with ``deterministic=True``
        (and an ``augment`` that takes ``rng``); see dataecho.pipeline.checkpoint.

        Raises:
            ValueError: a loader whose position cannot be saved mid-epoch (the
                message says why).
        """
        if self._resume is not None:
            return dict(self._resume)  # loaded, not started yet
        state = {"format": FORMAT, "epoch": self._numbers.next, "config": self.config.fingerprint(), "stages": None}
        current = self._current
        if current is not None:
            state["epoch"] = current.epoch
            state["stages"] = current.state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state_dict()``'s result at the next ``iter(loader)``;
        the current epoch, if any, is stopped.

        Raises:
            TypeError, ValueError: a state that is not one, or was saved by a
                loader with other arguments that decide the batches (named).
        """
        config = self.config
        checked = check_state(state, config.fingerprint(), stage_names(config),
                              lambda epoch: epoch_order(config, epoch) if config.map_style else None)
        self.close()
        self._numbers.next = checked["epoch"]
        self._resume = checked

    def __len__(self) -> int:
        """Batches per epoch on this rank (see dataecho.reading.order.batches_per_epoch)."""
        return batches_per_epoch(self.config)

    def close(self) -> None:
        """Stops the current epoch and every worker; iterating again starts a new epoch."""
        current = self._current
        if current is not None:
            current.close()
        _release(self.__dict__)

    def stats(self, flat: bool = False, prefix: str = "dataecho/") -> dict[str, Any]:
        """Counters over every epoch and the current one; ``flat=True`` for a metrics logger (dataecho.pipeline.stats)."""
        return self._totals.stats(self._current, self._numbers.last, flat, prefix)

    def __enter__(self) -> EchoLoader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if "_current_ref" in self.__dict__:
            self.close()


def _release(kept: dict[str, Any]) -> None:
    """Frees what a loader keeps between epochs (given its ``__dict__``, which a
    half-built loader may lack): persistent workers, echo-buffer memory."""
    if kept.get("_pool") is not None:
        kept["_pool"].close(PROCESS_GRACE_S)
    if kept.get("_memory") is not None:
        kept["_memory"].clear()


def _ended(loader: EchoLoader, resume: dict[str, Any] | None, counters: dict[str, Any], workers: list) -> None:
    """An epoch of ``loader`` ended; ``resume``: the checkpoint it started from, if any."""
    loader._totals.add(counters, workers)
    if counters["batches"] == 0 and counters["state"] == "stopped":  # as if never started
        loader._numbers.give_back(counters["epoch"])
        if resume is not None and loader._resume is None:
            loader._resume = resume
