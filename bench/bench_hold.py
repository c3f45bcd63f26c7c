"""Where holding large examples by reference pays: ShuffleBuffer throughput with
``hold`` on and off across example sizes, the time to the first batch, and the
first-touch cost of the memory a buffer brings in.

Workload (``bench_buffer.run_dataecho``): a producer thread puts rows of a
pre-generated uint8 source array, in chunks, into a shuffle buffer at echo 1;
the main thread iterates the shuffled batches. Two forms of put:

* stacked: ``put_many`` of a view of ``chunk`` source rows; held, the buffer
  keeps the view (the source lives anyway) and gathers batches from it;
* per example: the same rows as one array each in one ``put_each`` call, as
  EchoLoader's readers put what a dataset returns; held, each row's array is
  kept (and made read-only) until its last echo is gathered.

Copied, every example is copied into a slot and then into the batch: two
copies; held, one. Holding costs bookkeeping per example (a handle, a count,
a release with the batch), so below some size the copy is cheaper: that size
is ``dataecho.native.hold.HOLD_MIN_BYTES``, and this table is how it was chosen
(the buffer's threshold is lowered here so that every size can be held).

Time to first batch: from the buffer's construction to the first batch in
hand, the source already in memory, for a fresh buffer (its slots and batch
blocks touched for the first time) against the steady-state time per batch.

Usage:
    python bench/bench_hold.py [--quick] [--seconds S]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import common
import dataecho
import dataecho.native.hold
from bench_buffer import Case, make_source, median_run, run_dataecho

SIZES = (
    Case("256 B", 256, capacity=4096, batch_size=256, chunk=256),
    Case("1 KiB", 1024, capacity=4096, batch_size=256, chunk=256),
    Case("4 KiB", 4096, capacity=4096, batch_size=256, chunk=256),
    Case("8 KiB", 8192, capacity=4096, batch_size=256, chunk=256),
    Case("12 KiB", 12288, capacity=4096, batch_size=256, chunk=256),
    Case("48 KiB", 49152, capacity=2048, batch_size=128, chunk=64),
    Case("150 KiB", 153600, capacity=1024, batch_size=64, chunk=32),
)


def first_batch(case: Case, src: np.ndarray, hold: bool) -> dict:
    """Seconds from construction to the first batch (a fresh buffer), and the
    steady time per batch after it, for comparison."""
    t0 = time.perf_counter()
    buf = dataecho.ShuffleBuffer(((case.nbytes,), "uint8"), capacity=case.capacity, batch_size=case.batch_size,
                                 seed=0, hold=hold)
    built = time.perf_counter() - t0
    rows = min(len(src), buf.initial)
    done = 0
    while done < buf.initial:
        take = min(case.chunk, buf.initial - done, rows)
        buf.put_many(src[done % rows : done % rows + take])
        done += take
    batch = buf.next_batch()
    first = time.perf_counter() - t0
    assert len(batch) == case.batch_size
    buf.close()
    return {"construct_s": built, "first_s": first, "per_example_s": first / buf.initial}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, one round")
    parser.add_argument("--seconds", type=float, default=None, help="per contestant (default 1.5, quick 0.7)")
    args = parser.parse_args(argv)
    seconds = args.seconds or (0.7 if args.quick else 1.5)
    repeat = 1 if args.quick else 3
    dataecho.native.hold.HOLD_MIN_BYTES = 1  # every size holdable, to find the crossover

    common.print_header(common.machine(), "delivered examples/s at echo 1, median of interleaved rounds; higher is better")
    table = []
    for case in SIZES:
        src = make_source(case)
        runs: dict[str, list[dict]] = {k: [] for k in ("stacked copy", "stacked held", "each copy", "each held")}
        for _ in range(repeat):
            print(f"running {case.label} ...", file=sys.stderr, flush=True)
            runs["stacked copy"].append(run_dataecho(case, 1.0, src, seconds, hold=False))
            runs["stacked held"].append(run_dataecho(case, 1.0, src, seconds, hold=True))
            runs["each copy"].append(run_dataecho(case, 1.0, src, seconds, hold=False, per_example=True))
            runs["each held"].append(run_dataecho(case, 1.0, src, seconds, hold="auto", per_example=True))
        r = {k: median_run(v)["ex_s"] for k, v in runs.items()}
        table.append((
            case.label, f"{r['stacked copy']:,.0f}", f"{r['stacked held']:,.0f}",
            f"{r['stacked held'] / r['stacked copy']:.2f}x", f"{r['each copy']:,.0f}", f"{r['each held']:,.0f}",
            f"{r['each held'] / r['each copy']:.2f}x",
        ))
        del src
    common.print_table(("size", "stacked copy", "stacked held", "held/copy", "per-example copy",
                        "per-example held", "held/copy"), table)

    print()
    print("time to the first batch (fresh buffer, first touch of its memory) against steady state")
    table = []
    for case in SIZES[-1:] + SIZES[4:5]:
        src = make_source(case)
        for hold in (False, True):
            first = first_batch(case, src, hold)
            steady = median_run([run_dataecho(case, 1.0, src, seconds, hold=hold)])
            table.append((
                case.label, "held" if hold else "copied", f"{first['construct_s'] * 1e3:.1f} ms",
                f"{first['first_s'] * 1e3:.1f} ms", f"{first['per_example_s'] * 1e6:.2f} us",
                f"{1e6 / steady['ex_s']:.2f} us",
            ))
        del src
    common.print_table(("size", "put", "construct", "first batch", "per example to first", "per example steady"),
                       table, left=(0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
