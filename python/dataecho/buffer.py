"""``ShuffleBuffer``: the native echo-aware shuffle buffer's public face. It
validates every argument and example, naming what is wrong, and keeps to one
consumer thread; dataecho's own stages use :class:`dataecho.native.echo_buffer.NativeBuffer`.

Holding: a put may hand over a large value (a field of
``dataecho.native.hold.HOLD_MIN_BYTES`` or more per example) by reference
instead of having it copied into a slot. The buffer then keeps the array alive,
gathers each batch straight from it (one copy per example instead of two), and
lets go of it with the batch that holds the example's last echo.
``ShuffleBuffer(hold="auto")`` holds what ``put`` hands over and copies
``put_many``'s stacked rows, so that a stacked array is not kept alive for the
sake of one row; ``hold=True`` holds those too (each stacked array until the
last echo of its last row: best for views of memory that lives anyway, such as
a dataset array); ``hold=False`` always copies. A held array is read-only while
it is held, so a write through it raises, and writeable again (if it was) once
the buffer lets go of it: a staging array can be reused after its examples'
last echoes, or the buffer's end. Its memory must not be changed through
another view (or a torch tensor that shares it) until the example's last echo
is delivered (dataecho.native.hold says what is held and why).
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping

import numpy as np

from . import _checks, _core
from .errors import BufferClosed
from .examples.fields import Field, field_value, parse_fields, to_field_array
from .examples.ragged import Ragged
from .examples.tree import key_mismatch
from .native.echo_buffer import NativeBuffer, park_if_exiting, put_many_error
from .native.sizing import buffer_config, page_heap

__all__ = ["ShuffleBuffer"]

_TIMEOUT = _core.Status.TIMEOUT


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
                cast by the rule in :mod:`dataecho.examples.fields`.
            timeout: seconds to wait for a free slot; None waits forever.

        Raises:
            BufferClosed: the buffer is closed (also when it closes while waiting).
            TimeoutError: no slot became free in time.
            TypeError, ValueError, OverflowError: the example does not fit.
        """
        self._native.check_process()
        try:
            self._native.put_arrays(self._arrays(example, None, "put()"), _checks.timeout(timeout))
        except BufferClosed:
            park_if_exiting()
            raise

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
        try:
            self._put_many(examples, timeout)
        except BufferClosed:
            park_if_exiting()
            raise

    def _put_many(self, examples: Any, timeout: float | None) -> None:
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
            raise put_many_error(_TIMEOUT, done, rows, timeout)

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

