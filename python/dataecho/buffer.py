"""The native echo-aware shuffle buffer, in two faces.

``ShuffleBuffer`` is the public one: it validates every argument and example,
naming what is wrong, and keeps to one consumer thread. ``NativeBuffer`` is
what dataecho's own pipeline stages use: named methods over the compiled
buffer, for callers that hand it a validated configuration and converted
arrays.

Holding: a put may hand over a large value (a field of ``HOLD_MIN_BYTES`` or
more per example) by reference instead of having it copied into a slot. The
buffer then keeps the array alive, gathers each batch straight from it (one
copy per example instead of two), and lets go of it with the batch that holds
the example's last echo. ``ShuffleBuffer(hold="auto")`` holds what ``put``
hands over and copies ``put_many``'s stacked rows, so that a stacked array is
not kept alive for the sake of one row; ``hold=True`` holds those too (each
stacked array until the last echo of its last row: best for views of memory
that lives anyway, such as a dataset array); ``hold=False`` always copies. A
held array is made read-only, so a write through it raises; its memory must not
be changed through another view (or a torch tensor that shares it) until the
example's last echo is delivered. EchoLoader holds the rows of an in-memory
source array (never changing that array) and copies what a dataset returns
into slots it keeps from one epoch to the next (held, each epoch's arrays would
be freed at its end and the next epoch's faulted in anew: 0.75x at 150 KiB);
worker processes copy.
"""

from __future__ import annotations

import atexit
import math
import os
import threading
import weakref
from typing import Any, Iterator, Mapping

import numpy as np

from . import _checks, _core
from .errors import BufferClosed
from .fields import Field, field_value, parse_fields, to_field_array
from .objects import LeafMap
from .ragged import Ragged
from .structure import key_mismatch

__all__ = ["NativeBuffer", "ShuffleBuffer", "buffer_config", "page_heap", "ragged_heap"]

_OK, _CLOSED, _TIMEOUT = _core.Status.OK, _core.Status.CLOSED, _core.Status.TIMEOUT
_STATS = ("fresh", "delivered", "batches", "dropped", "evicted", "resident", "free_slots", "batch_blocks",
          "pages", "pages_in_use", "starved", "producer_wait_s", "consumer_wait_s")
_live: weakref.WeakSet[NativeBuffer] = weakref.WeakSet()
MAX_PAGE_FOR_DEFAULT = 1 << 16  # the largest page chosen by default (bigger examples take several)
# Fields of at least this many bytes per example can be held by reference
# instead of copied into a slot (see NativeBuffer's ``hold``). Below it the
# copy costs less than the bookkeeping: bench/bench_hold.py measures the crossover.
HOLD_MIN_BYTES = 8192


def buffer_config(**values: Any) -> _core.BufferConfig:
    """A ``_core.BufferConfig`` with the given fields set (the rest default)."""
    config = _core.BufferConfig()
    for name, value in values.items():
        setattr(config, name, value)
    return config


def page_heap(budget_bytes: int, example_bytes: float) -> tuple[int, int]:
    """(pages, page_bytes) of a page heap for ragged values: pages of about an
    eighth of an example's ragged bytes (a power of two, 64 B to 64 KiB), so that
    the last, partly filled page of each example wastes about 6% on average, and
    as many as ``budget_bytes`` holds.

    Args:
        budget_bytes: the memory budget for ragged values.
        example_bytes: an example's ragged bytes, on average (a guess is fine).
    """
    target = max(example_bytes / 8, 1.0)
    page = 1 << max(0, round(math.log2(target)))
    page = min(max(page, _core.MIN_PAGE_BYTES), MAX_PAGE_FOR_DEFAULT)
    return max(1, min(budget_bytes // page, _core.MAX_PAGES)), page


def ragged_heap(structure: Any, capacity: int, budget_bytes: int | None, objects: str) -> tuple[int, int]:
    """(pages, page_bytes) for a buffer of ``structure``'s examples: none
    without ragged values; else pages sized from the examples the structure was
    inferred from, and ``budget_bytes`` of them. By default capacity x the
    larger of 4 x their mean and 2 x the largest: the heap's pages are touched
    only once used (dataecho's page heap takes fresh pages last), so the room
    for examples longer than the first ones costs no memory until they come.
    Shared with worker processes (``objects="pickle"``), the memory is reserved
    up front: capacity x the larger of 2 x the mean and the largest. Object
    leaves count there, as they travel pickled, as ragged bytes."""
    kinds = set(structure.kinds)
    pickled = objects == "pickle" and "object" in kinds
    if "ragged" not in kinds and not pickled:
        return 0, 0
    sample = structure.sample_bytes["ragged"] or [0]
    if pickled:
        extra = structure.sample_bytes["object"] or [256]
        sample = [a + b for a, b in zip(sample, extra)] if "ragged" in kinds else extra
    mean = max(sum(sample) / len(sample), 1.0)
    if budget_bytes is None:
        scale = (2 * mean, max(sample)) if objects == "pickle" else (4 * mean, 2 * max(sample))
        budget_bytes = max(int(capacity * max(scale)), 1 << 16)
    return page_heap(budget_bytes, mean)


class NativeBuffer:
    """The compiled buffer for dataecho's stages: puts, batches, snapshots.

    Arguments are not checked here beyond what memory safety needs: callers
    pass a configuration built from validated arguments (``_core`` aborts the
    process on one that breaks its invariants) and, to ``put_arrays``, arrays
    already converted to the fields.

    Each field is one leaf of an example. Array and ragged fields are native
    fields; object fields ride in one more native field, the carrier
    (dataecho.objects), after them. A batch has one entry per field: an array,
    a :class:`~dataecho.ragged.Ragged`, or a list of objects.

    Args:
        fields: the example's fields.
        config: the buffer's configuration (with a page heap where a field is
            ragged, the carrier included: see :func:`page_heap`).
        restore: a snapshot to resume from (deterministic buffers).
        cache: where the buffer's memory comes from and goes back to when it is
            freed, for the next buffer of the same size (a loader's next epoch).
        objects: how object fields travel: ``"key"`` (by reference) or
            ``"pickle"`` (the buffer is shared with worker processes).
        hold: how values of fields of ``HOLD_MIN_BYTES`` or more get in:
            ``"sources"`` (the loader's): only rows of an in-memory source
            array given as (array, indices) are held by reference, and the
            batch is gathered straight from them (one copy per example, not
            two); what a dataset returns is copied into slots, which the loader
            keeps from one epoch to the next, where held arrays would be freed
            and their memory faulted in again. ``"auto"`` (ShuffleBuffer's):
            arrays of one example each (``put_arrays``, list columns of
            ``put_each``) are held too; stacked arrays (``put_many_arrays``,
            stacked columns) and memory-mapped sources are copied, so that no
            stacked array stays alive for the sake of one row. ``True``:
            stacked arrays are held too. ``False``: everything is copied. A held array is made read-only and kept alive
            until its last echo is gathered; a source array is not changed and
            must not be written meanwhile. Shared buffers copy.
    """

    def __init__(self, fields: list[Field], config: _core.BufferConfig, restore: _core.Snapshot | None = None,
                 cache: _core.BlockCache | None = None, objects: str = "key", hold: bool | str = "sources"):
        self.fields = fields
        self.hold = hold
        config.hold_min_bytes = HOLD_MIN_BYTES if hold else 0
        self.page_bytes = config.page_bytes  # of the page heap for ragged values (0: none)
        self.capacity = config.capacity
        self._map = LeafMap(fields, objects)
        self.codec = self._map.codec
        if self.codec is not None and self.codec.mode == "key":
            config.key_field = len(self._map.native) - 1
        try:
            self._core = _core.Buffer([f.decl() for f in self._map.native], config, restore, cache)
        except MemoryError:
            example = sum(f.nbytes for f in fields)
            raise MemoryError(
                f"capacity: cannot allocate {config.capacity} slots of {example} bytes "
                f"({config.capacity * example / 2**30:.1f} GiB) and {config.pages * config.page_bytes} bytes "
                f"for ragged values; lower capacity (or ragged_bytes)"
            ) from None
        self._holdable = list(self._core.holdable_fields)  # native field indices
        self._pid = os.getpid()
        self.forked = False  # set in a forked child by _forget_after_fork: no syscall per call
        _live.add(self)

    # ---- producers ----

    def put_values(self, values: list, timeout_s: float | None = None, seq: int = 0) -> None:
        """Puts one example given as one value per field (converted here);
        ``seq`` is its position in the input, for deterministic intake."""
        self.put_arrays([field_value(v, f, None, "put()") for v, f in zip(values, self.fields)], timeout_s, seq)

    def put_arrays(self, arrays: list[Any], timeout_s: float | None = None, seq: int = 0) -> None:
        """Puts one example given as one converted array per field (object
        fields: the objects themselves)."""
        self.check_process()
        hold = self.hold in ("auto", True) and bool(self._holdable)
        status = self._core.put(self._map.example(arrays), timeout_s, seq, hold)
        if status == _CLOSED:
            raise BufferClosed("put(): the ShuffleBuffer is closed")
        if status == _TIMEOUT:
            raise TimeoutError(f"put(): no free slot within {timeout_s} s")

    def put_many_arrays(self, arrays: list[np.ndarray], rows: int, timeout_s: float | None = None) -> None:
        """Puts `rows` stacked examples; on failure the exception's
        ``examples_put`` says how many went in."""
        self.check_process()
        status, done = self._core.put_many(arrays, rows, timeout_s, 0, self.hold is True and bool(self._holdable))
        if status != _OK:
            raise _put_many_error(status, done, rows, timeout_s)

    def put_each(self, columns: list, rows: int, first_seq: int = 0, timeout_s: float | None = None,
                 done: int = 0) -> int:
        """Puts rows [done, rows) of ``columns`` (one per native field, the
        carrier last: see ``_core.Buffer.put_each`` and dataecho.chunks.Columns),
        row i numbered ``first_seq + i``; returns the rows put by then: all of
        them, or fewer when ``timeout_s`` ran out.

        Raises:
            BufferClosed: the buffer was closed or stopped.
        """
        self.check_process()
        status, done = self._core.put_each(columns, rows, timeout_s, first_seq, done, self._holds(columns))
        if status == _CLOSED:
            raise BufferClosed("put(): the ShuffleBuffer is closed")
        return done

    def _holds(self, columns: list) -> bool:
        """Whether a ``put_each`` of ``columns`` holds its holdable fields' values (see ``hold``)."""
        if not self._holdable or self.hold is False:
            return False
        if self.hold is True:
            return True
        for f in self._holdable:
            column = columns[f]
            if isinstance(column, tuple):
                if isinstance(column[0], np.memmap):
                    return False
            elif not isinstance(column, list) or self.hold == "sources":
                return False
        return True

    @property
    def held(self) -> int:
        """Values (one per example and held field) held by reference now."""
        return self._core.held_values

    def native_columns(self, columns: list) -> list:
        """Columns of ``put_each`` given one per field: the object fields'
        columns become the carrier's (dataecho.objects), last."""
        return self._map.columns(columns)

    def claim_range(self, count: int) -> tuple[int, int]:
        """Up to ``count`` consecutive positions of a map-style order to read:
        (first, how many), how many 0 when all are claimed."""
        return self._core.claim_range(count)

    def set_index_range(self, begin: int, end: int) -> None:
        """Positions [begin, end) are to be claimed (before any producer starts)."""
        self._core.set_index_range(begin, end)

    def close(self) -> None:
        """Ends the input: later puts fail; what is resident drains, then the stream ends."""
        if not self.forked:
            self._core.close()

    def abort(self) -> None:
        """Stops at once: blocked producers get BufferClosed, the consumer the end,
        and what is resident is dropped. For pipelines shutting down."""
        if not self.forked:
            self._core.stop()

    # ---- worker processes ----

    @property
    def region_name(self) -> str:
        """The shared region's name for worker processes ("" once unlinked, or private)."""
        return self._core.region_name

    def unlink_region(self) -> None:
        """Removes the shared region's name (every worker has mapped it, or none will)."""
        self._core.unlink_region()

    def worker_counters(self, workers: int) -> list[tuple[int, int]]:
        """(examples produced, busy nanoseconds) of each worker process."""
        return self._core.worker_counters(workers)

    # ---- consumer ----

    def next_arrays(self, timeout_s: float | None = None) -> tuple[Any, ...]:
        """The next batch, one entry per field (an array, a Ragged, a list of
        objects). Raises StopIteration at the end and TimeoutError when
        ``timeout_s`` passes first."""
        self.check_process()
        status, arrays = self._core.next(timeout_s)
        if status == _OK:
            return self._map.leaves(arrays, self._core.last_released if self.codec is not None else None)
        if status == _CLOSED:
            raise StopIteration
        raise TimeoutError(f"next_batch(): no batch within {timeout_s} s")

    def copy_batch(self, leaves: tuple[Any, ...]) -> tuple[Any, ...]:
        """A copy of a batch of this buffer's fields, in a block of its batch pool
        (reused once no array of it is alive: no fresh pages to fault in);
        object fields' lists are copied, their objects shared."""
        self.check_process()
        return self._map.copied(leaves, self._core.copy_batch(self._map.for_copy(leaves), len(leaves[0])))

    @property
    def last_seqs(self) -> np.ndarray:
        """Deterministic buffers: each row's sequence number, for the last batch."""
        return self._core.last_seqs

    def snapshot(self, timeout_s: float | None = None) -> _core.Snapshot:
        """Deterministic buffers: the state before the next batch to be assembled
        (see checkpoint.hpp), with the rows of the batches assembled but not taken."""
        self.check_process()
        status, state = self._core.snapshot(timeout_s)
        if status == _CLOSED:
            raise BufferClosed("state: the ShuffleBuffer was stopped")
        if status == _TIMEOUT:
            raise TimeoutError(f"state: the batch being assembled did not finish within {timeout_s} s")
        return state

    # ---- memory and counters ----

    def stats(self) -> dict[str, Any]:
        """The native counters as a dict (see ShuffleBuffer.stats)."""
        self.check_process()
        native = self._core.stats()
        return {name: getattr(native, name) for name in _STATS}

    @property
    def batch_bytes(self) -> int:
        """Bytes of one batch's memory block."""
        return self._core.batch_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes each slot takes in the arena, alignment included."""
        return self._core.slot_stride

    @property
    def initial(self) -> int:
        """Resident examples needed before the first batch."""
        return self._core.initial

    def add_batch_memory(self, address: int, nbytes: int, owner: Any) -> None:
        """Hands a block of batch memory (page-locked, say) to the pool; `owner`
        is kept alive for as long as the pool may use the block."""
        self._core.add_batch_memory(address, nbytes, owner)

    def check_process(self) -> None:
        """Raises in a forked child: the buffer belongs to the parent."""
        if self.forked:
            raise RuntimeError(
                f"ShuffleBuffer was created in process {self._pid} and cannot be used in a forked "
                f"child ({os.getpid()}); create the buffer in the process that uses it"
            )

    def forget_after_fork(self) -> None:
        """In a forked child: the child has no assembler thread; leak the core
        instead of joining it."""
        self.forked = True
        self._core.abandon_after_fork()

    def shut_down(self) -> None:
        """At interpreter exit: release blocked producers, stop the assembler and
        remove a shared-memory name still linked (workers that never attached)."""
        if not self.forked:
            self._core.stop()
            self._core.unlink_region()


class ShuffleBuffer:
    """A bounded shuffle buffer that echoes examples and yields shuffled batches.

    Producers (any number of threads) ``put`` examples; each is copied once into
    a native slot (or, if large, held by reference: see ``hold``) and repeated
    ``echo_factor`` times on average (``floor(e)`` times plus one more with
    probability ``e - floor(e)``). A native thread draws uniformly among the
    resident examples, without replacement within a batch, and copies them into
    batch memory that the yielded arrays view without a further copy. A batch
    stays valid, unchanged, for as long as any of its arrays is alive.

    Args:
        fields: ``(shape, dtype)`` for plain array examples, or a mapping
            ``name -> (shape, dtype)`` for dict examples. A shape ``(None,
            *rest)`` declares a ragged field (each example has its own number of
            rows; batches give a :class:`~dataecho.Ragged`), and ``((), object)``
            a field of Python objects (carried by reference; batches give a list).
        capacity: slots, i.e. the most examples resident at once.
        batch_size: examples per batch; at most ``capacity``.
        echo_factor: mean number of times each example is delivered, >= 1; or
            ``"auto"``: repeat examples only while the consumer would otherwise
            wait, each at most about ``max_echo`` times (see ``EchoLoader``).
        seed: seeds the shuffle and the echo draws; None draws a random seed.
            With one producer, the same seed and input give the same order.
        drop_last: drop the final batch if it is short.
        prefetch: batches assembled ahead of the consumer.
        initial: resident examples needed before the first batch. Defaults to
            ``max(batch_size, capacity // 4)``. After the first batch the
            reservoir grows by one example per example delivered until full.
        max_echo: with ``echo_factor="auto"``, the most times an example is
            delivered on average (each gets ``floor(m)`` or ``floor(m) + 1``).
        ragged_bytes: memory for the values of ragged fields of the examples in
            the buffer (default: 1 KiB per slot). While it is full, a put waits
            and batches are drawn from fewer resident examples.
        hold: ``"auto"`` (default), True or False: whether values of 8 KiB
            or more are held by reference instead of copied into a slot (see
            "Holding" in this module's docstring): ``"auto"`` holds what
            ``put`` hands over, True also ``put_many``'s stacked arrays.

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
    """

    def __init__(
        self,
        fields: Any,
        capacity: int = 4096,
        batch_size: int = 256,
        echo_factor: float | str = 1.0,
        seed: int | None = None,
        drop_last: bool = False,
        prefetch: int = 2,
        initial: int | None = None,
        max_echo: float = 4.0,
        ragged_bytes: int | None = None,
        hold: bool | str = "auto",
    ) -> None:
        self._fields, self._single = parse_fields(fields)
        hold = _checks.hold(hold)
        capacity = _checks.positive_int("capacity", capacity, _core.MAX_CAPACITY)
        batch_size = _checks.positive_int("batch_size", batch_size)
        if batch_size > capacity:
            raise ValueError(f"batch_size: {batch_size} is larger than capacity {capacity}")
        auto_echo = _checks.echo_factor(echo_factor) == "auto"
        echo = 1.0 if auto_echo else float(echo_factor)
        max_echo = _checks.real("max_echo", max_echo, 1.0, _core.MAX_ECHO)
        if initial is not None:
            initial = _checks.positive_int("initial", initial, capacity)
        self._check_sizes(capacity, batch_size)
        config = buffer_config(
            capacity=capacity, batch_size=batch_size, echo_factor=echo, auto_echo=auto_echo, max_echo=max_echo,
            seed=_checks.seed(seed), drop_last=_checks.flag("drop_last", drop_last),
            prefetch=_checks.positive_int("prefetch", prefetch, 1 << 16), initial=initial or 0,
        )
        if any(f.ragged for f in self._fields):
            budget = capacity * 1024 if ragged_bytes is None else _checks.positive_int("ragged_bytes", ragged_bytes)
            config.pages, config.page_bytes = page_heap(budget, budget / capacity)
        self._native = NativeBuffer(self._fields, config, hold=hold)
        self.capacity, self.batch_size, self.max_echo, self.hold = capacity, batch_size, max_echo, hold
        self.echo_factor: float | str = "auto" if auto_echo else echo
        self.drop_last, self.prefetch = config.drop_last, config.prefetch
        self.initial = self._native.initial
        self._names = [f.name for f in self._fields]
        self._closed = False
        self._consumer = threading.Lock()

    def _check_sizes(self, capacity: int, batch_size: int) -> None:
        example = sum(f.nbytes for f in self._fields)
        for what, count in (("capacity", capacity), ("batch_size", batch_size)):
            if example * count > 1 << 62:
                raise ValueError(f"{what}: {count} examples of {example} bytes overflow the addressable size")

    @property
    def fields(self) -> list[Field]:
        """The declared fields, in order."""
        return list(self._fields)

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._closed

    @property
    def slot_bytes(self) -> int:
        """Bytes each resident example takes, alignment included (64-byte slots,
        4096-byte ones for examples of 4 KiB or more)."""
        return self._native.slot_bytes

    @property
    def held(self) -> int:
        """Values held by reference now (see ``hold``), one per example and field."""
        return self._native.held

    # ---- producers ----

    def put(self, example: Any, timeout: float | None = None) -> None:
        """Puts one example into the buffer (copied, or held: see ``hold``);
        blocks while it is full.

        Args:
            example: a dict ``name -> array`` (or one array for a single field),
                cast by the rule in :mod:`dataecho.fields`.
            timeout: seconds to wait for a free slot; None waits forever.

        Raises:
            BufferClosed: the buffer is closed (also when it closes while waiting).
            TimeoutError: no slot became free in time.
            TypeError, ValueError, OverflowError: the example does not fit.
        """
        self._native.check_process()
        self._native.put_arrays(self._arrays(example, None, "put()"), _checks.timeout(timeout))

    def put_many(self, examples: Any, timeout: float | None = None) -> None:
        """Puts n stacked examples (leading axis n) into the buffer (copied,
        or held with ``hold=True``).

        Args:
            examples: a dict ``name -> array`` with a leading axis of the same
                length n in every field (or one such array for a single field).
            timeout: seconds to wait, for the whole call; None waits forever.

        Raises:
            BufferClosed, TimeoutError: as for ``put``. Examples before the
                failing one are in the buffer; the exception's ``examples_put``
                attribute says how many.
            TypeError, ValueError, OverflowError: the examples do not fit.
        """
        self._native.check_process()
        rows = _rows(examples, self._fields, self._single)
        if rows == 0:
            return
        if all(f.kind == "array" for f in self._fields):
            self._native.put_many_arrays(self._arrays(examples, rows, "put_many()"), rows, _checks.timeout(timeout))
            return
        values = [examples] if self._single else [examples[f.name] for f in self._fields]
        columns = [_column(v, f, rows) for v, f in zip(values, self._fields)]
        done = self._native.put_each(self._native.native_columns(columns), rows, timeout_s=_checks.timeout(timeout))
        if done < rows:
            raise _put_many_error(_TIMEOUT, done, rows, timeout)

    def close(self) -> None:
        """Ends the input: later puts raise BufferClosed, blocked ones are released,
        and iteration delivers what is left (echoes included), then stops. Idempotent."""
        self._closed = True
        self._native.close()

    # ---- consumer ----

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.next_batch()

    def next_batch(self, timeout: float | None = None) -> Any:
        """Returns the next batch, waiting up to ``timeout`` seconds.

        Returns:
            A dict ``name -> ndarray`` of shape ``(batch, *field_shape)``, or one
            ndarray for single-field buffers. The last batch is shorter unless
            ``drop_last``.

        Raises:
            StopIteration: the buffer is closed and everything was delivered.
            TimeoutError: no batch within ``timeout``.
            RuntimeError: another thread is iterating this buffer.
        """
        timeout = _checks.timeout(timeout)
        self._native.check_process()
        if not self._consumer.acquire(blocking=False):
            raise RuntimeError("ShuffleBuffer: another thread is already iterating this buffer")
        try:
            arrays = self._native.next_arrays(timeout)
        finally:
            self._consumer.release()
        return arrays[0] if self._single else dict(zip(self._names, arrays))

    def stats(self) -> dict[str, Any]:
        """Counters: fresh (examples put), delivered (examples in yielded batches),
        batches, dropped (echoes lost to drop_last), evicted (with "auto": unspent
        budget of examples freed to make room), resident, free_slots (equal to
        capacity once everything put was delivered), batch_blocks (batch memory
        blocks allocated: prefetch + 1 + the batches you keep alive),
        producer_wait_s, consumer_wait_s, and echo_factor_achieved (delivered / fresh)."""
        stats = self._native.stats()
        stats["echo_factor_achieved"] = stats["delivered"] / stats["fresh"] if stats["fresh"] else 0.0
        return stats

    def __enter__(self) -> ShuffleBuffer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        def spec(f: Field) -> str:
            return "object" if f.kind == "object" else f"{(None, *f.shape) if f.ragged else f.shape} {f.dtype}"

        fields = spec(self._fields[0]) if self._single else ", ".join(f"{f.name}: {spec(f)}" for f in self._fields)
        return (
            f"ShuffleBuffer({fields}; capacity={self.capacity}, batch_size={self.batch_size}, "
            f"echo_factor={self.echo_factor}{', closed' if self._closed else ''})"
        )

    # ---- internals ----

    def _arrays(self, example: Any, rows: int | None, where: str) -> list[Any]:
        if self._single:
            return [field_value(example, self._fields[0], rows, where)]
        if not isinstance(example, Mapping):
            raise TypeError(f"{where}: expected a dict with fields {self._names}, got {type(example).__name__}")
        mismatch = key_mismatch(self._names, example)
        if mismatch is not None:
            raise ValueError(
                f"{where}: example fields do not match: missing {mismatch[0]}, unexpected {mismatch[1]}"
            )
        return [field_value(example[f.name], f, rows, where) for f in self._fields]


def _rows(examples: Any, fields: list[Field], single: bool) -> int:
    """How many stacked examples ``put_many`` was given (checking their form)."""
    names = [f.name for f in fields]
    if not single and isinstance(examples, Mapping) and names[0] in examples:
        first = examples[names[0]]
        if isinstance(first, (Ragged, list)) and fields[0].kind != "array":
            return len(first)
    elif isinstance(examples, (Ragged, list)) and fields[0].kind != "array":
        return len(examples)
    first = examples if single else None
    if not single:
        if not isinstance(examples, Mapping):
            raise TypeError(
                f"put_many(): expected a dict of stacked arrays with fields {names}, got {type(examples).__name__}"
            )
        first = examples.get(names[0])
    try:
        shape = np.shape(first) if first is not None else ()
    except (TypeError, ValueError) as exc:  # ragged lists, say
        raise TypeError(f"put_many(): {fields[0].label()} could not be read as stacked arrays: {exc}") from None
    if len(shape) < 1:
        raise ValueError("put_many(): expected stacked arrays with a leading axis of examples")
    return int(shape[0])


def _column(value: Any, field: Field, rows: int) -> Any:
    """``put_many``'s value of a field as a column of ``rows`` examples: stacked
    arrays; for a ragged field a Ragged (as it is) or a list of arrays (each
    converted); for an object field a list of objects."""
    if field.kind == "array":
        return to_field_array(value, field, rows, "put_many()")
    if not isinstance(value, (Ragged, list)) or len(value) != rows:
        what = "a Ragged or a list" if field.ragged else "a list"
        raise TypeError(f"put_many(): {field.label()} expected {what} of {rows} examples, got "
                        f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, (Ragged, list)) else ''}")
    if field.kind == "object":
        return list(value)
    if isinstance(value, Ragged):
        array = to_field_array(value.values, Field(field.name, field.shape, field.dtype), len(value.values),
                               "put_many()")
        return array, np.ascontiguousarray(value.offsets, dtype=np.int64)
    return [to_field_array(v, field, None, "put_many()") for v in value]


def _put_many_error(status: Any, done: int, rows: int, timeout: float | None) -> Exception:
    # Built here, not in the caller: an exception held in a local of the frame that
    # raises it is a reference cycle (frame, exception, traceback), which would keep
    # the buffer and its assembler thread alive until the cyclic GC runs.
    if status == _CLOSED:
        error: Exception = BufferClosed(f"put_many(): the ShuffleBuffer is closed ({done} of {rows} examples put)")
    else:
        error = TimeoutError(f"put_many(): timed out after {timeout} s ({done} of {rows} examples put)")
    error.examples_put = done  # type: ignore[attr-defined]
    return error


def _forget_after_fork() -> None:
    for buffer in list(_live):
        buffer.forget_after_fork()


def _stop_all() -> None:
    for buffer in list(_live):
        buffer.shut_down()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop_all)
