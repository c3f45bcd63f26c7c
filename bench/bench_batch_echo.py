"""What safe in-place batch echo costs: with torch output, every delivery of a
repeated batch but the last is a copy (torch has no read-only tensors, and a
loop may change its batch in place); NumPy output shares one batch among its
deliveries as read-only views.

The same EchoLoader (``echo_at="batch"``, an in-memory map-style source fast
enough that the loader is the bottleneck, 2 thread workers, batch 256) is run
with ``output="numpy"`` and ``output="torch"``, interleaved; the table prints
delivered examples/s and the ratio torch / numpy (1.0: the copies are free).

Usage:
    python bench/bench_batch_echo.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics

import bench_workers
import common

import dataecho

BATCH = 256


def rate(nbytes: int, echo: float, output: str, n: int) -> float:
    """Delivered examples per second over one epoch."""
    return common.epoch_rate(dataecho.EchoLoader(
        common.Records(n, nbytes), batch_size=BATCH, echo_factor=echo, echo_at="batch", shuffle_buffer=16,
        num_workers=2, seed=0, output=output,
    ))


def run(n: int, rounds: int) -> list[dict]:
    rows = []
    for nbytes in (12 << 10, 150 << 10):
        for echo in (2, 4):
            samples: dict[str, list[float]] = {"numpy": [], "torch": []}
            for _ in range(rounds):
                for output in samples:
                    samples[output].append(rate(nbytes, echo, output, n))
            shared, copies = (statistics.median(samples[o]) for o in ("numpy", "torch"))
            rows.append({"bytes": nbytes, "echo": echo, "numpy": shared, "torch": copies, "ratio": copies / shared})
    return rows


def print_table(rows: list[dict]) -> None:
    common.print_table(
        ("example", "echo", "numpy: shared read-only", "torch: a copy per repeat", "torch / numpy"),
        [(f"{r['bytes'] >> 10} KiB", f"{r['echo']}", f"{r['numpy']:,.0f}", f"{r['torch']:,.0f}", f"{r['ratio']:.2f}")
         for r in rows],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer examples and rounds")
    args = parser.parse_args()
    n, rounds = (4_000, 1) if args.quick else (20_000, 3)
    common.print_header(common.machine(torch=bench_workers.torch_version()),
                        "delivered examples/s, median of interleaved rounds; higher is better\n")
    print_table(run(n, rounds))


if __name__ == "__main__":
    main()
