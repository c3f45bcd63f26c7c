"""What every benchmark shares: the machine it ran on, its tables and targets,
and the map-style source of the loader benchmarks.

Worker processes unpickle ``Records`` by this module's name: the benchmarks run
as scripts from bench/, and worker processes get the parent's ``sys.path``.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Sequence

import numpy as np

import dataecho


def machine(**versions: str | None) -> dict[str, Any]:
    """The CPU model, core count, and the versions of Python, NumPy, dataecho and
    of each library in `versions` (name -> version, None where it is missing)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "dataecho": dataecho.__version__,
    }
    info.update({name: version or "not available" for name, version in versions.items()})
    return info


MEMCPY_BYTES = 256 << 20


def memcpy_gb_s(seconds: float) -> float:
    """One thread's ``np.copyto`` of a 256 MiB buffer (far larger than any
    cache): GB/s copied, the machine's one-thread copy bandwidth."""
    a = np.ones(MEMCPY_BYTES, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)  # first touch
    copies, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or copies < 2:
        np.copyto(b, a)
        copies += 1
    return copies * MEMCPY_BYTES / elapsed / 1e9


def print_header(info: dict[str, Any], reading: str) -> None:
    """Prints the machine line of `info` (from ``machine``), then how to read the
    figures below it, e.g. "delivered examples/s; higher is better"."""
    names = {"python": "Python", "numpy": "NumPy"}
    libraries = [f"{names.get(k, k)} {v}" for k, v in info.items() if k not in ("cpu", "cpu_count")]
    print(f"machine: {info['cpu']}, {info['cpu_count']} CPUs; {', '.join(libraries)}")
    print(reading)


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = (0,)) -> None:
    """Prints `rows` of cells under `header`, each column as wide as its widest
    cell; the columns numbered in `left` are left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(header))
    for row in rows:
        print(line(row))


def print_document(doc: dict[str, Any]) -> None:
    """Prints a benchmark's result as the device check reads it (``--json``):
    the machine and reading direction, each table, the targets and the notes."""
    print()
    print_header(doc["machine"], f"device: {doc['device']}\n{doc['reading']}")
    for table in doc["tables"]:
        print(f"\n{table['title']}")
        if table["rows"]:
            print_table(table["header"], table["rows"])
        else:
            print("  (no rows)")
    print()
    print_targets(doc["targets"])
    for note in doc["notes"]:
        print(f"- {note}")
    print(f"({doc['seconds']:.1f} s)", flush=True)


def stop_contestant(batches: Any, loader: Any) -> None:
    """Ends a timed contestant: its batch generator, and an EchoLoader (a
    DataLoader's workers end as its iterator is collected: drop it, then collect)."""
    batches.close()
    if isinstance(loader, dataecho.EchoLoader):
        loader.close()


def print_targets(checks: list[dict[str, Any]]) -> None:
    """Prints each target (``target``, ``shown``, ``met``: True, False, or None
    where it could not be measured here) as met, NOT met or skipped."""
    print("targets:")
    for c in checks:
        mark = "skipped" if c["met"] is None else "met" if c["met"] else "NOT met"
        section = f"({c['section']}) " if "section" in c else ""
        print(f"  [{mark}] {section}{c['target']}: {c['shown']}")


def epoch_rate(loader: dataecho.EchoLoader, warmup: int = 4) -> float:
    """Delivered examples per second over one epoch of `loader`, after `warmup` batches."""
    epoch = iter(loader)
    for _ in range(warmup):
        next(epoch)
    start, rows = time.perf_counter(), 0
    for batch in epoch:
        rows += len(batch["id"])
    return rows / (time.perf_counter() - start)


class Records:
    """The map-style source of the loader benchmarks: example i is ``{"x": row,
    "id": i}``, the row one of 16 random rows of `nbytes` bytes.

    Args:
        n: number of examples.
        nbytes: bytes per example.
        spin: iterations of a pure-Python loop per read (decoding that holds the GIL).
        delay_s: a sleep per read (I/O that releases the GIL).
        tail: reads of one example in ten sleep this many times ``delay_s`` (I/O
            whose latency varies, as a network's or a disk's does).
    """

    def __init__(self, n: int, nbytes: int, spin: int = 0, delay_s: float = 0.0, tail: float = 1.0) -> None:
        self.n, self.spin, self.delay_s, self.tail = n, spin, delay_s, tail
        self.pool = np.random.default_rng(0).integers(0, 256, (16, nbytes), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        acc = 0
        for k in range(self.spin):
            acc += k * k
        if self.delay_s:
            time.sleep(self.delay_s * (self.tail if (i * 2654435761) % 10 == 0 else 1.0))
        return {"x": self.pool[i % 16], "id": i}
