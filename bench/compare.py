"""dataecho against the usual ways of building shuffled, echoed batches: one run, one table per section.

Sections (every figure in a table is measured in the same run; higher is better everywhere):

(a) Shuffled-batch throughput: delivered examples/s in steady state for one uint8
    field of 64 B, 12 KiB and 150 KiB at echo factors 1 and 2, with the capacity,
    batch size and ``put_many`` chunk of ``bench_buffer.CASES``. Contestants:

    * dataecho: ``ShuffleBuffer(hold=True)``, ``put_many`` of views of the
      source array from a producer thread, batches iterated by the main thread
      (``bench_buffer.run_dataecho``): the buffer holds the rows by reference
      and gathers each batch straight from them, one copy per example, as
      tf.data's ``shuffle`` holds its tensors; and the same with
      ``hold=False``, which copies each example into a slot first (two copies).
      Rows of 32 KiB or more go into batches with streaming stores
      (dataecho's ``stream_copy.hpp``), which is why dataecho can pass the
      gather limit below, whose ``np.take`` reads each destination line first;
    * the hand-written baseline: threads + ``queue.Queue`` + a Python list as
      shuffle buffer + ``np.stack`` (``bench_buffer.run_baseline``);
    * torch ``DataLoader`` over an ``IterableDataset`` that is its own shuffle
      buffer (``shuffled_rows``: a list of examples, random picks, each example
      picked ``e`` times before its place takes the next source row), default
      collate, with ``num_workers=0`` and ``num_workers=2`` (each worker reads
      half of the source rows through ``get_worker_info()`` and keeps
      ``capacity / 2`` examples, so the pipeline holds ``capacity`` in all);
    * ``torchdata.nodes``: ``IterableWrapper(shuffled_rows) -> Batcher ->
      Mapper(default_collate) -> Prefetcher(2) -> Loader`` (torchdata 0.11 has
      no shuffle node), where torchdata is installed;
    * tf.data: ``from_tensor_slices(source).repeat()``, echo as
      ``flat_map(lambda x: from_tensors(x).repeat(e))``, then
      ``shuffle(capacity).batch(B).prefetch(2)``, where tensorflow imports;
    * two limits of the machine, not pipelines: the gather limit (NumPy copying
      random rows of a ``capacity`` pool into batches, one copy per example,
      ``bench_buffer.run_gather``) and memcpy bandwidth (``np.copyto`` of a
      256 MiB buffer, one thread, as examples/s of the size). Both are one
      thread's figures: a pipeline that copies on two threads at once (in and
      out) can pass the memcpy figure.

    Every pipeline delivers each example exactly ``e`` times. Rates skip the
    first ``2 * capacity`` deliveries (buffers filling, workers starting, first
    touch of memory) and are the median of ``--repeat`` interleaved rounds.
(b) The slow-upstream matrix of ``bench_echo``: wall time per training step at
    echo factors 1, 2, 4 and auto against the ideal speed-up ``min(e, R)``.
(c) The process-worker comparison of ``bench_workers``: ``EchoLoader`` process
    and thread workers against torch ``DataLoader(num_workers=2)``.
(d) What safe in-place batch echo costs (``bench_batch_echo``): with torch
    output every repeat of a batch but the last is a copy; NumPy output shares
    one batch as read-only views.
(e) Loader against loader (``bench_loaders``): ``EchoLoader`` with default
    arguments at echo 1 over a per-example Python dataset, a NumPy array and a
    ``__getitems__`` dataset (64 B, 12 KiB, 150 KiB), against torch
    ``DataLoader`` (0 and 2 workers), ``torchdata.nodes``, tf.data and the bare
    ``__getitem__`` loop; and a Hugging Face ``Dataset`` of 12 KiB rows against
    ``DataLoader(num_workers=2)``. Section (a) measures the shuffle buffer
    alone; this one, the path users run.
(f) Variable-length token sequences (``bench_ragged``): 16 to 512 int32 tokens
    per sequence through ``EchoLoader`` (packed, and padded to the longest)
    against ``DataLoader`` with a padding ``collate_fn`` and tf.data's
    ``padded_batch``, from a per-example dataset and a Hugging Face ``Dataset``;
    delivered tokens/s, and the echo buffer's memory per sequence it holds.

Targets are printed at the end as met / NOT met.

Usage:
    python bench/compare.py [--quick] [--sections a,b,c,d,e,f] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

import bench_batch_echo
import bench_buffer
import bench_echo
import bench_loaders
import bench_ragged
import bench_workers
import common
from bench_buffer import CASES, ECHOES, Case, SteadyRate, make_source, median_run

try:  # torch is optional: without it the torch contestants are skipped with a note
    import torch.utils.data as torch_data

    _IterableDataset: type = torch_data.IterableDataset
except ImportError:
    torch_data = None
    _IterableDataset = object

DATAECHO = "dataecho ShuffleBuffer"
DATAECHO_COPY = "dataecho, hold=False (copying)"
BASELINE = "hand-written queue + list"
DATALOADER_0 = "torch DataLoader, 0 workers"
DATALOADER_2 = "torch DataLoader, 2 workers"
TORCHDATA = "torchdata.nodes"
TFDATA = "tf.data"
GATHER = "gather limit (np.take)"
MEMCPY = "memcpy, one thread (np.copyto)"


# ---- the shuffle buffer that torch users write into their dataset ----


def shuffled_rows(rows: Iterable[np.ndarray], capacity: int, echo: float, rng: random.Random) -> Iterator[np.ndarray]:
    """Yields ``rows`` shuffled through a buffer of ``capacity``, each ``echo`` times.

    The buffer is a list of ``[row, picks left]``; each step picks an entry at
    random and yields its row; an entry whose picks are spent takes the next
    source row in its place (or is removed once the source is exhausted). Each
    row is yielded ``floor(echo)`` or ``floor(echo) + 1`` times.

    Args:
        rows: the source, consumed lazily.
        capacity: entries kept.
        echo: mean times each row is yielded, >= 1.
        rng: the random source of the picks.

    Yields:
        The rows (the same objects, not copies).
    """
    whole, frac = int(echo), echo - int(echo)
    source = iter(rows)
    entries = [[row, whole + (rng.random() < frac)] for row in itertools.islice(source, capacity)]
    while entries:
        i = rng.randrange(len(entries))
        entry = entries[i]
        yield entry[0]
        entry[1] -= 1
        if entry[1] == 0:
            row = next(source, None)
            if row is not None:
                entry[0], entry[1] = row, whole + (rng.random() < frac)
            else:
                entries[i] = entries[-1]
                entries.pop()


class ShuffleBufferDataset(_IterableDataset):
    """A torch ``IterableDataset`` over the rows of ``src``, shuffled by ``shuffled_rows``.

    In a ``DataLoader`` with workers, worker ``k`` of ``n`` reads the k-th of n
    contiguous parts of ``src`` and keeps ``capacity // n`` entries.

    Args:
        src: source rows (leading axis).
        capacity: shuffle-buffer entries in all.
        echo: times each row is yielded on average.
        seed: seeds each worker's picks (with the worker id added).
        cycle: cycle over the rows for ever (the benchmark) or read them once (tests).
    """

    def __init__(self, src: np.ndarray, capacity: int, echo: float, seed: int = 0, cycle: bool = True) -> None:
        self.src, self.capacity, self.echo, self.seed, self.cycle = src, capacity, echo, seed, cycle

    def __iter__(self) -> Iterator[np.ndarray]:
        info = torch_data.get_worker_info() if torch_data is not None else None
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        part = self.src[worker * len(self.src) // workers : (worker + 1) * len(self.src) // workers]
        rows = (part[i % len(part)] for i in itertools.count()) if self.cycle else iter(part)
        return shuffled_rows(rows, max(1, self.capacity // workers), self.echo, random.Random(self.seed + worker))


# ---- section (a) contestants: each returns at least {"ex_s": ...} ----


def _timed(batches: Iterable[Any], case: Case, seconds: float) -> dict:
    """Steady-state delivered examples/s of an endless iterable of batches."""
    rate = SteadyRate(warmup=2 * case.capacity, seconds=seconds)
    for batch in batches:
        if rate.add(len(batch)):
            break
    return rate.result()


def run_dataloader(case: Case, echo: float, src: np.ndarray, seconds: float, num_workers: int) -> dict:
    """torch ``DataLoader`` over ``ShuffleBufferDataset``, default collate."""
    loader = torch_data.DataLoader(
        ShuffleBufferDataset(src, case.capacity, echo), batch_size=case.batch_size, num_workers=num_workers
    )
    it = iter(loader)
    try:
        return _timed(it, case, seconds)
    finally:
        del it  # shuts the workers down


def run_torchdata(case: Case, echo: float, src: np.ndarray, seconds: float) -> dict:
    """``torchdata.nodes``: the same shuffle generator, batched, collated and prefetched by nodes."""
    import torchdata.nodes as tn

    rows = (src[i % len(src)] for i in itertools.count())
    node = tn.IterableWrapper(shuffled_rows(rows, case.capacity, echo, random.Random(0)))
    node = tn.Batcher(node, batch_size=case.batch_size, drop_last=False)
    node = tn.Mapper(node, torch_data.default_collate)
    node = tn.Prefetcher(node, prefetch_factor=2)
    try:
        return _timed(tn.Loader(node), case, seconds)
    finally:
        prefetch_iter = getattr(node, "_it", None)  # stop its thread now, not at garbage collection
        if prefetch_iter is not None:
            prefetch_iter._shutdown()


def run_tfdata(case: Case, echo: float, src: np.ndarray, seconds: float) -> dict:
    """tf.data: slices of the source, echo by ``flat_map``, ``shuffle``, ``batch``, ``prefetch``."""
    import tensorflow as tf

    if echo != int(echo):
        raise ValueError("tf.data contestant: integer echo factors only")
    ds = tf.data.Dataset.from_tensor_slices(src).repeat()
    if echo > 1:
        ds = ds.flat_map(lambda x: tf.data.Dataset.from_tensors(x).repeat(int(echo)))
    ds = ds.shuffle(case.capacity, seed=0).batch(case.batch_size).prefetch(2)
    return _timed(ds, case, seconds)


def run_memcpy(seconds: float) -> dict:
    """One-thread ``np.copyto`` of a 256 MiB buffer; ``gb_s`` counts bytes copied."""
    return {"gb_s": common.memcpy_gb_s(seconds)}


def _try_import(name: str) -> tuple[str | None, str | None]:
    """Returns (version, None) if ``name`` imports, else (None, the reason)."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # an install broken in any way is a skip, not a crash
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0]
    try:
        return importlib.metadata.version({"tensorflow": "tensorflow-cpu"}.get(name, name)), None
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules[name], "__version__", "?"), None


def contestants(available: dict[str, tuple[str | None, str | None]]) -> tuple[dict[str, Callable], list[str]]:
    """The pipelines that can run in this interpreter, and a note for each that cannot."""
    runs: dict[str, Callable] = {
        DATAECHO: bench_buffer.run_dataecho,
        DATAECHO_COPY: lambda c, e, s, t: bench_buffer.run_dataecho(c, e, s, t, hold=False),
        BASELINE: bench_buffer.run_baseline,
    }
    notes = []
    if available["torch"][0]:
        runs[DATALOADER_0] = lambda c, e, s, t: run_dataloader(c, e, s, t, 0)
        runs[DATALOADER_2] = lambda c, e, s, t: run_dataloader(c, e, s, t, 2)
    else:
        notes.append(f"torch DataLoader: skipped, torch does not import here ({available['torch'][1]})")
    if available["torch"][0] and available["torchdata"][0]:
        runs[TORCHDATA] = run_torchdata
    else:
        notes.append(f"{TORCHDATA}: skipped ({available['torchdata'][1] or 'needs torch'})")
    if available["tensorflow"][0]:
        runs[TFDATA] = run_tfdata
    else:
        notes.append(
            f"{TFDATA}: skipped, tensorflow does not import in this interpreter ({available['tensorflow'][1]}); "
            "run this script with a Python that has tensorflow-cpu and dataecho for its figures"
        )
    return runs, notes


def run_throughput(seconds: float, repeat: int, available: dict) -> tuple[list[dict], list[str]]:
    """Section (a): every (size, echo) row for every contestant, rounds interleaved.

    Returns:
        One dict per (size, echo, contestant), and notes on skips and failures.
    """
    runs, notes = contestants(available)
    rows = []
    for case in CASES:
        src = make_source(case)
        memcpy_gb_s = run_memcpy(min(seconds, 1.0))["gb_s"]
        for echo in ECHOES:
            results: dict[str, list[dict]] = {name: [] for name in (*runs, GATHER)}
            failed: dict[str, str] = {}
            for _ in range(repeat):
                # Interleaved rounds: memory bandwidth on a shared machine drifts
                # over seconds, and this spreads the drift over every contestant.
                for name, fn in runs.items():
                    if name in failed:
                        continue
                    print(f"running {case.label}, echo {echo:g}: {name} ...", file=sys.stderr, flush=True)
                    try:
                        results[name].append(fn(case, echo, src, seconds))
                    except Exception as exc:  # one broken contestant must not end the comparison
                        if name == DATAECHO:
                            raise
                        failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                examples = results[DATAECHO][-1]["examples"]
                results[GATHER].append(bench_buffer.run_gather(case, src, examples, 2 * seconds))
            for name, reason in failed.items():
                notes.append(f"{name} failed at {case.label}, echo {echo:g}: {reason}")
            de = median_run(results[DATAECHO])
            stats = de["stats"]
            if stats["delivered"] != round(stats["fresh"] * echo):
                notes.append(
                    f"dataecho at {case.label}, echo {echo:g}: delivered {stats['delivered']} "
                    f"!= fresh {stats['fresh']} x echo"
                )
            measured = {name: median_run(r)["ex_s"] for name, r in results.items() if r and name not in failed}
            measured[MEMCPY] = memcpy_gb_s * 1e9 / case.nbytes
            for name, ex_s in measured.items():
                rows.append({
                    "size": case.label, "example_bytes": case.nbytes, "echo": echo,
                    "capacity": case.capacity, "batch_size": case.batch_size, "contestant": name,
                    "ex_s": ex_s, "gb_s": ex_s * case.nbytes / 1e9, "dataecho_over": de["ex_s"] / ex_s,
                })
        del src
    return rows, notes


def print_throughput(rows: list[dict], notes: list[str], seconds: float, repeat: int) -> None:
    """Prints section (a) as one table."""
    print(
        f"(a) shuffled-batch throughput: delivered examples/s in steady state, ~{seconds:g} s per "
        f"contestant, median of {repeat} interleaved round(s); higher is better; GB = 1e9 bytes"
    )
    for case in CASES:
        print(f"    {case.label}: capacity {case.capacity}, batch {case.batch_size}, put_many chunks of {case.chunk}")
    header = ("size", "echo", "contestant", "ex/s", "GB/s", "dataecho / it")
    table = [
        (
            r["size"], f"{r['echo']:g}", r["contestant"], f"{r['ex_s']:,.0f}", f"{r['gb_s']:.2f}",
            "" if r["contestant"] == DATAECHO else f"{r['dataecho_over']:.2f}x",
        )
        for r in rows
    ]
    common.print_table(header, table, left=(0, 2))
    for note in notes:
        print(f"    note: {note}")


def throughput_targets(rows: list[dict], tf_ran: bool) -> list[dict]:
    """Section (a) targets, each at its worst echo factor."""
    def rate(size: str, echo: float, name: str) -> float | None:
        return next((r["ex_s"] for r in rows if (r["size"], r["echo"], r["contestant"]) == (size, echo, name)), None)

    checks = []
    torch_ran = any(r["contestant"] in (DATALOADER_0, DATALOADER_2) for r in rows)
    for size in ("64 B", "12 KiB"):
        ratios = []
        for echo in ECHOES:
            best = max(filter(None, (rate(size, echo, DATALOADER_0), rate(size, echo, DATALOADER_2))), default=None)
            if best:
                ratios.append(rate(size, echo, DATAECHO) / best)
        checks.append(_check(
            f"dataecho >= 10x torch DataLoader (better of 0/2 workers) at {size}",
            min(ratios) if ratios and torch_ran else None, 10.0, "{:.1f}x", "torch DataLoader did not run",
        ))
    for case in CASES:
        ratios = [
            rate(case.label, echo, DATAECHO) / tf
            for echo in ECHOES if (tf := rate(case.label, echo, TFDATA))
        ]
        checks.append(_check(
            f"dataecho >= tf.data at {case.label}", min(ratios) if ratios and tf_ran else None, 1.0,
            "{:.2f}x", "tf.data did not run",
        ))
    fractions = [r["dataecho_over"] for r in rows if r["size"] == "150 KiB" and r["contestant"] == GATHER]
    checks.append(_check(
        "dataecho >= 0.80 x gather limit at 150 KiB", min(fractions) if fractions else None, 0.80, "{:.2f}",
        "150 KiB did not run",
    ))
    # Below dataecho.native.hold.HOLD_MIN_BYTES both contestants run the same code, so
    # that ratio is the run's noise: the bar is set below it.
    for size, bar in (("64 B", 0.90), ("12 KiB", 1.0)):
        ratios = [r["dataecho_over"] for r in rows if r["size"] == size and r["contestant"] == DATAECHO_COPY]
        checks.append(_check(
            f"hold=True no slower than hold=False at {size}", min(ratios) if ratios else None, bar, "{:.2f}x",
            f"{size} did not run",
        ))
    return [{"section": "a", **c} for c in checks]


# ---- shared helpers ----


def _check(target: str, value: float | None, threshold: float, fmt: str, why_skipped: str) -> dict:
    met = None if value is None else value >= threshold
    shown = why_skipped if value is None else f"{fmt.format(value)} (worst over echo factors)"
    return {"target": target, "value": value, "threshold": threshold, "shown": shown, "met": met}


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen sections, prints one table per section, then the targets."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs: about two minutes in all")
    parser.add_argument("--sections", default="e,f,a,b,c,d", help="comma-separated subset of a,b,c,d,e,f")
    parser.add_argument("--seconds", type=float, default=None, help="(a) seconds per contestant (default 1.5, quick 0.5)")
    parser.add_argument("--repeat", type=int, default=None, help="(a) interleaved rounds, medians (default 3, quick 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections <= {"a", "b", "c", "d", "e", "f"}:
        parser.error(f"--sections: expected a subset of a,b,c,d,e,f, got {args.sections!r}")
    seconds = args.seconds if args.seconds is not None else (0.5 if args.quick else 1.5)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # tensorflow's start-up log lines
    available = {name: _try_import(name) for name in ("torch", "torchdata", "tensorflow")}
    info = common.machine(**{name: version for name, (version, _) in available.items()})
    common.print_header(info, f"{'quick' if args.quick else 'full'} run; higher is better in every table\n")
    report: dict[str, Any] = {"machine": info, "quick": args.quick}
    checks: list[dict] = []

    if "e" in sections:
        loader_seconds = 0.5 if args.quick else 1.5
        print(f"(e) loader against loader (bench_loaders): batch {bench_loaders.BATCH}, echo 1, default arguments; "
              f"delivered examples/s, ~{loader_seconds:g} s per contestant, median of {repeat} round(s)")
        rows, loader_checks = bench_loaders.run(loader_seconds, repeat)
        bench_loaders.print_table(rows)
        checks += [{"section": "e", **c} for c in loader_checks]
        report["e"] = {"seconds": loader_seconds, "repeat": repeat, "rows": rows}
        print()
    if "f" in sections:
        ragged_seconds = 0.5 if args.quick else 1.5
        print(f"(f) token sequences (bench_ragged): batch {bench_ragged.BATCH} sequences of {bench_ragged.SHORTEST}-"
              f"{bench_ragged.LONGEST} int32 tokens, echo 1; delivered tokens/s, ~{ragged_seconds:g} s per "
              f"contestant, median of {repeat} round(s)")
        rows, memory, ragged_checks = bench_ragged.run(ragged_seconds, repeat)
        bench_ragged.print_table(rows, memory)
        checks += [{"section": "f", **c} for c in ragged_checks]
        report["f"] = {"seconds": ragged_seconds, "repeat": repeat, "rows": rows, "memory": memory}
        print()
    if "a" in sections:
        rows, notes = run_throughput(seconds, repeat, available)
        print_throughput(rows, notes, seconds, repeat)
        checks += throughput_targets(rows, tf_ran=any(r["contestant"] == TFDATA for r in rows))
        report["a"] = {"seconds": seconds, "repeat": repeat, "rows": rows, "notes": notes}
        print()
    if "b" in sections:
        steps, warmup = (40, 60) if args.quick else (120, 60)
        print(f"(b) slow upstream (bench_echo): {bench_echo.describe(steps, warmup)}")
        rows = bench_echo.run_matrix(steps, warmup)
        bench_echo.print_table(rows)
        checks += [{"section": "b", **c} for c in bench_echo.targets(rows)]
        report["b"] = {"steps": steps, "warmup": warmup, "rows": rows}
        print()
    if "c" in sections:
        count, warmup = (60, 20) if args.quick else (200, 20)
        print(
            f"(c) process workers (bench_workers): batch {bench_workers.BATCH}, 2 workers, {count} timed batches "
            f"after {warmup}; delivered examples/s, higher is better"
        )
        rows = bench_workers.run_workloads(count, warmup)
        bench_workers.print_table(rows)
        checks += [{"section": "c", **c} for c in bench_workers.targets(rows)]
        report["c"] = {"count": count, "warmup": warmup, "rows": rows}
        print()

    if "d" in sections and available["torch"][0] is not None:
        n, rounds = (4_000, 1) if args.quick else (20_000, 3)
        print(f"(d) batch echo with torch output (bench_batch_echo): a copy per repeat against NumPy's shared "
              f"read-only repeats; delivered examples/s, median of {rounds} round(s); higher is better")
        rows = bench_batch_echo.run(n, rounds)
        bench_batch_echo.print_table(rows)
        report["d"] = {"n": n, "rounds": rounds, "rows": rows}
        print()

    common.print_targets(checks)
    report["targets"] = checks
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
