"""The demo's command line: ``python -m dataecho demo [options]``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

import dataecho

from . import digits, report
from .train import CONFIGS, train

_NEEDS = {"torch": "torch", "PIL": "pillow", "matplotlib": "matplotlib", "mlxtend": "mlxtend"}


def missing_packages() -> list[str]:
    import importlib.util

    return [package for module, package in _NEEDS.items() if importlib.util.find_spec(module) is None]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dataecho demo",
        description=(
            "Train a small CNN on 5,000 real MNIST digits, read and decoded from PNG files with a simulated "
            "network latency, to a target validation accuracy: without echoing, and with each kind of data "
            "echoing. Prints time to target, fresh examples read and speed-up, and plots accuracy curves."
        ),
    )
    p.add_argument("--quick", action="store_true", help="a lower target and shorter caps: under a minute on 2 cores")
    p.add_argument("--out", type=Path, default=Path("dataecho-demo"), help="where the plot and results go")
    p.add_argument("--device", default="cpu", help="torch device for the model: cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="seeds the split, the model, the order and augmentation")
    p.add_argument("--latency-ms", type=float, default=2.0, help="simulated read latency per example (default 2)")
    p.add_argument("--target", type=float, default=None, help="target validation accuracy (default 0.96, quick 0.85)")
    p.add_argument("--workers", type=int, default=4, help="reader threads (and augment threads)")
    p.add_argument("--max-seconds", type=float, default=None, help="cap per configuration (default 120, quick 12)")
    p.add_argument("--cache", type=Path, default=None, help=f"PNG cache (default {digits.default_cache()})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    missing = missing_packages()
    if missing:
        print(
            f"the demo needs {', '.join(missing)}: pip install 'dataecho[demo]' (or pip install {' '.join(missing)})",
            file=sys.stderr,
        )
        return 2
    import torch

    target = args.target if args.target is not None else (0.85 if args.quick else 0.96)
    max_seconds = args.max_seconds if args.max_seconds is not None else (12.0 if args.quick else 120.0)
    torch.set_num_threads(1)  # the model stands in for an accelerator: leave the other cores to the input
    files, labels = digits.write_pngs(args.cache or digits.default_cache())
    train_idx, val_idx = digits.split(labels, validation=1000, seed=args.seed)
    val_x = np.stack([digits.to_float({"image": digits.decode(files[i]), "label": 0})["image"] for i in val_idx])
    val_y = labels[val_idx]
    dataset = digits.PngDigits(files, labels, train_idx, args.latency_ms / 1000)
    print(
        f"dataecho {dataecho.__version__} demo: {len(train_idx)} training and {len(val_idx)} validation MNIST digits "
        f"as PNG files; read latency {args.latency_ms:g} ms/example, {args.workers} reader threads; model on "
        f"{args.device}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        flush=True,
    )
    progress = report.Progress()
    runs = []
    for config in CONFIGS:
        runs.append(
            train(config, dataset, (val_x, val_y), target=target, max_seconds=max_seconds, batch_size=64,
                  workers=args.workers, eval_every=10, seed=args.seed, device=args.device, progress=progress)
        )
        progress.end()
    print()
    print(report.table(runs, target))
    args.out.mkdir(parents=True, exist_ok=True)
    title = (f"MNIST-5k from PNG, read latency {args.latency_ms:g} ms/example, {args.workers} readers; "
             f"target {target:.2f}")
    path = report.plot(runs, target, args.out / "dataecho-demo.png", title)
    results = {
        "target": target,
        "latency_ms": args.latency_ms,
        "runs": [
            {"config": run.config.name, "echo": run.config.echo, "placement": run.config.placement,
             "reached": run.reached, "history": run.history}
            for run in runs
        ],
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nplot: {path.resolve()}")
    return 0
