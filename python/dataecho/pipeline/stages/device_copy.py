"""Copies of batches to a device that overlap the training step: a
:class:`DeviceMover` on its own stream, over a :class:`Backend` (CUDA's streams
and events, or the CPU's).

The flow for ``pin_memory=True, device="cuda"``: batches are gathered into
pinned blocks (dataecho.tensors.pinned), wrapped as tensors over that memory,
and handed to a :class:`DeviceMover`, which copies batch n + 1 to the device on
its own stream while the training step runs on batch n.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

from ...tensors.convert import import_torch, map_tree, tree_leaves

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "CpuBackend", "CudaBackend", "DeviceMover"]

class Backend(Protocol):
    """The stream and event operations that :class:`DeviceMover` needs.

    Streams and events are opaque to the mover. :class:`CudaBackend` maps them
    to ``torch.cuda``; tests substitute a fake that logs the calls.
    """

    def current_stream(self) -> Any:
        """The stream the consumer's work is queued on now."""

    def new_stream(self) -> Any:
        """A new stream for copies."""

    def stream_context(self, stream: Any) -> ContextManager[Any]:
        """Makes ``stream`` the current stream inside the ``with`` block."""

    def new_event(self) -> Any:
        """A new event."""

    def record(self, event: Any, stream: Any) -> None:
        """Records ``event`` after the work queued on ``stream`` so far."""

    def query(self, event: Any) -> bool:
        """True once the work before ``event`` has completed; never blocks."""

    def synchronize(self, event: Any) -> None:
        """Blocks until the work before ``event`` has completed."""

    def wait(self, stream: Any, event: Any) -> None:
        """Makes later work on ``stream`` wait for ``event`` (no host wait)."""

    def copy(self, tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
        """A copy of ``tensor`` on ``device``, queued on the current stream."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Marks ``tensor`` as used by ``stream`` for the caching allocator."""


class CudaBackend:
    """:class:`Backend` on ``torch.cuda`` streams and events, for one device."""

    def __init__(self, device: torch.device) -> None:
        torch = import_torch()
        if not torch.cuda.is_available():
            raise RuntimeError(f"DeviceMover: device {device} needs CUDA, but torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._torch = torch
        self.device = device

    def current_stream(self) -> Any:
        return self._torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return self._torch.cuda.Stream(device=self.device)

    def stream_context(self, stream: Any) -> ContextManager[Any]:
        return self._torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return self._torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class CpuBackend:
    """:class:`Backend` for device ``"cpu"``: no streams, every event is done.

    ``copy`` makes a real copy even on the CPU: the mover releases the host
    batch (``on_done``) as soon as its copy is complete, so the batch it
    returns must not alias the host memory that goes back to the pool.
    """

    def current_stream(self) -> Any:
        return None

    def new_stream(self) -> Any:
        return None

    def stream_context(self, stream: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def new_event(self) -> Any:
        return None

    def record(self, event: Any, stream: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        pass

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def copy(self, tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
        return tensor.to(device, copy=True)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass


class DeviceMover:
    """Copies batches to a device on a dedicated stream, one batch ahead.

    ``submit`` queues the copy of batch n + 1 on the copy stream and returns at
    once, so the copy overlaps the training step on batch n; ``take`` hands
    over the oldest batch. For the copy to be asynchronous the host tensors
    must be in pinned memory (:func:`allocate_pinned`).

    Synchronization:
        (S1) ``submit`` queues the copies on the copy stream, then records the
            batch's event there: the event completes after every copy.
        (S2) ``on_done`` runs only after ``query``/``synchronize`` saw the
            event complete (after S1's copies), so the pool never reuses host
            memory a copy still reads. Events complete in the order they were
            recorded on the one copy stream; on_done runs in submission order
            and waits for every earlier batch's event too.
        (S3) ``take`` makes the consumer's current stream wait on the event
            (pairs with S1) before returning, so kernels queued later on it see
            the copied values; ``record_stream`` keeps the caching allocator
            from reusing a device tensor's memory (allocated on the copy
            stream) until the consumer's queued work is done with it.
        (S4) With ``max_unreleased``, ``submit`` first waits on the host for
            the oldest copies (S2) until fewer than that many batches are
            unreleased: a consumer faster than the link waits for it instead of
            holding ever more host blocks (past a pool's pinned blocks, batches
            would go to pageable memory, whose copies are not asynchronous).
            The copy stream waits on nothing else, so that wait always ends.

    Invariants: ``len(self)`` batches are submitted and not taken; every
    accepted batch's ``on_done`` runs exactly once, in submission order, at the
    latest in ``close()``, unless the device failed before its copy could be
    seen complete (then never: see ``close``). The mover keeps each host tree
    alive until its on_done runs, and for its own life where that never comes.
    Not thread-safe: one thread at a time (the consumer's, or the one that
    closes it); on_done runs inside ``submit``, ``take``, ``poll`` or ``close``.

    Args:
        device: the target device, e.g. ``"cuda"``, ``"cuda:1"`` or ``"cpu"``.
        backend: the :class:`Backend`; None picks :class:`CudaBackend` for a
            CUDA device and :class:`CpuBackend` for ``"cpu"``.
        max_unreleased: at most this many batches submitted and not yet
            released (S4), or None: no bound.

    Raises:
        RuntimeError: a CUDA device without CUDA available.
        ValueError: another device type with no backend given.
    """

    def __init__(self, device: Any, backend: Backend | None = None, max_unreleased: int | None = None) -> None:
        torch = import_torch()
        self.device = torch.device(device)
        if backend is None:
            if self.device.type == "cuda":
                backend = CudaBackend(self.device)
                self.device = backend.device
            elif self.device.type == "cpu":
                backend = CpuBackend()
            else:
                raise ValueError(f"device: expected a 'cuda' or 'cpu' device, got {str(self.device)!r}")
        self._torch = torch
        self._backend = backend
        self.stream = backend.new_stream()
        self._ready: deque[tuple[Any, Any]] = deque()  # (device tree, event), not yet taken
        self._pending: deque[tuple[Any, Any, Callable[[], Any] | None]] = deque()  # (event, host tree, on_done)
        # Host trees whose copies could not be seen complete (the device failed): never released.
        self._unconfirmed: list[Any] = []
        self._max_unreleased = max_unreleased
        self._closed = False

    def submit(self, host_tree: Any, on_done: Callable[[], Any] | None = None) -> None:
        """Starts the asynchronous copy of one batch to the device.

        Args:
            host_tree: a tensor, or dicts, tuples and lists nested of tensors.
            on_done: called with no arguments once the copy has completed,
                to give the host memory back to its pool.

        Raises:
            RuntimeError: the mover is closed.
            TypeError: a leaf is not a tensor, named by its path. If submit
                raises, the batch is not accepted: no copy from it is still in
                flight and on_done will not be called.
        """
        if self._closed:
            raise RuntimeError("DeviceMover.submit(): the mover is closed")
        map_tree(self._check_leaf, host_tree, "host_tree")
        while self._max_unreleased is not None and len(self._pending) >= max(1, self._max_unreleased):
            self._release_oldest()  # (S4)
        backend, stream = self._backend, self.stream
        event = backend.new_event()
        try:
            with backend.stream_context(stream):
                device_tree = map_tree(
                    lambda t, _: backend.copy(t, self.device, non_blocking=True), host_tree, "host_tree"
                )
            backend.record(event, stream)  # (S1)
        except BaseException:
            # Some copies may be queued: wait for them so the caller may reuse the memory.
            # Where the device itself failed that wait fails too: the error that
            # reaches the caller is the copy's, and the host tree is kept, unreleased.
            try:
                backend.record(event, stream)
                backend.synchronize(event)
            except Exception:  # noqa: BLE001 - the copy's own error is raised below
                self._unconfirmed.append(host_tree)
            raise
        self._ready.append((device_tree, event))
        self._pending.append((event, host_tree, on_done))
        self.poll()

    def take(self) -> Any:
        """Returns the oldest submitted batch as device tensors.

        The consumer's current stream waits (on the device) for the batch's
        copies; the host does not wait.

        Raises:
            IndexError: no batch is waiting (every submitted batch was taken).
            RuntimeError: the mover is closed.
        """
        if self._closed:
            raise RuntimeError("DeviceMover.take(): the mover is closed")
        if not self._ready:
            raise IndexError("DeviceMover.take(): no batch waiting; submit() one first")
        device_tree, event = self._ready.popleft()
        backend = self._backend
        current = backend.current_stream()
        backend.wait(current, event)  # (S3)
        for tensor in tree_leaves(device_tree):
            backend.record_stream(tensor, current)
        self.poll()
        return device_tree

    def poll(self) -> int:
        """Runs ``on_done`` for the batches whose copies have completed, oldest
        first, stopping at the first that has not; never blocks.

        Returns:
            The number of batches released by this call.
        """
        released = 0
        while self._pending and self._backend.query(self._pending[0][0]):  # (S2)
            _, _, on_done = self._pending.popleft()
            released += 1
            if on_done is not None:
                on_done()
        return released

    def _release_oldest(self) -> None:
        """Waits on the host for the oldest unreleased batch's copy, then releases it."""
        event, _, on_done = self._pending[0]
        self._backend.synchronize(event)  # (S2); raises where the device failed: the batch stays for close()
        self._pending.popleft()
        if on_done is not None:
            on_done()

    def close(self) -> None:
        """Waits for every outstanding copy, runs each pending ``on_done`` and
        drops the batches not taken. Idempotent; never blocks for ever (every
        copy is queued on the copy stream, which waits on nothing else).

        Where a wait fails (the device failed: a CUDA error in the training
        step, say, leaves the context unusable), that batch's copy cannot be
        seen complete: its on_done is not called, and its host tree is kept,
        never released, so that its memory is not reused under a copy. Every
        other batch is still waited for and released.

        Raises:
            Exception: the first exception a wait or an on_done raised, after
                every batch has been waited for or given up on.
        """
        self._closed = True
        self._ready.clear()
        error: BaseException | None = None
        while self._pending:
            event, host_tree, on_done = self._pending.popleft()
            try:
                self._backend.synchronize(event)  # (S2)
            except Exception as exc:  # the device failed: keep the memory, go on with the others
                self._unconfirmed.append(host_tree)
                error = error or exc
                continue
            try:
                if on_done is not None:
                    on_done()
            except Exception as exc:  # keep releasing; report the first
                error = error or exc
        if error is not None:
            raise error

    @property
    def closed(self) -> bool:
        """True once ``close()`` has been called."""
        return self._closed

    def __len__(self) -> int:
        return len(self._ready)

    def __enter__(self) -> DeviceMover:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DeviceMover({str(self.device)!r}; waiting={len(self._ready)}, "
            f"unreleased={len(self._pending)}{', closed' if self._closed else ''})"
        )

    def _check_leaf(self, leaf: Any, path: str) -> None:
        if not isinstance(leaf, self._torch.Tensor):
            raise TypeError(f"DeviceMover.submit(): {path}: expected a torch.Tensor, got {type(leaf).__name__}")
