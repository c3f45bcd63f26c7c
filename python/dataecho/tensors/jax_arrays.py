"""NumPy arrays as JAX arrays, without a copy where JAX can take the memory.

jax is imported on first use (:func:`import_jax`), never when this module is
imported, so ``import dataecho`` works without jax installed.

How the memory is handed over: ``jax.device_put(arrays, device, may_alias=True)``.
On a CPU device JAX then aliases an array's memory instead of copying it, and
keeps a reference to the array (and so to the batch lease that owns the
memory, its ``base``) until the last JAX array over it is gone: the batch pool
recycles a block only once nothing references its lease, so a live JAX array
never sees recycled memory. JAX never writes to it: its arrays are immutable,
and a step that donates an array over memory JAX does not own gets new memory
for its output (tests/test_jax.py checks both).

Why not DLPack: ``jax.numpy.from_dlpack`` refuses a read-only NumPy array (the
unversioned DLPack that JAX asks for cannot mark memory read-only), and
batches whose memory is shared (echoed batches) are read-only by design.

A copy happens where JAX cannot take the memory as it is:

- the device is not a CPU (a transfer, as for any host data);
- JAX changes the dtype: without ``jax_enable_x64``, 64-bit leaves (int64,
  uint64, float64, complex128) become 32-bit, ragged offsets included;
- the memory is not aligned to :data:`ALIGN_BYTES` (batch memory always is;
  so are the arrays dataecho stacks or pads itself, see :func:`aligned_empty`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["ALIGN_BYTES", "aligned_empty", "import_jax", "ml_dtype_view", "put_arrays", "resolve_device"]

# The alignment XLA's CPU client needs to alias host memory (measured: arrays at
# 16 or 32 bytes past a 64-byte boundary are copied, at 64 or 128 they are not).
ALIGN_BYTES = 64

# The torch dtypes NumPy lacks that ml_dtypes (a JAX dependency) has, by
# str(torch dtype): a raw leaf's bytes are viewed as these, bit for bit.
_ML_DTYPES = {
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e4m3fnuz": "float8_e4m3fnuz",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.float8_e5m2fnuz": "float8_e5m2fnuz",
}


def import_jax() -> Any:
    """jax, imported now; an ImportError that says how to install it."""
    try:
        import jax
    except ImportError as exc:
        raise ImportError("dataecho needs jax for JAX arrays: pip install 'dataecho[jax]'") from exc
    return jax


def resolve_device(device: Any, name: str) -> Any:
    """A JAX device: a ``jax.Device`` as it is, a platform name (``"cpu"``,
    ``"gpu"``, ``"tpu"``) as that platform's first device, None as None (JAX's
    default device, chosen when each batch is put).

    Raises:
        TypeError: neither; the message names the argument ``name``.
        RuntimeError: no device of that platform here.
        ImportError: jax is not installed.
    """
    jax = import_jax()
    if device is None or isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"{name}: expected a jax.Device (jax.devices()[0], say) or a platform name such as "
                        f"'cpu', got {type(device).__name__}")
    try:
        return jax.devices(device)[0]
    except RuntimeError as exc:  # an unknown platform, or one without devices here
        raise RuntimeError(f"{name}: no JAX device for {device!r} here ({exc})") from None


def put_arrays(arrays: Sequence[Any], device: Any, paths: Sequence[str]) -> list[Any]:
    """``arrays`` (NumPy arrays or scalars) as JAX arrays on ``device``, in one
    ``jax.device_put``: aliased where JAX can take the memory (see the module
    docstring), each holding its array alive for as long as it lives.

    Args:
        arrays: the host arrays.
        device: a ``jax.Device``, or None for JAX's default device.
        paths: each array's path, for messages.

    Raises:
        TypeError: an array of a dtype JAX has no type for (str, bytes,
            object, structured, datetime); the message names its path.
    """
    jax = import_jax()
    try:
        return list(jax.device_put(list(arrays), device, may_alias=True))
    except TypeError:
        for array, path in zip(arrays, paths):  # which one: put each alone, naming the first that fails
            try:
                jax.device_put(array, device)
            except TypeError as exc:
                raise TypeError(f"to_jax(): {path}: {exc}") from None
        raise


def ml_dtype_view(bits: Any, dtype_name: str, path: str) -> np.ndarray:
    """A raw leaf's bytes (dataecho.tensors.raw: bfloat16 stored as uint16) as
    the NumPy array of its dtype from ml_dtypes, over the same memory, which
    JAX takes as ``jnp.bfloat16`` and so on.

    Raises:
        TypeError: a dtype JAX has no type for (``torch.complex32``, say); the
            message names the leaf.
    """
    name = _ML_DTYPES.get(dtype_name)
    if name is None:
        raise TypeError(f"output='jax': leaf {path!r} is a {dtype_name} tensor, a dtype JAX lacks; convert it "
                        f"in transform (to one NumPy has)")
    import ml_dtypes

    return np.asarray(bits).view(getattr(ml_dtypes, name))


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts at an
    :data:`ALIGN_BYTES` boundary, so that JAX can take it without a copy
    (NumPy's allocator aligns to 16 bytes)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start:start + nbytes].view(dtype).reshape(shape)
