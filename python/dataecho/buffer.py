"""``ShuffleBuffer``: the native echo-aware shuffle buffer, with a NumPy face."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any, Iterator, Mapping

import numpy as np

from . import _checks, _core
from .errors import BufferClosed
from .fields import Field, parse_fields, to_field_array
from .structure import key_mismatch

__all__ = ["ShuffleBuffer"]

_OK, _CLOSED, _TIMEOUT = 0, 1, 2
_MAX_CAPACITY = 1 << 31
_MAX_ECHO = float(1 << 32)
_live: weakref.WeakSet[ShuffleBuffer] = weakref.WeakSet()


class ShuffleBuffer:
    """A bounded shuffle buffer that echoes examples and yields shuffled batches.

    Producers (any number of threads) ``put`` examples; each is copied once into
    a native slot and repeated ``echo_factor`` times on average (``floor(e)``
    times plus one more with probability ``e - floor(e)``). A native thread
    draws uniformly among the resident examples, without replacement within a
    batch, and copies them into batch memory that the yielded arrays view
    without a further copy. A batch stays valid, unchanged, for as long as any
    of its arrays is alive.

    Args:
        fields: ``(shape, dtype)`` for plain array examples, or a mapping
            ``name -> (shape, dtype)`` for dict examples.
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

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
    """

    def __init__(
        self,
        fields: Any,
        capacity: int = 4096,
        batch_size: int = 256,
        echo_factor: float = 1.0,
        seed: int | None = None,
        drop_last: bool = False,
        prefetch: int = 2,
        initial: int | None = None,
        max_echo: float = 4.0,
        _shared: bool = False,
        _deterministic: bool = False,
        _exact_echo: bool = False,
        _restore: dict | None = None,
    ) -> None:
        self._fields, self._single = parse_fields(fields)
        capacity = _checks.positive_int("capacity", capacity, _MAX_CAPACITY)
        batch_size = _checks.positive_int("batch_size", batch_size)
        if batch_size > capacity:
            raise ValueError(f"batch_size: {batch_size} is larger than capacity {capacity}")
        auto_echo = isinstance(echo_factor, str)
        if auto_echo and echo_factor != "auto":
            raise ValueError(f"echo_factor: expected a number >= 1 or 'auto', got {echo_factor!r}")
        if auto_echo and (_deterministic or _exact_echo):
            raise ValueError("echo_factor: 'auto' depends on timing, so it cannot be deterministic")
        echo_factor = 1.0 if auto_echo else _checks.real("echo_factor", echo_factor, 1.0, _MAX_ECHO)
        max_echo = _checks.real("max_echo", max_echo, 1.0, _MAX_ECHO)
        drop_last = _checks.flag("drop_last", drop_last)
        prefetch = _checks.positive_int("prefetch", prefetch, 1 << 16)
        if initial is not None:
            initial = _checks.positive_int("initial", initial, capacity)
        self._check_sizes(capacity, batch_size)
        try:
            self._core = _core.Buffer(
                [(f.shape, f.dtype) for f in self._fields],
                capacity,
                batch_size,
                echo_factor,
                auto_echo,
                max_echo,
                _checks.seed(seed),
                drop_last,
                prefetch,
                initial or 0,
                _shared,
                _deterministic,
                _exact_echo,
                _restore,
            )
        except MemoryError:
            example = sum(f.nbytes for f in self._fields)
            raise MemoryError(
                f"capacity: cannot allocate {capacity} slots of {example} bytes "
                f"({capacity * example / 2**30:.1f} GiB); lower capacity"
            ) from None
        self.capacity = capacity
        self.batch_size = batch_size
        self.echo_factor: float | str = "auto" if auto_echo else echo_factor
        self.max_echo = max_echo
        self.drop_last = drop_last
        self.prefetch = prefetch
        self.initial = int(self._core.initial)
        self._names = [f.name for f in self._fields]
        self._closed = False
        self._pid = os.getpid()
        self._forked = False  # set in a forked child by _forget_after_fork: no syscall per call
        self._consumer = threading.Lock()
        _live.add(self)

    def _check_sizes(self, capacity: int, batch_size: int) -> None:
        example = sum(f.nbytes for f in self._fields)
        for what, count in (("capacity", capacity), ("batch_size", batch_size)):
            if example * count > 1 << 62:
                raise ValueError(
                    f"{what}: {count} examples of {example} bytes overflow the addressable size"
                )

    @property
    def fields(self) -> list[Field]:
        """The declared fields, in order."""
        return list(self._fields)

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._closed

    # ---- producers ----

    def put(self, example: Any, timeout: float | None = None) -> None:
        """Copies one example into the buffer; blocks while it is full.

        Args:
            example: a dict ``name -> array`` (or one array for a single field),
                cast by the rule in :mod:`dataecho.fields`.
            timeout: seconds to wait for a free slot; None waits forever.

        Raises:
            BufferClosed: the buffer is closed (also when it closes while waiting).
            TimeoutError: no slot became free in time.
            TypeError, ValueError, OverflowError: the example does not fit.
        """
        self._check_process()
        self._put_arrays(self._arrays(example, None, "put()"), timeout)

    def _put_values(self, values: list, timeout: float | None = None, seq: int = 0) -> None:
        """Like ``put``, for an example already flattened to one value per field;
        ``seq`` is its position in the input, for deterministic intake."""
        self._check_process()
        arrays = [to_field_array(v, f, None, "put()") for v, f in zip(values, self._fields)]
        self._put_arrays(arrays, timeout, seq)

    def _put_arrays(self, arrays: list[np.ndarray], timeout: float | None, seq: int = 0) -> None:
        status = self._core.put(arrays, _checks.timeout(timeout), seq)
        if status == _CLOSED:
            raise BufferClosed("put(): the ShuffleBuffer is closed")
        if status == _TIMEOUT:
            raise TimeoutError(f"put(): no free slot within {timeout} s")

    def put_many(self, examples: Any, timeout: float | None = None) -> None:
        """Copies n stacked examples (leading axis n) into the buffer.

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
        self._check_process()
        rows = self._rows(examples)
        if rows == 0:
            return
        arrays = self._arrays(examples, rows, "put_many()")
        status, done = self._core.put_many(arrays, rows, _checks.timeout(timeout), 0)
        if status == _OK:
            return
        raise _put_many_error(status, done, rows, timeout)

    def close(self) -> None:
        """Ends the input: later puts raise BufferClosed, blocked ones are released,
        and iteration delivers what is left (echoes included), then stops. Idempotent."""
        self._closed = True
        if not self._forked:
            self._core.close()

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
        arrays = self._next_arrays(timeout)
        return arrays[0] if self._single else dict(zip(self._names, arrays))

    def _next_arrays(self, timeout: float | None = None) -> tuple[np.ndarray, ...]:
        """Like ``next_batch``, returning one array per field, in field order."""
        self._check_process()
        if not self._consumer.acquire(blocking=False):
            raise RuntimeError("ShuffleBuffer: another thread is already iterating this buffer")
        try:
            status, arrays = self._core.next(_checks.timeout(timeout))
        finally:
            self._consumer.release()
        if status == _CLOSED:
            raise StopIteration
        if status == _TIMEOUT:
            raise TimeoutError(f"next_batch(): no batch within {timeout} s")
        return arrays

    def _snapshot(self, timeout: float | None = None) -> dict[str, Any]:
        """Deterministic buffers: the state before the next batch to be assembled
        (resident examples by sequence number, echo counts, RNG counter, intake
        position) and the rows of the batches assembled but not yet taken."""
        self._check_process()
        status, state = self._core.snapshot(_checks.timeout(timeout))
        if status == _CLOSED:
            raise BufferClosed("state: the ShuffleBuffer was stopped")
        if status == _TIMEOUT:
            raise TimeoutError(f"state: the batch being assembled did not finish within {timeout} s")
        return state

    def _abort(self) -> None:
        """Stops at once: blocked producers get BufferClosed, the consumer the end,
        and what is resident is dropped. For pipelines shutting down on an error."""
        self._closed = True
        if not self._forked:
            self._core.stop()

    def stats(self) -> dict[str, Any]:
        """Counters: fresh (examples put), delivered (examples in yielded batches),
        batches, dropped (echoes lost to drop_last), evicted (with "auto": unspent
        budget of examples freed to make room), resident, producer_wait_s,
        consumer_wait_s, and echo_factor_achieved (delivered / fresh)."""
        self._check_process()
        stats = self._core.stats()
        stats["echo_factor_achieved"] = stats["delivered"] / stats["fresh"] if stats["fresh"] else 0.0
        return stats

    def __enter__(self) -> ShuffleBuffer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        fields = (
            f"{self._fields[0].shape}, {self._fields[0].dtype}"
            if self._single
            else ", ".join(f"{f.name}: {f.shape} {f.dtype}" for f in self._fields)
        )
        return (
            f"ShuffleBuffer({fields}; capacity={self.capacity}, batch_size={self.batch_size}, "
            f"echo_factor={self.echo_factor}{', closed' if self._closed else ''})"
        )

    # ---- internals ----

    def _check_process(self) -> None:
        if self._forked:
            raise RuntimeError(
                f"ShuffleBuffer was created in process {self._pid} and cannot be used in a forked "
                f"child ({os.getpid()}); create the buffer in the process that uses it"
            )

    def _arrays(self, example: Any, rows: int | None, where: str) -> list[np.ndarray]:
        if self._single:
            return [to_field_array(example, self._fields[0], rows, where)]
        if not isinstance(example, Mapping):
            raise TypeError(f"{where}: expected a dict with fields {self._names}, got {type(example).__name__}")
        mismatch = key_mismatch(self._names, example)
        if mismatch is not None:
            raise ValueError(
                f"{where}: example fields do not match: missing {mismatch[0]}, unexpected {mismatch[1]}"
            )
        return [to_field_array(example[f.name], f, rows, where) for f in self._fields]

    def _rows(self, examples: Any) -> int:
        first = examples if self._single else None
        if not self._single:
            if not isinstance(examples, Mapping):
                raise TypeError(
                    f"put_many(): expected a dict of stacked arrays with fields {self._names}, "
                    f"got {type(examples).__name__}"
                )
            first = examples.get(self._names[0])
        try:
            shape = np.shape(first) if first is not None else ()
        except (TypeError, ValueError) as exc:  # ragged lists, say
            raise TypeError(
                f"put_many(): {self._fields[0].label()} could not be read as stacked arrays: {exc}"
            ) from None
        if len(shape) < 1:
            raise ValueError("put_many(): expected stacked arrays with a leading axis of examples")
        return int(shape[0])


def _put_many_error(status: int, done: int, rows: int, timeout: float | None) -> Exception:
    # Built here, not in put_many(): an exception held in a local of the frame that
    # raises it is a reference cycle (frame, exception, traceback), which would keep
    # the buffer and its assembler thread alive until the cyclic GC runs.
    if status == _CLOSED:
        error: Exception = BufferClosed(f"put_many(): the ShuffleBuffer is closed ({done} of {rows} examples put)")
    else:
        error = TimeoutError(f"put_many(): timed out after {timeout} s ({done} of {rows} examples put)")
    error.examples_put = done  # type: ignore[attr-defined]
    return error


def _forget_after_fork() -> None:
    # The child has no assembler thread: leak each core instead of joining it.
    for buffer in list(_live):
        buffer._forked = True
        buffer._core.abandon_after_fork()


def _stop_all() -> None:
    # At interpreter exit, release blocked producers, stop the assembler threads
    # and remove any shared-memory name still linked (workers that never attached).
    for buffer in list(_live):
        if not buffer._forked:
            buffer._core.stop()
            buffer._core.unlink_region()


os.register_at_fork(after_in_child=_forget_after_fork)
atexit.register(_stop_all)
