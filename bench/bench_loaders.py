"""Loader against loader: the path users run, ``EchoLoader`` with default
arguments, against the loaders they would otherwise use, in one run.

Every pipeline delivers shuffled batches of 256 one-field uint8 examples (64 B,
12 KiB and 150 KiB) at echo factor 1, epoch after epoch, from one of three
sources of the same rows:

* ``per-example``: a map-style dataset whose ``__getitem__`` returns a fresh
  copy of an in-memory row (Python per example, holding the GIL: the usual
  torch ``Dataset``);
* ``array``: the NumPy array of the rows itself;
* ``__getitems__``: a dataset that also has ``__getitems__(indices)`` (torch's
  batched fetch, which DataLoader calls too), one NumPy gather per call;
* ``read_into`` (EchoLoader alone): ``per-example`` with ``read_into(i, out)``,
  which writes row i straight into the loader's memory (at echo 1, into its
  batch: one copy).

Contestants: ``EchoLoader(source, batch_size=256, echo_factor=1)``, and for
the per-example source also with 2 (persistent) worker processes; the loop a
user would write in a few minutes, over the per-example source (one thread
calls ``source[i]`` over a permutation into a ``queue.Queue``, another keeps a
Python list of 4,096 examples as its shuffle buffer and ``np.stack``-s 256
random picks into each batch: two copies per example); torch
``DataLoader(source, batch_size=256, shuffle=True)`` with ``num_workers=0`` and
with ``num_workers=2, persistent_workers=True``; ``torchdata.nodes``
(``SamplerWrapper -> ParallelMapper(2 threads) -> Batcher -> Mapper(collate)
-> Prefetcher``), where installed; ``tf.data``'s
``from_tensor_slices(rows).shuffle(4096).batch(256).prefetch(2)`` over the
array, where tensorflow imports (the reference for sources read without
Python per example); and the bare loop: one thread calling ``source[i]`` in a
Python loop, nothing else (the reference for per-example sources).

A torch ``TensorDataset`` of 12 KiB rows (and int64 ids) is read by
``EchoLoader`` and by ``DataLoader`` with 0 and 2 workers; a Hugging Face
``datasets.Dataset`` of 12 KiB rows (torch format) by ``EchoLoader`` and by
``DataLoader(num_workers=2)``, where datasets imports.

Rates are delivered examples/s in steady state (after the first epoch, and at
least 4 batches: workers starting, memory touched for the first time), epochs
included, the median of ``repeat`` interleaved rounds. Beside each: the copies
of each example's bytes the pipeline makes (``__getitem__``'s own included:
1 for the bare loop), the GB/s those copies move, and that as a fraction of
one thread's memcpy bandwidth measured in the same run (``np.copyto`` of
256 MiB): two threads copying at once can pass 1.

Usage:
    python bench/bench_loaders.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import common
import dataecho
from dataecho.examples.columns import FRESH_MIN_BYTES
from bench_buffer import SteadyRate, median_run

BATCH = 256
SHUFFLE = 4096
WARMUP_BATCHES = 4
# Examples not timed, set per size (run_matrix): the first epoch, at least WARMUP_BATCHES batches.
warmup = {"examples": WARMUP_BATCHES * BATCH}
ECHO = "EchoLoader"
ECHO_PROCESSES = "EchoLoader, 2 worker processes"
DL0, DL2 = "DataLoader, 0 workers", "DataLoader, 2 workers"
NODES, TF, BARE = "torchdata.nodes", "tf.data (the array)", "bare __getitem__ loop"
HAND = "hand-written loop (queue, list buffer, np.stack)"


@dataclass(frozen=True)
class Size:
    label: str
    nbytes: int
    rows: int  # rows in the source: an epoch


SIZES = (Size("64 B", 64, 1 << 18), Size("12 KiB", 12 << 10, 1 << 14), Size("150 KiB", 150 << 10, 4096),
         Size("1 MiB", 1 << 20, 1024))
SOURCES = ("per-example", "array", "__getitems__")


class FreshRows:
    """Map-style: ``self[i]`` is a fresh copy of row i (as a Dataset that reads and decodes returns new memory)."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[i].copy()


class BatchedRows(FreshRows):
    """``FreshRows`` with ``__getitems__``: one gather per call, split into rows."""

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return list(self.rows[indices])


class WrittenRows(FreshRows):
    """``FreshRows`` that also writes row i straight into the loader's memory (``read_into``)."""

    def read_into(self, i: int, out: np.ndarray) -> None:
        out[...] = self.rows[i]


def source_of(kind: str, rows: np.ndarray) -> Any:
    return {"per-example": FreshRows, "__getitems__": BatchedRows}.get(kind, lambda r: r)(rows)


def endless(make_epoch: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    """Batches of epoch after epoch."""
    while True:
        yield from make_epoch()


def timed(batches: Iterator[Any], seconds: float) -> dict:
    rate = SteadyRate(warmup=warmup["examples"], seconds=seconds)
    for batch in batches:
        # A batch of columns (a dict or a tuple of leaves) or one array.
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        rows = batch[0] if isinstance(batch, (tuple, list)) else batch
        if rate.add(len(rows)):
            break
    return rate.result()


Measure = Callable[[Iterator[Any], float], dict]


def run_echo(source: Any, seconds: float, measure: Measure = timed, **options: Any) -> dict:
    """``EchoLoader(source, **options)`` at echo 1, measured by ``measure``."""
    loader = dataecho.EchoLoader(source, batch_size=BATCH, echo_factor=1, **options)
    try:
        return measure(endless(lambda: loader), seconds)
    finally:
        loader.close()


def run_dataloader(source: Any, seconds: float, workers: int, measure: Measure = timed,
                   collate_fn: Callable[[list], Any] | None = None) -> dict:
    """``DataLoader(shuffle=True)`` with ``workers`` (persistent) workers."""
    import torch.utils.data as data

    loader = data.DataLoader(source, batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=collate_fn,
                             persistent_workers=workers > 0)
    batches = endless(lambda: loader)
    try:
        return measure(batches, seconds)
    finally:
        batches.close()
        del loader  # shuts its workers down


def run_nodes(source: Any, seconds: float) -> dict:
    import torch.utils.data as data
    import torchdata.nodes as tn

    made: list[Any] = []

    def epoch() -> Iterable[Any]:
        node = tn.SamplerWrapper(data.RandomSampler(source))
        node = tn.ParallelMapper(node, map_fn=source.__getitem__, num_workers=2, method="thread")
        made.append(node)
        node = tn.Prefetcher(tn.Mapper(tn.Batcher(node, batch_size=BATCH), data.default_collate), prefetch_factor=2)
        made.append(node)
        return tn.Loader(node)

    try:
        return timed(endless(epoch), seconds)
    finally:
        for node in made:  # stop their threads now: left running, they would slow the next contestant
            running = getattr(node, "_it", None)
            while running is not None:
                shutdown = getattr(running, "_shutdown", None)
                if shutdown is not None:
                    shutdown()
                running = getattr(running, "_it", None)


def run_hand_loop(source: Any, seconds: float) -> dict:
    """The loop a user writes: a reading thread puts ``source[i]`` over a
    permutation (a new one each epoch) into a queue; an assembling thread keeps
    a list of ``SHUFFLE`` examples and ``np.stack``-s ``BATCH`` random picks
    (each taken out, its place refilled) into each batch; the main thread
    takes the batches."""
    inbox: queue.Queue = queue.Queue(maxsize=2 * BATCH)
    outbox: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()

    def put(box: queue.Queue, item: Any) -> bool:
        while not stop.is_set():
            try:
                box.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def get(box: queue.Queue) -> Any:
        while not stop.is_set():
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                pass
        return None

    def read() -> None:
        order = np.random.default_rng(0)
        while True:
            for i in order.permutation(len(source)).tolist():
                if not put(inbox, source[i]):
                    return

    def assemble() -> None:
        picks, pool = random.Random(0), []
        while True:
            while len(pool) < SHUFFLE:
                example = get(inbox)
                if example is None:
                    return
                pool.append(example)
            batch = []
            for _ in range(BATCH):
                j = picks.randrange(len(pool))
                pool[j], pool[-1] = pool[-1], pool[j]
                batch.append(pool.pop())
            if not put(outbox, np.stack(batch)):
                return

    threads = [threading.Thread(target=f, daemon=True) for f in (read, assemble)]
    for t in threads:
        t.start()
    def batches() -> Iterator[np.ndarray]:
        while (batch := get(outbox)) is not None:
            yield batch

    try:
        return timed(batches(), seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(5)


def run_tfdata(rows: np.ndarray, seconds: float) -> dict:
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(rows).shuffle(SHUFFLE, seed=0).batch(BATCH).prefetch(2).repeat()
    return timed(iter(ds), seconds)


def run_bare(source: Any, seconds: float) -> dict:
    """One thread calling ``source[i]`` over shuffled indices; 'batches' of 256 calls."""
    order = np.random.default_rng(0).permutation(len(source)).tolist()

    def epoch() -> Iterator[range]:
        for start in range(0, len(order), BATCH):
            for i in order[start:start + BATCH]:
                source[i]
            yield range(min(BATCH, len(order) - start))

    return timed(endless(epoch), seconds)


def contestants(available: dict[str, bool]) -> dict[str, Callable[[Any, np.ndarray, float], dict]]:
    runs: dict[str, Callable[[Any, np.ndarray, float], dict]] = {ECHO: lambda s, r, t: run_echo(s, t)}
    if available["torch"]:
        runs[DL0] = lambda s, r, t: run_dataloader(s, t, 0)
        runs[DL2] = lambda s, r, t: run_dataloader(s, t, 2)
    if available["torch"] and available["torchdata"]:
        runs[NODES] = lambda s, r, t: run_nodes(s, t)
    runs[BARE] = lambda s, r, t: run_bare(s, t)
    return runs


# Copies of each example's bytes, __getitem__'s own included, by (source, contestant), at echo 1. EchoLoader:
# into its slot, then into the batch; from FRESH_MIN_BYTES up, the new array __getitem__ returns is held until
# it is copied into its batch (dataecho.native.hold); the array source is gathered straight from.
# __getitems__' rows are views of one gather, so copied into slots. DataLoader with workers collates into
# shared memory, which the main process takes as it is.
COPIES = {
    ("per-example", ECHO): 3, ("per-example", ECHO_PROCESSES): 3, ("per-example", HAND): 2,
    ("per-example", DL0): 2, ("per-example", DL2): 2, ("per-example", NODES): 2, ("per-example", BARE): 1,
    ("array", ECHO): 1, ("array", TF): 2, ("__getitems__", ECHO): 3,
}


def copies(kind: str, name: str, nbytes: int) -> int | None:
    """Copies of each example's bytes (see COPIES)."""
    if (kind, name) == ("per-example", ECHO) and nbytes >= FRESH_MIN_BYTES:
        return 2
    if (kind, name) == ("read_into", ECHO):  # at echo 1 written straight into its batch
        return 1
    return COPIES.get((kind, name))


def run_matrix(seconds: float, repeat: int, available: dict[str, bool]) -> list[dict]:
    """Every (size, source, contestant), rounds interleaved; tf.data once per size."""
    runs, out = contestants(available), []
    for size in SIZES:
        rows = np.random.default_rng(0).integers(0, 256, (size.rows, size.nbytes), dtype=np.uint8)
        warmup["examples"] = max(WARMUP_BATCHES * BATCH, size.rows)
        cells: dict[tuple[str, str], list[dict]] = {}
        for _ in range(repeat):
            for kind in SOURCES:
                source = source_of(kind, rows)
                for name, fn in runs.items():
                    print(f"running {size.label}, {kind}: {name} ...", file=sys.stderr, flush=True)
                    cells.setdefault((kind, name), []).append(fn(source, rows, seconds))
            print(f"running {size.label}, per-example: {HAND} ...", file=sys.stderr, flush=True)
            cells.setdefault(("per-example", HAND), []).append(run_hand_loop(source_of("per-example", rows), seconds))
            print(f"running {size.label}, read_into: {ECHO} ...", file=sys.stderr, flush=True)
            cells.setdefault(("read_into", ECHO), []).append(run_echo(WrittenRows(rows), seconds))
            # Declared: a Python __getitem__ that holds the GIL, read by processes.
            print(f"running {size.label}, per-example: {ECHO_PROCESSES} ...", file=sys.stderr, flush=True)
            cells.setdefault(("per-example", ECHO_PROCESSES), []).append(run_echo(
                source_of("per-example", rows), seconds, num_workers=2, worker_type="process", persistent_workers=True))
            if available["tensorflow"]:
                print(f"running {size.label}: {TF} ...", file=sys.stderr, flush=True)
                cells.setdefault(("array", TF), []).append(run_tfdata(rows, seconds))
        for (kind, name), results in cells.items():
            out.append({"size": size.label, "source": kind, "contestant": name, "bytes": size.nbytes,
                        "copies": copies(kind, name, size.nbytes), "ex_s": median_run(results)["ex_s"]})
        del rows
    warmup["examples"] = WARMUP_BATCHES * BATCH
    return out


def run_hf(seconds: float, repeat: int, available: dict[str, bool]) -> list[dict]:
    """A Hugging Face Dataset of 12 KiB rows, torch format: EchoLoader against DataLoader(num_workers=2)."""
    if not (available["datasets"] and available["torch"]):
        return []
    import datasets

    rows = np.random.default_rng(0).integers(0, 256, (1 << 14, 12 << 10), dtype=np.uint8)
    dataset = datasets.Dataset.from_dict({"x": rows}).with_format("torch")
    results: dict[str, list[dict]] = {ECHO: [], DL2: []}
    for _ in range(repeat):
        print("running Hugging Face Dataset, 12 KiB ...", file=sys.stderr, flush=True)
        results[ECHO].append(run_echo(dataset, seconds))
        results[DL2].append(run_dataloader(dataset, seconds, 2))
    return [{"size": "12 KiB", "source": "HF Dataset (torch format)", "contestant": name,
             "ex_s": median_run(r)["ex_s"]} for name, r in results.items()]


def run_tensor_dataset(seconds: float, repeat: int, available: dict[str, bool]) -> list[dict]:
    """A torch ``TensorDataset`` of 12 KiB uint8 rows and int64 ids: EchoLoader against DataLoader(0 and 2 workers)."""
    if not available["torch"]:
        return []
    import torch

    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (1 << 14, 12 << 10), dtype=np.uint8))
    dataset = torch.utils.data.TensorDataset(rows, torch.arange(len(rows)))
    runs = {ECHO: lambda: run_echo(dataset, seconds), DL0: lambda: run_dataloader(dataset, seconds, 0),
            DL2: lambda: run_dataloader(dataset, seconds, 2)}
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            print(f"running TensorDataset, 12 KiB: {name} ...", file=sys.stderr, flush=True)
            results[name].append(fn())
    return [{"size": "12 KiB", "source": "torch TensorDataset", "contestant": name, "ex_s": median_run(r)["ex_s"]}
            for name, r in results.items()]


def rate(rows: list[dict], size: str, source: str, name: str) -> float | None:
    return next((r["ex_s"] for r in rows if (r["size"], r["source"], r["contestant"]) == (size, source, name)), None)


def print_table(rows: list[dict]) -> None:
    table = []
    for r in rows:
        echo = rate(rows, r["size"], r["source"], ECHO)
        ratio = "" if r["contestant"] == ECHO or not echo else f"{echo / r['ex_s']:.2f}x"
        copied = moved = ""
        if r.get("copies"):
            gb_s = r["ex_s"] * r["bytes"] * r["copies"] / 1e9
            copied, moved = f"{gb_s:.2f}", f"{gb_s / r['memcpy_gb_s']:.2f}" if r.get("memcpy_gb_s") else ""
        table.append((r["size"], r["source"], r["contestant"], f"{r['ex_s']:,.0f}", ratio, str(r.get("copies") or ""),
                      copied, moved))
    common.print_table(("size", "source", "contestant", "ex/s", "EchoLoader / it", "copies", "GB/s copied",
                        "of memcpy"), table, left=(0, 1, 2))
    if rows and rows[0].get("memcpy_gb_s"):
        print(f"    memcpy, one thread (np.copyto of 256 MiB), this run: {rows[0]['memcpy_gb_s']:.1f} GB/s")
    for size in SIZES:
        bare = rate(rows, size.label, "per-example", BARE)
        costs = [f"{name} {1e6 / r - 1e6 / bare:.2f} us" for name in (ECHO, DL0, DL2)
                 if bare and (r := rate(rows, size.label, "per-example", name))]
        if costs:
            print(f"    {size.label}, per-example source: wall time per example beyond the bare loop's "
                  f"{1e6 / bare:.2f} us: {', '.join(costs)}")


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each at its worst size."""
    checks = []

    def worst(source: str, against: Callable[[str], float | None]) -> float | None:
        ratios = [rate(rows, s.label, source, ECHO) / ref for s in SIZES if (ref := against(s.label))]
        return min(ratios) if ratios else None

    def best_dataloader(size: str) -> float | None:
        found = [r for n in (DL0, DL2) if (r := rate(rows, size, "per-example", n))]
        return max(found) if found else None

    checks.append(_check("per-example source: EchoLoader >= DataLoader's best (0 or 2 workers)",
                         worst("per-example", best_dataloader), 1.0, "torch did not run"))
    def best_peer(size: str) -> float | None:
        found = [r for n in (DL0, DL2, NODES, HAND) if (r := rate(rows, size, "per-example", n))]
        return max(found) if found else None

    checks.append(_check("per-example source: EchoLoader >= 1.5 x the best of DataLoader, torchdata.nodes and the "
                         "hand-written loop", worst("per-example", best_peer), 1.5, ""))
    into = [rate(rows, s.label, "read_into", ECHO) / array for s in SIZES[2:]
            if (array := rate(rows, s.label, "array", ECHO))]
    checks.append(_check("read_into source, 150 KiB and 1 MiB: EchoLoader >= 0.8 x EchoLoader over the array",
                         min(into) if into else None, 0.8, "did not run"))
    bare_64 = rate(rows, SIZES[0].label, "per-example", BARE)
    echo_64 = rate(rows, SIZES[0].label, "per-example", ECHO)
    checks.append(_check(f"per-example source, {SIZES[0].label}: EchoLoader >= 0.7 x the bare __getitem__ loop",
                         echo_64 / bare_64 if echo_64 and bare_64 else None, 0.7, "did not run"))
    for source in ("array", "__getitems__"):
        checks.append(_check(f"{source} source: EchoLoader >= tf.data",
                             worst(source, lambda s: rate(rows, s, "array", TF)), 1.0, "tf.data did not run"))
    hf = [r for r in rows if r["source"].startswith("HF")]
    hf_ratio = (rate(hf, "12 KiB", hf[0]["source"], ECHO) / rate(hf, "12 KiB", hf[0]["source"], DL2)) if hf else None
    checks.append(_check("HF Dataset, 12 KiB: EchoLoader >= 2 x DataLoader(num_workers=2)", hf_ratio, 2.0,
                         "datasets or torch did not import"))
    return checks


def _check(target: str, value: float | None, threshold: float, why_skipped: str) -> dict:
    met = None if value is None else value >= threshold
    shown = why_skipped if value is None else f"{value:.2f}x (worst over sizes)"
    return {"target": target, "value": value, "threshold": threshold, "shown": shown, "met": met}


def available_libraries() -> dict[str, bool]:
    found = {}
    for name in ("torch", "torchdata", "tensorflow", "datasets"):
        try:
            __import__(name)
            found[name] = True
        except Exception:  # a broken install is a skip, not a crash
            found[name] = False
    return found


def run(seconds: float, repeat: int) -> tuple[list[dict], list[dict]]:
    """The loader matrix and the HF rows, and their targets."""
    available = available_libraries()
    memcpy = common.memcpy_gb_s(min(seconds, 1.0))
    rows = (run_matrix(seconds, repeat, available) + run_tensor_dataset(seconds, repeat, available)
            + run_hf(seconds, repeat, available))
    for row in rows:
        row["memcpy_gb_s"] = memcpy
    return rows, targets(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, one round")
    args = parser.parse_args(argv)
    seconds, repeat = (0.5, 1) if args.quick else (1.5, 3)
    info = common.machine(**{k: "yes" if v else None for k, v in available_libraries().items()})
    common.print_header(info, f"delivered examples/s, batch {BATCH}, echo 1; higher is better")
    rows, checks = run(seconds, repeat)
    print_table(rows)
    common.print_targets(checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
