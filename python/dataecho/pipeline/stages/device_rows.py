"""The device-resident examples of the device echo stage
(dataecho.pipeline.stages.device_echo): one tensor per leaf on the device,
``slots`` rows each, written once per fresh example and gathered by index for
every batch.

Memory safety: the stage never hands out these tensors or a view of them.
``gather`` returns new tensors (``index_select``), so a slot is rewritten for
the next fresh example while batches gathered from it live on; on a CUDA
device both are queued on the consumer's current stream, in the order they
were asked for, so the write waits for every earlier gather. Where the loop
changes its current stream between batches, the new stream first waits for
the work queued on the one used before (``wait_stream``, on the device: the
host does not wait), so that the order holds across streams too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...examples.ragged import Padded, Ragged
from ...tensors.convert import import_torch

__all__ = ["DeviceRows"]


class DeviceRows:
    """``slots`` rows of every leaf, on ``device``; allocated at the first write.

    Args:
        device: the torch device.
        slots: rows per leaf.
        paths: the leaves' paths, for messages.
    """

    def __init__(self, device: Any, slots: int, paths: list[str]) -> None:
        self._torch = import_torch()
        self.device = self._torch.device(device)
        self.slots = slots
        self._paths = paths
        self._leaves: list[Any] | None = None
        self._stream: Any = None  # CUDA: the stream the last write or gather was queued on

    @property
    def nbytes(self) -> int:
        """Bytes of device memory held (0 before the first write and after release)."""
        return 0 if self._leaves is None else sum(t.numel() * t.element_size() for t in self._leaves)

    def check_host(self, leaves: tuple) -> None:
        """Refuses leaves that cannot be kept as fixed-shape rows on the device.

        Raises:
            ValueError: a ragged, padded or object leaf, named by its path.
        """
        for leaf, path in zip(leaves, self._paths):
            if isinstance(leaf, (Ragged, Padded, list)):
                kind = "a list of objects" if isinstance(leaf, list) else "ragged"
                raise ValueError(f"echo_at: 'device' keeps examples as fixed-shape rows on the device; leaf "
                                 f"{path or 'example'!r} is {kind}; echo it on the host (echo_at='example')")

    def write(self, slots: np.ndarray, leaves: list[Any]) -> None:
        """Rows ``slots`` of every leaf become ``leaves`` (device tensors, one row per slot)."""
        if self._leaves is None:
            self._allocate(leaves)
        self._follow_stream()
        index = self._index(slots)
        for kept, leaf in zip(self._leaves, leaves):
            kept.index_copy_(0, index, leaf)

    def gather(self, slots: np.ndarray) -> list[Any]:
        """New tensors of rows ``slots`` of every leaf, in that order."""
        self._follow_stream()
        index = self._index(slots)
        return [kept.index_select(0, index) for kept in self._leaves]

    def release(self) -> None:
        """Gives the device memory back (to torch's allocator)."""
        self._leaves = None

    def _follow_stream(self) -> None:
        """CUDA: work on the rows goes on the current stream, after what the previous one queued on them."""
        if self.device.type != "cuda":
            return
        current = self._torch.cuda.current_stream(self.device)
        if self._stream is not None and current != self._stream:
            current.wait_stream(self._stream)
        self._stream = current

    def _index(self, slots: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)

    def _allocate(self, leaves: list[Any]) -> None:
        torch = self._torch
        row_bytes = sum(leaf[0].numel() * leaf.element_size() for leaf in leaves)
        need = self.slots * row_bytes
        free = _free_bytes(torch, self.device)
        if free is not None and need > free:
            raise RuntimeError(_too_large(self.slots, row_bytes, self.device, free))
        try:
            self._leaves = [torch.empty((self.slots, *leaf.shape[1:]), dtype=leaf.dtype, device=self.device)
                            for leaf in leaves]
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            self._leaves = None
            raise RuntimeError(_too_large(self.slots, row_bytes, self.device, free) + f" ({exc})") from None


def _free_bytes(torch: Any, device: Any) -> int | None:
    """Free memory on a CUDA device (None elsewhere: the allocation itself says)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def _too_large(slots: int, row_bytes: int, device: Any, free: int | None) -> str:
    have = f", {free / 2**30:.2f} GiB free" if free is not None else ""
    return (f"shuffle_buffer: with echo_at='device', {slots} rows of {row_bytes} bytes "
            f"({slots * row_bytes / 2**30:.2f} GiB) do not fit on {device}{have}; give a smaller shuffle_buffer")
