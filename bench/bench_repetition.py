"""What echo trades, side by side: time to a target, fresh examples read, and
what repetition did to the data.

The paper's measure (Choi et al., 2019) on the demo's task: its small CNN
trained on 4,000 MNIST digits read from PNG files after a simulated network
latency, decoded and augmented on the CPU (``dataecho.demo``), until the mean
of three validation accuracies reaches the target. Configurations: no echo,
fixed factors 2 and 4 (echo before augmentation), and ``echo_factor="auto"``
with its repeats spread evenly, with echo_gap 1 and 8. Every example carries
its index, so each row's repetition figures are counted here from what the
loop received, per complete epoch (the last, stopped at the target, is left
out): the achieved factor (deliveries per distinct example), the
most-delivered example against ``ceil(achieved) + 1`` (the worst epoch), and
the distance between an example's repeats in batches (smallest, 5th
percentile). For this tree's rows they are checked against the loader's own
repetition report.

``--baseline TREE`` also runs ``"auto"`` from another checkout whose
``python/dataecho`` is built (its ``_core`` beside it), in a subprocess of this
script: an older commit's uniform repeats against these, in the same run.

Usage:
    python bench/bench_repetition.py [--target 0.9] [--max-seconds 60] [--rounds 1] [--baseline TREE
                                     [--baseline-python PYTHON]]
    python bench/bench_repetition.py --bursty --rounds 3 [--baseline TREE]   # auto's spread alone (seconds)
    python bench/bench_repetition.py --quick          # a lower target, one round (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import common
import numpy as np

import dataecho
from dataecho.demo import digits
from dataecho.demo.train import Config, Run, fit, make_trainer

CONFIGS: dict[str, dict[str, Any]] = {
    "no echo": {"echo_factor": 1.0},
    "fixed e=2": {"echo_factor": 2.0},
    "fixed e=4": {"echo_factor": 4.0},
    "auto (max 4)": {"echo_factor": "auto"},
    "auto (max 4), echo_gap=8": {"echo_factor": "auto", "echo_gap": 8},
}
BASELINE = "auto (max 4), baseline tree"


class Indexed:
    """The demo's digits, each with its index."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {**self.dataset[i], "index": np.int64(i)}


class Counting:
    """A loader whose batches are entered, by example index, in a ledger per epoch."""

    def __init__(self, loader: dataecho.EchoLoader) -> None:
        self.loader = loader
        self.epochs: list[dict[str, Any]] = []  # per epoch: batches per index, complete, the loader's report

    def __iter__(self):
        seen: dict[int, list[int]] = {}
        epoch = {"seen": seen, "complete": False}
        self.epochs.append(epoch)
        for k, batch in enumerate(self.loader):
            for i in batch["index"].tolist():
                seen.setdefault(i, []).append(k)
            yield batch
        epoch["complete"] = True
        epoch["report"] = self.loader.stats()["this_epoch"].get("repetition")

    def close(self) -> None:
        self.loader.close()

    def stats(self) -> dict[str, Any]:
        return self.loader.stats()


def figures(seen: dict[int, list[int]]) -> dict[str, Any]:
    """An epoch's repetition, from its ledger."""
    times = [len(ks) for ks in seen.values()]
    gaps = sorted(b - a for ks in seen.values() for a, b in pairwise(ks))
    achieved = sum(times) / len(times)
    return {"achieved": achieved, "most": max(times), "bound": math.ceil(achieved) + 1,
            "gap_min": gaps[0] if gaps else None,
            "gap_p05": gaps[max(1, math.ceil(0.05 * len(gaps))) - 1] if gaps else None}


def one_run(name: str, kwargs: dict[str, Any], args: argparse.Namespace, data: tuple | None = None) -> dict:
    """Trains from the same initial weights to the target, counting what the loop received."""
    import torch

    dataset, validation = data or load(args)
    step, evaluate = make_trainer(torch, validation, seed=args.seed, device="cpu")
    augment = digits.Augment(args.seed)

    def indexed_augment(example: dict, rng: np.random.Generator) -> dict:
        return {**augment(example, rng=rng), "index": example["index"]}

    loader = Counting(dataecho.EchoLoader(Indexed(dataset), batch_size=64, augment=indexed_augment,
                                          shuffle_buffer=1024, num_workers=args.workers, seed=args.seed,
                                          max_echo=4.0, output="torch", **kwargs))
    run = fit(Run(Config(name, kwargs["echo_factor"], "before")), loader, step, evaluate,
              lambda: int(loader.stats()["fresh"]), target=args.target, higher_is_better=True,
              max_seconds=args.max_seconds, eval_every=10, progress=lambda run, cap: None)
    complete = [e for e in loader.epochs if e["complete"]]
    epochs = [figures(e["seen"]) for e in complete]
    for epoch, counted in zip(complete, epochs):
        report = epoch.get("report")
        if report is not None and "deliveries" in report:  # this tree: the loader's report agrees
            assert report["max"] == counted["most"] and report["gap_min"] == counted["gap_min"], (report, counted)
    return {"name": name, "reached": run.reached, "last": run.history[-1] if run.history else None,
            "epochs": epochs}


class Bursty:
    """Reads 2x too slowly for the step in runs of 200 examples, at once in the runs between."""

    def __len__(self) -> int:
        return 2400

    def __getitem__(self, i: int) -> dict:
        if (i // 200) % 2 == 0:
            time.sleep(0.00025)  # a step of 2 ms takes 16 examples: 0.125 ms each
        return {"index": np.int64(i)}


def bursty_run(name: str, seed: int) -> dict[str, Any]:
    """An epoch of "auto" over a variable-speed upstream (no model: a 2 ms step), counted."""
    loader = Counting(dataecho.EchoLoader(Bursty(), batch_size=16, echo_factor="auto", seed=seed, num_workers=1,
                                          shuffle=False))
    for _ in loader:
        time.sleep(0.002)
    loader.close()
    return {"name": name, **figures(loader.epochs[0]["seen"])}


def load(args: argparse.Namespace) -> tuple:
    files, labels = digits.write_pngs(digits.default_cache())
    train_idx, val_idx = digits.split(labels, validation=1000, seed=args.seed)
    val_x = np.stack([digits.to_float({"image": digits.decode(files[i]), "label": 0})["image"] for i in val_idx])
    return digits.PngDigits(files, labels, train_idx, args.latency_ms / 1000), (val_x, labels[val_idx])


def baseline(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The "auto" row from another checkout, in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(tree / "python")}
    command = [args.baseline_python or sys.executable, __file__, "--only-baseline", "--target", str(args.target), "--max-seconds",
               str(args.max_seconds), "--latency-ms", str(args.latency_ms), "--workers", str(args.workers),
               "--seed", str(args.seed), "--rounds", str(args.rounds)] + (["--bursty"] if args.bursty else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.max_seconds * 3 + 120,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the baseline run failed:\n{done.stderr[-2000:]}")
    module, result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(module).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the baseline imported dataecho from {module}, not from {tree} (an editable install "
                           f"wins over PYTHONPATH: pass --baseline-python, an interpreter without it)")
    return result


def row(result: dict[str, Any], base_s: float | None) -> list[str]:
    reached = result["reached"]
    seconds, fresh = (reached[0], reached[1]) if reached else (result["last"][0], result["last"][1])
    time_text = f"{seconds:.1f} s" if reached else f"> {seconds:.0f} s"
    epochs = result["epochs"]
    if not epochs:
        return [result["name"], time_text, f"{fresh:,}", "-", "-", "-", "-"]
    worst = max(epochs, key=lambda e: e["most"] - e["bound"])
    gaps = [e for e in epochs if e["gap_min"] is not None]
    gap_text = f"{min(e['gap_min'] for e in gaps)}, {min(e['gap_p05'] for e in gaps)}" if gaps else "-"
    achieved = sum(e["achieved"] for e in epochs) / len(epochs)
    return [result["name"], time_text, f"{fresh:,}", f"{base_s / seconds:.2f}x" if reached and base_s else "-",
            f"{achieved:.2f} ({len(epochs)})", f"{worst['most']} (bound {worst['bound']})", gap_text]


def print_bursty(args: argparse.Namespace) -> int:
    """--bursty: only the variable-speed upstream, this tree's "auto" against the baseline's."""
    results = [bursty_run("auto (max 4)", seed) for seed in range(args.rounds)]
    if args.baseline is not None:
        results += baseline(args.baseline, args)
    common.print_table(["configuration", "echo", "most deliveries (bound ceil(echo) + 1)", "gap: min, p05"],
                       [[r["name"], f"{r['achieved']:.2f}", f"{r['most']} ({r['bound']})",
                         f"{r['gap_min']}, {r['gap_p05']}"] for r in results])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="target 0.85, 20 s cap, one round")
    parser.add_argument("--baseline", type=Path, help="a checkout to run the 'auto' row of, in a subprocess")
    parser.add_argument("--bursty", action="store_true",
                        help="only an upstream 2x too slow in runs of 200 examples (no model; --rounds seeds)")
    parser.add_argument("--baseline-python", help="the interpreter for --baseline (default: this one)")
    parser.add_argument("--only-baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.target, args.max_seconds, args.rounds = 0.85, 20.0, 1
    import torch

    torch.set_num_threads(1)  # the model stands in for an accelerator: the other core reads
    if args.only_baseline:
        print(json.dumps([dataecho.__file__, one_run(BASELINE, {"echo_factor": "auto"}, args) if not args.bursty
                          else [bursty_run(BASELINE, seed) for seed in range(args.rounds)]]))
        return 0
    if args.bursty:
        return print_bursty(args)
    common.print_header(common.machine(torch=torch.__version__),
                        f"the demo's digits, read latency {args.latency_ms:g} ms, {args.workers} reader threads, "
                        f"batch 64, augment after the echo stage; target {args.target} (mean of 3 evaluations)")
    data = load(args)
    results = []
    for _ in range(args.rounds):
        for name, kwargs in CONFIGS.items():
            results.append(one_run(name, kwargs, args, data))
            print(f"  {name}: done", file=sys.stderr, flush=True)
        if args.baseline is not None:
            results.append(baseline(args.baseline, args))
    base = next((r["reached"][0] for r in results if r["name"] == "no echo" and r["reached"]), None)
    common.print_table(["configuration", "time to target", "fresh", "speed-up", "echo (complete epochs)",
                        "most deliveries (worst epoch)", "gap: min, p05 (batches)"], [row(r, base) for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
