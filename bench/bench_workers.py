"""Process workers against torch's DataLoader, on the same dataset and transform.

Two workloads, each measured in the same run for every contestant:

1. CPU-bound: a pure-Python transform (a loop in the interpreter, so threads
   are serialized by the GIL) over 12 KiB examples;
2. data-bound: a cheap transform over 150 KiB examples, where moving bytes
   dominates.

Contestants: ``EchoLoader(worker_type="process", num_workers=2)`` at echo factor 1
(and 2, where the loop gets twice the batches per fresh example), the same with
``worker_type="thread"``, and ``torch.utils.data.DataLoader(num_workers=2,
pin_memory=False, persistent_workers=True)`` with default collation. Rates are
delivered examples per second in steady state: ``--warmup`` batches (worker
start-up, buffer fill) are not timed. Higher is better.

Targets on a 2-core machine: workload 1 at least DataLoader's rate; workload 2 at
least 2x DataLoader's; echo 2 delivers close to 2x the echo-1 rate in workload 1;
process workers about 2x thread workers in workload 1.

Usage:
    python bench/bench_workers.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import common
import dataecho


def measure(batches, warmup: int, count: int) -> float:
    """Delivered examples per second over ``count`` batches after ``warmup``."""
    it = iter(batches)
    for _ in range(warmup):
        next(it)
    start, examples = time.perf_counter(), 0
    for _ in range(count):
        batch = next(it)
        examples += len(batch["id"])
    return examples / (time.perf_counter() - start)


def run_dataecho(ds: common.Records, worker_type: str, echo: float, batch: int, warmup: int, count: int) -> float:
    loader = dataecho.EchoLoader(
        ds, batch_size=batch, echo_factor=echo, num_workers=2, worker_type=worker_type, shuffle_buffer=2048, seed=0
    )
    try:
        return measure(loader, warmup, count)
    finally:
        loader.close()


def cpu_times() -> dict[str, float]:
    """CPU seconds so far of this process's main thread, of its other threads
    (the assembler, the stages' threads) and of its live child processes (the
    workers), from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")

    def used(stat_path: str) -> float:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    me = os.getpid()
    times = {"main": 0.0, "other threads": 0.0, "workers": 0.0}
    for tid in os.listdir(f"/proc/{me}/task"):
        times["main" if int(tid) == me else "other threads"] += used(f"/proc/{me}/task/{tid}/stat")
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):  # a process that exited meanwhile
            continue
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor not in (None, 0, 1, me):  # workers may descend from a forkserver
            ancestor = parents.get(ancestor)
        if ancestor == me:
            try:
                times["workers"] += sum(used(f"/proc/{pid}/task/{t}/stat") for t in os.listdir(f"/proc/{pid}/task"))
            except (OSError, ValueError):
                continue
    return times


def cpu_split(ds: common.Records, echo: float, warmup: int, count: int) -> dict[str, float]:
    """Where the CPU goes with process workers: microseconds of CPU per delivered
    example in the parent's main thread (the loop), its other threads and the
    workers, with the wall time per example, over ``count`` batches."""
    loader = dataecho.EchoLoader(ds, batch_size=BATCH, echo_factor=echo, num_workers=2, worker_type="process",
                                 shuffle_buffer=2048, seed=0)
    try:
        it = iter(loader)
        for _ in range(warmup):
            next(it)
        before, start, examples = cpu_times(), time.perf_counter(), 0
        for _ in range(count):
            examples += len(next(it)["id"])
        wall, after = time.perf_counter() - start, cpu_times()
    finally:
        loader.close()
    split = {k: (after[k] - before[k]) / examples * 1e6 for k in before}
    return {**split, "wall": wall / examples * 1e6}


def print_cpu_split(count: int, warmup: int) -> None:
    """Echo 1 against echo 2 with process workers on the CPU-bound workload:
    the CPU each part takes per delivered example, and the rate the machine's
    cores allow at echo 2 given those costs."""
    ds = common.Records((warmup + count) * BATCH * 2, 12 * 1024, spin=4000)
    rows = {echo: cpu_split(ds, echo, warmup, count) for echo in (1.0, 2.0)}
    cores = os.cpu_count() or 1
    print(f"CPU per delivered example, CPU-bound workload, process workers (us; {cores} cores)")
    table = [(f"{e:g}", *(f"{r[k]:.1f}" for k in ("main", "other threads", "workers", "wall")),
              f"{sum(r[k] for k in ('main', 'other threads', 'workers')) / cores:.1f}") for e, r in rows.items()]
    common.print_table(("echo", "main thread", "parent's other threads", "workers", "wall", "CPU / cores"), table)
    one, two = rows[1.0], rows[2.0]
    print(f"echo 2 / echo 1 delivered rate: {one['wall'] / two['wall']:.2f}x")


def run_dataloader(ds: common.Records, batch: int, warmup: int, count: int) -> float:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=2, pin_memory=False, persistent_workers=True
    )
    rate = measure(loader, warmup, count)
    del loader
    return rate


BATCH = 64
DATALOADER = "torch DataLoader(num_workers=2)"


def torch_version() -> str | None:
    """torch's version, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def run_workloads(count: int, warmup: int) -> list[dict]:
    """Runs both workloads for every contestant (torch's DataLoader where torch is installed).

    Args:
        count: timed batches per contestant.
        warmup: untimed batches before them.

    Returns:
        One dict per workload: ``workload`` and ``rates`` (contestant -> examples/s).
    """
    workloads = {
        "CPU-bound Python transform, 12 KiB": common.Records((warmup + count) * BATCH * 2, 12 * 1024, spin=4000),
        "cheap transform, 150 KiB": common.Records((warmup + count) * BATCH * 2, 150 * 1024, spin=0),
    }
    have_torch = torch_version() is not None
    rows = []
    for name, ds in workloads.items():
        contestants = {
            "dataecho process, echo 1": lambda: run_dataecho(ds, "process", 1.0, BATCH, warmup, count),
            "dataecho process, echo 2": lambda: run_dataecho(ds, "process", 2.0, BATCH, warmup, count),
            "dataecho thread, echo 1": lambda: run_dataecho(ds, "thread", 1.0, BATCH, warmup, count),
        }
        if have_torch:
            contestants[DATALOADER] = lambda: run_dataloader(ds, BATCH, warmup, count)
        rates = {}
        for label, fn in contestants.items():
            print(f"running {name}: {label} ...", file=sys.stderr, flush=True)
            rates[label] = fn()
        rows.append({"workload": name, "rates": rates})
    return rows


def print_table(rows: list[dict]) -> None:
    """Prints the rows of ``run_workloads``: rate and ratio to DataLoader per contestant."""
    header = ("workload", "contestant", "ex/s", "/ DataLoader")
    table = []
    for row in rows:
        base = row["rates"].get(DATALOADER)
        for label, rate in row["rates"].items():
            table.append((row["workload"], label, f"{rate:,.0f}", f"{rate / base:.2f}x" if base else ""))
    common.print_table(header, table, left=(0, 1))


def targets(rows: list[dict]) -> list[dict]:
    """Checks the rows against the targets; ``met`` is None where torch is missing."""
    cpu, data = rows[0]["rates"], rows[1]["rates"]
    dl = DATALOADER
    checks = [
        ("process echo 1 >= DataLoader, CPU-bound", cpu["dataecho process, echo 1"] / cpu[dl] if dl in cpu else None, 1.0),
        ("process echo 1 >= 2x DataLoader, 150 KiB", data["dataecho process, echo 1"] / data[dl] if dl in data else None, 2.0),
        ("echo 2 delivers ~2x echo 1, CPU-bound", cpu["dataecho process, echo 2"] / cpu["dataecho process, echo 1"], 1.8),
        ("process ~2x thread workers, CPU-bound", cpu["dataecho process, echo 1"] / cpu["dataecho thread, echo 1"], 1.6),
    ]
    return [
        {
            "target": label, "value": value, "threshold": threshold,
            "shown": "torch is not installed" if value is None else f"{value:.2f}x (target {threshold:g}x)",
            "met": None if value is None else value >= threshold,
        }
        for label, value, threshold in checks
    ]


def main(argv: list[str] | None = None) -> int:
    """Runs both workloads for every contestant and prints one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches (about 40 s in all)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed batches first")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--cpu", action="store_true", help="instead: where the CPU goes at echo 1 and 2")
    args = parser.parse_args(argv)
    if args.cpu:
        print_cpu_split(60 if args.quick else 200, args.warmup)
        return 0
    count = 60 if args.quick else 200
    info = common.machine(torch=torch_version())
    common.print_header(info, "delivered examples/s and their ratios: higher is better")
    print(f"batch {BATCH}, 2 workers, {count} timed batches after {args.warmup}\n")
    rows = run_workloads(count, args.warmup)
    print_table(rows)
    print()
    common.print_targets(targets(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
