"""Throughput of dataecho.ShuffleBuffer against a memory limit and a plain-Python baseline.

Workload: a producer thread puts examples (single uint8 field of 64 B, 12 KiB or
150 KiB) into a shuffle buffer; the main thread iterates shuffled batches and
only reads each batch's shape. Each (size, echo factor) row runs three
contestants, in the same process, one after another:

* dataecho: ``put_many`` over chunks of a pre-generated source array from a
  producer thread, then ``close()``; the main thread iterates until the buffer
  is drained. Rate = delivered examples / wall time, start-up fill and final
  drain included.
* gather limit: ``np.take(pool, idx, axis=0, out=batch, mode="clip")`` of
  random rows from a pool of ``capacity`` examples into one preallocated batch,
  single-threaded, for as many examples as dataecho delivered (or at most twice
  the time budget). It is the bytes/s a shuffled batch copy can reach on this
  machine; dataecho does the same copy out, plus one copy in per fresh
  example. (``mode="clip"``: with the default ``mode="raise"`` NumPy buffers
  ``out``, which adds a second copy and understates the limit.)
* baseline: what one would write by hand: a producer thread puts single rows
  into a ``queue.Queue``, a consumer thread keeps a Python list of ``capacity``
  entries (random pop by swap with the last; echo as a remaining count,
  re-inserted after the batch), builds batches with ``np.stack`` and hands them
  to the main thread through a second ``queue.Queue``.

How to read it: higher is better everywhere. "dataecho / gather limit" is the
fraction of the machine's shuffled-copy bandwidth that dataecho reaches;
"dataecho / baseline" is the speed-up over the hand-written pipeline. Echo 2
halves the fresh examples per delivered one, so it should be at least as fast
as echo 1. The gather limit reuses one output batch, which stays in cache when
it is small enough (a 64 x 150 KiB batch is 9.8 MB), whereas dataecho writes
each batch to fresh batch memory; for big examples the limit is therefore on
the high side. The baseline passes row views and copies once (``np.stack``),
while dataecho copies each example in and each delivery out, so for big
examples at echo 1 the two are close. Numbers are from one run on a shared
machine; compare ratios rather than absolute rates across machines.

Usage:
    python bench/bench_buffer.py [--quick] [--seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

import dataecho

SOURCE_BYTES = 64 << 20  # largest pre-generated source array
SOURCE_ROWS = 65536  # most rows in the source array


@dataclass(frozen=True)
class Case:
    """One example size and its buffer settings.

    Attributes:
        label: size as printed.
        nbytes: bytes per example (one uint8 field of shape ``(nbytes,)``).
        capacity: shuffle-buffer slots.
        batch_size: examples per batch.
        chunk: rows per ``put_many`` call.
    """

    label: str
    nbytes: int
    capacity: int
    batch_size: int
    chunk: int


CASES = (
    Case("64 B", 64, capacity=4096, batch_size=256, chunk=4096),
    Case("12 KiB", 12288, capacity=4096, batch_size=256, chunk=256),
    Case("150 KiB", 153600, capacity=1024, batch_size=64, chunk=32),
)
ECHOES = (1.0, 2.0)


def make_source(case: Case) -> np.ndarray:
    """Returns a random uint8 source array of at most 64 MiB to cycle over.

    Args:
        case: the example size and chunking.

    Returns:
        An array of shape ``(rows, case.nbytes)``, rows a multiple of ``case.chunk``.
    """
    rows = max(case.chunk, min(SOURCE_ROWS, SOURCE_BYTES // case.nbytes))
    rows -= rows % case.chunk
    return np.random.default_rng(0).integers(0, 256, (rows, case.nbytes), dtype=np.uint8)


def run_dataecho(case: Case, echo: float, src: np.ndarray, seconds: float) -> dict:
    """Runs the ShuffleBuffer workload for about ``seconds`` plus the drain.

    Args:
        case: example size and buffer settings.
        echo: echo factor.
        src: source rows, put in chunks of ``case.chunk`` and cycled over.
        seconds: how long the producer keeps putting before it closes the buffer.

    Returns:
        ``examples`` delivered, ``seconds`` of wall time, ``ex_s`` and the buffer's ``stats``.
    """
    buf = dataecho.ShuffleBuffer(
        ((case.nbytes,), "uint8"),
        capacity=case.capacity,
        batch_size=case.batch_size,
        echo_factor=echo,
        seed=0,
    )
    stop = threading.Event()

    def produce() -> None:
        start = 0
        while not stop.is_set():
            buf.put_many(src[start : start + case.chunk])
            start = (start + case.chunk) % len(src)
        buf.close()

    producer = threading.Thread(target=produce, name="bench-producer")
    t0 = time.perf_counter()
    deadline = t0 + seconds
    producer.start()
    delivered = 0
    for batch in buf:
        delivered += batch.shape[0]
        if time.perf_counter() >= deadline:
            stop.set()
    elapsed = time.perf_counter() - t0
    producer.join()
    return {"examples": delivered, "seconds": elapsed, "ex_s": delivered / elapsed, "stats": buf.stats()}


def run_gather(case: Case, src: np.ndarray, examples: int, max_seconds: float) -> dict:
    """Measures random-row gathers from a pool of ``capacity`` examples into one batch.

    Args:
        case: example size, pool size (``capacity``) and batch size.
        src: source rows the pool is filled from.
        examples: examples to gather (rounded up to whole batches).
        max_seconds: stop early after this long.

    Returns:
        ``examples`` gathered, ``seconds`` taken and ``ex_s``.
    """
    pool = src[np.arange(case.capacity) % len(src)]  # a fresh, touched copy
    out = np.empty((case.batch_size, case.nbytes), dtype=np.uint8)
    rng = np.random.default_rng(1)
    # Index sets are drawn up front so that the loop times the copy alone.
    idx_sets = [rng.permutation(case.capacity)[: case.batch_size] for _ in range(64)]
    batches = max(1, math.ceil(examples / case.batch_size))
    t0 = time.perf_counter()
    done = 0
    while done < batches:
        np.take(pool, idx_sets[done % len(idx_sets)], axis=0, out=out, mode="clip")
        done += 1
        if done % 16 == 0 and time.perf_counter() - t0 >= max_seconds:
            break
    elapsed = time.perf_counter() - t0
    gathered = done * case.batch_size
    return {"examples": gathered, "seconds": elapsed, "ex_s": gathered / elapsed}


def run_baseline(case: Case, echo: float, src: np.ndarray, seconds: float) -> dict:
    """Runs the hand-written queue + list shuffle buffer for about ``seconds``.

    The rate counts examples handed to the main thread up to the deadline
    (start-up fill included); the pipeline is then shut down and drained untimed.

    Args:
        case: example size and buffer settings.
        echo: echo factor; each example is delivered floor(echo) or ceil(echo) times.
        src: source rows, put one at a time and cycled over.
        seconds: time budget.

    Returns:
        ``examples`` delivered, ``seconds`` of wall time and ``ex_s``.
    """
    inbox: queue.Queue = queue.Queue(maxsize=case.capacity)
    outbox: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    rng = random.Random(0)
    whole, frac = int(echo), echo - int(echo)

    def produce() -> None:
        i = 0
        while not stop.is_set():
            inbox.put(src[i])
            i = (i + 1) % len(src)
        inbox.put(None)

    def assemble() -> None:
        entries: list[list] = []  # [row, deliveries left]
        closed = False
        while entries or not closed:
            while not closed and len(entries) < case.capacity:
                row = inbox.get()
                if row is None:
                    closed = True
                else:
                    entries.append([row, whole + (rng.random() < frac)])
            rows, again = [], []
            for _ in range(min(case.batch_size, len(entries))):
                i = rng.randrange(len(entries))
                entry = entries[i]
                entries[i] = entries[-1]
                entries.pop()
                rows.append(entry[0])
                entry[1] -= 1
                if entry[1]:
                    again.append(entry)
            entries.extend(again)
            outbox.put(np.stack(rows))
        outbox.put(None)

    threads = [threading.Thread(target=f, name=f"baseline-{f.__name__}") for f in (produce, assemble)]
    t0 = time.perf_counter()
    deadline = t0 + seconds
    for t in threads:
        t.start()
    delivered, elapsed = 0, None
    while (batch := outbox.get()) is not None:
        if elapsed is None:
            delivered += batch.shape[0]
            if time.perf_counter() >= deadline:
                elapsed = time.perf_counter() - t0
                stop.set()
    for t in threads:
        t.join()
    elapsed = elapsed if elapsed is not None else time.perf_counter() - t0
    return {"examples": delivered, "seconds": elapsed, "ex_s": delivered / elapsed}


def machine() -> dict:
    """Returns the CPU model, core count and library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "dataecho": dataecho.__version__,
    }


def targets(rows: list[dict]) -> list[dict]:
    """Checks the results against the performance targets.

    Args:
        rows: one dict per (size, echo), as built by ``main``.

    Returns:
        One dict per target: ``target``, the worst ``value`` over echo factors, and ``met``.
    """
    def worst(size: str, key: str) -> float:
        return min(r[key] for r in rows if r["size"] == size)

    checks = [
        ("dataecho delivers >= 5e6 64-byte examples/s", worst("64 B", "dataecho_ex_s"), 5e6, "{:.3g} ex/s"),
        ("dataecho >= 0.70 x gather limit bytes/s at 150 KiB", worst("150 KiB", "vs_gather"), 0.70, "{:.2f}"),
        ("dataecho >= 20 x hand-written baseline at 64 B", worst("64 B", "vs_baseline"), 20.0, "{:.1f}x"),
    ]
    return [
        {"target": name, "value": value, "threshold": threshold, "shown": fmt.format(value), "met": value >= threshold}
        for name, value, threshold, fmt in checks
    ]


def print_report(info: dict, rows: list[dict], checks: list[dict], seconds: float) -> None:
    """Prints the machine, the results table and the targets."""
    print(
        f"machine: {info['cpu']}, {info['cpu_count']} CPUs; Python {info['python']}, "
        f"NumPy {info['numpy']}, dataecho {info['dataecho']}"
    )
    print(
        f"workload: put_many from a producer thread, shuffled batches iterated by the main thread; "
        f"~{seconds:g} s per contestant"
    )
    for case in CASES:
        print(f"  {case.label}: capacity {case.capacity}, batch {case.batch_size}, put_many chunks of {case.chunk}")
    print("higher is better; GB = 1e9 bytes\n")
    header = (
        "size", "echo", "dataecho ex/s", "dataecho GB/s", "gather-limit GB/s",
        "dataecho/gather", "baseline ex/s", "dataecho/baseline",
    )
    table = [
        (
            r["size"], f"{r['echo']:g}", f"{r['dataecho_ex_s']:,.0f}", f"{r['dataecho_gb_s']:.2f}",
            f"{r['gather_gb_s']:.2f}", f"{r['vs_gather']:.2f}", f"{r['baseline_ex_s']:,.0f}",
            f"{r['vs_baseline']:.1f}x",
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for t in table:
        print("  ".join(c.rjust(w) for c, w in zip(t, widths)))
    print("\ntargets:")
    for c in checks:
        print(f"  [{'met' if c['met'] else 'NOT met'}] {c['target']}: {c['shown']} (worst over echo factors)")


def main(argv: list[str] | None = None) -> int:
    """Parses arguments, runs every (size, echo) row and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs; the whole script takes well under a minute")
    parser.add_argument("--seconds", type=float, default=None, help="time budget per contestant (default 3, quick 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)

    rows = []
    for case in CASES:
        src = make_source(case)
        for echo in ECHOES:
            print(f"running {case.label}, echo {echo:g} ...", file=sys.stderr, flush=True)
            de = run_dataecho(case, echo, src, seconds)
            gather = run_gather(case, src, de["examples"], 2 * seconds)
            base = run_baseline(case, echo, src, seconds)
            rows.append({
                "size": case.label,
                "example_bytes": case.nbytes,
                "echo": echo,
                **{k: v for k, v in asdict(case).items() if k in ("capacity", "batch_size", "chunk")},
                "dataecho_ex_s": de["ex_s"],
                "dataecho_gb_s": de["ex_s"] * case.nbytes / 1e9,
                "gather_ex_s": gather["ex_s"],
                "gather_gb_s": gather["ex_s"] * case.nbytes / 1e9,
                "vs_gather": de["ex_s"] / gather["ex_s"],
                "baseline_ex_s": base["ex_s"],
                "vs_baseline": de["ex_s"] / base["ex_s"],
                "runs": {"dataecho": de, "gather": gather, "baseline": base},
            })
        del src

    info = machine()
    checks = targets(rows)
    print_report(info, rows, checks, seconds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "seconds": seconds, "rows": rows, "targets": checks}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
