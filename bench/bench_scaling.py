"""Scaling with cores: worker processes, and the shuffle buffer alone, from 1 to 15.

Two parts, measured in one run:

1. Worker processes. A per-example map-style dataset decodes a 224x224 JPEG
   held in memory with PIL, then takes a random 128x128 crop and a random
   horizontal flip in NumPy (48 KiB out per example). JPEG decoding is what the
   workers of an image pipeline spend their CPU on, in C as here, so the
   figures show the loaders and the cores; a pure-Python loop
   (bench_workers.py) would add the interpreter to both. The cost is about
   0.3-0.5 ms per example, more bytes per CPU second than full-size ImageNet
   decoding, which shows the loaders' own per-example costs.
   ``EchoLoader(worker_type="process", echo_factor=1)`` with its defaults
   otherwise, against torch ``DataLoader(pin_memory=False)``, both with
   ``shuffle=True`` and batches of 64, at 1, 2, 4, 8 and 15 workers: delivered
   examples/s, the ratio, and each one's scaling efficiency against its own
   1-worker rate (``rate_k / (k * rate_1)``). Beside them, from /proc: the
   workers' CPU per example and how many cores they keep busy, and how busy the
   parent's threads are, which say where scaling stops and why. At the largest
   count, ``EchoLoader(deterministic=False)`` runs too: what the default
   in-order intake costs there.
2. The shuffle buffer alone. ``ShuffleBuffer.put_many`` of stacked 150 KiB
   examples from 1, 2, 4 and 8 producer threads while the main thread takes
   batches, copied into slots (the default) and held by reference
   (``hold=True``), against the bytes/s that the same number of threads copy
   with ``np.copyto`` (NumPy releases the GIL while it copies): the memory bus.

Every rate is steady state: the workers' start, the buffer's fill and the first
batches are not timed. Contestants are interleaved within each round (their
order alternating) and the figures are medians over rounds. Worker and thread
counts above the CPUs this process may use (affinity, cgroup quota) are
skipped. ``--budget-s`` bounds the whole run: windows are sized from it, a
later round is shortened or dropped where it no longer fits, and a watchdog
reports what was measured and exits 1 if the run still overruns (a hung loader).
A part that fails is reported and the other still runs; the exit status is then 1.

Targets: EchoLoader ahead of DataLoader at every worker count; EchoLoader at
least 0.8 of linear from 1 to 8 workers.

Usage:
    python bench/bench_scaling.py [--cpu] [--budget-s S] [--json PATH]

``--cpu``: tiny sizes and counts up to 2, in about 20 s on 2 cores: every
function runs, for checking the harness, not for its figures.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

try:
    from PIL import Image
except ImportError:  # part 1 reports it and the rest runs
    Image = None

import bench_buffer
import bench_workers
import common
import dataecho

COUNTS = (1, 2, 4, 8, 15)
PRODUCERS = (1, 2, 4, 8)
LINEAR_AT = 8  # the efficiency target's worker count
# The shortest timed windows: a loader's holds a few batches at 1 worker, and a
# buffer's some thousands of examples at any size.
SHORTEST_LOADER_S, SHORTEST_BUFFER_S = 0.25, 0.15
READING = "delivered examples/s, bytes/s, their ratios and scaling efficiency: higher is better; GB = 1e9 bytes"


@dataclass(frozen=True)
class Sizes:
    """What one run measures, full or ``--cpu``.

    Attributes:
        examples: the dataset's length in part 1: more than a timed window
            takes (a loader's reading order of it goes to every worker).
        side, crop: JPEG side and crop side, in pixels.
        batch: examples per batch in part 1.
        case: part 2's example size and buffer settings.
        copy_bytes: bytes each memcpy thread copies per call.
        most: the largest worker or thread count this mode runs.
        rounds: rounds wanted (fewer where the budget runs out).
        budget_s: the default ``--budget-s``.
        part2_share: the fraction of the budget part 2 may take.
        start_s: a loader's start-up, warm-up and shutdown, as planned for.
        buffer_start_s: part 2's buffer fills and drains per thread count and
            round, as planned for.
    """

    examples: int
    side: int
    crop: int
    batch: int
    case: bench_buffer.Case
    copy_bytes: int
    most: int
    rounds: int
    budget_s: float
    part2_share: float
    start_s: float
    buffer_start_s: float


FULL = Sizes(
    examples=1 << 18, side=224, crop=128, batch=64, case=bench_buffer.CASES[2], copy_bytes=32 << 20,
    most=max(COUNTS), rounds=3, budget_s=90.0, part2_share=0.2, start_s=1.0, buffer_start_s=0.6,
)
TINY = Sizes(
    examples=1 << 16, side=48, crop=32, batch=16,
    case=bench_buffer.Case("16 KiB", 16384, capacity=256, batch_size=32, chunk=16), copy_bytes=4 << 20,
    most=2, rounds=2, budget_s=20.0, part2_share=0.2, start_s=0.8, buffer_start_s=0.15,
)


# ---- the machine's CPUs ----


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup CPU quota."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # cgroup v2: "max 100000" or "400000 100000"
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def physical_cores() -> int | None:
    """Distinct (package, core) pairs among this process's CPUs; None where unknown."""
    cores = set()
    try:
        for cpu in os.sched_getaffinity(0):
            topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
            with open(f"{topology}/physical_package_id") as p, open(f"{topology}/core_id") as c:
                cores.add((p.read().strip(), c.read().strip()))
    except OSError:
        return None
    return len(cores)


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds so far of each thread of this process, by native thread id (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        times[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return times


class CpuWindow:
    """The CPU this process's threads and (with ``children``) its child
    processes spend over a timed window. Children are found by a walk of /proc,
    which takes milliseconds: not for windows timed from inside the walk."""

    def __init__(self, children: bool = True) -> None:
        self.walk = children
        self.threads, self.children = thread_cpu_s(), self._children()

    def _children(self) -> float:
        return bench_workers.cpu_times()["workers"] if self.walk else 0.0

    def end(self, wall_s: float, group: set[int] = frozenset()) -> dict[str, float]:
        """Busy fractions over ``wall_s``: the main thread, the busiest other
        thread not in ``group`` (native ids), the mean of ``group``'s, and the
        children (in cores)."""
        threads, children = thread_cpu_s(), self._children()
        main = threading.main_thread().native_id
        used = {t: threads[t] - self.threads.get(t, 0.0) for t in threads}
        others = [s for t, s in used.items() if t != main and t not in group]
        grouped = [s for t, s in used.items() if t in group]
        return {
            "main": used.get(main, 0.0) / wall_s,
            "busiest_other": max(others, default=0.0) / wall_s,
            "group": sum(grouped) / len(grouped) / wall_s if grouped else 0.0,
            "children_cores": (children - self.children) / wall_s,
            "children_cpu_s": children - self.children,
        }


def run_rounds(part: dict, wanted: int, runs_per_round: int, deadline: float, shortest_s: float,
               one_round: Callable[[int, float], None]) -> None:
    """Runs up to ``wanted`` rounds, ``one_round(number, window_s)``, counting
    them in ``part["rounds"]`` and their windows in ``part["windows"]``.

    The first round's window is ``part["window_s"]``. Later rounds share what is
    left before ``deadline`` (less each run's start-up and shutdown, as the last
    round took them): their windows may grow to 1.5 times the first or shrink,
    and where they would be under half the first or ``shortest_s``, one more
    round runs if its window fits alone, and then none.
    """
    window, round_s = part["window_s"], 0.0
    floor = max(shortest_s, 0.5 * part["window_s"])
    while part["rounds"] < wanted:
        if part["rounds"]:
            overhead = max(0.0, round_s / runs_per_round - window)
            left = deadline - time.perf_counter()
            window = left / ((wanted - part["rounds"]) * runs_per_round) - overhead
            if window < floor:
                window = left / runs_per_round - overhead
                if window < floor:
                    return
            window = min(window, 1.5 * part["window_s"])
        began = time.perf_counter()
        one_round(part["rounds"], window)
        part["windows"].append(window)
        part["rounds"] += 1
        round_s = time.perf_counter() - began


# ---- part 1: worker processes ----


def jpeg_pool(side: int, count: int) -> list[bytes]:
    """``count`` JPEG images of ``side`` pixels: smooth colour fields with grain,
    encoded at quality 90, so that they compress as photographs do."""
    rng = np.random.default_rng(0)
    images = []
    for _ in range(count):
        coarse = Image.fromarray(rng.integers(0, 256, (side // 16, side // 16, 3), dtype=np.uint8))
        smooth = np.asarray(coarse.resize((side, side), Image.BILINEAR), dtype=np.int16)
        grain = rng.integers(-16, 17, smooth.shape, dtype=np.int16)
        out = io.BytesIO()
        Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
        images.append(out.getvalue())
    return images


class JpegCrops:
    """Map-style dataset: example i decodes JPEG ``i % pool`` with PIL, crops a
    ``crop``-pixel square and flips it horizontally half of the time, in NumPy.

    The crop's place and the flip come from i alone, so every loader does the
    same work for the same example. Defined here, at module level, so that worker
    processes unpickle it (they import this script as their main module).

    Args:
        n: number of examples.
        side: the JPEGs' side in pixels.
        crop: the crop's side in pixels.
        pool: distinct JPEGs, held encoded in memory.
    """

    def __init__(self, n: int, side: int, crop: int, pool: int = 32) -> None:
        self.n, self.crop = n, crop
        self.jpegs = jpeg_pool(side, pool)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        pixels = np.asarray(Image.open(io.BytesIO(self.jpegs[i % len(self.jpegs)])))
        h = (i * 2654435761) & 0xFFFFFFFF  # Knuth's multiplicative hash: spread, cheap
        span = pixels.shape[0] - self.crop + 1
        y, x = h % span, (h >> 12) % span
        crop = pixels[y : y + self.crop, x : x + self.crop]
        if h >> 31:
            crop = crop[:, ::-1]
        # Contiguous: torch's default collate cannot take NumPy's negative strides.
        return {"image": np.ascontiguousarray(crop), "label": i % 1000}


def inline_us(ds: JpegCrops, seconds: float) -> float:
    """Microseconds per ``ds[i]`` in this process, after a few untimed calls."""
    for i in range(8):
        ds[i]
    start, i = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        ds[i]
        i += 1
    return (time.perf_counter() - start) / i * 1e6


def timed_batches(it: Any, warmup: int, window_s: float) -> dict[str, Any]:
    """Delivered examples/s from iterator ``it`` over ``window_s`` after ``warmup``
    batches, with the CPU of this process's threads and children meanwhile."""
    for _ in range(warmup):
        next(it)
    cpu = CpuWindow()
    start, examples, batches = time.perf_counter(), 0, 0
    while True:
        batch = next(it, None)
        wall = time.perf_counter() - start
        if batch is None:  # the epoch ended first: the window is what it had
            if batches < 3:
                raise RuntimeError(f"the epoch ended {batches} batches into the timed window")
            break
        examples += len(batch["label"])
        batches += 1
        if wall >= window_s and batches >= 3:
            break
    return {"ex_s": examples / wall, "examples": examples, "seconds": wall, **cpu.end(wall)}


def run_echoloader(ds: JpegCrops, workers: int, sizes: Sizes, window_s: float, **options: Any) -> dict[str, Any]:
    """EchoLoader with process workers at echo 1: ``timed_batches`` of a fresh loader.

    Otherwise its defaults, as a DataLoader user gets them: at echo 1 over a
    shuffled map-style dataset, a buffer of two batches and a deterministic
    intake (reads run at most a batch ahead of the example the buffer takes
    in next), unless ``options`` say otherwise.
    """
    loader = dataecho.EchoLoader(ds, batch_size=sizes.batch, shuffle=True, num_workers=workers,
                                 worker_type="process", echo_factor=1, seed=0, timeout=15, **options)
    try:
        return timed_batches(iter(loader), warmup(workers), window_s)
    finally:
        loader.close()


def run_echoloader_any_order(ds: JpegCrops, workers: int, sizes: Sizes, window_s: float) -> dict[str, Any]:
    """EchoLoader taking examples in the order they are read: what the deterministic intake costs."""
    return run_echoloader(ds, workers, sizes, window_s, deterministic=False)


def run_dataloader(ds: JpegCrops, workers: int, sizes: Sizes, window_s: float) -> dict[str, Any]:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(ds, batch_size=sizes.batch, shuffle=True, num_workers=workers,
                                         pin_memory=False, timeout=15)
    it = iter(loader)
    try:
        return timed_batches(it, warmup(workers), window_s)
    finally:
        del it  # shuts its workers down now, not at the next collection


def warmup(workers: int) -> int:
    """Untimed batches: past every worker's start and first batches, and the buffer's fill."""
    return 4 + 2 * workers


LOADERS: dict[str, Callable[[JpegCrops, int, Sizes, float], dict[str, Any]]] = {
    "EchoLoader": run_echoloader,
    "DataLoader": run_dataloader,
}
ANY_ORDER = "EchoLoader, deterministic=False"  # a diagnostic, at the largest count only


def workers_part(sizes: Sizes, counts: list[int], deadline: float, results: Results) -> None:
    """Runs every loader at every worker count in ``counts``, in interleaved
    rounds, until ``deadline`` leaves no room for another round.

    Args:
        sizes: the image and batch sizes, the rounds wanted, the start-up allowed for.
        counts: worker counts to run.
        deadline: ``time.perf_counter()`` by which the part ends.
        results: where the part goes, as ``parts["workers"]``, filled in as it
            runs: ``inline_us`` (the transform in this process), ``window_s``,
            ``rounds`` run, and ``runs``: (loader, workers) -> each round's
            result (``ANY_ORDER`` at the largest count only); and where a
            failed run's message goes.
    """
    if Image is None:
        raise RuntimeError("Pillow is not installed")
    loaders = dict(LOADERS)
    if bench_workers.torch_version() is None:
        del loaders["DataLoader"]
    ds = JpegCrops(sizes.examples, sizes.side, sizes.crop)
    cost_us = inline_us(ds, 0.3 if sizes is FULL else 0.1)
    runners = {**loaders, ANY_ORDER: run_echoloader_any_order}
    runs_per_round = len(counts) * len(loaders) + 1
    left = deadline - time.perf_counter()
    window_s = min(2.0, max(SHORTEST_LOADER_S, left / (sizes.rounds * runs_per_round) - sizes.start_s))
    print(f"part 1: the transform takes {cost_us:.0f} us per example here; {window_s:.2f} s windows",
          file=sys.stderr, flush=True)
    runs: dict[tuple[str, int], list[dict]] = {(name, k): [] for name in loaders for k in counts}
    runs[ANY_ORDER, counts[-1]] = []
    part = {"inline_us": cost_us, "window_s": window_s, "windows": [], "rounds": 0, "runs": runs,
            "loaders": list(loaders), "example_bytes": sizes.crop * sizes.crop * 3, "failed": set()}
    results.parts["workers"] = part

    def one_round(number: int, window: float) -> None:
        for position, k in enumerate(counts):
            order = list(loaders) if (number + position) % 2 == 0 else list(loaders)[::-1]
            for name in order + [ANY_ORDER] * (k == counts[-1]):
                print(f"  round {number + 1}: {name}, {k} workers ...", file=sys.stderr, flush=True)
                try:
                    runs[name, k].append(runners[name](ds, k, sizes, window))
                except Exception as exc:  # one failed run is reported; the others still run
                    part["failed"].add((name, k))
                    results.failures.append(f"part 1, {name} with {k} workers: {type(exc).__name__}: {exc}")
                    traceback.print_exc()

    run_rounds(part, sizes.rounds, runs_per_round, deadline, SHORTEST_LOADER_S, one_round)


# ---- part 2: the shuffle buffer alone ----


def run_buffer(case: bench_buffer.Case, src: np.ndarray, producers: int, hold: bool | str,
               seconds: float) -> dict[str, Any]:
    """``producers`` threads ``put_many`` chunks of ``src`` (each from its own
    offset) while this thread takes batches; steady-state delivered examples/s,
    with how busy the buffer's native thread, the producers and this thread were."""
    buf = dataecho.ShuffleBuffer(((case.nbytes,), "uint8"), capacity=case.capacity, batch_size=case.batch_size,
                                 echo_factor=1.0, seed=0, hold=hold)
    stop = threading.Event()
    ids: set[int] = set()
    left = [producers]
    lock = threading.Lock()

    def produce(first: int) -> None:
        ids.add(threading.get_native_id())
        start = first
        try:
            while not stop.is_set():
                buf.put_many(src[start : start + case.chunk])
                start = (start + case.chunk) % len(src)
        except dataecho.BufferClosed:  # the consumer's loop ended early and closed it
            pass
        finally:
            with lock:  # the last producer out closes the buffer, which ends the consumer's loop
                left[0] -= 1
                if left[0] == 0:
                    buf.close()

    stride = (len(src) // producers) // case.chunk * case.chunk
    threads = [threading.Thread(target=produce, args=(p * stride,), name=f"producer-{p}") for p in range(producers)]
    rate = bench_buffer.SteadyRate(warmup=2 * case.capacity, seconds=seconds)
    cpu: CpuWindow | None = None
    busy: dict[str, float] | None = None
    for t in threads:
        t.start()
    try:
        for batch in buf:
            if rate.add(batch.shape[0]):
                stop.set()
            if cpu is None and rate.start is not None:
                cpu = CpuWindow(children=False)  # the timed window has just begun
            if busy is None and rate.end is not None:
                busy = cpu.end(rate.end[0] - rate.start[0], group=ids)
    finally:
        stop.set()
        buf.close()  # releases producers blocked on a full buffer, should this loop end early
        for t in threads:
            t.join()
    # The buffer's one native thread is the busiest but for the producers and this one.
    return {**rate.result(), "assembler_busy": busy["busiest_other"], "producers_busy": busy["group"],
            "consumer_busy": busy["main"]}


def memcpy_bytes_s(threads: int, blocks: list[tuple[np.ndarray, np.ndarray]], seconds: float) -> float:
    """Bytes/s that ``threads`` threads copy together, each its own block (``np.copyto``)."""
    rates: list[float] = []
    barrier = threading.Barrier(threads)

    def copy(src: np.ndarray, dst: np.ndarray) -> None:
        barrier.wait()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            np.copyto(dst, src)
            n += 1
        rates.append(n * src.nbytes / (time.perf_counter() - start))

    pool = [threading.Thread(target=copy, args=blocks[t]) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(rates)


def buffer_part(sizes: Sizes, counts: list[int], deadline: float, results: Results) -> None:
    """Runs the buffer (copied and held) and memcpy at every thread count in
    ``counts``, in interleaved rounds, until ``deadline``.

    The part goes to ``results.parts["buffer"]``, filled in as it runs:
    ``window_s``, ``rounds`` run, ``case``, and ``runs``: (contestant, threads)
    -> each round's result.
    """
    case = sizes.case
    src = bench_buffer.make_source(case)
    # A block per thread, touched here, so that memcpy times copies, not page faults.
    blocks = [(np.full(sizes.copy_bytes, t, np.uint8), np.full(sizes.copy_bytes, 0, np.uint8))
              for t in range(max(counts))]
    contestants = {
        "copied": lambda p, s: run_buffer(case, src, p, "auto", s),  # put_many's rows copied: the default
        "held": lambda p, s: run_buffer(case, src, p, True, s),
        "memcpy": lambda p, s: {"bytes_s": memcpy_bytes_s(p, blocks, s)},
    }
    left = deadline - time.perf_counter()
    per_count = left / (sizes.rounds * len(counts)) - sizes.buffer_start_s
    window_s = min(1.0, max(SHORTEST_BUFFER_S, per_count / len(contestants)))
    print(f"part 2: {case.label} examples, {window_s:.2f} s windows", file=sys.stderr, flush=True)
    runs: dict[tuple[str, int], list[dict]] = {(c, p): [] for c in contestants for p in counts}
    part = {"window_s": window_s, "windows": [], "rounds": 0, "runs": runs, "case": case}
    results.parts["buffer"] = part

    def one_round(number: int, window: float) -> None:
        for p in counts:
            print(f"  round {number + 1}: {p} threads ...", file=sys.stderr, flush=True)
            for name in list(contestants)[:: 1 if (number + p) % 2 else -1]:
                runs[name, p].append(contestants[name](p, window))

    run_rounds(part, sizes.rounds, len(counts) * len(contestants), deadline, SHORTEST_BUFFER_S, one_round)


# ---- where scaling stops, and why ----


def stop_point(rates: dict[int, float], efficiency: float = 0.8) -> int | None:
    """The first count whose efficiency against the lowest count falls below ``efficiency``."""
    if not rates:
        return None
    base = min(rates)
    return next((k for k in sorted(rates) if k > base and rates[k] / (k / base * rates[base]) < efficiency), None)


def why_workers(k: int, runs: dict[int, dict], cpus: int, cores: int | None,
                memcpy_max: float | None, example_bytes: int) -> str:
    """One line on why a loader stops scaling at ``k`` workers, from the CPU figures of its median runs."""
    one, at = runs[min(runs)], runs[k]
    cost_one = one["children_cpu_s"] / one["examples"]
    cost_ratio = at["children_cpu_s"] / at["examples"] / cost_one if cost_one else 1.0
    parent = max(at["main"], at["busiest_other"])
    if k + 1 > cpus:
        return f"cores: {k} workers and the parent's threads share {cpus} CPUs"
    if parent >= 0.85:
        return f"the consumer side: the parent's busiest thread is busy {parent:.0%} of the time"
    if memcpy_max and at["ex_s"] * example_bytes * 2 >= 0.6 * memcpy_max:
        return (f"memory bandwidth: {at['ex_s'] * example_bytes / 1e9:.1f} GB/s delivered, each byte written "
                f"twice, against {memcpy_max / 1e9:.1f} GB/s of memcpy")
    busy = at["children_cores"] / k
    if busy < 0.8:
        return (f"the workers wait: busy {busy:.0%} of the time while the parent's busiest thread is at "
                f"{parent:.0%}: the hand-off between them")
    if cost_ratio >= 1.2:
        shared = f"{k} workers on {cores} physical cores (SMT siblings)" if cores and k > cores else "caches, clocks"
        return f"cores: each example takes {cost_ratio:.2f}x the worker CPU it takes with 1 worker ({shared})"
    return f"none measured here: workers busy {busy:.0%}, {cost_ratio:.2f}x the CPU per example of 1 worker"


def why_buffer(p: int, run: dict, cpus: int, memcpy: dict[int, float], nbytes: int) -> str:
    """One line on why the copied buffer stops scaling at ``p`` producer threads."""
    if p + 2 > cpus:
        return f"cores: {p} producers, the assembler and the consumer share {cpus} CPUs"
    if run["assembler_busy"] >= 0.85:
        return (f"the consumer thread: one native thread gathers every batch, busy {run['assembler_busy']:.0%}; "
                f"producers only add copy-in bandwidth")
    if run["consumer_busy"] >= 0.85:
        return f"the consumer thread: the Python loop taking batches is busy {run['consumer_busy']:.0%}"
    if run["ex_s"] * nbytes * 2 >= 0.7 * memcpy[p]:
        return f"memory bandwidth: two copies per delivered byte against {memcpy[p] / 1e9:.1f} GB/s of memcpy"
    return (f"none of the threads is saturated (assembler {run['assembler_busy']:.0%}, producers "
            f"{run['producers_busy']:.0%}, consumer {run['consumer_busy']:.0%}): waits between them")


# ---- report ----


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def summarize(runs: dict[tuple[str, int], list[dict]], key: str) -> tuple[dict, dict]:
    """Per (contestant, count) with at least one run: the median of ``key`` over
    rounds, and the run with the median rate (whose CPU figures are shown)."""
    medians = {at: statistics.median(r[key] for r in rs) for at, rs in runs.items() if rs}
    middle = {at: bench_buffer.median_run([{**r, "ex_s": r[key]} for r in rs]) for at, rs in runs.items() if rs}
    return medians, middle


def missing(part: dict | None, at: tuple[str, int], cpus: int, sizes: Sizes) -> str:
    """Why (contestant, count) has no figure: the part failed, the count was skipped, or its runs failed."""
    if at[1] > cpus:
        return f"skipped: {cpus} CPUs"
    if at[1] > sizes.most:
        return f"skipped: --cpu runs up to {sizes.most}"
    if part is None:
        return "part failed"
    if at[0] == "DataLoader" and "DataLoader" not in part.get("loaders", ["DataLoader"]):
        return "torch not installed"
    return "failed" if at in part.get("failed", ()) else "not run: out of time"


def workers_report(part: dict | None, cpus: int, cores: int | None, memcpy_max: float | None,
                   sizes: Sizes) -> tuple[list[dict], list[dict], list[str]]:
    """Part 1's tables, targets and notes (``part`` None: it failed)."""
    rates, middle = summarize(part["runs"], "ex_s") if part else ({}, {})
    names = ("EchoLoader", "DataLoader")

    def shown(at: tuple[str, int]) -> str:
        return fmt_rate(rates[at]) if at in rates else missing(part, at, cpus, sizes)

    def efficiency(name: str, k: int) -> float | None:
        one, at = rates.get((name, 1)), rates.get((name, k))
        return at / (k * one) if one and at else None

    rows, cpu_rows = [], []
    for k in COUNTS:
        e, d = rates.get(("EchoLoader", k)), rates.get(("DataLoader", k))
        effs = [efficiency(n, k) for n in names]
        rows.append([str(k), shown(("EchoLoader", k)), shown(("DataLoader", k)), f"{e / d:.2f}x" if e and d else "",
                     *(f"{x:.2f}" if x is not None else "" for x in effs),
                     fmt_rate(k * 1e6 / part["inline_us"]) if e or d else ""])
        em, dm = middle.get(("EchoLoader", k)), middle.get(("DataLoader", k))
        if em or dm:
            cpu_rows.append([
                str(k), *(f"{m['children_cpu_s'] / m['examples'] * 1e6:.0f}" if m else "" for m in (em, dm)),
                *(f"{m['children_cores']:.1f}" if m else "" for m in (em, dm)),
                f"{em['main']:.0%}, {em['busiest_other']:.0%}" if em else "", f"{dm['main']:.0%}" if dm else "",
            ])
    tables = [{
        "title": "Worker processes: JPEG decode + random crop + flip per example, delivered examples/s",
        "header": ["workers", "EchoLoader ex/s", "DataLoader ex/s", "EchoLoader / DataLoader",
                   "EchoLoader efficiency", "DataLoader efficiency", "ideal ex/s (k x inline)"],
        "rows": rows,
    }]
    if cpu_rows:
        tables.append({
            "title": "Worker processes: where the CPU goes (the median runs, from /proc)",
            "header": ["workers", "EchoLoader workers' CPU us/ex", "DataLoader workers' CPU us/ex",
                       "EchoLoader workers busy (cores)", "DataLoader workers busy (cores)",
                       "EchoLoader parent: main, busiest other thread", "DataLoader parent: main thread"],
            "rows": cpu_rows,
        })
    return tables, workers_targets(part, rates, cpus, sizes), workers_notes(part, rates, middle, cpus, cores,
                                                                           memcpy_max, sizes)


def workers_targets(part: dict | None, rates: dict, cpus: int, sizes: Sizes) -> list[dict]:
    """Part 1's targets, ``met`` None where a figure is missing (skipped, failed)."""
    targets = []
    for k in COUNTS:
        e, d = rates.get(("EchoLoader", k)), rates.get(("DataLoader", k))
        why = missing(part, ("EchoLoader" if e is None else "DataLoader", k), cpus, sizes)
        targets.append({"target": f"EchoLoader ahead of DataLoader with {k} worker{'s' * (k > 1)}",
                        "shown": f"{e / d:.2f}x ({fmt_rate(e)} against {fmt_rate(d)} ex/s)" if e and d else why,
                        "met": e > d if e and d else None})
    one, top = rates.get(("EchoLoader", 1)), rates.get(("EchoLoader", LINEAR_AT))
    eff = top / (LINEAR_AT * one) if one and top else None
    targets.append({
        "target": f"EchoLoader at least 0.8 of linear from 1 to {LINEAR_AT} workers",
        "shown": (f"{eff:.2f} ({fmt_rate(top)} against {LINEAR_AT} x {fmt_rate(one)} ex/s)" if eff is not None
                  else missing(part, ("EchoLoader", LINEAR_AT if one else 1), cpus, sizes)),
        "met": eff >= 0.8 if eff is not None else None,
    })
    return targets


def windows_text(part: dict) -> str:
    """The timed windows' length, a range where rounds had different ones."""
    windows = part["windows"] or [part["window_s"]]
    low, high = min(windows), max(windows)
    return f"{high:.2f} s" if high - low < 0.005 else f"{low:.2f}-{high:.2f} s"


def rounds_text(part: dict) -> str:
    """How many interleaved rounds the medians are over (a round cut short by the watchdog said so)."""
    started = max((len(rs) for rs in part["runs"].values()), default=0)
    if started > part["rounds"]:
        done = f"{part['rounds']} complete interleaved rounds and part of another" if part["rounds"] else None
        return f"median of {done or 'part of a round'} (stopped early)"
    return f"median of {part['rounds']} interleaved rounds"


def workers_notes(part: dict | None, rates: dict, middle: dict, cpus: int, cores: int | None,
                  memcpy_max: float | None, sizes: Sizes) -> list[str]:
    """Part 1's workload, where each loader stops scaling and why, and what the deterministic intake costs."""
    if part is None:
        return []
    notes = [f"Part 1: the transform takes {part['inline_us']:.0f} us per example in the parent process "
             f"({sizes.side}x{sizes.side} JPEG, {sizes.crop}x{sizes.crop} crop); batches of {sizes.batch}; "
             f"{windows_text(part)} timed windows, {rounds_text(part)}."]
    for name in ("EchoLoader", "DataLoader"):
        own = {k: r for (n, k), r in rates.items() if n == name}
        if len(own) < 2:
            continue
        at = stop_point(own)
        if at is None:
            top = max(own)
            notes.append(f"{name} scales to {top} workers: efficiency {own[top] / (top * own[min(own)]):.2f}.")
        else:
            runs = {k: r for (n, k), r in middle.items() if n == name}
            notes.append(f"{name} stops scaling at {at} workers (efficiency below 0.8): "
                         + why_workers(at, runs, cpus, cores, memcpy_max, part["example_bytes"]) + ".")
    for (name, k), rate in rates.items():
        default = rates.get(("EchoLoader", k))
        if name == ANY_ORDER and default:
            busy = middle[ANY_ORDER, k]["children_cores"]
            notes.append(f"EchoLoader with deterministic=False at {k} workers (examples taken in the order they are "
                         f"read): {fmt_rate(rate)} ex/s, {rate / default:.2f}x the default's; workers busy "
                         f"{busy:.1f} cores against {middle['EchoLoader', k]['children_cores']:.1f}.")
    return notes


def buffer_report(part: dict | None, cpus: int, sizes: Sizes) -> tuple[list[dict], list[str], float | None]:
    """Part 2's table and notes, and the highest memcpy bytes/s measured (``part`` None: it failed)."""
    case = part["case"] if part else sizes.case
    runs = part["runs"] if part else {}
    rates, middle = summarize({at: rs for at, rs in runs.items() if at[0] != "memcpy"}, "ex_s")
    memcpy, _ = summarize({at: rs for at, rs in runs.items() if at[0] == "memcpy"}, "bytes_s")
    gb = {at: rate * case.nbytes for at, rate in rates.items()}
    rows = []
    for p in PRODUCERS:
        copied, held, copy = gb.get(("copied", p)), gb.get(("held", p)), memcpy.get(("memcpy", p))
        if copied is None or held is None or copy is None:
            rows.append([str(p), missing(part, ("buffer", p), cpus, sizes), *[""] * 8])
            continue
        one_copied, one_held = gb.get(("copied", 1)), gb.get(("held", 1))
        rows.append([
            str(p), f"{copied / 1e9:.2f}", f"{held / 1e9:.2f}", f"{copy / 1e9:.2f}", f"{copied / copy:.2f}",
            f"{copied / (p * one_copied):.2f}" if one_copied else "",
            f"{held / (p * one_held):.2f}" if one_held else "",
            f"{middle['copied', p]['assembler_busy']:.0%}", f"{middle['copied', p]['producers_busy']:.0%}",
            f"{middle['copied', p]['consumer_busy']:.0%}",
        ])
    table = {
        "title": f"Shuffle buffer alone: put_many of {case.label} examples from producer threads, "
                 f"delivered GB/s against memcpy",
        "header": ["producer threads", "copied GB/s", "held GB/s", "memcpy GB/s (same threads)", "copied / memcpy",
                   "copied efficiency", "held efficiency", "copied: assembler thread busy", "producers busy (mean)",
                   "consumer busy"],
        "rows": rows,
    }
    notes = []
    if part:
        notes.append(f"Part 2: capacity {case.capacity}, batch {case.batch_size}, put_many chunks of {case.chunk}, "
                     f"echo 1; copied (the default): each delivered byte is copied twice, into a slot and into a "
                     f"batch; held (hold=True): once; {windows_text(part)} windows, {rounds_text(part)}.")
        copied = {p: r for (c, p), r in gb.items() if c == "copied"}
        bandwidth = {p: r for (_, p), r in memcpy.items()}
        at = stop_point(copied)
        if at is None and len(copied) > 1:
            top = max(copied)
            notes.append(f"The copied buffer scales to {top} producer threads: efficiency "
                         f"{copied[top] / (top * copied[min(copied)]):.2f}.")
        elif at is not None:
            notes.append(f"The copied buffer stops scaling at {at} producer threads: "
                         + why_buffer(at, middle["copied", at], cpus, bandwidth, case.nbytes) + ".")
        if len(bandwidth) > 1:
            top = max(bandwidth)
            notes.append(f"memcpy: {top} threads copy {bandwidth[top] / bandwidth[min(bandwidth)]:.1f}x what "
                         f"{min(bandwidth)} does ({bandwidth[top] / 1e9:.1f} GB/s): how far the memory bus scales.")
    return [table], notes, max(memcpy.values(), default=None)


class Results:
    """What the report is made from, filled in as the parts run, so that a
    report can be made at any moment: at the end, or by the watchdog when the
    run overruns its budget.

    Attributes:
        parts: ``"buffer"`` and ``"workers"``: each part's figures so far.
        failures: one line per failed part or run.
    """

    def __init__(self, json_path: str | None, sizes: Sizes, budget_s: float, began: float) -> None:
        self.json_path, self.sizes, self.budget_s, self.began = json_path, sizes, budget_s, began
        self.cpus, self.cores = usable_cpus(), physical_cores()
        self.parts: dict[str, dict] = {}
        self.failures: list[str] = []
        self._emitted = threading.Lock()

    def run(self, name: str, part: Callable[[], None]) -> None:
        """Runs one part; its failure is recorded, and the next part runs."""
        try:
            part()
        except Exception as exc:
            self.failures.append(f"{name} failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()

    def report(self) -> dict[str, Any]:
        """The report as the JSON has it, from the figures so far."""
        worker_tables, targets, worker_notes, buffer_tables, buffer_notes, memcpy_max = [], [], [], [], [], None
        # Each part's report on its own: one that fails leaves the other's, and the JSON is written all the same.
        try:
            buffer_tables, buffer_notes, memcpy_max = buffer_report(self.parts.get("buffer"), self.cpus, self.sizes)
        except Exception as exc:
            self.failures.append(f"part 2's report failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        try:
            worker_tables, targets, worker_notes = workers_report(self.parts.get("workers"), self.cpus, self.cores,
                                                                  memcpy_max, self.sizes)
        except Exception as exc:
            self.failures.append(f"part 1's report failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        tables, notes = worker_tables + buffer_tables, worker_notes + buffer_notes
        notes.insert(0, f"{self.cpus} usable CPUs, {self.cores or 'unknown'} physical cores; worker and thread "
                        f"counts above the usable CPUs are skipped.")
        return {
            "name": "scaling", "title": "Scaling with cores", "command": "python bench/bench_scaling.py",
            "machine": common.machine(torch=bench_workers.torch_version()), "device": "cpu", "reading": READING,
            "tables": tables, "targets": targets, "notes": notes + self.failures,
            "seconds": round(time.perf_counter() - self.began, 2),
        }

    def emit(self) -> bool:
        """Prints the report and writes its JSON, once: False where it was already done."""
        if not self._emitted.acquire(blocking=False):
            return False
        self._write()
        return True

    def overrun(self) -> None:
        """The watchdog: the run is still going past its budget (a hung loader,
        a machine far slower than planned); reports what there is and exits 1."""
        if not self._emitted.acquire(blocking=False):  # the report is being made: the run is over
            return
        self.failures.append(f"the run overran its budget of {self.budget_s:g} s: stopped, with the figures "
                             f"measured so far")
        self._write()
        for child in multiprocessing.active_children():  # loader workers would otherwise linger a few seconds
            child.terminate()
        os._exit(1)  # the main thread may be blocked in a loader: no clean exit is possible

    def _write(self) -> None:
        report = self.report()
        print()
        common.print_header(report["machine"], READING)
        for table in report["tables"]:
            print(f"\n{table['title']}")
            common.print_table(table["header"], table["rows"])
        print()
        common.print_targets(report["targets"])
        print("notes:")
        for note in report["notes"]:
            print(f"  - {note}")
        print(f"({report['seconds']:.1f} s)", flush=True)
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump(report, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    """Runs both parts within the budget, prints the report, writes the JSON; 1 if a part failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes, counts up to 2: checks the harness quickly")
    parser.add_argument("--budget-s", type=float, default=None, help="the whole run's time (default 90, --cpu 20)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    sizes = TINY if args.cpu else FULL
    budget_s = args.budget_s if args.budget_s is not None else sizes.budget_s
    results = Results(args.json, sizes, budget_s, began)
    # Runs are planned to end by 93% of the budget, leaving the last loader's
    # shutdown and the report the rest; the watchdog steps in at the budget's end.
    end = began + 0.93 * budget_s
    watchdog = threading.Timer(budget_s, results.overrun)
    watchdog.daemon = True
    watchdog.start()
    limit = min(results.cpus, sizes.most)
    counts, producers = [k for k in COUNTS if k <= limit], [p for p in PRODUCERS if p <= limit]
    print(f"{results.cpus} usable CPUs ({results.cores or '?'} physical cores); workers {counts}, producer threads "
          f"{producers}; budget {budget_s:g} s", file=sys.stderr, flush=True)

    # The buffer first: its share of the budget is fixed, and its memcpy figures
    # tell part 1 whether memory bandwidth is what stops the loaders.
    part2_end = time.perf_counter() + sizes.part2_share * (end - time.perf_counter())
    results.run("part 2 (the shuffle buffer)", lambda: buffer_part(sizes, producers, part2_end, results))
    results.run("part 1 (worker processes)", lambda: workers_part(sizes, counts, end, results))
    watchdog.cancel()
    results.emit()
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
