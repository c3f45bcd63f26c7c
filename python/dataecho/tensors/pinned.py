"""Page-locked (pinned) host memory for batches, so that their copies to a CUDA
device run asynchronously: allocated once, handed to a buffer's batch pool."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from .. import _checks
from .convert import import_torch

if TYPE_CHECKING:
    import torch

__all__ = ["allocate_pinned", "pin_batch_memory", "pinned_pointers"]

def allocate_pinned(nbytes: int, count: int, device: Any = None) -> list[torch.Tensor]:
    """Allocates ``count`` page-locked host blocks of ``nbytes`` bytes each.

    Pinned memory lets host-to-device copies run asynchronously. The blocks
    are allocated once; keep the returned tensors alive for as long as
    anything uses their memory (see :func:`pinned_pointers`).

    Args:
        nbytes: bytes per block.
        count: number of blocks.
        device: the CUDA device the blocks are copied to, or None. They are
            allocated with it as the current device: in a process that has not
            used CUDA yet, page-locking creates a context on the current device
            (device 0 unless set), which on another rank's GPU costs its memory.

    Returns:
        ``count`` one-dimensional uint8 CPU tensors of ``nbytes`` elements.

    Raises:
        RuntimeError: CUDA is not available (checked before allocating), or the
            memory could not be page-locked (the blocks locked so far are freed).
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
    device = torch.device(device) if device is not None else None
    blocks: list[torch.Tensor] = []
    with torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext():
        for i in range(count):
            try:
                blocks.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
            except RuntimeError as exc:  # cudaHostAlloc failed: out of page-lockable memory, say
                blocks.clear()  # gives the blocks locked so far back
                raise RuntimeError(
                    f"pin_memory=True: could not page-lock batch memory, block {i + 1} of {count} "
                    f"({_mib(nbytes)} each, {_mib(nbytes * count)} in all): {exc}. Use pin_memory=False, or "
                    f"fewer or smaller batches in flight (batch_size, prefetch_factor)"
                ) from exc
    return blocks


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


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


def pin_batch_memory(buffer: Any, count: int, device: Any = None) -> None:
    """Gives ``buffer`` (a NativeBuffer) ``count`` page-locked blocks of batch
    memory, allocated once (for ``device``: see :func:`allocate_pinned`); past
    those its pool falls back to pageable memory."""
    blocks = allocate_pinned(buffer.batch_bytes, count, device)
    for block, (address, nbytes) in zip(blocks, pinned_pointers(blocks)):
        buffer.add_batch_memory(address, nbytes, block)
