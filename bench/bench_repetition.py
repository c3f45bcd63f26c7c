"""What echo trades, side by side: time to a target, fresh examples read, and
what repetition did to the data.

The paper's measure (Choi et al., 2019) on the demo's task: its small CNN
trained on 4,000 MNIST digits read from PNG files after a simulated network
latency, decoded and augmented on the CPU (``dataecho.demo``), until the mean
of three validation accuracies reaches the target. Configurations: no echo,
fixed factors 2 and 4 (echo before augmentation), and ``echo_factor="auto"``
with its repeats spread evenly, with echo_gap 1 and 8. Each row gives the
loader's repetition report: over the run, how many times an example was
delivered (mean, spread, most) and, in its last epoch, the distance between
an example's repeats (smallest, 5th percentile) and the most-delivered
example against ``ceil(achieved) + 1``.

``--baseline TREE`` also runs ``"auto"`` from another checkout whose
``python/dataecho`` is built (its ``_core`` beside it), in a subprocess of this
script: an older commit's uniform repeats against these, in the same run.

Usage:
    python bench/bench_repetition.py [--target 0.9] [--max-seconds 60] [--rounds 1] [--baseline TREE]
    python bench/bench_repetition.py --quick          # a lower target, one round (about a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
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


def one_run(name: str, kwargs: dict[str, Any], data: tuple, args: argparse.Namespace) -> dict[str, Any]:
    """Trains from the same initial weights to the target; the loader's report with it."""
    import torch

    dataset, validation = data
    step, evaluate = make_trainer(torch, validation, seed=args.seed, device="cpu")
    loader = dataecho.EchoLoader(dataset, batch_size=64, augment=digits.Augment(args.seed), shuffle_buffer=1024,
                                 num_workers=args.workers, seed=args.seed, max_echo=4.0, output="torch", **kwargs)
    run = fit(Run(Config(name, kwargs["echo_factor"], "before")), loader, step, evaluate,
              lambda: int(loader.stats()["fresh"]), target=args.target, higher_is_better=True,
              max_seconds=args.max_seconds, eval_every=10, progress=lambda run, cap: None)
    last = run.stats["this_epoch"]
    return {"name": name, "reached": run.reached, "last": run.history[-1] if run.history else None,
            "repetition": run.stats["repetition"], "epoch": last["repetition"],
            "achieved": last["echo_factor_achieved"]}


def load(args: argparse.Namespace) -> tuple:
    files, labels = digits.write_pngs(digits.default_cache())
    train_idx, val_idx = digits.split(labels, validation=1000, seed=args.seed)
    val_x = np.stack([digits.to_float({"image": digits.decode(files[i]), "label": 0})["image"] for i in val_idx])
    return digits.PngDigits(files, labels, train_idx, args.latency_ms / 1000), (val_x, labels[val_idx])


def baseline(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The "auto" row from another checkout, in a subprocess (its report computed here from its deliveries)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "python")}
    command = [sys.executable, __file__, "--only-baseline", "--target", str(args.target), "--max-seconds",
               str(args.max_seconds), "--latency-ms", str(args.latency_ms), "--workers", str(args.workers),
               "--seed", str(args.seed)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.max_seconds * 3 + 120)
    if done.returncode != 0:
        raise RuntimeError(f"the baseline run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def counted_run(args: argparse.Namespace) -> dict[str, Any]:
    """"auto" under a build without the repetition report: deliveries counted from the batches."""
    import torch

    dataset, validation = load(args)
    seen: dict[int, int] = {}
    step_model, evaluate = make_trainer(torch, validation, seed=args.seed, device="cpu")

    class Indexed:
        def __len__(self) -> int:
            return len(dataset)

        def __getitem__(self, i: int) -> dict:
            return {**dataset[i], "index": np.int64(i)}

    def step(batch: dict) -> None:
        for i in batch["index"].tolist():
            seen[i] = seen.get(i, 0) + 1
        step_model(batch)

    augment = digits.Augment(args.seed)

    def indexed_augment(example: dict, rng: np.random.Generator) -> dict:
        return {**augment(example, rng=rng), "index": example["index"]}

    loader = dataecho.EchoLoader(Indexed(), batch_size=64, augment=indexed_augment, shuffle_buffer=1024,
                                 num_workers=args.workers, seed=args.seed, max_echo=4.0, output="torch",
                                 echo_factor="auto")
    run = fit(Run(Config("auto, baseline tree", "auto", "before")), loader, step, evaluate,
              lambda: int(loader.stats()["fresh"]), target=args.target, higher_is_better=True,
              max_seconds=args.max_seconds, eval_every=10, progress=lambda run, cap: None)
    times = np.array(list(seen.values()))
    histogram = np.bincount(times).tolist()
    figures = {"deliveries": histogram, "max": int(times.max()), "mean": float(times.mean()),
               "spread": float(times.std())}
    return {"name": "auto (max 4), baseline tree", "reached": run.reached, "last": run.history[-1],
            "repetition": figures, "epoch": None, "achieved": float(times.mean())}


def row(result: dict[str, Any], base_s: float | None) -> list[str]:
    reached = result["reached"]
    seconds, fresh = (reached[0], reached[1]) if reached else (result["last"][0], result["last"][1])
    time_text = f"{seconds:.1f} s" if reached else f"> {seconds:.0f} s"
    run, epoch = result["repetition"], result["epoch"]
    bound = math.ceil(result["achieved"]) + 1
    return [result["name"], time_text, f"{fresh:,}", f"{base_s / seconds:.2f}x" if reached and base_s else "-",
            f"{run['mean']:.2f} +- {run['spread']:.2f}", str(run["max"]),
            "-" if epoch is None else f"{epoch['max']} (bound {bound})",
            "-" if epoch is None or epoch["gap_min"] is None else f"{epoch['gap_min']}, {epoch['gap_p05']}"]


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
    parser.add_argument("--only-baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.target, args.max_seconds, args.rounds = 0.85, 20.0, 1
    import torch

    torch.set_num_threads(1)  # the model stands in for an accelerator: the other core reads
    if args.only_baseline:
        print(json.dumps(counted_run(args)))
        return 0
    common.print_header(common.machine(torch=torch.__version__),
                        f"the demo's digits, read latency {args.latency_ms:g} ms, {args.workers} reader threads, "
                        f"batch 64, augment after the echo stage; target {args.target} (mean of 3 evaluations)")
    data = load(args)
    results = []
    for _ in range(args.rounds):
        for name, kwargs in CONFIGS.items():
            results.append(one_run(name, kwargs, data, args))
            print(f"  {name}: done", file=sys.stderr, flush=True)
        if args.baseline is not None:
            results.append(baseline(args.baseline, args))
    base = next((r["reached"][0] for r in results if r["name"] == "no echo" and r["reached"]), None)
    common.print_table(["configuration", "time to target", "fresh", "speed-up", "deliveries per example (run)",
                        "most (run)", "most (last epoch)", "gap: min, p05 (batches)"],
                       [row(r, base) for r in results])
    return 0


if __name__ == "__main__":
    sys.exit(main())
