"""``EchoLoader``: data echoing for a training loop, in the three placements of
Choi et al. (2019), with fractional and adaptive echo factors.

Pipeline of one epoch::

    source -> [producer threads: read, transform] -> echo buffer (native)
           -> [batch echoing]                      (echo_at="batch")
           -> [augment threads] -> output buffer   (augment given)
           -> consumer: batches as NumPy arrays or torch tensors, on `device`
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import numpy as np

from . import _checks
from .augment import AugmentStage
from .batch_echo import BatchEcho
from .checkpoint import FORMAT, check_state
from .buffer import NativeBuffer, buffer_config
from . import _core
from .errors import BufferClosed
from .process_producers import ProcessProducers, check_picklable, default_start_method
from .distributed import resolve_shard
from .producers import Failure, Producers
from .ray_source import RayRows, is_ray_data
from .fields import parse_fields, to_field_array
from .structure import Structure

__all__ = ["EchoLoader"]

_MAX_ECHO = float(1 << 32)
_DEFAULT_EXAMPLES = 4096
_DEFAULT_BATCHES = 16
_JOIN_TIMEOUT_S = 5.0


def exact_deliveries(count: int, echo: float) -> int:
    """Deliveries of `count` items with exact echo counts: floor(e) each, and one
    more for floor(count * f) of them (f = e - floor(e))."""
    whole = math.floor(echo)
    return count * whole + math.floor(count * (echo - whole))


def _is_map_style(source: Any) -> bool:
    return hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(source, (str, bytes))


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
        transform: per-example function run by the producer threads, before the
            echo stage (read, decode, ...).
        augment: per-example function run after the echo stage, by worker
            threads: every repeat is augmented anew. It may change the
            example's structure, shapes or dtypes.
        shuffle_buffer: examples resident in the echo buffer (default 4096); with
            ``echo_at="batch"``, batches resident in the batch buffer (default 16).
        workers: producer threads (and augment threads).
        shuffle: map-style sources: a new random order every epoch.
        seed: seeds the order, the shuffle and the echo draws; None draws one.
            With ``workers=1`` and a fixed factor, a seed gives a repeatable order.
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
            shard using ``dataecho.get_worker_info()``. Started per epoch.
        start_method: for processes: ``"forkserver"`` (default where available)
            or ``"spawn"``; ``"fork"`` is refused, as forking a process that runs
            native threads is unsafe.
        deterministic: the batches are a function of (seed, epoch, rank,
            world_size) alone, whatever the number or kind of workers and their
            timing: examples enter the echo buffer in reading order (through a
            reorder window of ``batch_size``), and fractional echo counts follow
            the example's position. Not with ``echo_factor="auto"``. An
            ``augment`` with its own randomness stays as random as it is.
        rank, world_size: this process's part of a data-parallel job; by default
            taken from ``torch.distributed`` when it is initialized. Each rank
            reads a disjoint shard of a map-style dataset, of equal size (padded
            by repeating indices, or cut with ``drop_last``, as torch's
            ``DistributedSampler`` does), and yields the same number of batches;
            shuffling and echoing are local to each rank, seeded differently.
            The ``seed`` must be the same on every rank (None means 0 then).

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
        augment: Callable[[Any], Any] | None = None,
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
        if is_ray_data(source):
            if worker_type == "process":
                raise ValueError(
                    "worker_type: a Ray dataset is read in this process (Ray runs its preprocessing); "
                    "use worker_type='thread'"
                )
            source = RayRows(source)
        if not (_is_map_style(source) or isinstance(source, Iterable)):
            raise TypeError(
                f"source: expected an iterable or a map-style dataset (__len__ and __getitem__), "
                f"got {type(source).__name__}"
            )
        self.source = source
        self.batch_size = _checks.positive_int("batch_size", batch_size)
        if isinstance(echo_factor, str):
            if echo_factor != "auto":
                raise ValueError(f"echo_factor: expected a number >= 1 or 'auto', got {echo_factor!r}")
            self.echo_factor: float | str = "auto"
        else:
            self.echo_factor = _checks.real("echo_factor", echo_factor, 1.0, _MAX_ECHO)
        echo_at = _checks.choice("echo_at", echo_at, ("example", "batch"))
        self.echo_at = echo_at
        for name, fn in (("transform", transform), ("augment", augment)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name}: expected a callable or None, got {type(fn).__name__}")
        self.transform, self.augment = transform, augment
        default = _DEFAULT_BATCHES if echo_at == "batch" else _DEFAULT_EXAMPLES
        # An epoch's ShuffleBuffers hold at most 2**31 examples each: shuffle_buffer
        # examples (echo_at="example"), 2 batches (echo_at="batch"), 4 (after augment).
        self.shuffle_buffer = (
            default if shuffle_buffer is None else _checks.positive_int("shuffle_buffer", shuffle_buffer, 1 << 31)
        )
        if echo_at == "example" and self.shuffle_buffer < self.batch_size:
            raise ValueError(
                f"shuffle_buffer: {self.shuffle_buffer} examples cannot hold a batch of {self.batch_size}"
            )
        held = 4 if augment is not None else 2 if echo_at == "batch" else 1
        if self.batch_size * held > 1 << 31:
            raise ValueError(
                f"batch_size: expected at most {(1 << 31) // held} (a buffer of this epoch holds "
                f"{held} batches, at most 2**31 examples), got {self.batch_size}"
            )
        self.workers = _checks.positive_int("workers", workers, 1024)
        self.shuffle = _checks.flag("shuffle", shuffle)
        self.shard = resolve_shard(rank, world_size)
        # Ranks must agree on the epoch's permutation: a common seed.
        self.seed = _checks.seed(0 if seed is None and self.shard.world_size > 1 else seed)
        self.deterministic = _checks.flag("deterministic", deterministic)
        # Exact echo counts (see ShuffleBuffer's deterministic mode): equal
        # batch counts on every rank need them.
        self.exact_echo = self.deterministic or self.shard.world_size > 1
        if self.exact_echo and self.echo_factor == "auto":
            why = "deterministic=True" if self.deterministic else f"world_size={self.shard.world_size}"
            raise ValueError(
                f"echo_factor: 'auto' adapts to timing, so its batches (and their number per rank) "
                f"cannot be fixed in advance as {why} needs; give a number"
            )
        self.drop_last = _checks.flag("drop_last", drop_last)
        self.prefetch = _checks.positive_int("prefetch", prefetch, 1 << 16)
        self.max_echo = _checks.real("max_echo", max_echo, 1.0, _MAX_ECHO)
        self.output = _checks.choice("output", output, ("numpy", "torch"))
        self.pin_memory = _checks.flag("pin_memory", pin_memory)
        self.device = self._check_device(device)
        worker_type = _checks.choice("worker_type", worker_type, ("thread", "process"))
        self.worker_type = worker_type
        self.start_method = start_method
        if worker_type == "process":
            self.start_method = self._check_start_method(start_method)
            check_picklable("source", source)
            check_picklable("transform", transform)
            if self.deterministic and not _is_map_style(source):
                raise ValueError(
                    "deterministic: worker processes each read their own shard of an iterable, which "
                    "have no common order; use a map-style source, or worker_type='thread'"
                )
        self._structure: Structure | None = None
        self._epoch = 0
        self._resume: dict[str, Any] | None = None  # from load_state_dict, for the next epoch
        # Weakly: an epoch nobody iterates any more is collected, and stops.
        self._current_ref: Callable[[], _Epoch | None] = lambda: None
        self._totals = {"fresh": 0, "delivered": 0, "batches": 0, "wait_s": 0.0, "active_s": 0.0}
        self._worker_counters: list[dict[str, float]] = []

    def _check_device(self, device: Any) -> Any:
        if device is None and not self.pin_memory:
            return None
        from . import torch_support

        torch = torch_support._torch()
        if self.pin_memory and not torch.cuda.is_available():
            raise RuntimeError("pin_memory=True needs CUDA, and torch.cuda.is_available() is False")
        if device is None:
            return None
        try:
            device = torch.device(device)
        except (TypeError, ValueError, RuntimeError) as exc:  # ValueError: an index beyond int64
            raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device: {device} needs CUDA, and torch.cuda.is_available() is False")
        return device

    @staticmethod
    def _check_start_method(method: str | None) -> str:
        import multiprocessing

        if method is None:
            return default_start_method()
        if not isinstance(method, str):
            raise TypeError(f"start_method: expected None or a str, got {method!r}")
        if method == "fork":
            raise ValueError(
                "start_method: 'fork' is unsafe in a process that runs native threads (the buffer's "
                "assembler); use 'forkserver' or 'spawn'"
            )
        if method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method: expected one of {multiprocessing.get_all_start_methods()}, got {method!r}"
            )
        return method

    # ---- iteration ----

    def __iter__(self) -> Iterator[Any]:
        """Starts an epoch (map-style sources: a new order from seed and epoch)."""
        if self._current is not None:
            self._current.close()
        resume, self._resume = self._resume, None
        epoch = _Epoch(self, self._epoch, resume["position"] if resume else None)
        self._current_ref = weakref.ref(epoch)
        self._epoch += 1
        return epoch

    @property
    def _current(self) -> _Epoch | None:
        return self._current_ref()

    # ---- checkpoints ----

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, to resume from with ``load_state_dict`` (the
        convention of torchdata's ``StatefulDataLoader``); see dataecho.checkpoint
        for what it holds. Take it between batches, in the consumer's thread.

        Map-style sources: exact resume needs ``deterministic=True``; then the
        resumed loader yields exactly the batches this one would have yielded next.
        Iterable sources: a skip-ahead count (resident examples are not restored).

        Raises:
            ValueError: a loader whose position cannot be saved (named in the message).
        """
        if self._resume is not None:
            return dict(self._resume)  # loaded, not started yet
        state = {"format": FORMAT, "epoch": self._epoch, **self._identity(), "position": None}
        current = self._current
        if current is not None and not current._closed:
            state["epoch"] = current.epoch
            state["position"] = current.position()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from ``state_dict()``'s result at the next ``iter(loader)``;
        the current epoch, if any, is stopped.

        Raises:
            TypeError, ValueError: a state that is not one, or was saved by a loader
                over another source, seed or shard.
        """
        order = None
        if _is_map_style(self.source) and isinstance(state, dict) and isinstance(state.get("epoch"), int):
            order = self.shard.order(len(self.source), self.shuffle, _order_seed(self.seed, state["epoch"]), self.drop_last)
        checked = check_state(state, self._identity(), order)
        if checked["position"] is not None and order is not None:
            self._check_resumable()
        self.close()
        self._epoch = checked["epoch"]
        self._resume = checked

    def _identity(self) -> dict[str, Any]:
        map_style = _is_map_style(self.source)
        return {
            "seed": self.seed, "rank": self.shard.rank, "world_size": self.shard.world_size,
            "length": len(self.source) if map_style else None,
        }

    def _check_resumable(self) -> None:
        """Map-style positions: what exact resume supports."""
        why = None
        if not self.deterministic:
            why = "needs deterministic=True (otherwise the order depends on thread timing)"
        elif self.echo_at != "example":
            why = "is not supported with echo_at='batch'"
        elif self.augment is not None:
            why = "is not supported with augment (its output buffer is not checkpointed)"
        if why:
            raise ValueError(f"state_dict: saving a position mid-epoch {why}")

    def __len__(self) -> int:
        """Batches per epoch (on this rank), for a map-style source and a fixed
        echo factor: integer, or fractional with ``deterministic=True`` or several
        ranks (whose echo counts are exact)."""
        if not _is_map_style(self.source):
            raise TypeError("len(): the source is an iterable of unknown length")
        fixed = self.echo_factor != "auto" and (float(self.echo_factor).is_integer() or self.exact_echo)
        if not fixed:
            raise TypeError("len(): the number of batches is random with a fractional or 'auto' echo factor")
        rounding = math.floor if self.drop_last else math.ceil
        examples = self.shard.per_rank(len(self.source), self.drop_last)
        if self.echo_at == "batch":
            return exact_deliveries(rounding(examples / self.batch_size), float(self.echo_factor))
        return rounding(exact_deliveries(examples, float(self.echo_factor)) / self.batch_size)

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
            process: examples produced and seconds busy reading and transforming.
        """
        totals = dict(self._totals)
        current = self._current
        if current is not None:
            for key, value in current.counters().items():
                totals[key] += value
            self._worker_counters = current.worker_counters()
        active = totals["active_s"]
        return {
            "fresh": totals["fresh"],
            "delivered": totals["delivered"],
            "batches": totals["batches"],
            "echo_factor_achieved": totals["delivered"] / totals["fresh"] if totals["fresh"] else 0.0,
            "upstream_examples_per_s": totals["fresh"] / active if active > 0 else 0.0,
            "consumer_wait_fraction": totals["wait_s"] / active if active > 0 else 0.0,
            "epoch": max(0, self._epoch - 1),
            "workers": self._worker_counters,
        }

    def _epoch_finished(self, counters: dict[str, float], workers: list[dict[str, float]]) -> None:
        for key, value in counters.items():
            self._totals[key] += value
        self._worker_counters = workers

    def __enter__(self) -> EchoLoader:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        current = self._current if hasattr(self, "_current_ref") else None
        if current is not None:
            current.close()


class _Epoch:
    """One pass over the source: its threads, buffers and the consumer side."""

    def __init__(self, loader: EchoLoader, epoch: int, resume: dict[str, Any] | None = None) -> None:
        self._loader = loader
        self.epoch = epoch
        self._resume = resume
        self._replay: deque[np.ndarray] = deque()  # resumed: batches to yield first (rows' positions)
        self._replayed: np.ndarray | None = None  # the last batch's positions, if it was replayed
        self._in_flight: deque[np.ndarray] = deque()  # device=: rows' positions of batches not yet yielded
        self._failure = Failure()
        self._closed = False
        self._started = time.perf_counter()
        self._wait_s = 0.0
        self._delivered = 0
        self._batches = 0
        self._mover = None
        self._exhausted = False
        # The order seed is the same on every rank (so that shards are disjoint);
        # the shuffle, echo and worker seeds differ per rank.
        self._order_seed = _order_seed(loader.seed, epoch)
        seeds = np.random.SeedSequence([loader.seed, epoch, loader.shard.rank]).generate_state(4, dtype=np.uint64)
        self._seeds = [int(s) for s in seeds]
        self._echo_buffer: ShuffleBuffer | None = None
        self._output_buffer: ShuffleBuffer | None = None
        self._final: Callable[[float | None], tuple[np.ndarray, ...]] | None = None
        self._final_structure: Structure | None = None
        self._iterator: Iterator[Any] | None = None
        self._batch_echo: BatchEcho | None = None
        self._augment: AugmentStage | None = None
        self._producers: Producers | None = None
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # ---- building the pipeline ----

    def _start(self) -> None:
        loader = self._loader
        map_style = _is_map_style(loader.source)
        # The epoch's reading order: the same permutation on every rank (seeded by
        # seed and epoch alone), of which this rank reads its shard.
        self._order = (
            loader.shard.order(len(loader.source), loader.shuffle, self._order_seed, loader.drop_last)
            if map_style
            else None
        )
        resume = self._resume
        if resume is not None and not map_style:
            # Iterable: read again from the start, dropping what was taken before.
            self._iterator = itertools.islice(iter(loader.source), resume["skip"], None)
        first, start = self._first_example()
        if loader._structure is None:
            if first is _NOTHING:
                self._echo_buffer = None
                return
            loader._structure = Structure.infer(first)
        structure = loader._structure
        if resume is not None and map_style:
            # The first example only told the structure; reading goes on where it stopped.
            first, start = _NOTHING, resume["next_seq"]
            self._replay.extend(resume["queued"])
            if resume["ended"]:
                self._echo_buffer = None
                return
        elif resume is not None:
            start += resume["skip"]
        self._echo_buffer = self._make_echo_buffer(structure)
        if map_style:
            # Positions of the order are claimed by producers (threads or
            # processes) from a counter in the buffer's region; a position is
            # also the example's sequence number for deterministic intake.
            self._echo_buffer.set_index_range(start, len(self._order))
            if resume is not None:
                self._put_resident(resume)
        if first is not _NOTHING and (map_style or loader.worker_type == "thread"):
            self._echo_buffer.put_values(structure.flatten(first), seq=start - 1)
        elif first is not _NOTHING:
            start = 0  # worker processes each read their iterable from its start
        if loader.worker_type == "process":
            self._producers = ProcessProducers(
                self._echo_buffer, structure, self._source_for_workers, loader.transform, loader.workers,
                loader.start_method, map_style, self._order, self._seeds[1], self._failure,
                _weakly(self._abort),
            )
        else:
            self._producers = Producers(
                self._echo_buffer, structure, loader.transform, loader.workers, self._failure, _weakly(self._abort)
            )
            if map_style:
                self._producers.start_map(loader.source, self._order)
            else:
                self._producers.start_iterable(self._iterator, first_seq=start)
        upstream = self._echo_buffer.next_arrays
        if loader.echo_at == "batch":
            echo = None if loader.echo_factor == "auto" else float(loader.echo_factor)
            self._batch_echo = BatchEcho(
                upstream, loader.shuffle_buffer, echo, loader.max_echo, np.random.default_rng(self._seeds[1]),
                exact=loader.exact_echo,
            )
            upstream = self._batch_echo.next_batch
        if loader.augment is not None:
            self._augment = AugmentStage(
                upstream, structure, loader.augment, loader.workers, _weakly(self._make_output_buffer, raise_if_gone=True),
                self._failure, _weakly(self._abort),
            )
        else:
            self._final = upstream
            self._final_structure = structure

    def _restore_plan(self) -> _core.Snapshot | None:
        resume = self._resume
        if resume is None or self._order is None:
            return None
        plan = _core.Snapshot()
        for key in ("batches", "rng_state", "next_seq", "available"):
            setattr(plan, key, resume[key])
        plan.seqs, plan.echoes = resume["positions"], resume["echoes"]
        return plan

    def position(self) -> dict[str, Any]:
        """This epoch's position for state_dict() (see dataecho.checkpoint)."""
        loader = self._loader
        if self._order is None:
            if loader.worker_type == "process":
                raise ValueError(
                    "state_dict: worker processes each read their own shard of an iterable source, "
                    "so there is no single position to skip to; use a map-style source"
                )
            fresh = self._echo_buffer.stats()["fresh"] if self._echo_buffer is not None else 0
            return {"skip": (self._resume["skip"] if self._resume else 0) + fresh}
        loader._check_resumable()
        if self._echo_buffer is not None:
            snap = _snapshot_dict(self._echo_buffer.snapshot())
        else:  # nothing more to assemble
            snap = {"batches": 0, "rng_state": 0, "next_seq": len(self._order), "available": 0,
                    "seqs": [], "echoes": [], "queued": [], "ended": True}
        positions = np.asarray(snap["seqs"], dtype=np.uint64)
        return {
            **{key: int(snap[key]) for key in ("batches", "rng_state", "next_seq", "available")},
            "positions": positions,
            "indices": np.asarray(self._order, dtype=np.int64)[positions.astype(np.int64)],
            "echoes": np.asarray(snap["echoes"], dtype=np.uint32),
            # In the order they will be yielded: taken ahead (on their way to the
            # device), left over from a resume, then the buffer's.
            "queued": [np.asarray(q, dtype=np.uint64) for q in (*self._in_flight, *self._replay, *snap["queued"])],
            "ended": bool(snap["ended"]),
        }

    def _read(self, position: int) -> list:
        """The example at `position` of this epoch's order, transformed and flattened."""
        example = self._loader.source[int(self._order[position])]
        return self._loader._structure.flatten(self._transformed(example))

    def _transformed(self, example: Any) -> Any:
        transform = self._loader.transform
        return example if transform is None else transform(example)

    def _put_resident(self, resume: dict[str, Any]) -> None:
        """Resume: reads the resident examples again and puts them with their
        numbers, before any producer starts (the buffer waits for all of them)."""
        positions = sorted(int(p) for p in resume["positions"])
        if not positions:
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(self._loader.workers, len(positions))) as pool:
            for position, values in zip(positions, pool.map(self._read, positions)):
                self._echo_buffer.put_values(values, seq=position)

    def _first_example(self) -> tuple[Any, int]:
        """Reads (and transforms) one example if the structure is not known yet.

        Returns the example (or _NOTHING) and the map-style position to go on from.
        """
        loader = self._loader
        # Worker processes get the source as it is before the parent reads from it.
        self._source_for_workers = _Pickled(loader.source) if loader.worker_type == "process" else None
        if self._iterator is None and not _is_map_style(loader.source):
            self._iterator = iter(loader.source)
        if loader._structure is not None:
            return _NOTHING, 0
        if self._iterator is None:
            if len(self._order) == 0:
                return _NOTHING, 0
            example = loader.source[int(self._order[0])]
        else:
            example = next(self._iterator, _NOTHING)
            if example is _NOTHING:
                return _NOTHING, 0
        return self._transformed(example), 1

    def _make_echo_buffer(self, structure: Structure) -> NativeBuffer:
        loader = self._loader
        per_example = loader.echo_at == "example"
        capacity = loader.shuffle_buffer if per_example else max(2 * loader.batch_size, _DEFAULT_EXAMPLES)
        auto = per_example and loader.echo_factor == "auto"
        config = buffer_config(
            capacity=capacity, batch_size=loader.batch_size,
            echo_factor=1.0 if auto or not per_example else float(loader.echo_factor), auto_echo=auto,
            max_echo=loader.max_echo, seed=self._seeds[2],
            # With augment, the output buffer decides what a short last batch means.
            drop_last=loader.drop_last and loader.augment is None, prefetch=loader.prefetch,
            # Batch echoing: batches flow from the first one on; the example
            # shuffle behind them still grows to its capacity.
            initial=0 if per_example else loader.batch_size,
            shared=loader.worker_type == "process", deterministic=loader.deterministic,
            exact_echo=loader.exact_echo and per_example,
        )
        buffer = NativeBuffer(parse_fields(structure.fields())[0], config, self._restore_plan())
        if loader.augment is None:
            self._pin(buffer)
        return buffer

    def _make_output_buffer(self, structure: Structure) -> NativeBuffer:
        loader = self._loader
        config = buffer_config(
            capacity=max(4 * loader.batch_size, 256), batch_size=loader.batch_size, seed=self._seeds[3],
            drop_last=loader.drop_last, prefetch=loader.prefetch, initial=loader.batch_size,
            deterministic=loader.deterministic,
        )
        buffer = NativeBuffer(parse_fields(structure.fields())[0], config)
        self._pin(buffer)
        self._output_buffer = buffer
        return buffer

    def _pin(self, buffer: ShuffleBuffer) -> None:
        """Page-locked batch memory, allocated once: prefetch + the batch being
        assembled + the consumer's + two in flight to the device (+ the batches
        held for batch echoing). Past that the pool falls back to pageable memory."""
        if not self._loader.pin_memory:
            return
        from . import torch_support

        count = self._loader.prefetch + 4
        if self._loader.echo_at == "batch" and self._loader.augment is None:
            count += self._loader.shuffle_buffer  # batches held for echoing
        blocks = torch_support.allocate_pinned(buffer.batch_bytes, count)
        for block, (address, nbytes) in zip(blocks, torch_support.pinned_pointers(blocks)):
            buffer.add_batch_memory(address, nbytes, block)

    # ---- consuming ----

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            if self._loader.device is None:
                batch = self._next_tree()
            else:
                batch = self._next_on_device()
        except KeyboardInterrupt:
            self.close()  # Ctrl-C stops the epoch's threads and worker processes
            raise
        finally:
            self._wait_s += time.perf_counter() - start
        self._batches += 1
        return batch

    def _next_host(self) -> tuple[Structure, tuple[np.ndarray, ...]]:
        if self._replay:
            positions = self._replay.popleft()
            arrays = _stack(self._loader._structure, [self._read(int(p)) for p in positions])
            self._delivered += len(positions)
            self._replayed = positions
            return self._loader._structure, arrays
        if self._closed or self._echo_buffer is None:
            self._failure.raise_if_set()
            raise StopIteration
        try:
            self._replayed = None
            return self._next_from_stages()
        except StopIteration:
            # The end, or a stage failed: either way the epoch is over. Its
            # threads and processes are stopped before the error reaches the loop.
            self._finish()
            self._failure.raise_if_set()
            raise

    def _next_from_stages(self) -> tuple[Structure, tuple[np.ndarray, ...]]:
        if self._final is None:
            # Augmented output: its buffer exists once the first result does.
            while not self._augment.ready.wait(0.05):
                pass
            if self._augment.output is None or self._failure.error is not None:
                raise StopIteration
            self._final = self._augment.output.next_arrays
            self._final_structure = self._augment.out_structure
        arrays = self._final(None)
        self._delivered += len(arrays[0])
        return self._final_structure, arrays

    def _next_tree(self) -> Any:
        structure, arrays = self._next_host()
        if self._loader.output == "torch":
            from .torch_support import to_torch

            return structure.unflatten(arrays, wrap=lambda a: to_torch(a))
        return structure.unflatten(arrays)

    def _next_on_device(self) -> Any:
        from .torch_support import DeviceMover, to_torch

        if self._mover is None:
            self._mover = DeviceMover(self._loader.device)
        # Keep one batch in flight ahead of the one handed out.
        while not self._exhausted and len(self._mover) < 2:
            try:
                structure, arrays = self._next_host()
            except StopIteration:
                self._exhausted = True
                break
            if self._loader.deterministic:  # taken ahead: state_dict() lists their rows first
                self._in_flight.append(
                    self._replayed if self._replayed is not None else self._echo_buffer.last_seqs
                )
            host = [to_torch(a) for a in arrays]
            self._mover.submit(host, on_done=host.clear)
            self._pending_structure = structure
        if len(self._mover) == 0:
            raise StopIteration
        if self._in_flight:
            self._in_flight.popleft()
        return self._pending_structure.unflatten(self._mover.take())

    # ---- shutting down ----

    def worker_counters(self) -> list[dict[str, float]]:
        return self._producers.counters() if self._producers is not None else []

    def counters(self) -> dict[str, float]:
        fresh = self._echo_buffer.stats()["fresh"] if self._echo_buffer is not None else 0
        return {
            "fresh": fresh,
            "delivered": self._delivered,
            "batches": self._batches,
            "wait_s": self._wait_s,
            "active_s": time.perf_counter() - self._started,
        }

    def _abort(self) -> None:
        """Stops every stage at once (an error, or the consumer leaving)."""
        for stage in (self._producers, self._augment):
            if stage is not None:
                stage.stop()
        for buffer in (self._echo_buffer, self._output_buffer):
            if buffer is not None:
                buffer.abort()

    def _finish(self, wait: bool = True) -> None:
        if not self._closed:
            self._closed = True
            self._abort()
            self._join(wait)
            self._loader._epoch_finished(self.counters(), self.worker_counters())
            if self._loader._current is self:
                self._loader._current_ref = lambda: None

    def close(self) -> None:
        """Stops this epoch's threads (idempotent)."""
        if self._mover is not None:
            self._mover.close()
        self._finish()

    def __del__(self) -> None:
        # The last reference went (the loop left, the loader was deleted): stop
        # every stage. Threads are not waited for (one may be inside the user's
        # code); each ends at its next put. Worker processes are reaped.
        if not getattr(self, "_closed", True):
            if self._mover is not None:
                self._mover.close()
            self._finish(wait=False)

    def _join(self, wait: bool = True) -> None:
        if isinstance(self._producers, ProcessProducers) or wait and self._producers is not None:
            self._producers.join(_JOIN_TIMEOUT_S)
        if wait and self._augment is not None:
            self._augment.join(_JOIN_TIMEOUT_S)


_NOTHING = object()


def _weakly(method: Callable[..., Any], raise_if_gone: bool = False) -> Callable[..., Any]:
    """`method` for a stage's thread to call without keeping the epoch alive: an
    epoch nobody iterates is collected, and its __del__ stops the threads. Once
    it is gone, the call does nothing, or raises BufferClosed (the stage then
    ends quietly)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        if bound is not None:
            return bound(*args)
        if raise_if_gone:
            raise BufferClosed("the epoch has ended")
        return None

    return call


def _snapshot_dict(snap: _core.Snapshot) -> dict[str, Any]:
    keys = ("batches", "rng_state", "next_seq", "available", "seqs", "echoes", "queued", "ended")
    return {key: getattr(snap, key) for key in keys}


def _order_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's reading order: the same on every rank."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])


def _stack(structure: Structure, rows: list[list]) -> tuple[np.ndarray, ...]:
    """A batch built from flattened examples as the buffer would gather it
    (for the batches a resumed epoch yields first)."""
    fields, _ = parse_fields(structure.fields())
    return tuple(
        np.stack([to_field_array(row[i], f, None, "resume") for row in rows]) for i, f in enumerate(fields)
    )


class _Pickled:
    """A source pickled once, so that every worker gets the same bytes (and the
    parent's later reads from it do not leak into the workers' copies)."""

    def __init__(self, value: Any) -> None:
        import pickle

        self._bytes = pickle.dumps(value)

    def __reduce__(self) -> tuple:
        import pickle

        return pickle.loads, (self._bytes,)
