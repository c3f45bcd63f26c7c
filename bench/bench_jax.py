"""What handing a batch to JAX costs: ``dataecho.to_jax`` (what
``EchoLoader(output="jax")`` does: JAX views the batch memory on a CPU device)
against copying each leaf into JAX (``jnp.array``), per batch, on JAX's CPU
backend.

Workload: one batch of a ShuffleBuffer, ``{"x": float32 rows, "label": int32}``,
at three row sizes; each conversion is timed over many rounds (the best of
five medians), with ``block_until_ready`` so that a copy is counted whole.

Usage:
    python bench/bench_jax.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import common
import dataecho

CASES = (("64 B", 16, 256), ("12 KiB", 3072, 256), ("150 KiB", 38400, 64))  # (label, float32 per row, batch)


def one_batch(floats: int, batch_size: int) -> dict[str, np.ndarray]:
    """A batch as the buffer gives it: views of its batch memory."""
    fields = {"x": ((floats,), "float32"), "label": ((), "int32")}
    with dataecho.ShuffleBuffer(fields, capacity=2 * batch_size, batch_size=batch_size, seed=0) as buf:
        buf.put_many({"x": np.ones((batch_size, floats), np.float32), "label": np.arange(batch_size, dtype=np.int32)})
    return next(iter(buf))


def per_batch_us(convert, batch, rounds: int) -> float:
    """The best of five medians of ``convert(batch)``, in microseconds."""
    medians = []
    for _ in range(5):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            out = convert(batch)
            for leaf in out.values():
                leaf.block_until_ready()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return min(medians) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    common.print_header(common.machine(jax=jax.__version__), "microseconds per batch; lower is better")
    rows = []
    for label, floats, batch_size in CASES:
        batch = one_batch(floats, batch_size)
        viewed = dataecho.to_jax(batch)
        assert viewed["x"].unsafe_buffer_pointer() == batch["x"].ctypes.data, "to_jax views the batch memory"
        shared = per_batch_us(dataecho.to_jax, batch, args.rounds)
        copied = per_batch_us(lambda b: {k: jnp.array(v) for k, v in b.items()}, batch, args.rounds)
        mib = sum(leaf.nbytes for leaf in batch.values()) / 2**20
        rows.append([f"{label} x {batch_size}", f"{mib:.2f}", f"{shared:.0f}", f"{copied:.0f}",
                     f"{copied / shared:.1f}x"])
    common.print_table(["rows", "MiB", "to_jax (no copy)", "jnp.array (copy)", "copy / to_jax"], rows)


if __name__ == "__main__":
    main()
