"""Ray Data into EchoLoader: reading with ``iter_batches`` against ``iter_rows``,
in one run, on a local Ray instance (``ray.init(num_cpus=2)``).

The dataset: ``rows`` rows of 12 KiB, a uint8 ``image`` column of 12,288 bytes
and an int64 ``label``, made by ``map_batches`` and materialized, so that an
epoch measures reading rather than preprocessing.

Raw Ray iteration, rows/s:

* ``iter_rows``: ``ds.iter_rows()``, a row dict per row;
* ``iter_batches, blocks``: ``ds.iter_batches(batch_size=None,
  batch_format="numpy")``, Ray's blocks as they are, rows counted;
* ``iter_batches, 256 rows``: the same, re-batched by Ray to 256 rows;
* ``iter_batches, split into rows``: ``dataecho.reading.ray.RayRows``' rows,
  the blocks split into row dicts (what ``transform`` sees).

``EchoLoader(..., batch_size=256, echo_factor=1)`` end to end, delivered rows/s:

* ``iter_rows``: over an iterable of ``ds.iter_rows()`` (how a Ray dataset was read before);
* ``iter_batches, split into rows``: over an iterable of ``RayRows``' rows, one by one;
* ``iter_batches, blocks``: ``EchoLoader(ds)``, each block put with one native
  call, its rows copied from its columns without the GIL.

Rows are copied into the echo buffer on every path: a row of 12 KiB is large
enough to be held by reference (dataecho.native.hold), but it views its
block, which holding would keep alive.

Each figure is whole epochs after a warm-up epoch (the first one starts Ray's
execution and touches memory for the first time), the median of ``repeat``
interleaved rounds, with their range.

Usage:
    python bench/bench_ray.py [--quick]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

import common
import dataecho
from dataecho.reading.ray import RayRows

BATCH = 256
IMAGE_BYTES = 12 << 10
ROWS_BEFORE = "iter_rows"
BLOCKS = "iter_batches, blocks"
SPLIT = "iter_batches, split into rows"


class IterRows:
    """An iterable source of ``iter_rows()``: how a Ray dataset was read before."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __iter__(self) -> Iterator[dict]:
        return iter(self.ds.iter_rows())


class SplitRows:
    """An iterable source of ``RayRows``' rows, one by one (the blocks hidden)."""

    def __init__(self, ds: Any) -> None:
        self.rows = RayRows(ds)

    def __iter__(self) -> Iterator[dict]:
        yield from self.rows


def make_dataset(rows: int) -> Any:
    import ray

    def decode(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["id"]
        image = np.broadcast_to((ids % 251).astype(np.uint8)[:, None], (len(ids), IMAGE_BYTES)).copy()
        return {"image": image, "label": ids}

    return ray.data.range(rows).map_batches(decode, batch_format="numpy").materialize()


def raw_runs(ds: Any) -> dict[str, Callable[[], int]]:
    """Raw Ray iteration: each returns the rows of one epoch."""

    def count_rows(rows: Any) -> int:
        return sum(1 for _ in rows)

    def count_batches(batch_size: int | None) -> int:
        return sum(len(b["label"]) for b in ds.iter_batches(batch_size=batch_size, batch_format="numpy"))

    return {
        ROWS_BEFORE: lambda: count_rows(ds.iter_rows()),
        BLOCKS: lambda: count_batches(None),
        "iter_batches, 256 rows": lambda: count_batches(BATCH),
        SPLIT: lambda: count_rows(RayRows(ds)),
    }


def loader_runs(ds: Any) -> dict[str, Callable[[], int]]:
    """EchoLoader over each reading: each returns the rows one epoch delivered."""
    loaders = {ROWS_BEFORE: IterRows(ds), SPLIT: SplitRows(ds), BLOCKS: ds}
    made = {name: dataecho.EchoLoader(source, batch_size=BATCH, echo_factor=1) for name, source in loaders.items()}

    def epoch(loader: dataecho.EchoLoader) -> int:
        rows = 0
        for batch in loader:
            assert batch["image"].shape[1:] == (IMAGE_BYTES,)
            rows += len(batch["label"])
        return rows

    return {name: (lambda loader=loader: epoch(loader)) for name, loader in made.items()}


def measure(runs: dict[str, Callable[[], int]], rows: int, epochs: int, repeat: int, what: str) -> dict[str, list]:
    """Rows/s of each run over ``epochs`` epochs, ``repeat`` interleaved rounds,
    after one warm-up epoch each."""
    for name, run in runs.items():
        print(f"warming up {what}: {name} ...", file=sys.stderr, flush=True)
        assert run() == rows
    rates: dict[str, list] = {name: [] for name in runs}
    for round_ in range(repeat):
        for name, run in runs.items():
            print(f"round {round_ + 1}/{repeat}, {what}: {name} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            for _ in range(epochs):
                assert run() == rows
            rates[name].append(rows * epochs / (time.perf_counter() - start))
    return rates


def table(section: str, rates: dict[str, list], baseline: str) -> list[tuple[str, ...]]:
    base = statistics.median(rates[baseline])
    return [(section, name, f"{statistics.median(r):,.0f}", f"{min(r):,.0f} - {max(r):,.0f}",
             f"{statistics.median(r) / base:.2f}x") for name, r in rates.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows, two rounds")
    args = parser.parse_args(argv)
    rows, epochs, repeat = (1 << 13, 1, 2) if args.quick else (1 << 15, 2, 5)
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = make_dataset(rows)
        raw = measure(raw_runs(ds), rows, epochs, repeat, "raw Ray")
        end_to_end = measure(loader_runs(ds), rows, epochs, repeat, "EchoLoader")
    finally:
        ray.shutdown()
    common.print_header(common.machine(ray=ray.__version__),
                        f"rows/s, {rows} rows of 12 KiB (uint8 image + int64 label), {epochs} epoch(s) per figure, "
                        f"median of {repeat} rounds; EchoLoader: batch {BATCH}, echo 1; higher is better")
    common.print_table(("path", "reading", "rows/s", "range", "vs iter_rows"),
                       table("raw Ray", raw, ROWS_BEFORE) + table("EchoLoader", end_to_end, ROWS_BEFORE),
                       left=(0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
