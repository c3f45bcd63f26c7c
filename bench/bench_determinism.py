"""What deterministic=True costs, and what resuming costs.

1. Throughput: the same EchoLoader with ``deterministic=False`` and ``True``
   (the default wherever it can be), in one run, interleaved: a fast source
   (64 B and 12 KiB examples, where the loader itself is the bottleneck) with
   two thread or process workers and with the default workers (threads that
   grow while reads wait); and reads of 1 ms of which one in ten takes 10 ms
   (I/O whose latency varies: examples that come out of turn wait for the
   late one, within the reorder window). Rates are delivered examples per
   second over an epoch; the table prints the ratio deterministic /
   non-deterministic (1.0 = free).
2. Resume: ``state_dict()`` taken mid-epoch, its size in JSON, and the time from
   ``load_state_dict()`` to the first batch, against the time a fresh epoch takes
   to its first batch (both re-read what they need; a resumed epoch re-reads the
   resident examples, up to ``shuffle_buffer``), for example echoing, and for
   echoing before an ``augment`` that draws from its ``rng`` (whose pending rows,
   up to its output buffer and the rows being augmented, are augmented again);
   and the same for another rank of a job of 8 (rank 3 given rank 0's state, as
   Lightning, HF Trainer and Accelerate hand it over), which first works out its
   own position (dataecho.pipeline.progress.replay), and for a rank of a job of 16.

Usage:
    python bench/bench_determinism.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import common
import dataecho
import numpy as np


def flip(example: dict, rng: np.random.Generator) -> dict:
    """A cheap augmentation drawing from the generator it is given."""
    x = example["x"]
    return {"x": x[::-1].copy() if rng.random() < 0.5 else x, "id": example["id"]}


def loader(nbytes: int, deterministic: bool, worker_type: str, n: int, augment=None, workers: int | None = 2,
           delay_s: float = 0.0, rank: int = 0, world_size: int = 1) -> dataecho.EchoLoader:
    return dataecho.EchoLoader(
        common.Records(n, nbytes, delay_s=delay_s, tail=10.0), batch_size=256, echo_factor=2, shuffle_buffer=4096,
        num_workers=workers, seed=0, deterministic=deterministic, worker_type=worker_type, augment=augment,
        rank=rank, world_size=world_size,
    )


# (name, worker type, example bytes, workers, read delay, examples per epoch as a share of n)
WORKLOADS = [
    ("thread, 64 B", "thread", 64, 2, 0.0, 1.0),
    ("thread, 12 KiB", "thread", 12 << 10, 2, 0.0, 1.0),
    ("process, 64 B", "process", 64, 2, 0.0, 1.0),
    ("process, 12 KiB", "process", 12 << 10, 2, 0.0, 1.0),
    ("default workers, 12 KiB", "thread", 12 << 10, None, 0.0, 1.0),
    ("default workers, 1 ms reads (1 in 10: 10 ms)", "thread", 12 << 10, None, 1e-3, 0.3),
]


def rate(nbytes: int, deterministic: bool, worker_type: str, n: int, workers: int | None = 2,
         delay_s: float = 0.0) -> float:
    """Delivered examples per second over one epoch."""
    return common.epoch_rate(loader(nbytes, deterministic, worker_type, n, workers=workers, delay_s=delay_s))


def first_batch_s(make, state=None) -> float:
    loader = make()
    start = time.perf_counter()
    if state is not None:
        loader.load_state_dict(state)
    next(iter(loader))
    elapsed = time.perf_counter() - start
    loader.close()
    return elapsed


def resume_costs(make, rounds: int, loading=None) -> dict:
    """The state mid-epoch: its size and what it names; first-batch times,
    fresh and resumed (by ``loading``, another loader, where given)."""
    source = make()
    epoch = iter(source)
    for _ in range(len(source) // 2):
        next(epoch)
    state = source.state_dict()
    source.close()
    stages = state["stages"]
    augment = stages.get("augment")
    loading = loading or make
    return {
        "state_bytes": len(json.dumps(state)),
        "resident": len(stages["intake"]["positions"]),
        "pending": len(augment["pending"]["rows"]) if augment else 0,
        "fresh_first_batch_s": statistics.median(first_batch_s(loading) for _ in range(rounds)),
        "resumed_first_batch_s": statistics.median(first_batch_s(loading, state) for _ in range(rounds)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer examples and rounds")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    n, rounds = (20_000, 1) if args.quick else (100_000, 3)
    common.print_header(
        common.machine(),
        "throughput: delivered examples/s, median of interleaved rounds; ratio = deterministic / not; "
        "higher is better (a ratio of 1.0: determinism is free)\n",
    )
    results: dict = {"throughput": {}, "resume": {}}
    table = []
    for name, worker_type, nbytes, workers, delay_s, share in WORKLOADS:
        samples: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for deterministic in (False, True):
                samples[deterministic].append(rate(nbytes, deterministic, worker_type, int(n * share), workers,
                                                   delay_s))
        base, det = (statistics.median(samples[d]) for d in (False, True))
        results["throughput"][name] = {"non_deterministic": base, "deterministic": det, "ratio": det / base}
        table.append((name, f"{base:,.0f}", f"{det:,.0f}", f"{det / base:.2f}"))
    common.print_table(("workload", "deterministic=False", "deterministic=True", "ratio"), table)

    print()
    jobs = (("", 1, 0, 1), (", rank 3 of 8 from rank 0's state", 8, 3, 8),
            (", rank 5 of 16 from a job of 8", 8, 5, 16))
    for (name, augment), (job, world, rank, new_world) in [(p, j) for p in (("example echo", None),
                                                                            ("augment with rng", flip)) for j in jobs]:
        make = functools.partial(loader, 12 << 10, True, "thread", n * world, augment, world_size=world)
        loading = functools.partial(loader, 12 << 10, True, "thread", n * world, augment, rank=rank,
                                    world_size=new_world)
        results["resume"][name + job] = r = resume_costs(make, rounds, loading)
        print(f"resume mid-epoch, {name}{job} (12 KiB, shuffle_buffer 4096): state {r['state_bytes']:,} bytes for "
              f"{r['resident']} resident examples and {r['pending']} pending augmented rows; first batch after "
              f"load {r['resumed_first_batch_s'] * 1e3:.0f} ms vs a fresh epoch's "
              f"{r['fresh_first_batch_s'] * 1e3:.0f} ms "
              f"({r['resumed_first_batch_s'] / r['fresh_first_batch_s']:.2f}x; lower is better)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
