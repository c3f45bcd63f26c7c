"""The compiled buffer for dataecho's own pipeline stages: named methods over
``_core.Buffer``, for callers that hand it a validated configuration and
converted arrays (the public, validating face is ``dataecho.ShuffleBuffer``).

A buffer belongs to the process that made it: in a forked child it refuses to
work, and at interpreter exit every live buffer is stopped.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any

import numpy as np

from .. import _core
from ..errors import BufferClosed
from ..examples.columns import Columns, Into
from ..examples.fields import Field, field_value
from ..examples.objects import LeafMap
from .hold import HoldPolicy

__all__ = ["NativeBuffer", "put_many_error"]

_OK, _CLOSED, _TIMEOUT = _core.Status.OK, _core.Status.CLOSED, _core.Status.TIMEOUT

_STATS = ("fresh", "delivered", "batches", "dropped", "evicted", "resident", "free_slots", "batch_blocks",
          "pages", "pages_in_use", "starved", "producer_wait_s", "consumer_wait_s")

_live: weakref.WeakSet[NativeBuffer] = weakref.WeakSet()


class NativeBuffer:
    """The compiled buffer for dataecho's stages: puts, batches, snapshots.

    Arguments are not checked here beyond what memory safety needs: callers
    pass a configuration built from validated arguments (``_core`` aborts the
    process on one that breaks its invariants) and, to ``put_arrays``, arrays
    already converted to the fields.

    Each field is one leaf of an example. Array and ragged fields are native
    fields; object fields ride in one more native field, the carrier
    (dataecho.examples.objects), after them. A batch has one entry per field: an array,
    a :class:`~dataecho.examples.ragged.Ragged`, or a list of objects.

    Args:
        fields: the example's fields.
        config: the buffer's configuration (with a page heap where a field is
            ragged, the carrier included: see :func:`page_heap`).
        restore: a snapshot to resume from (deterministic buffers).
        cache: where the buffer's memory comes from and goes back to when it is
            freed, for the next buffer of the same size (a loader's next epoch).
        objects: how object fields travel: ``"key"`` (by reference) or
            ``"pickle"`` (the buffer is shared with worker processes).
        hold: which large values are held by reference instead of copied:
            ``"sources"`` (the loader's), ``"auto"`` (ShuffleBuffer's), True
            or False (see dataecho.native.hold, which decides; shared buffers
            hold nothing).
    """

    def __init__(self, fields: list[Field], config: _core.BufferConfig, restore: _core.Snapshot | None = None,
                 cache: _core.BlockCache | None = None, objects: str = "key", hold: bool | str = "sources"):
        self.fields = fields
        self._hold = HoldPolicy(hold, shared=config.shared)
        self.private = not config.shared  # this process's own memory: examples may be written straight into slots
        config.hold_min_bytes = self._hold.min_bytes
        self.page_bytes = config.page_bytes  # of the page heap for ragged values (0: none)
        self.capacity = config.capacity
        self.paced = config.paced  # auto echo for a consumer that reads (dataecho.workers.inline_reader)
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
        self._hold.holdable = list(self._core.holdable_fields)  # native field indices
        self._pid = os.getpid()
        self.forked = False  # set in a forked child by _forget_after_fork: no syscall per call
        _live.add(self)

    # ---- producers ----

    def put_values(self, values: list, timeout_s: float | None = None, seq: int = 0, where: str = "put()") -> None:
        """Puts one example given as one value per field (converted here);
        ``seq`` is its position in the input, for deterministic intake;
        ``where`` names the values in messages."""
        self.put_arrays([field_value(v, f, None, where) for v, f in zip(values, self.fields)], timeout_s, seq)

    def put_arrays(self, arrays: list[Any], timeout_s: float | None = None, seq: int = 0) -> None:
        """Puts one example given as one converted array per field (object
        fields: the objects themselves)."""
        self.check_process()
        native = self._map.example(arrays)
        status = self._core.put(native, timeout_s, seq, self._hold.example(native))
        if status == _CLOSED:
            raise BufferClosed("put(): the ShuffleBuffer is closed")
        if status == _TIMEOUT:
            raise TimeoutError(f"put(): no free slot within {timeout_s} s")

    def put_many_arrays(self, arrays: list[np.ndarray], rows: int, timeout_s: float | None = None) -> None:
        """Puts `rows` stacked examples; on failure the exception's
        ``examples_put`` says how many went in."""
        self.check_process()
        status, done = self._core.put_many(arrays, rows, timeout_s, 0, self._hold.stacked())
        if status != _OK:
            raise put_many_error(status, done, rows, timeout_s)

    def put_each(self, columns: list | Into, rows: int, first_seq: int = 0, timeout_s: float | None = None,
                 done: int = 0) -> int:
        """Puts rows [done, rows) of ``columns`` (one per native field, the
        carrier last: see ``_core.Buffer.put_each`` and dataecho.reading.chunking.Columns;
        or an ``Into``, whose rows are written straight into their slots),
        row i numbered ``first_seq + i``; returns the rows put by then: all of
        them, or fewer when ``timeout_s`` ran out.

        Raises:
            BufferClosed: the buffer was closed or stopped.
        """
        self.check_process()
        if isinstance(columns, Into):  # written straight into slots (dataecho.examples.columns.Into)
            status, done = self._core.put_into(rows, first_seq, columns.write, timeout_s, done)
        else:
            status, done = self._core.put_each(columns, rows, timeout_s, first_seq, done, self._hold.columns(columns))
        if status == _CLOSED:
            raise BufferClosed("put(): the ShuffleBuffer is closed")
        return done

    @property
    def held(self) -> int:
        """Values (one per example and held field) held by reference now."""
        return self._core.held_values

    def columns(self, structure: Any) -> Columns:
        """What converts a list of examples of ``structure`` to this buffer's columns."""
        return Columns(structure, self.fields, self.codec, private=self.private)

    def native_columns(self, columns: list) -> list:
        """Columns of ``put_each`` given one per field: the object fields'
        columns become the carrier's (dataecho.examples.objects), last."""
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
        """Each row's sequence number (its position in the reading order), for the last batch."""
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


def put_many_error(status: Any, done: int, rows: int, timeout: float | None) -> Exception:
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


# Set at interpreter exit, before every buffer is stopped (see park_if_exiting).
_exiting = threading.Event()
_EXIT_PARK_S = 10.0


def park_if_exiting() -> None:
    """Called where a public put found its buffer closed. If the stop at
    interpreter exit closed it, and this is not the main thread (a daemon
    producer of the user's), waits for the interpreter to finalize, which ends
    the thread quietly, instead of raising a traceback over the exit; bounded,
    so that a thread joined by a later exit handler still ends."""
    if _exiting.is_set() and threading.current_thread() is not threading.main_thread():
        threading.Event().wait(_EXIT_PARK_S)


def _stop_all() -> None:
    _exiting.set()
    for buffer in list(_live):
        buffer.shut_down()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop_all)
