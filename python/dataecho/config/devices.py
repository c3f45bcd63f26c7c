"""What the loop gets and where: ``output``, torch's ``device`` and
``jax_device``, checked together, since each device belongs to one output.

- ``device`` is torch's: batches are copied there on CUDA streams one batch
  ahead (dataecho.pipeline.stages.device_copy), so it takes torch devices only.
- ``jax_device`` is JAX's: each batch is handed to ``jax.device_put`` there
  (without a copy on a CPU device: dataecho.tensors.jax_arrays).

Keeping them apart means ``output="jax"`` never needs torch, and a torch
device never means a JAX one; the other combinations are refused here.
"""

from __future__ import annotations

from typing import Any

from .. import _checks
from ..examples.outputs import OUTPUTS
from ..tensors.convert import import_torch
from ..tensors.jax_arrays import resolve_device

__all__ = ["check_output"]



def check_output(output: Any, device: Any, jax_device: Any, pin_memory: Any, collate_fn: Any
                 ) -> tuple[str, Any, Any]:
    """(output, torch device or None, JAX device or None), checked.

    Raises:
        TypeError, ValueError: a bad argument or combination, named in the message.
        RuntimeError: a device that is not available here.
        ImportError: ``output="jax"`` without jax installed.
    """
    output = _checks.choice("output", output, tuple(OUTPUTS))
    if output != "jax":
        if jax_device is not None:
            raise ValueError(f"jax_device: batches go to a JAX device with output='jax' only, got "
                             f"output={output!r}; for torch tensors on a device give device=")
        device = _torch_device(device)
        if collate_fn is not None and device is not None:
            raise ValueError("collate_fn: its result is yielded as it is, so `device` cannot move it; "
                             "move the batch in the loop (batch.to(device)), as with DataLoader")
        return output, device, None
    if device is not None:
        raise ValueError(f"device: is torch's device (batches copied on CUDA streams); with output='jax' give "
                         f"jax_device= (a jax.Device, or 'cpu'), got device={device!r}")
    if _checks.flag("pin_memory", pin_memory):
        raise ValueError("pin_memory: page-locks batch memory for torch's CUDA copies; with output='jax' JAX "
                         "transfers the batches itself (jax_device=): leave pin_memory=False")
    jax_device = resolve_device(jax_device, "jax_device")
    if collate_fn is not None and jax_device is not None:
        raise ValueError("collate_fn: its result is yielded as it is, so `jax_device` cannot move it; "
                         "put the batch there in the loop (jax.device_put(batch, device))")
    return output, None, jax_device


def _torch_device(device: Any) -> Any:
    """A torch device that exists here, checked now rather than at the first batch."""
    if device is None:
        return None
    torch = import_torch()
    try:
        device = torch.device(device)
    except (TypeError, ValueError, RuntimeError) as exc:  # ValueError: an index beyond int64
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected a 'cpu' or 'cuda' device (batches are copied on CUDA streams), "
                         f"got {device}; move batches to other devices in the loop")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device: {device} needs CUDA, and torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"device: {device}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
