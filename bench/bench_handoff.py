"""The pinned handoff, against the link: host-to-device copies of EchoLoader's
batches (``pin_memory=True, device="cuda"``, ``output="torch"``) beside what
the link gives, measured in one run; then the copy hidden behind a step.

Batches of 64 uint8 examples of 1 KiB, 16 KiB, 256 KiB and 1 MiB (64 KiB,
1 MiB, 16 MiB and 64 MiB a batch), shuffled, at echo 1, read from one
in-memory NumPy array of 1 GiB (the loader reads it natively, no Python per
example). GB/s are 10^9 bytes of batches a second; each in brackets as a
ratio to the pinned limit:

- pinned limit: one 256 MiB copy from a pinned buffer, timed with CUDA
  events, the best of 5: what the link gives.
- pinned, back to back: copies of one batch's size from a pinned buffer,
  queued back to back, timed with events: what the link gives at that size.
- EchoLoader, its copies: the bytes its batches' copies move over the copy
  engine's time for them (each copy's own duration, from torch.profiler's
  CUDA trace; the time between copies left out): whether they come from
  pinned memory and run at the link's rate. A cell marked ``[pageable ...]``
  counts copies that did not come from pinned memory.
- EchoLoader, delivered: the bytes of the batches the loop got over the
  loop's wall time, from after 2 warm-up batches to a device sync after the
  last: end to end, the host's gather included.
- EchoLoader, host batches (``device=None``): the gather into pinned blocks
  alone, no copy: what the loader can feed the link.
- pageable ``.to("cuda")``: the same batches' bytes from a plain tensor.
- ``DataLoader(pin_memory=True)`` + ``.to("cuda", non_blocking=True)`` over
  the same rows: delivered, its copies, and its host batches alone.

Target: EchoLoader's copies at least 0.9 of the pinned limit at 1 MiB and
above. Second table: a synthetic step (bf16 matmuls, then a read of the whole
batch, then a sync as ``loss.item()`` would) as long as one 16 MiB batch's
copy, or as the loader's gather of one where that is longer (else the loader
and not the copy would set the pace): its loop time per batch alone over a
preloaded device batch, after a synchronous pinned copy, and fed by
EchoLoader; the copy hidden = 1 - (EchoLoader's - alone) / (synchronous - alone).

``--cpu``: no CUDA: the copies cannot run. The same code on the host at small
sizes: the loaders' host batches against a memcpy of the same bytes as the
limit, and the step fed by ``device="cpu"`` (the mover's host path); the CUDA
rows say "no CUDA" and their targets are skipped.

Usage:
    python bench/bench_handoff.py [--cpu] [--budget-s 60] [--json PATH]
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import common
import numpy as np
import torch

import dataecho

KIB, MIB = 1 << 10, 1 << 20
BATCH = 64  # examples a batch
WARMUP = 2  # batches before any timing
MIN_BATCHES = 3  # timed at least, whatever the budget
LIMIT_ROUNDS = 5
TARGET_RATIO = 0.9  # EchoLoader's copies, of the pinned limit, at 1 MiB and above
TARGET_HIDDEN = 0.8  # of the copy, behind a step as long as it
CPU_BUDGET_S = 12.0  # --cpu finishes within this, whatever --budget-s says
OVERLAP_SHARE = 0.3  # of the budget left when the first table starts
NO_CUDA, SKIPPED, ERROR = "no CUDA", "skipped (budget)", "error"
READING = ("GB/s: 10^9 bytes of batches a second, higher is better; in brackets, the ratio to the pinned limit "
           "(with --cpu: to a memcpy). Overlap: loop time per batch, lower is better; copy hidden, higher is better")


class Scale(NamedTuple):
    sizes: tuple[int, ...]  # bytes a batch
    source_bytes: int
    limit_bytes: int
    overlap_bytes: int


GPU_SCALE = Scale((64 * KIB, MIB, 16 * MIB, 64 * MIB), 1 << 30, 256 * MIB, 16 * MIB)
CPU_SCALE = Scale((64 * KIB, MIB), 64 * MIB, 32 * MIB, MIB)
T = TypeVar("T")


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc), or 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


STARTED = time.perf_counter() - process_age_s()  # the budget counts Python's start and torch's import too


def progress(message: str) -> None:
    print(f"[handoff {time.perf_counter() - STARTED:5.1f} s] {message}", flush=True)


def size_name(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


class Measured(NamedTuple):
    gbps: float
    detail: str = ""  # shown beside the rate, where there is something to flag


class Failed:
    """What ``Report.attempt`` returns for a part that raised."""


FAILED = Failed()


class Env:
    """Where the copies go: a CUDA device (CUDA events time them), or with
    --cpu none (host memcpys stand in, timed by the clock)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu (no CUDA)"


class Budget:
    """The run's time: each part times for a share of what is left, so that
    the whole ends within ``total_s`` (setting a part up takes time too)."""

    def __init__(self, total_s: float) -> None:
        self.total_s = total_s

    def left_s(self) -> float:
        return self.total_s - (time.perf_counter() - STARTED)

    def slice_s(self, parts_left: int, reserve_s: float = 0.0) -> float | None:
        """Seconds of timing for the next of ``parts_left`` parts: half of an
        even share of what is left beyond ``reserve_s`` (the other half for
        setting it up), at most 1 s; None once too little is left."""
        share = (self.left_s() - reserve_s) / max(1, parts_left)
        return None if share < 0.06 else min(1.0, share / 2)


@dataclass
class Report:
    """What the run found: tables, targets and notes, and the parts that failed."""

    device: str = ""
    tables: list[dict[str, Any]] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    on_table: Callable[[], None] = lambda: None  # saves what is found so far (a later part may hang)

    def attempt(self, what: str, run: Callable[[], Any]) -> Any:
        """``run()``, or FAILED where it raised: reported (traceback on stderr,
        a note), and the run goes on."""
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - a failed part is reported; the others still run
            traceback.print_exc()
            sys.stderr.flush()
            self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            progress(f"{what}: FAILED ({type(exc).__name__}: {exc})")
            return FAILED

    def table(self, title: str, header: list[str], rows: list[list[str]]) -> None:
        self.tables.append({"title": title, "header": header, "rows": rows})
        self.on_table()

    def target(self, target: str, shown: str, met: bool | None) -> None:
        self.targets.append({"target": target, "shown": shown, "met": met})


# ---- what is timed ----


def copy_rate(env: Env, nbytes: int, repeats: int, rounds: int) -> float:
    """GB/s of ``repeats`` copies of ``nbytes`` queued back to back, the best
    of ``rounds``: host to device from a pinned buffer, timed with CUDA events;
    with --cpu, a memcpy between two host buffers, timed by the clock."""
    best = math.inf
    if not env.cuda:
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        np.copyto(dst, src)  # every page of both touched before the timing
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(repeats):
                np.copyto(dst, src)
            best = min(best, time.perf_counter() - start)
        return gbps(nbytes * repeats, best)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
    dst.copy_(src, non_blocking=True)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        torch.cuda.synchronize()
        begin.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, begin.elapsed_time(end) / 1e3)
    return gbps(nbytes * repeats, best)


def back_to_back(env: Env, nbytes: int, seconds: float, limit_gbps: float) -> Measured:
    """``copy_rate`` at one batch's size, 3 rounds of about ``seconds`` in all."""
    repeats = int(min(2000, max(4, seconds / 3 * limit_gbps * 1e9 / nbytes)))
    return Measured(copy_rate(env, nbytes, repeats, 3))


def delivered(env: Env, batches: Iterator[Any], batch_bytes: int, seconds: float,
              move: Callable[[Any], Any] | None = None) -> Measured:
    """GB/s of the batches the loop gets from ``batches`` (each passed to
    ``move``, where given): 2 warm-up batches, then as many as ``seconds``
    allows (at least 3, at most to the epoch's end), to a device sync after."""
    for _ in range(WARMUP):
        batch = next(batches)
        if move is not None:
            move(batch)
    env.sync()
    start, count = time.perf_counter(), 0
    for batch in batches:
        if move is not None:
            batch = move(batch)
        count += 1
        if count >= MIN_BATCHES and time.perf_counter() - start >= seconds:
            break
    env.sync()
    return Measured(gbps(count * batch_bytes, time.perf_counter() - start))


def copy_engine(env: Env, batches: Iterator[Any], batch_bytes: int, count: int,
                move: Callable[[Any], Any] | None = None) -> Measured:
    """GB/s of the host-to-device copies of ``count`` batches (one copy a
    batch) over the copy engine's time for them, each copy's own duration in
    torch.profiler's CUDA trace; the detail flags copies from pageable memory."""
    for _ in range(WARMUP):
        batch = next(batches)
        if move is not None:
            move(batch)
    env.sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(count):
            batch = next(batches)
            if move is not None:
                move(batch)
        env.sync()
    copies = [e for e in profile.events() if e.name.lower().startswith("memcpy htod")]
    if not copies:
        raise RuntimeError("the profiler's CUDA trace holds no host-to-device copy")
    busy_s = sum(e.time_range.elapsed_us() for e in copies) / 1e6
    pageable = sum("pinned" not in e.name.lower() for e in copies)
    return Measured(gbps(len(copies) * batch_bytes, busy_s), f"[pageable {pageable}/{len(copies)}]" if pageable else "")


class Rows(torch.utils.data.Dataset):
    """DataLoader's view of the rows: row i as a tensor over the array's memory."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.rows[i])


def with_loader(make: Callable[[], Any], measure: Callable[[Iterator[Any]], T]) -> T:
    """``measure`` over an epoch of a new loader, which is closed after."""
    loader = make()
    try:
        return measure(iter(loader))
    finally:
        if isinstance(loader, dataecho.EchoLoader):
            loader.close()
        del loader
        gc.collect()  # DataLoader's pinning thread ends with its iterator


def echo_loader(rows: np.ndarray, pin: bool, device: Any) -> dataecho.EchoLoader:
    # A shuffle buffer of 4 batches: its fill at an epoch's start is cheap at 1 MiB examples too.
    return dataecho.EchoLoader(rows, batch_size=BATCH, echo_factor=1, shuffle_buffer=4 * BATCH, output="torch",
                               pin_memory=pin, device=device)


def torch_loader(rows: np.ndarray, pin: bool) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Rows(rows), batch_size=BATCH, shuffle=True, pin_memory=pin)


def slices(rows: np.ndarray) -> Iterator[torch.Tensor]:
    """Batches of consecutive rows, as plain (pageable) tensors over the array, round and round."""
    while True:
        for first in range(0, len(rows) - BATCH + 1, BATCH):
            yield torch.from_numpy(rows[first:first + BATCH])


# ---- the first table: the handoff against the link ----

Run = Callable[[float], Measured]  # seconds of timing -> the rate


def contestants(env: Env, rows: np.ndarray, limit_gbps: float) -> list[tuple[str, str, Run | None]]:
    """(key, label, run) of each row of the first table at one batch size;
    run is None where the row needs CUDA and there is none."""
    nbytes, device = rows[:BATCH].nbytes, env.device
    epoch_batches = len(rows) // BATCH

    def count(seconds: float) -> int:  # batches in a profiled pass: a few, within one epoch
        return int(max(4, min(24, epoch_batches - WARMUP - 1, seconds * limit_gbps * 1e9 / nbytes)))

    def to_device(batch: torch.Tensor) -> torch.Tensor:
        return batch.to(device, non_blocking=True)

    def pageable(batch: torch.Tensor) -> torch.Tensor:
        return batch.to(device)

    cuda_rows: list[tuple[str, str, Run]] = [
        ("echo_copies", "EchoLoader, its copies (copy engine time)", lambda s: with_loader(
            lambda: echo_loader(rows, True, device), lambda b: copy_engine(env, b, nbytes, count(s)))),
        ("echo_delivered", "EchoLoader, delivered", lambda s: with_loader(
            lambda: echo_loader(rows, True, device), lambda b: delivered(env, b, nbytes, s))),
        ("pageable", 'pageable .to("cuda")', lambda s: delivered(env, slices(rows), nbytes, s, pageable)),
        ("torch_delivered", "DataLoader(pin_memory=True) + .to(non_blocking=True), delivered", lambda s: with_loader(
            lambda: torch_loader(rows, True), lambda b: delivered(env, b, nbytes, s, to_device))),
        ("torch_copies", "DataLoader(pin_memory=True), its copies (copy engine time)", lambda s: with_loader(
            lambda: torch_loader(rows, True), lambda b: copy_engine(env, b, nbytes, count(s), to_device))),
    ]
    pinned = " (pin_memory=True)" if env.cuda else ""
    everywhere: list[tuple[str, str, Run]] = [
        ("back_to_back", "pinned, back to back" if env.cuda else "memcpy, back to back",
         lambda s: back_to_back(env, nbytes, s, limit_gbps)),
        ("echo_host", f"EchoLoader, host batches (device=None){pinned}", lambda s: with_loader(
            lambda: echo_loader(rows, env.cuda, None), lambda b: delivered(env, b, nbytes, s))),
        ("torch_host", f"DataLoader, host batches{pinned}", lambda s: with_loader(
            lambda: torch_loader(rows, env.cuda), lambda b: delivered(env, b, nbytes, s))),
    ]
    order = ("back_to_back", "echo_copies", "echo_delivered", "echo_host", "pageable", "torch_delivered",
             "torch_copies", "torch_host")
    runs = {key: (label, run) for key, label, run in everywhere}
    runs.update({key: (label, run if env.cuda else None) for key, label, run in cuda_rows})
    return [(key, *runs[key]) for key in order]


def rows_of(source: np.ndarray, batch_bytes: int) -> np.ndarray:
    """The source as rows of one example each, ``BATCH`` of them ``batch_bytes``."""
    return source.reshape(-1, batch_bytes // BATCH)


def cell(measured: Measured | Failed, limit: float | Failed) -> str:
    if isinstance(measured, Failed):
        return ERROR
    ratio = "" if isinstance(limit, Failed) else f" ({measured.gbps / limit:.2f})"
    return f"{measured.gbps:.2f}{ratio}{' ' + measured.detail if measured.detail else ''}"


def handoff_table(env: Env, scale: Scale, budget: Budget, report: Report,
                  source: np.ndarray) -> tuple[dict[tuple[str, int], Measured], float | Failed]:
    """Measures and reports the first table; returns what was measured, by
    (row key, batch bytes), and the limit (GB/s)."""
    what = f"{'pinned' if env.cuda else 'memcpy'} limit: one {size_name(scale.limit_bytes)} copy, best of {LIMIT_ROUNDS}"
    progress(f"{what} ...")
    limit = report.attempt(what, lambda: copy_rate(env, scale.limit_bytes, 1, LIMIT_ROUNDS))
    guess = 25.0 if isinstance(limit, Failed) else limit  # only sizes the parts' repeat counts
    plan = [(size, contestants(env, rows_of(source, size), guess)) for size in scale.sizes]
    parts_left = sum(run is not None for _, rows in plan for _, _, run in rows)
    reserve_s = budget.left_s() * OVERLAP_SHARE
    found: dict[tuple[str, int], Measured] = {}
    labels: dict[str, str] = {}
    cells: dict[str, list[str]] = {}
    for size, rows in plan:
        for key, label, run in rows:
            labels[key] = label
            column = cells.setdefault(key, [])
            if run is None:
                column.append(NO_CUDA)
                continue
            seconds = budget.slice_s(parts_left, reserve_s)
            parts_left -= 1
            if seconds is None:
                column.append(SKIPPED)
                continue
            progress(f"{size_name(size)}: {label} ...")
            measured = report.attempt(f"{label}, {size_name(size)}", lambda: run(seconds))  # noqa: B023 - called at once
            column.append(cell(measured, limit))
            if not isinstance(measured, Failed):
                found[(key, size)] = measured
    limit_cell = ERROR if isinstance(limit, Failed) else f"{limit:.2f} (1.00)"
    table = [[what] + [limit_cell] * len(scale.sizes)] + [[labels[key]] + column for key, column in cells.items()]
    report.table(f"Host to device, GB/s (ratio to the {'pinned' if env.cuda else 'memcpy'} limit), "
                 f"batches of {BATCH} examples", ["", *map(size_name, scale.sizes)], table)
    return found, limit


def handoff_findings(env: Env, scale: Scale, report: Report, found: dict[tuple[str, int], Measured],
                     limit: float | Failed) -> None:
    """The first table's target, and what its rows say together."""
    target = f"EchoLoader's copies at least {TARGET_RATIO} of the pinned limit at 1 MiB and above"
    if not env.cuda:
        report.target(target, NO_CUDA, None)
        return
    sizes = [size for size in scale.sizes if size >= MIB]
    ratios = {} if isinstance(limit, Failed) else {
        size: found[("echo_copies", size)].gbps / limit for size in sizes if ("echo_copies", size) in found}
    shown = ", ".join(f"{size_name(size)}: {ratio:.2f}" for size, ratio in ratios.items())
    missing = [size_name(size) for size in sizes if size not in ratios]
    if missing:
        report.target(target, f"{shown}; not measured at {', '.join(missing)}".lstrip("; "), None)
    else:
        report.target(target, shown, all(ratio >= TARGET_RATIO for ratio in ratios.values()))
    paced = []
    for size in scale.sizes:
        parts = [found.get((key, size)) for key in ("echo_delivered", "echo_host")]
        if None not in parts and not isinstance(limit, Failed):
            slowest = min(limit, parts[1].gbps)
            paced.append(f"{size_name(size)}: {parts[0].gbps / slowest:.2f}")
    if paced:
        report.notes.append("EchoLoader delivered, of the slower of the link and its own host gather: "
                            + ", ".join(paced))


# ---- the second table: the copy hidden behind a step ----


class Step:
    """A synthetic training step: ``k`` matmuls of ``n`` x ``n`` (bf16 on a
    GPU), a read of the whole batch (so the step depends on its copy), then a
    sync of the loop's own stream, as a loop that reads its loss each step does
    (a device-wide sync would wait for the loader's next copy too)."""

    def __init__(self, env: Env, n: int) -> None:
        device = env.device or torch.device("cpu")
        self.cuda, self.k = env.cuda, 1
        self.a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if env.cuda else torch.float32)
        self.out = torch.empty_like(self.a)
        self.total = torch.zeros((), dtype=torch.int64, device=device)

    def __call__(self, batch: torch.Tensor) -> None:
        for _ in range(self.k):
            torch.mm(self.a, self.a, out=self.out)
        self.total += batch.sum(dtype=torch.int64)
        if self.cuda:
            torch.cuda.current_stream().synchronize()


def loop_time(step: Step, batches: Iterator[torch.Tensor], seconds: float) -> float:
    """Median seconds a batch of the loop ``for batch in batches: step(batch)``
    (the step and the wait for its batch), after 2 warm-up batches, over about
    ``seconds`` (at least 5 batches)."""
    for _ in range(WARMUP):
        step(next(batches))
    times: list[float] = []
    start = last = time.perf_counter()
    for batch in batches:
        step(batch)
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if len(times) >= 5 and now - start >= seconds:
            break
    return statistics.median(times)


def repeat(batch: torch.Tensor) -> Iterator[torch.Tensor]:
    while True:
        yield batch


def calibrate(step: Step, batch: torch.Tensor, target_s: float) -> float:
    """Sets ``step.k`` so that a step over ``batch`` takes about ``target_s``; returns its time."""
    step.k = 0
    bare_s = loop_time(step, repeat(batch), 0.05)
    step.k = 32
    per_matmul_s = max(1e-6, (loop_time(step, repeat(batch), 0.05) - bare_s) / 32)
    step.k = min(5000, max(1, round((target_s - bare_s) / per_matmul_s)))
    return loop_time(step, repeat(batch), 0.1)


def overlap_loops(env: Env, rows: np.ndarray, step: Step, budget: Budget,
                  report: Report) -> dict[str, float | Failed | None]:
    """The loop's time a batch: the step alone over a preloaded batch, after a
    synchronous copy of each batch, and fed by EchoLoader (None: no time left)."""
    host = [torch.from_numpy(rows[i * BATCH:(i + 1) * BATCH]) for i in range(4)]
    if env.cuda:
        host = [batch.pin_memory() for batch in host]
    preloaded = host[0].to(env.device) if env.cuda else host[0].clone()

    def copied() -> Iterator[torch.Tensor]:  # a blocking copy of each batch, as a loop without a loader's stream makes
        while True:
            for batch in host:
                yield batch.to(env.device) if env.cuda else batch.clone()

    loops: dict[str, Callable[[float], float]] = {
        "alone": lambda s: loop_time(step, repeat(preloaded), s),
        "synchronous": lambda s: loop_time(step, copied(), s),
        "echo": lambda s: with_loader(lambda: echo_loader(rows, env.cuda, env.device or "cpu"),
                                      lambda batches: loop_time(step, batches, s)),
    }
    times: dict[str, float | Failed | None] = {}
    for left, (name, loop) in zip((3, 2, 1), loops.items()):
        seconds = budget.slice_s(left)
        if seconds is None:
            times[name] = None
            continue
        progress(f"overlap: {name} ...")
        times[name] = report.attempt(f"overlap, {name}", lambda: loop(seconds))  # noqa: B023 - called at once
    return times


def overlap_table(env: Env, scale: Scale, budget: Budget, report: Report, source: np.ndarray,
                  found: dict[tuple[str, int], Measured]) -> None:
    """Measures and reports the second table, and its target."""
    nbytes = scale.overlap_bytes
    rows = rows_of(source, nbytes)
    link = found.get(("back_to_back", nbytes)) or Measured(copy_rate(env, nbytes, 8, 3))
    copy_s = nbytes / (link.gbps * 1e9)
    gather = found.get(("echo_host", nbytes))
    gather_s = nbytes / (gather.gbps * 1e9) if gather else 0.0
    # As long as the copy, or as the loader's gather where that is longer: else the loader would set the pace.
    target_s = max(copy_s, 1.25 * gather_s)
    progress(f"overlap: a step of about {target_s * 1e3:.2f} ms ...")
    step = Step(env, 2048 if env.cuda else 128)
    calibrate(step, torch.from_numpy(rows[:BATCH]).to(env.device or "cpu"), target_s)
    times = overlap_loops(env, rows, step, budget, report)

    def shown(name: str) -> str:
        value = times[name]
        return ERROR if isinstance(value, Failed) else SKIPPED if value is None else f"{value * 1e3:.3f} ms"

    alone = times["alone"]
    measured = {name: value for name, value in times.items() if isinstance(value, float)}
    slower = {name: f"{value / alone - 1:+.1%}" for name, value in measured.items()} if "alone" in measured else {}
    hidden = None
    if env.cuda and {"alone", "synchronous", "echo"} <= measured.keys():
        exposed_s = measured["synchronous"] - measured["alone"]
        hidden = 1 - (measured["echo"] - measured["alone"]) / exposed_s if exposed_s > 0 else None
    copy_label = "a synchronous pinned copy (.to())" if env.cuda else "a host copy (.clone())"
    echo_label = 'EchoLoader(pin_memory=True, device="cuda")' if env.cuda else 'EchoLoader(device="cpu")'
    report.table(
        f"Overlap: {size_name(nbytes)} batches; a step of {step.k} matmul{'s' * (step.k != 1)}; "
        f"the copy {copy_s * 1e3:.3f} ms "
        f"(back to back), the loader's gather {gather_s * 1e3:.3f} ms",
        ["loop", "per batch", "vs the step alone", "copy hidden"],
        [["the step alone, over a preloaded batch", shown("alone"), "", ""],
         [f"the step after {copy_label}", shown("synchronous"), slower.get("synchronous", ""),
          "0% (the baseline)" if env.cuda else NO_CUDA],
         [f"the step fed by {echo_label}", shown("echo"), slower.get("echo", ""),
          NO_CUDA if not env.cuda else "n/a" if hidden is None else f"{hidden:.0%}"]])
    target = f"EchoLoader hides at least {TARGET_HIDDEN:.0%} of a {size_name(nbytes)} batch's copy behind the step"
    if not env.cuda:
        report.target(target, NO_CUDA, None)
    else:
        report.target(target, "not measured" if hidden is None else f"{hidden:.0%}",
                      None if hidden is None else hidden >= TARGET_HIDDEN)
    report.notes.append("copy hidden = 1 - (fed by EchoLoader - alone) / (after a synchronous copy - alone); the "
                        "loader's own time in the loop's thread counts as not hidden")


# ---- the run ----


def make_source(nbytes: int) -> np.ndarray:
    """``nbytes`` of uint8, every page written (untouched zero pages would read faster than memory)."""
    source = np.empty(nbytes, np.uint8)
    source.reshape(-1, MIB)[:] = np.random.default_rng(0).integers(0, 256, MIB, dtype=np.uint8)
    return source


def run_all(env: Env, scale: Scale, budget: Budget, report: Report) -> None:
    progress(f"{report.device}; budget {budget.total_s:.0f} s; source: {size_name(scale.source_bytes)} of rows")
    source = make_source(scale.source_bytes)
    found, limit = handoff_table(env, scale, budget, report, source)
    handoff_findings(env, scale, report, found, limit)
    if not env.cuda:
        report.notes.append("--cpu: batches that fit in the caches copy faster than the memcpy limit, "
                            "which copies through memory")
    report.attempt("overlap", lambda: overlap_table(env, scale, budget, report, source, found))


def document(report: Report, cpu: bool, seconds: float, final: bool = True) -> dict[str, Any]:
    """The run as the JSON the device check reads (bench/device_report.py);
    not ``final``: what a run that has not ended yet found so far."""
    unfinished = [] if final else ["incomplete: the run had not ended when this was written"]
    return {
        "name": "handoff",
        "title": "The pinned handoff, against the link",
        "command": "python bench/bench_handoff.py" + (" --cpu" if cpu else ""),
        "machine": common.machine(torch=torch.__version__, cuda=torch.version.cuda),
        "device": report.device,
        "reading": READING,
        "tables": report.tables,
        "targets": report.targets,
        "notes": report.notes + [f"error: {error}" for error in report.errors] + unfinished,
        "seconds": round(seconds, 1),
    }


def save(path: str | None, doc: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="no CUDA: the host paths at small sizes")
    parser.add_argument("--budget-s", type=float, default=60.0, help="the whole run ends within about this")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    report = Report()
    cuda = not args.cpu and report.attempt("CUDA", torch.cuda.is_available) is True
    if not args.cpu and not cuda:
        report.errors.append("CUDA is not available here: measured as with --cpu")
    if not cuda:
        torch.set_num_threads(1)  # the loader's threads and the step share few cores
    budget = Budget(args.budget_s if cuda else min(args.budget_s, CPU_BUDGET_S))
    # A part that hangs: every thread's stack on stderr, and the run ends (exit 1) with the
    # tables saved so far, rather than running into the caller's own limit.
    faulthandler.dump_traceback_later(max(10.0, budget.left_s() + 15.0), exit=True)
    report.on_table = lambda: save(args.json, document(report, not cuda, time.perf_counter() - STARTED, False))
    save(args.json, document(report, not cuda, time.perf_counter() - STARTED, False))
    try:
        env = Env(cuda)
        report.device = env.name()
        run_all(env, GPU_SCALE if cuda else CPU_SCALE, budget, report)
    except Exception as exc:  # noqa: BLE001 - a fault of the run itself: reported, the JSON still written
        traceback.print_exc()
        report.errors.append(f"the run: {type(exc).__name__}: {exc}")
    faulthandler.cancel_dump_traceback_later()
    doc = document(report, not cuda, time.perf_counter() - STARTED)
    common.print_document(doc)
    save(args.json, doc)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
