"""What a loader costs the training step it feeds.

A training step that is Python-heavy the way real steps are (many small torch
ops, whose dispatch holds the GIL) runs over batches that are preloaded in
memory, and then over each loader feeding it at full speed, in one run. The
figure is the step's own time (the loop body, not the wait for a batch):
every extra microsecond there is the loader competing with the training loop
for the GIL or the cores. Beside it, what the loader costs the training
process itself, less noisy than a time on a shared machine: its CPU (all its
threads, not its worker processes) and its context switches per batch, beyond
those of the preloaded run. Each contestant runs ``--rounds`` times, each right
after the preloaded step is timed again; its slowdown is the median ratio of
those neighbours. Per-example work is either Python-bound (a pure
Python loop: holds the GIL) or GIL-releasing (a sleep, as I/O or native
decoding), as ``transform`` and, where given, ``augment``.

Contestants: ``EchoLoader`` with thread workers, with worker processes, with
worker processes and ``augment`` in them (``worker_type="process"``), and
torch ``DataLoader(num_workers=2)``, with ``transform`` and with ``transform``
then ``augment`` in its workers (at echo 2 the loader's workers run 32
transforms and 64 augments a batch; DataLoader's, 64 of each). Target: with
process workers and process ``augment``, the step at most 5% slower than with
preloaded batches.

Usage:
    python bench/bench_step.py [--steps 300] [--rounds 3] [--work-us 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import time
from typing import NamedTuple

import common
import numpy as np
import torch

import dataecho

BATCH, EXAMPLES = 64, 4096
# Per example, in transform (and again in augment): at echo 2 a step of about
# 2.4 ms gets 32 fresh examples and 64 augmented ones, 1 ms of work in all, so
# that the loader needs well under the one core the step leaves free here.
WORK_S = 10e-6


def python_bound(example: dict) -> dict:
    """Per-example work in pure Python: holds the GIL for ~WORK_S."""
    end, acc = time.perf_counter() + WORK_S, 0
    while time.perf_counter() < end:
        acc += 1
    return example


def gil_releasing(example: dict) -> dict:
    """Per-example work that releases the GIL (I/O, native decoding)."""
    time.sleep(WORK_S)
    return example


def python_bound_augment(example: dict, rng: np.random.Generator) -> dict:
    return python_bound(example)


def gil_releasing_augment(example: dict, rng: np.random.Generator) -> dict:
    return gil_releasing(example)


class Examples:
    """Map-style: ``{"x": 1 KiB of float32, "id": i}``."""

    def __init__(self, n: int) -> None:
        self.n, self.pool = n, np.random.default_rng(0).random((16, 256), dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": self.pool[i % 16].copy(), "id": i}


class Step:
    """A Python-heavy step: ``ops`` small torch ops (dispatch-bound, holding the GIL)."""

    def __init__(self, ops: int = 400) -> None:
        self.ops, self.weight = ops, torch.ones(256)

    def __call__(self, batch: dict) -> float:
        x = torch.as_tensor(batch["x"])[:4, :16]
        for _ in range(self.ops):
            x = x * 0.999 + 0.001
        return float(x.sum())


class Timing(NamedTuple):
    step_s: float  # the step's own time, median
    loop_s: float  # the loop's time per batch (the step and the wait for its batch), median
    cpu_s: float  # the training process's CPU (all its threads) per batch
    switches: float  # its threads' context switches per batch


def step_time(batches, step: Step, steps: int) -> Timing:
    """The step's own body over ``steps`` batches (waits excluded), the loop's
    time per batch (the step and the wait for the batch), and the training
    process's CPU and context switches per batch, the first 5 left out."""
    times, loops = [], []
    end = time.perf_counter()
    for i, batch in enumerate(batches):
        if i == 5:
            cpu, switches = time.process_time(), _switches()
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
        loops.append(time.perf_counter() - end)
        end = time.perf_counter()
        if i + 1 >= steps:
            break
    counted = len(times) - 5
    return Timing(statistics.median(times[5:]), statistics.median(loops[5:]), (time.process_time() - cpu) / counted,
                  (_switches() - switches) / counted)


def _switches() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def loaders(work: str):
    """(name, loader factory) of the contestants for per-example work ``work``."""
    transform = {"python": python_bound, "releasing": gil_releasing}[work]
    augment = {"python": python_bound_augment, "releasing": gil_releasing_augment}[work]
    common_args = {"batch_size": BATCH, "echo_factor": 2, "output": "torch", "transform": transform}

    return [
        ("EchoLoader, thread workers", lambda: dataecho.EchoLoader(Examples(EXAMPLES), **common_args)),
        ("EchoLoader, thread workers + augment", lambda: dataecho.EchoLoader(Examples(EXAMPLES), augment=augment,
                                                                             **common_args)),
        ("EchoLoader, worker processes", lambda: dataecho.EchoLoader(Examples(EXAMPLES), worker_type="process",
                                                                     num_workers=2, **common_args)),
        ("EchoLoader, worker processes + augment", lambda: dataecho.EchoLoader(
            Examples(EXAMPLES), worker_type="process", num_workers=2, augment=augment, **common_args)),
        ("DataLoader(num_workers=2)", lambda: _torch_loader(transform)),
        ("DataLoader(num_workers=2) + augment", lambda: _torch_loader(transform, augment)),
    ]


class _Transformed(torch.utils.data.Dataset):
    """``transform``, then ``augment`` where given, in DataLoader's workers."""

    def __init__(self, transform, augment=None) -> None:
        self.source, self.transform, self.augment = Examples(EXAMPLES), transform, augment
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict:
        example = self.transform(self.source[i])
        return example if self.augment is None else self.augment(example, self.rng)


def _torch_loader(transform, augment=None):
    return torch.utils.data.DataLoader(_Transformed(transform, augment), batch_size=BATCH, shuffle=True,
                                       num_workers=2, persistent_workers=True)


def loader_time(make, step: Step, steps: int) -> float:
    """The step's time over a new loader of ``make`` (epoch after epoch); the
    loader is closed after, its threads and processes gone before the next timing."""
    loader = make()

    def endless():
        while True:
            yield from loader

    batches = endless()
    try:
        return step_time(batches, step, steps)
    finally:
        common.stop_contestant(batches, loader)
        del loader, batches
        gc.collect()  # DataLoader's persistent workers end as its iterator is collected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per contestant; the median ratio is shown")
    parser.add_argument("--work-us", type=float, default=10.0, help="per-example work, microseconds")
    parser.add_argument("--only", help="only the contestants whose name contains this")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    globals()["WORK_S"] = args.work_us * 1e-6  # read by the per-example work functions
    torch.set_num_threads(1)
    common.print_header(common.machine(), f"step: {Step().ops} small torch ops; batch {BATCH}; per-example work "
                                          f"{WORK_S * 1e6:.0f} us; the step's own time, median; slowdown: the median over "
                                          f"{args.rounds} rounds of the step's time over the preloaded step's, "
                                          f"timed just before; loop: the same for the loop's time per batch (the step and the "
                                          f"wait for its batch); CPU/batch and switches: the training process's (all its "
                                          f"threads, not its workers') beyond the preloaded run's, per batch; lower is "
                                          f"better\n")
    step = Step()
    preloaded_batches = [{"x": torch.rand(BATCH, 256), "id": torch.arange(BATCH)} for _ in range(8)]

    def preloaded() -> float:
        return step_time((preloaded_batches[i % 8] for i in range(10 ** 9)), step, args.steps)

    rows, results = [], {"rounds": args.rounds, "runs": []}
    for work in ("python", "releasing"):
        for name, make in loaders(work):
            if args.only and args.only not in name:
                continue
            # Each round times the preloaded step and then the loader's, back to back: a ratio
            # of neighbours, so that the machine's drift between contestants cancels.
            bases, times = [], []
            for _ in range(args.rounds):
                bases.append(preloaded())
                times.append(loader_time(make, step, args.steps))
            slowdown = statistics.median(t.step_s / b.step_s for t, b in zip(times, bases)) - 1
            loop = statistics.median(t.loop_s / b.loop_s for t, b in zip(times, bases)) - 1
            base, t = (Timing(*map(statistics.median, zip(*runs))) for runs in (bases, times))
            rows.append((name, "Python-bound" if work == "python" else "GIL-releasing", f"{base.step_s * 1e6:.0f} us",
                         f"{t.step_s * 1e6:.0f} us", f"{slowdown:+.1%}", f"{loop:+.1%}", f"{(t.cpu_s - base.cpu_s) * 1e6:.0f} us",
                         f"{t.switches - base.switches:.1f}"))
            results["runs"].append({"loader": name, "work": work, "preloaded": base._asdict(), "loader_run": t._asdict(),
                                    "slowdown": slowdown, "loop_slowdown": loop})
    common.print_table(("loader", "transform/augment", "preloaded", "step", "slowdown", "loop", "CPU/batch", "switches"),
                       rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
