"""``EchoLoader``: data echoing for a training loop, in the three placements of
Choi et al. (2019), with fractional and adaptive echo factors.

The arguments are validated once into a :class:`dataecho.config.LoaderConfig`;
each ``iter(loader)`` starts an :class:`dataecho.epoch.Epoch`, whose chain of
stages (:mod:`dataecho.chain`) is::

    source -> [producers: read, transform] -> echo buffer (native)
           -> [batch echoing]                   (echo_at="batch")
           -> [augment threads] -> output buffer (augment given)
           -> batches as NumPy arrays or torch tensors, on `device`
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable

from .chain import stage_names
from .checkpoint import FORMAT, check_state
from .config import LoaderConfig, loader_config
from .epoch import Epoch
from .source import order_seed
from .stats import Totals
from .structure import Structure

__all__ = ["EchoLoader"]


def exact_deliveries(count: int, echo: float) -> int:
    """Deliveries of `count` items with exact echo counts: floor(e) each, and one
    more for floor(count * f) of them (f = e - floor(e))."""
    whole = math.floor(echo)
    return count * whole + math.floor(count * (echo - whole))


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
        source: an iterable of examples, or a map-style dataset (``__len__`` and
            ``__getitem__``, a torch ``Dataset`` included), or a Ray Data
            ``Dataset`` or ``DataIterator`` (read row by row; see
            dataecho.ray_source). An example is an array, a number, a torch CPU
            tensor, or a dict/tuple/list of them.
        batch_size: examples per batch.
        echo_factor: mean deliveries per example (or per batch), a number >= 1
            (fractional factors repeat ``floor(e)`` or ``floor(e) + 1`` times);
            or ``"auto"``: repeat only while the consumer would otherwise wait,
            up to about ``max_echo`` times.
        echo_at: ``"example"`` or ``"batch"``.
        transform: per-example function run by the producers, before the echo
            stage (read, decode, ...).
        augment: per-example function run after the echo stage, by worker
            threads: every repeat is augmented anew. It may change the
            example's structure, shapes or dtypes. If it accepts a keyword
            argument ``rng``, it is called as ``augment(example, rng=...)`` with
            a ``numpy.random.Generator`` derived from (seed, epoch, rank, the
            delivery's number in the epoch): draw its randomness from it, and
            with ``deterministic=True`` the augmented batches are a function of
            the seed alone, and resumable mid-epoch.
        shuffle_buffer: examples resident in the echo buffer (default 4096); with
            ``echo_at="batch"``, batches resident in the batch buffer (default 16).
        workers: producer threads or processes (and augment threads).
        shuffle: map-style sources: a new random order every epoch.
        seed: seeds the order, the shuffle, the echo draws and ``augment``'s
            generators; None draws one. With ``workers=1`` and a fixed factor, a
            seed gives a repeatable order.
        drop_last: drop the last batch of an epoch if it is short.
        prefetch: batches assembled ahead of the consumer.
        max_echo: cap on deliveries per example (batch) when echo_factor="auto".
        output: ``"numpy"`` or ``"torch"`` (tensors that share the batch memory).
        pin_memory: batch memory is page-locked, allocated once (needs CUDA).
        device: a torch device; each batch is copied there on a side stream,
            one batch ahead, so the copy overlaps the training step.
        worker_type: ``"thread"`` or ``"process"``: producer processes for a
            CPU-bound Python ``source``/``transform`` (the GIL would serialize
            threads). They write examples straight into the echo buffer's slots in
            shared memory. ``source`` and ``transform`` must be picklable; an
            iterable source is iterated by every worker, which should read its own
            shard using ``dataecho.get_worker_info()`` (or, for a torch
            ``Dataset``, torch's ``get_worker_info()``, as under DataLoader).
            Started per epoch.
        start_method: for processes: ``"forkserver"`` (default where available)
            or ``"spawn"``; ``"fork"`` is refused, as forking a process that runs
            native threads is unsafe.
        deterministic: the batches are a function of (seed, epoch, rank,
            world_size) alone, whatever the number or kind of workers and their
            timing: examples enter the echo buffer in reading order (through a
            reorder window of ``batch_size``), and fractional echo counts follow
            the example's position. Not with ``echo_factor="auto"``. An
            ``augment`` without ``rng`` stays as random as it is.
        rank, world_size: this process's part of a data-parallel job; by default
            taken from ``torch.distributed`` when it is initialized. Each rank
            reads a disjoint shard of a map-style dataset, of equal size (padded
            by repeating indices, or cut with ``drop_last``, as torch's
            ``DistributedSampler`` does), and yields the same number of batches;
            shuffling and echoing are local to each rank, seeded differently.
            The ``seed`` must be the same on every rank (None means 0 then).

    The validated arguments can be read back as attributes (``loader.batch_size``,
    ``loader.source``, ...; all of them as ``loader.config``).

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
        RuntimeError: ``pin_memory`` or a CUDA ``device`` without CUDA.
    """

    def __init__(
        self,
        source: Any,
        batch_size: int = 256,
        echo_factor: float | str = 2.0,
        echo_at: str = "example",
        transform: Callable[[Any], Any] | None = None,
        augment: Callable[..., Any] | None = None,
        shuffle_buffer: int | None = None,
        workers: int = 2,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
        prefetch: int = 2,
        max_echo: float = 4.0,
        output: str = "numpy",
        pin_memory: bool = False,
        device: Any = None,
        worker_type: str = "thread",
        start_method: str | None = None,
        deterministic: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.config: LoaderConfig = loader_config(
            source, batch_size=batch_size, echo_factor=echo_factor, echo_at=echo_at, transform=transform,
            augment=augment, shuffle_buffer=shuffle_buffer, workers=workers, shuffle=shuffle, seed=seed,
            drop_last=drop_last, prefetch=prefetch, max_echo=max_echo, output=output, pin_memory=pin_memory,
            device=device, worker_type=worker_type, start_method=start_method, deterministic=deterministic,
            rank=rank, world_size=world_size,
        )
        self._structure: Structure | None = None
        self._epoch = 0
        self._resume: dict[str, Any] | None = None  # from load_state_dict, for the next epoch
        # Weakly: an epoch nobody iterates any more is collected, and stops.
        self._current_ref: Callable[[], Epoch | None] = lambda: None
        self._totals = Totals()
        self._starting = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # The validated arguments, read as attributes (as torch's DataLoader keeps its own).
        config = self.__dict__.get("config")
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
                current.supersede()
            resume, self._resume = self._resume, None
            epoch = Epoch(self.config, self._epoch, self._structure, resume["stages"] if resume else None,
                          self._totals.add, owner=self)
            self._structure = self._structure or epoch.structure
            self._current_ref = weakref.ref(epoch)
            self._epoch += 1
            return epoch

    @property
    def _current(self) -> Epoch | None:
        epoch = self._current_ref()
        return None if epoch is None or epoch.closed else epoch

    # ---- checkpoints ----

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, to resume from with ``load_state_dict`` (the
        convention of torchdata's ``StatefulDataLoader``); see dataecho.checkpoint
        for what it holds. Take it between batches, in the consumer's thread.

        Map-style sources: exact resume needs ``deterministic=True`` (and an
        ``augment`` that takes ``rng``); then the resumed loader yields exactly
        the batches this one would have yielded next. Iterable sources: a
        skip-ahead count (resident examples are not restored).

        Raises:
            ValueError: a loader whose position cannot be saved mid-epoch (the
                message says why).
        """
        if self._resume is not None:
            return dict(self._resume)  # loaded, not started yet
        state = {"format": FORMAT, "epoch": self._epoch, "config": self.config.fingerprint(), "stages": None}
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

        def order_of(epoch: int) -> Any:
            if not config.map_style:
                return None
            return config.shard.order(len(config.source), config.shuffle, order_seed(config.seed, epoch),
                                      config.drop_last)

        checked = check_state(state, config.fingerprint(), stage_names(config), order_of)
        self.close()
        self._epoch = checked["epoch"]
        self._resume = checked

    def __len__(self) -> int:
        """Batches per epoch (on this rank), for a map-style source and a fixed
        echo factor: integer, or fractional with ``deterministic=True`` or several
        ranks (whose echo counts are exact)."""
        config = self.config
        if not config.map_style:
            raise TypeError("len(): the source is an iterable of unknown length")
        fixed = config.echo_factor != "auto" and (float(config.echo_factor).is_integer() or config.exact_echo)
        if not fixed:
            raise TypeError("len(): the number of batches is random with a fractional or 'auto' echo factor")
        rounding = math.floor if config.drop_last else math.ceil
        examples = config.shard.per_rank(len(config.source), config.drop_last)
        if config.echo_at == "batch":
            return exact_deliveries(rounding(examples / config.batch_size), float(config.echo_factor))
        return rounding(exact_deliveries(examples, float(config.echo_factor)) / config.batch_size)

    def close(self) -> None:
        """Stops the current epoch's threads; iterating again starts a new epoch."""
        current = self._current
        if current is not None:
            current.close()

    def stats(self) -> dict[str, Any]:
        """Counters over every epoch so far.

        Returns:
            fresh: examples read from the source and put in the echo buffer;
            delivered: examples in the batches yielded (repeats counted);
            echo_factor_achieved: delivered / fresh;
            upstream_examples_per_s: fresh examples per second of iteration;
            consumer_wait_fraction: share of iteration time spent waiting in next();
            batches, epoch;
            workers: for the current (or last) epoch, per producer thread or
            process: examples produced and seconds busy reading and transforming
            (and a worker process's ``pid``).
        """
        return self._totals.stats(self._current, max(0, self._epoch - 1))

    def __enter__(self) -> EchoLoader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if "_current_ref" in self.__dict__:
            self.close()
