"""Short epochs with worker processes: what starting workers costs per epoch,
and what ``persistent_workers=True`` saves, against torch's DataLoader in the
same run.

An evaluation set or a small dataset makes epochs short, and then starting
worker processes (and unpickling the dataset in each) is a large part of an
epoch. Every contestant runs ``--epochs`` epochs of ``--examples`` 12 KiB
examples with 2 worker processes at echo factor 1; the table gives the mean
wall time per epoch, first batch to last, start-up included, and its ratio to
DataLoader with the same ``persistent_workers``. Lower is better.

Usage:
    python bench/bench_epochs.py [--epochs 10] [--examples 2000]
"""

from __future__ import annotations

import argparse
import sys
import time

import common
import dataecho

BATCH = 64


def seconds_per_epoch(loader, epochs: int) -> float:
    start = time.perf_counter()
    for _ in range(epochs):
        for _batch in loader:
            pass
    return (time.perf_counter() - start) / epochs


def run_dataecho(ds: common.Records, persistent: bool, epochs: int) -> float:
    with dataecho.EchoLoader(ds, batch_size=BATCH, echo_factor=1, num_workers=2, worker_type="process",
                             persistent_workers=persistent, seed=0) as loader:
        return seconds_per_epoch(loader, epochs)


def run_dataloader(ds: common.Records, persistent: bool, epochs: int) -> float:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2,
                                         persistent_workers=persistent)
    return seconds_per_epoch(loader, epochs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--examples", type=int, default=2000)
    args = parser.parse_args(argv)
    import torch

    common.print_header(common.machine(torch=torch.__version__), "seconds per epoch and ratios: lower is better")
    print(f"{args.epochs} epochs of {args.examples} examples of 12 KiB, batch {BATCH}, 2 worker processes\n")
    ds = common.Records(args.examples, 12 * 1024)
    rows = []
    for persistent in (False, True):
        torch_s = run_dataloader(ds, persistent, args.epochs)
        echo_s = run_dataecho(ds, persistent, args.epochs)
        rows.append([f"persistent_workers={persistent}", f"{echo_s * 1e3:.0f} ms", f"{torch_s * 1e3:.0f} ms",
                     f"{echo_s / torch_s:.2f}"])
    common.print_table(["", "EchoLoader", "DataLoader", "EchoLoader / DataLoader"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
