"""torch integration: zero-copy tensors, tensors of dtypes NumPy lacks, pinned
host memory, and copies to a device that overlap the training step.

torch is imported on first use, never when this module is imported, so
``import dataecho`` works without torch installed.

The flow for ``pin_memory=True, device="cuda"``: batches are gathered into
pinned blocks from :func:`allocate_pinned`, wrapped as tensors by
:func:`to_torch`, and handed to a :class:`DeviceMover`, which copies batch
n + 1 to the device on its own stream while the training step runs on batch n.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

import numpy as np

from . import _checks

if TYPE_CHECKING:
    import torch

__all__ = [
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "DeviceMover",
    "allocate_pinned",
    "import_torch",
    "leaf_to_torch",
    "nested_from_packed",
    "raw_bytes",
    "raw_to_tensor",
    "pin_batch_memory",
    "pinned_pointers",
    "to_torch",
]

# torch.from_numpy warns (once per process) that a read-only array gives a
# tensor that must not be written; to_torch documents that instead.
_READ_ONLY_WARNING = "The given NumPy array is not writable"
# The torch integer dtype of each item size: what a raw leaf's bytes are viewed as.
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def import_torch() -> Any:
    """torch, imported now; an ImportError that says how to install it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "dataecho.torch_support needs torch: pip install 'dataecho[torch]'"
        ) from exc
    return torch


# ---- trees ----


def _map_tree(fn: Callable[[Any, str], Any], tree: Any, path: str) -> Any:
    """Applies ``fn(leaf, path)`` to every leaf; dicts, tuples (named ones
    included) and lists keep their structure and key order."""
    if isinstance(tree, dict):
        return {key: _map_tree(fn, value, f"{path}[{key!r}]") for key, value in tree.items()}
    if isinstance(tree, tuple):
        items = [_map_tree(fn, value, f"{path}[{i}]") for i, value in enumerate(tree)]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    if isinstance(tree, list):
        return [_map_tree(fn, value, f"{path}[{i}]") for i, value in enumerate(tree)]
    return fn(tree, path)


def _leaves(tree: Any) -> list[Any]:
    out: list[Any] = []
    _map_tree(lambda leaf, _: out.append(leaf), tree, "")
    return out


# ---- zero-copy conversion ----


def to_torch(tree: Any) -> Any:
    """Wraps a batch tree of NumPy arrays as torch tensors, without copying.

    Each tensor shares memory with its array and keeps the array (and so the
    batch lease that owns the memory) alive. A read-only array gives a tensor
    that must not be written to: torch has no read-only tensors, and a write
    would change the batch in place (or fault, for read-only pages).

    Args:
        tree: an ndarray, or dicts, tuples and lists nested of ndarrays.

    Returns:
        The same structure (dicts in key order, named tuples keep their type)
        with a tensor for each array.

    Raises:
        TypeError: a leaf is not an ndarray, or its dtype has no torch
            equivalent (bytes, str, object, structured, datetime, ...); the
            message names the leaf's path, e.g. ``tree['image']``.
        ValueError: an array has negative strides or non-native byte order,
            which torch cannot view without a copy; named the same way.
        ImportError: torch is not installed.
    """
    torch = import_torch()
    return _map_tree(lambda leaf, path: _array_to_tensor(torch, leaf, path), tree, "tree")


def _array_to_tensor(torch: Any, array: Any, path: str) -> torch.Tensor:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"to_torch(): {path}: expected a numpy.ndarray, got {type(array).__name__}")
    if array.dtype.fields is not None or array.dtype.kind not in "biufc":
        raise TypeError(f"to_torch(): {path}: torch has no dtype for numpy {array.dtype!r}")
    try:
        return _from_numpy(torch, array)
    except TypeError as exc:  # a numeric dtype this torch build lacks (uint16 before 2.3)
        raise TypeError(f"to_torch(): {path}: torch has no dtype for numpy {array.dtype!r} ({exc})") from None
    except ValueError as exc:  # negative strides, byte-swapped
        raise ValueError(f"to_torch(): {path}: cannot view this array without a copy: {exc}") from None


def _from_numpy(torch: Any, array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy``, without its warning for a read-only array (the
    callers document that such a tensor must not be written)."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
        return torch.from_numpy(array)


# ---- ragged leaves and lists ----


def nested_from_packed(values: Any, offsets: Any, bounds: tuple[int, int] | None = None) -> torch.Tensor:
    """A nested tensor of layout ``torch.jagged`` whose rows are
    ``values[offsets[i]:offsets[i + 1]]``, over the same memory (no copy).

    Args:
        values: ``(total, *row_shape)``, a NumPy array or a tensor.
        offsets: ``(batch + 1,)`` int64, from 0, non-decreasing.
        bounds: (shortest, longest) row, where known (offsets on a device:
            reading them would wait for the device).
    """
    torch = import_torch()
    if bounds is None:
        # NumPy's diff and reductions on a small array cost a tenth of torch's.
        lengths = np.diff(offsets) if isinstance(offsets, np.ndarray) else offsets.diff()
        bounds = (int(lengths.min()), int(lengths.max())) if len(lengths) else (0, 0)
    if isinstance(values, np.ndarray):
        values, offsets = _from_numpy(torch, values), _from_numpy(torch, offsets)
    # The longest row told up front: without it torch's to_padded_tensor pads
    # to the total length (torch 2.13), and nothing needs to compute it later.
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, min_seqlen=bounds[0],
                                                  max_seqlen=bounds[1])


def leaf_to_torch(leaf: Any) -> Any:
    """One batch leaf as torch gives it: an array as a tensor over its memory,
    a ragged leaf as a jagged nested tensor over its memory, a
    :class:`~dataecho.ragged.Padded` as one of tensors, a list as it is."""
    from .ragged import Padded, Ragged

    if isinstance(leaf, Ragged):
        return nested_from_packed(leaf.values, leaf.offsets)
    if isinstance(leaf, Padded):
        torch = import_torch()
        return Padded(_from_numpy(torch, leaf.data), _from_numpy(torch, leaf.lengths))
    if isinstance(leaf, list):
        return leaf
    return _array_to_tensor(import_torch(), leaf, "leaf")


# ---- dtypes NumPy lacks ----
#
# A leaf of a torch dtype with no NumPy equivalent (bfloat16, float8_*, complex32,
# ...) travels as its bytes: a NumPy array of the unsigned integer of the same
# item size (bfloat16 as uint16), viewed back as the torch dtype on the way out.
# Both directions are views: the bits are kept exactly and nothing is copied.


def raw_bytes(tensor: torch.Tensor, path: str) -> np.ndarray:
    """The bytes of a CPU tensor whose dtype NumPy lacks, as a NumPy array.

    Args:
        tensor: a dense CPU tensor (bfloat16, float8_e4m3fn, complex32, ...).
        path: the leaf's path, for messages.

    Returns:
        An array of the unsigned integer of the tensor's item size (uint16 for
        bfloat16), of its shape and strides, over its memory (no copy; a
        conjugate or negative view is resolved first, which copies).

    Raises:
        TypeError: the tensor is quantized (its bytes are not its values without
            its scale and zero point), not dense, or its items have no integer
            of their size; the message names the leaf.
    """
    torch = import_torch()
    what = f"example: leaf {path!r} is a {tensor.dtype} tensor"
    expected = "expected a dtype that NumPy has or whose bytes are its values (bfloat16, float8_*, complex32, ...)"
    # Checked before any view: viewing a quantized tensor as integers crashes torch 2.13.
    if tensor.is_quantized:
        raise TypeError(f"{what}, whose values need its scale and zero point; {expected}: give "
                        f"tensor.dequantize(), or tensor.int_repr() and the scale as leaves of their own")
    if tensor.layout != torch.strided:
        raise TypeError(f"example: leaf {path!r} is a {tensor.layout} tensor; expected a dense tensor "
                        f"(tensor.to_dense())")
    size = tensor.element_size()
    if size not in _INT_OF_SIZE:
        raise TypeError(f"{what} of {size}-byte items; {expected}")
    tensor = tensor.detach().resolve_conj().resolve_neg()
    try:
        ints = tensor.view(getattr(torch, _INT_OF_SIZE[size]))
    except RuntimeError as exc:
        raise TypeError(f"{what} whose bytes torch cannot view as integers ({exc}); {expected}") from None
    return ints.numpy().view(f"u{size}")


def raw_to_tensor(leaf: Any, dtype_name: str, copy: bool = False) -> torch.Tensor:
    """A leaf stored by :func:`raw_bytes` as a tensor of its own dtype again.

    Args:
        leaf: the unsigned integer array (or NumPy scalar) of its bytes, or a
            tensor of them (on a device, say).
        dtype_name: the torch dtype, as ``str(dtype)`` gives it (``"torch.bfloat16"``).
        copy: give the tensor its own memory; else it views ``leaf``'s memory
            (and keeps it alive), read-only or not: torch has no read-only
            tensors, so such a tensor must not be written to.

    Returns:
        A tensor of ``dtype_name``, bit for bit the bytes of ``leaf``.
    """
    torch = import_torch()
    if isinstance(leaf, (np.ndarray, np.generic)):
        ints = np.asarray(leaf).view(f"i{leaf.dtype.itemsize}")  # signed: torch < 2.3 has no uint16/32/64
        leaf = _from_numpy(torch, ints.copy() if copy else ints)
    elif copy:
        leaf = leaf.clone()
    return leaf.view(getattr(torch, dtype_name.rpartition(".")[2]))


# ---- pinned host memory ----


def allocate_pinned(nbytes: int, count: int) -> list[torch.Tensor]:
    """Allocates ``count`` page-locked host blocks of ``nbytes`` bytes each.

    Pinned memory lets host-to-device copies run asynchronously. The blocks
    are allocated once; keep the returned tensors alive for as long as
    anything uses their memory (see :func:`pinned_pointers`).

    Args:
        nbytes: bytes per block.
        count: number of blocks.

    Returns:
        ``count`` one-dimensional uint8 CPU tensors of ``nbytes`` elements.

    Raises:
        RuntimeError: CUDA is not available (checked before allocating).
        TypeError, ValueError: a bad argument, named in the message.
    """
    nbytes = _checks.positive_int("nbytes", nbytes)
    count = _checks.positive_int("count", count)
    torch = import_torch()
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"pin_memory=True needs CUDA, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
            f"use pin_memory=False"
        )
    return [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]


def pinned_pointers(blocks: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Returns ``(data_ptr, nbytes)`` for each block, for the native pool.

    The pointers are valid only while the tensors are alive: the caller keeps
    ``blocks`` for as long as the pool may touch the memory.

    Raises:
        ValueError: a block is not contiguous, so its bytes are not one range.
    """
    out = []
    for i, block in enumerate(blocks):
        if not block.is_contiguous():
            raise ValueError(f"pinned_pointers(): blocks[{i}] is not contiguous")
        out.append((int(block.data_ptr()), block.numel() * block.element_size()))
    return out


def pin_batch_memory(buffer: Any, count: int) -> None:
    """Gives ``buffer`` (a NativeBuffer) ``count`` page-locked blocks of batch
    memory, allocated once; past those its pool falls back to pageable memory."""
    blocks = allocate_pinned(buffer.batch_bytes, count)
    for block, (address, nbytes) in zip(blocks, pinned_pointers(blocks)):
        buffer.add_batch_memory(address, nbytes, block)


# ---- copies to a device ----


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

    Invariants: ``len(self)`` batches are submitted and not taken; every
    accepted batch's ``on_done`` runs exactly once, in submission order, at the
    latest in ``close()``. The mover keeps each host tree alive until its
    on_done runs. Not thread-safe: use it from the consumer thread; on_done
    runs on that thread, inside ``submit``, ``take``, ``poll`` or ``close``.

    Args:
        device: the target device, e.g. ``"cuda"``, ``"cuda:1"`` or ``"cpu"``.
        backend: the :class:`Backend`; None picks :class:`CudaBackend` for a
            CUDA device and :class:`CpuBackend` for ``"cpu"``.

    Raises:
        RuntimeError: a CUDA device without CUDA available.
        ValueError: another device type with no backend given.
    """

    def __init__(self, device: Any, backend: Backend | None = None) -> None:
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
        _map_tree(self._check_leaf, host_tree, "host_tree")
        backend, stream = self._backend, self.stream
        event = backend.new_event()
        try:
            with backend.stream_context(stream):
                device_tree = _map_tree(
                    lambda t, _: backend.copy(t, self.device, non_blocking=True), host_tree, "host_tree"
                )
            backend.record(event, stream)  # (S1)
        except BaseException:
            # Some copies may be queued: wait for them so the caller may reuse the memory.
            backend.record(event, stream)
            backend.synchronize(event)
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
        for tensor in _leaves(device_tree):
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

    def close(self) -> None:
        """Waits for every outstanding copy, runs each pending ``on_done`` and
        drops the batches not taken. Idempotent.

        Raises:
            Exception: the first exception an on_done raised, after every
                other on_done has run.
        """
        self._closed = True
        self._ready.clear()
        error: BaseException | None = None
        while self._pending:
            event, _, on_done = self._pending.popleft()
            self._backend.synchronize(event)  # (S2)
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
