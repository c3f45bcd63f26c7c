"""Throughput of dataecho.ShuffleBuffer against a memory limit and a plain-Python baseline.

Workload: a producer thread puts examples (single uint8 field of 64 B, 12 KiB or
150 KiB) into a shuffle buffer; the main thread iterates shuffled batches and
only reads each batch's shape. Each (size, echo factor) row runs four
contestants, in the same process, one after another:

* dataecho: ``put_many`` over chunks of a pre-generated source array from a
  producer thread, then ``close()``; the main thread iterates until the buffer
  is drained. Rate = delivered examples / wall time in steady state: the first
  ``2 * capacity`` deliveries (the buffer filling, first-touch page faults) are
  not timed, nor is the final drain; the baseline is timed the same way.
* gather limit: ``np.take(pool, idx, axis=0, out=batch, mode="clip")`` of
  random rows from a pool of ``capacity`` examples into preallocated batches
  that rotate over ``prefetch + 1`` outputs (as dataecho's batch pool does),
  single-threaded: one copy per example, the bytes/s a shuffled batch copy can
  reach on this machine. (``mode="clip"``: with the default ``mode="raise"``
  NumPy buffers ``out``, which adds a second copy and understates the limit.)
* two-copy limit: the same gather running at the same time as a second thread
  copying examples in (``np.copyto`` of ``put_many``-sized chunks), which is
  what any buffer that copies on ``put`` does; the pipeline can deliver at most
  ``min(gather rate, echo * copy-in rate)`` with both running. Shown for
  examples of 4 KiB and more: below that NumPy's per-call overhead, not the
  memory bus, sets the figure.
* baseline: what one would write by hand: a producer thread puts single rows
  into a ``queue.Queue``, a consumer thread keeps a Python list of ``capacity``
  entries (random pop by swap with the last; echo as a remaining count,
  re-inserted after the batch), builds batches with ``np.stack`` and hands them
  to the main thread through a second ``queue.Queue``.

How to read it: higher is better everywhere. "dataecho / gather limit" is the
fraction of the machine's one-copy shuffled-gather bandwidth that dataecho
reaches while also copying every fresh example in; "dataecho / two-copy" is the
fraction of what a copy-in-then-gather design can reach here; "dataecho /
baseline" is the speed-up over the hand-written pipeline. The baseline passes
row views and copies once (``np.stack``), so for big examples it is
bandwidth-bound too and the two are close. Numbers are from one run on a
shared machine, where memory bandwidth varies by tens of percent from run to
run; compare ratios rather than absolute rates across machines.

Usage:
    python bench/bench_buffer.py [--quick] [--seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

import common
import dataecho

SOURCE_BYTES = 64 << 20  # largest pre-generated source array
SOURCE_ROWS = 65536  # most rows in the source array
PREFETCH = 2  # dataecho's default


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


class SteadyRate:
    """Delivered examples per second after a warm-up.

    The first ``warmup`` examples (the buffer filling, memory touched for the
    first time) are not timed; the clock then runs for ``seconds``.
    """

    def __init__(self, warmup: int, seconds: float) -> None:
        self.warmup, self.seconds = warmup, seconds
        self.seen = 0
        self.start: tuple[float, int] | None = None
        self.end: tuple[float, int] | None = None

    def add(self, examples: int) -> bool:
        """Counts a batch; returns True once the timed window is over."""
        self.seen += examples
        now = time.perf_counter()
        if self.start is None:
            if self.seen >= self.warmup:
                self.start = (now, self.seen)
        elif self.end is None and now - self.start[0] >= self.seconds:
            self.end = (now, self.seen)
        return self.end is not None

    def result(self) -> dict:
        (t0, n0), (t1, n1) = self.start, self.end
        return {"examples": n1 - n0, "seconds": t1 - t0, "ex_s": (n1 - n0) / (t1 - t0)}


def run_dataecho(case: Case, echo: float, src: np.ndarray, seconds: float, hold: bool | str = True,
                 per_example: bool = False) -> dict:
    """Runs the ShuffleBuffer workload for about ``seconds`` plus the drain.

    Args:
        case: example size and buffer settings.
        echo: echo factor.
        src: source rows, put in chunks of ``case.chunk`` and cycled over.
        seconds: how long the producer keeps putting before it closes the buffer.
        hold: the buffer's ``hold``. True (the default here): ``put_many``
            hands over views of ``src``, memory that lives anyway, and the
            buffer gathers batches straight from them; False copies each
            example into a slot first.
        per_example: put each chunk's rows as arrays of their own (one native
            call per chunk, as EchoLoader's readers put what a dataset returns)
            instead of stacked views.

    Returns:
        ``examples`` delivered, ``seconds`` of wall time, ``ex_s`` and the buffer's ``stats``.
    """
    buf = dataecho.ShuffleBuffer(
        ((case.nbytes,), "uint8"),
        capacity=case.capacity,
        batch_size=case.batch_size,
        echo_factor=echo,
        seed=0,
        hold=hold,
    )
    native = buf._native  # the per-example form goes through the loader's own entry point
    rows = [row.copy() for row in src] if per_example else []
    stop = threading.Event()

    def produce() -> None:
        start = 0
        while not stop.is_set():
            if per_example:
                native.put_each([rows[start : start + case.chunk]], case.chunk)
            else:
                buf.put_many(src[start : start + case.chunk])
            start = (start + case.chunk) % len(src)
        buf.close()

    producer = threading.Thread(target=produce, name="bench-producer")
    rate = SteadyRate(warmup=2 * case.capacity, seconds=seconds)
    producer.start()
    for batch in buf:
        if rate.add(batch.shape[0]):
            stop.set()
    producer.join()
    return {**rate.result(), "stats": buf.stats()}


def run_gather(case: Case, src: np.ndarray, examples: int, max_seconds: float) -> dict:
    """Measures random-row gathers from a pool of ``capacity`` examples into batches.

    The batches rotate over ``PREFETCH + 1`` preallocated outputs, as dataecho's
    batch pool does in steady state, so that neither side writes to a batch that
    stays in cache.

    Args:
        case: example size, pool size (``capacity``) and batch size.
        src: source rows the pool is filled from.
        examples: examples to gather (rounded up to whole batches).
        max_seconds: stop early after this long.

    Returns:
        ``examples`` gathered, ``seconds`` taken and ``ex_s``.
    """
    pool = src[np.arange(case.capacity) % len(src)]  # a fresh, touched copy
    outs = [np.zeros((case.batch_size, case.nbytes), dtype=np.uint8) for _ in range(PREFETCH + 1)]
    rng = np.random.default_rng(1)
    # Index sets are drawn up front so that the loop times the copy alone.
    idx_sets = [rng.permutation(case.capacity)[: case.batch_size] for _ in range(64)]
    batches = max(1, math.ceil(examples / case.batch_size))
    t0 = time.perf_counter()
    done = 0
    while done < batches:
        np.take(pool, idx_sets[done % len(idx_sets)], axis=0, out=outs[done % len(outs)], mode="clip")
        done += 1
        if done % 16 == 0 and time.perf_counter() - t0 >= max_seconds:
            break
    elapsed = time.perf_counter() - t0
    gathered = done * case.batch_size
    return {"examples": gathered, "seconds": elapsed, "ex_s": gathered / elapsed}


def run_two_copy_limit(case: Case, echo: float, src: np.ndarray, seconds: float) -> dict:
    """Measures the copy-in and the gather running at once, on two threads.

    Any buffer that copies an example in on ``put`` and out into a batch does
    both copies; on two cores they share the memory bus. NumPy releases the GIL
    for both loops. The pipeline can deliver at most ``min(gather rate, echo *
    copy-in rate)`` with both running, which is this limit.

    Args:
        case: example size, pool size and batch size.
        echo: echo factor (each copied-in example feeds ``echo`` deliveries).
        src: source rows copied in, in chunks of ``case.chunk``.
        seconds: how long both threads run.

    Returns:
        ``ex_s``: the delivered examples/s this bound allows, and the two rates.
    """
    pool = src[np.arange(case.capacity) % len(src)]
    slots = np.zeros_like(pool)
    outs = [np.zeros((case.batch_size, case.nbytes), dtype=np.uint8) for _ in range(PREFETCH + 1)]
    idx_sets = [np.random.default_rng(i).permutation(case.capacity)[: case.batch_size] for i in range(64)]
    rates: dict[str, float] = {}
    start = threading.Barrier(2)

    def copy_in() -> None:
        start.wait()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            s = (n * case.chunk) % (len(src) - case.chunk + 1)
            d = (n * case.chunk) % (case.capacity - case.chunk + 1)
            np.copyto(slots[d : d + case.chunk], src[s : s + case.chunk])
            n += 1
        rates["copy_in"] = n * case.chunk / (time.perf_counter() - t0)

    def gather() -> None:
        start.wait()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            np.take(pool, idx_sets[n % len(idx_sets)], axis=0, out=outs[n % len(outs)], mode="clip")
            n += 1
        rates["gather"] = n * case.batch_size / (time.perf_counter() - t0)

    threads = [threading.Thread(target=f) for f in (copy_in, gather)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"ex_s": min(rates["gather"], echo * rates["copy_in"]), **rates}


def draw_batch(entries: list[list], batch_size: int, rng: random.Random) -> list:
    """The hand-written baseline's batch: up to ``batch_size`` rows drawn uniformly
    without replacement from ``entries`` (``[row, deliveries left]``, updated in
    place; an entry leaves when its deliveries are spent)."""
    rows, again = [], []
    for _ in range(min(batch_size, len(entries))):
        i = rng.randrange(len(entries))
        entry = entries[i]
        entries[i] = entries[-1]
        entries.pop()
        rows.append(entry[0])
        entry[1] -= 1
        if entry[1]:
            again.append(entry)
    entries.extend(again)
    return rows


def run_baseline(case: Case, echo: float, src: np.ndarray, seconds: float) -> dict:
    """Runs the hand-written queue + list shuffle buffer for about ``seconds``.

    The rate counts examples handed to the main thread in steady state (see
    SteadyRate); the pipeline is then shut down and drained untimed.

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
            outbox.put(np.stack(draw_batch(entries, case.batch_size, rng)))
        outbox.put(None)

    threads = [threading.Thread(target=f, name=f"baseline-{f.__name__}") for f in (produce, assemble)]
    rate = SteadyRate(warmup=2 * case.capacity, seconds=seconds)
    for t in threads:
        t.start()
    while (batch := outbox.get()) is not None:
        if rate.add(batch.shape[0]):
            stop.set()
    for t in threads:
        t.join()
    return rate.result()


def median_run(runs: list[dict]) -> dict:
    """The run with the median rate."""
    return sorted(runs, key=lambda r: r["ex_s"])[len(runs) // 2]


def targets(rows: list[dict]) -> list[dict]:
    """Checks the results against the performance targets.

    Args:
        rows: one dict per (size, echo), as built by ``main``.

    Returns:
        One dict per target: ``target``, the worst ``value`` over echo factors, and ``met``.
    """
    def worst(size: str, key: str) -> float:
        return min((r[key] for r in rows if r["size"] == size), default=float("nan"))

    checks = [
        ("dataecho delivers >= 5e6 64-byte examples/s", worst("64 B", "dataecho_ex_s"), 5e6, "{:.3g} ex/s"),
        ("dataecho >= 0.70 x gather limit bytes/s at 150 KiB", worst("150 KiB", "vs_gather"), 0.70, "{:.2f}"),
        ("dataecho >= 20 x hand-written baseline at 64 B", worst("64 B", "vs_baseline"), 20.0, "{:.1f}x"),
    ]
    return [
        {
            "target": name, "value": value, "threshold": threshold,
            "shown": f"{fmt.format(value)} (worst over echo factors)", "met": value >= threshold,
        }
        for name, value, threshold, fmt in checks
        if not math.isnan(value)
    ]


def print_report(info: dict, rows: list[dict], checks: list[dict], seconds: float, repeat: int) -> None:
    """Prints the machine, the results table and the targets."""
    common.print_header(info, "delivered examples/s, bytes/s and their ratios: higher is better; GB = 1e9 bytes")
    print(
        f"workload: put_many from a producer thread, shuffled batches iterated by the main thread; "
        f"~{seconds:g} s per contestant, median of {repeat} interleaved rounds"
    )
    for case in CASES:
        print(f"  {case.label}: capacity {case.capacity}, batch {case.batch_size}, put_many chunks of {case.chunk}")
    print()
    header = (
        "size", "echo", "dataecho ex/s", "dataecho GB/s", "gather-limit GB/s", "dataecho/gather",
        "two-copy GB/s", "dataecho/two-copy", "baseline ex/s", "dataecho/baseline",
    )
    table = [
        (
            r["size"], f"{r['echo']:g}", f"{r['dataecho_ex_s']:,.0f}", f"{r['dataecho_gb_s']:.2f}",
            f"{r['gather_gb_s']:.2f}", f"{r['vs_gather']:.2f}",
            f"{r['two_copy_gb_s']:.2f}" if r["example_bytes"] >= 4096 else "n/a",
            f"{r['vs_two_copy']:.2f}" if r["example_bytes"] >= 4096 else "n/a",
            f"{r['baseline_ex_s']:,.0f}", f"{r['vs_baseline']:.1f}x",
        )
        for r in rows
    ]
    common.print_table(header, table, left=())
    print()
    common.print_targets(checks)


def main(argv: list[str] | None = None) -> int:
    """Parses arguments, runs every (size, echo) row and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs; the whole script takes well under a minute")
    parser.add_argument("--seconds", type=float, default=None, help="time budget per contestant (default 2, quick 1)")
    parser.add_argument(
        "--repeat", type=int, default=None,
        help="rounds per row, contestants interleaved; medians are reported (default 3, quick 1)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--sizes", default=",".join(c.label.replace(" ", "") for c in CASES),
        help="comma-separated subset of the sizes, e.g. 64B,150KiB",
    )
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 2.0)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)

    wanted = set(args.sizes.split(","))
    rows = []
    for case in (c for c in CASES if c.label.replace(" ", "") in wanted):
        src = make_source(case)
        for echo in ECHOES:
            print(f"running {case.label}, echo {echo:g} ...", file=sys.stderr, flush=True)
            # Interleaved rounds, medians: memory bandwidth on a shared machine
            # drifts by tens of percent over seconds, and this spreads the drift
            # over every contestant alike.
            runs: dict[str, list[dict]] = {"dataecho": [], "gather": [], "two_copy": [], "baseline": []}
            for _ in range(repeat):
                runs["dataecho"].append(run_dataecho(case, echo, src, seconds))
                runs["gather"].append(run_gather(case, src, runs["dataecho"][-1]["examples"], 2 * seconds))
                runs["two_copy"].append(run_two_copy_limit(case, echo, src, seconds))
                runs["baseline"].append(run_baseline(case, echo, src, seconds))
            de, gather, two_copy, base = (median_run(runs[k]) for k in ("dataecho", "gather", "two_copy", "baseline"))
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
                "two_copy_gb_s": two_copy["ex_s"] * case.nbytes / 1e9,
                "vs_two_copy": de["ex_s"] / two_copy["ex_s"],
                "baseline_ex_s": base["ex_s"],
                "vs_baseline": de["ex_s"] / base["ex_s"],
                "runs": runs,
            })
        del src

    info = common.machine()
    checks = targets(rows)
    print_report(info, rows, checks, seconds, repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "seconds": seconds, "rows": rows, "targets": checks}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
