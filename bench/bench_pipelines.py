"""Echo as a step of a Grain and of a torchdata.nodes pipeline, against the
same pipeline without it and with what a user of the library would do
instead: read the data again (Grain's ``repeat``; torchdata: the indices
listed twice).

Workload: a slow upstream, a ``map`` that sleeps 1 ms per example (I/O-like)
on one reading thread of the library's own that reads up to 128 examples ahead
while the loop works (Grain's ``ReadOptions(num_threads=1,
prefetch_buffer_size=128)``; torchdata's ``ParallelMapper(num_workers=1)``
then ``Prefetcher(128)``); then batches of 64, and a training loop whose step
sleeps 0.25 ms per example: the upstream is R = 4 times slower than the step.
Per pipeline, after the untimed first batches, over the timed ones:

* fresh examples/s: examples the slow map made (each a read of the upstream);
* delivered examples/s: examples the training loop got;

and each against the pipeline without echo, measured in the same run. With
echo factor ``e`` the loop gets up to ``e`` examples per fresh one, and no
more than its step takes (4,000/s here); reading again delivers no faster than
reading once. Higher is better.

Usage:
    python bench/bench_pipelines.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

import common

BATCH = 64
DECODE_S = 0.001  # the slow map, per example
STEP_S = 0.00025  # the training step, per example: R = DECODE_S / STEP_S = 4
BUFFER = 512  # the echo buffer's examples
AHEAD = 2 * BATCH  # examples the upstream's reading thread reads ahead
EXAMPLE_BYTES = 3 * 32 * 32


class Decode:
    """The slow map: sleeps ``DECODE_S``, then makes an example; counts them (thread-safe)."""

    def __init__(self) -> None:
        self.made, self._lock = 0, threading.Lock()
        self._row = np.zeros(EXAMPLE_BYTES, np.uint8)

    def __call__(self, i: int) -> dict:
        time.sleep(DECODE_S)
        with self._lock:
            self.made += 1
        return {"x": self._row, "id": np.int64(i)}


def timed(batches: Iterator[Any], decode: Decode, warmup: int, steps: int) -> dict[str, float]:
    """Runs the loop over ``batches``: ``warmup`` untimed steps, then ``steps`` timed ones.

    Returns:
        ``fresh`` and ``delivered`` examples per second over the timed steps.
    """
    for _ in range(warmup):
        time.sleep(STEP_S * len(next(batches)["id"]))
    made, delivered, start = decode.made, 0, time.perf_counter()
    for _ in range(steps):
        rows = len(next(batches)["id"])
        time.sleep(STEP_S * rows)  # the training step
        delivered += rows
    seconds = time.perf_counter() - start
    return {"fresh": (decode.made - made) / seconds, "delivered": delivered / seconds}


def grain_pipelines(n: int) -> dict[str, Callable[[Decode], Iterator[Any]]]:
    """Grain: MapDataset.range -> shuffle -> map(decode) -> to_iter_dataset(1 thread) -> ... -> batch."""
    import grain

    import dataecho.grain

    def upstream(decode: Decode, repeat: int = 1) -> grain.IterDataset:
        ds = grain.MapDataset.range(n).shuffle(seed=0).map(decode)
        ds = ds.repeat(repeat) if repeat > 1 else ds
        return ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=AHEAD))

    def echo(factor: Any, native: bool = True) -> Callable[[Decode], Iterator[Any]]:
        def make(decode: Decode) -> Iterator[Any]:
            ds = dataecho.grain.EchoIterDataset(upstream(decode), factor, BUFFER, 0, BATCH if native else None)
            return iter(ds if native else ds.batch(BATCH))
        return make

    return {
        "no echo": lambda decode: iter(upstream(decode).batch(BATCH)),
        "Grain repeat(2): read again": lambda decode: iter(upstream(decode, repeat=2).batch(BATCH)),
        "EchoIterDataset, e=2, one by one -> batch": echo(2, native=False),
        "EchoIterDataset, e=2, native batches": echo(2),
        "EchoIterDataset, e=4, native batches": echo(4),
        "EchoIterDataset, auto, native batches": echo("auto"),
    }


def node_pipelines(n: int) -> dict[str, Callable[[Decode], Iterator[Any]]]:
    """torchdata: IterableWrapper(shuffled indices) -> ParallelMapper(decode, 1 thread) -> Prefetcher
    -> ... -> Loader."""
    from torchdata import nodes

    import dataecho.nodes

    order = np.random.default_rng(0).permutation(n).tolist()

    def upstream(decode: Decode, repeat: int = 1) -> Any:
        indices = IterableIndices(order, repeat)
        mapped = nodes.ParallelMapper(nodes.IterableWrapper(indices), decode, num_workers=1, method="thread")
        return nodes.Prefetcher(mapped, prefetch_factor=AHEAD)

    def collate(examples: list) -> dict:
        return {"x": np.stack([e["x"] for e in examples]), "id": np.array([e["id"] for e in examples])}

    def batched(node: Any) -> Iterator[Any]:
        return iter(nodes.Loader(nodes.Mapper(nodes.Batcher(node, BATCH), collate)))

    def echo(factor: Any, native: bool = True) -> Callable[[Decode], Iterator[Any]]:
        def make(decode: Decode) -> Iterator[Any]:
            node = dataecho.nodes.Echo(upstream(decode), factor, BUFFER, 0, BATCH if native else None)
            return iter(nodes.Loader(node)) if native else batched(node)
        return make

    return {
        "no echo": lambda decode: batched(upstream(decode)),
        "indices twice: read again": lambda decode: batched(upstream(decode, repeat=2)),
        "Echo, e=2, one by one -> Batcher": echo(2, native=False),
        "Echo, e=2, native batches": echo(2),
        "Echo, e=4, native batches": echo(4),
        "Echo, auto, native batches": echo("auto"),
    }


class IterableIndices:
    """The shuffled indices, ``repeat`` times over (a new iterator each epoch)."""

    def __init__(self, order: list[int], repeat: int) -> None:
        self.order, self.repeat = order, repeat

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(itertools.repeat(self.order, self.repeat))


def run(library: str, pipelines: dict[str, Callable[[Decode], Iterator[Any]]], warmup: int,
        steps: int) -> list[dict[str, Any]]:
    rows = []
    for name, make in pipelines.items():
        print(f"running {library}: {name} ...", file=sys.stderr, flush=True)
        decode = Decode()
        batches = make(decode)
        try:
            rows.append({"library": library, "pipeline": name, **timed(batches, decode, warmup, steps)})
        finally:
            close = getattr(batches, "close", None)
            if callable(close):
                close()
    base = rows[0]["delivered"]
    for row in rows:
        row["delivered_ratio"] = row["delivered"] / base
        row["fresh_ratio"] = row["fresh"] / rows[0]["fresh"]
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    header = ("library", "pipeline", "fresh ex/s", "delivered ex/s", "delivered vs no echo", "fresh vs no echo")
    common.print_table(header, [
        (r["library"], r["pipeline"], f"{r['fresh']:.0f}", f"{r['delivered']:.0f}", f"{r['delivered_ratio']:.2f}x",
         f"{r['fresh_ratio']:.2f}x") for r in rows], left=(0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches (about 40 s in all)")
    parser.add_argument("--steps", type=int, default=None, help="timed batches per pipeline (default 100, quick 30)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed batches first, while the echo buffer fills (default 40, quick 20)")
    args = parser.parse_args(argv)
    steps = args.steps or (30 if args.quick else 100)
    warmup = args.warmup if args.warmup is not None else 20 if args.quick else 40
    versions = {}
    for name in ("grain", "torchdata"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    common.print_header(common.machine(**versions), "examples per second: higher is better")
    print(f"workload: map sleeps {DECODE_S * 1e3:g} ms per example on 1 reading thread; batch {BATCH}; step "
          f"{STEP_S * 1e3:g} ms per example (R = {DECODE_S / STEP_S:g}); echo buffer {BUFFER}; "
          f"{steps} timed batches after {warmup}\n")
    n = (steps + warmup) * BATCH * 2 + 4 * BUFFER
    rows = []
    if versions["grain"]:
        rows += run("Grain", grain_pipelines(n), warmup, steps)
    if versions["torchdata"]:
        rows += run("torchdata", node_pipelines(n), warmup, steps)
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
