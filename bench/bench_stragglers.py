"""One slow rank in a data-parallel job: what it costs with torch's DataLoader,
with EchoLoader at fixed echo factors, and with ``echo_factor="auto"``, whose
ranks echo in lockstep (dataecho.pipeline.stages.lockstep).

Every configuration runs the same job in one run: ``--ranks`` processes on a
gloo process group (on this machine), each reading its shard of a map-style
dataset whose reads sleep 1 ms (rank 0's ``--slow`` times longer: a busier
host, a slower disk), two reading threads per rank, and a training step of
10 ms that all-reduces a 1 MB gradient, so that every step waits for the
slowest rank. At two threads a fast rank reads a batch of 16 in 8 ms, under a
step; the straggler in 8 x slow ms.

Reported per configuration (the slowest rank's figures): the steps of the
epoch and their wall time, and the time per *epoch's worth* of steps (one step
per fresh batch: ``examples per rank / batch`` steps), which is what echoing
buys (repeats stand in for waiting). The ideal is the same job with no
straggler at echo 1. Targets: ``"auto"`` within 15% of the ideal where the
straggler is up to 2x slower, and the ranks' agreement under 2% of step time.

Usage:
    python bench/bench_stragglers.py [--ranks 2] [--slow 1.5,2] [--examples 3200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

READ_S, STEP_S, BATCH = 0.001, 0.010, 16


class Reads:
    """range(n) whose reads sleep ``delay_s``."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.delay_s)
        return i


def rank_main(args: argparse.Namespace) -> None:
    """One rank: the job with one loader, its figures written as JSON."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=args.rank, world_size=args.ranks,
                            init_method=f"tcp://127.0.0.1:{args.port}")
    dataset = Reads(args.examples, READ_S * (args.slow if args.rank == 0 else 1.0))
    loader = _loader(args.kind, dataset)
    gradient = torch.zeros(1 << 18)
    start, steps = time.perf_counter(), 0
    for _ in loader:
        time.sleep(STEP_S)
        dist.all_reduce(gradient)
        steps += 1
    wall = time.perf_counter() - start
    stats = loader.stats() if hasattr(loader, "stats") else {}
    Path(args.out).write_text(json.dumps({"steps": steps, "wall_s": wall,
                                          "agree_s": stats.get("lockstep_wait_s", 0.0),
                                          "echo": stats.get("echo_factor_achieved", 1.0),
                                          "most": (stats.get("repetition") or {}).get("max", 1)}))
    dist.destroy_process_group()


def _loader(kind: str, dataset: Reads):
    if kind == "DataLoader":
        from torch.utils.data import DataLoader, DistributedSampler

        return DataLoader(dataset, batch_size=BATCH, sampler=DistributedSampler(dataset, seed=0), num_workers=2)
    import dataecho

    factor = {"EchoLoader, echo 1": 1, "EchoLoader, echo 2": 2, "EchoLoader, auto": "auto"}[kind]
    return dataecho.EchoLoader(dataset, batch_size=BATCH, echo_factor=factor, num_workers=2)


def run_job(kind: str, ranks: int, slow: float, examples: int) -> dict:
    """The job on ``ranks`` processes; the slowest rank's figures."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(ranks)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--ranks", str(ranks), "--port",
                                   str(port), "--kind", kind, "--slow", str(slow), "--examples", str(examples),
                                   "--out", str(out)], env={**os.environ, "PYTHONWARNINGS": "ignore"})
                 for r, out in enumerate(outs)]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"{kind}: a rank failed (exit {proc.returncode})")
        results = [json.loads(out.read_text()) for out in outs]
    slowest = max(results, key=lambda r: r["wall_s"])
    slowest = {**slowest, "most": max(r["most"] for r in results), "echo": max(r["echo"] for r in results)}
    assert len({r["steps"] for r in results}) == 1, f"{kind}: ranks took different step counts: {results}"
    return {**slowest, "agree_s": max(r["agree_s"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--slow", default="1.5,2", help="comma-separated slowdowns of rank 0's reads")
    parser.add_argument("--examples", type=int, default=3200)
    parser.add_argument("--json", help="also write the results here")
    # A rank's own arguments (the script runs itself once per rank).
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        args.slow = float(args.slow)
        rank_main(args)
        return
    common.print_header(common.machine(), f"{args.ranks} ranks, {args.examples} examples, batch {BATCH}, reads "
                                          f"{READ_S * 1e3:g} ms (rank 0: x slow), step {STEP_S * 1e3:g} ms + "
                                          f"all-reduce; lower is better\n")
    fresh_steps = args.examples // args.ranks // BATCH
    ideal = run_job("EchoLoader, echo 1", args.ranks, 1.0, args.examples)
    ideal_s = ideal["wall_s"] * fresh_steps / ideal["steps"]
    rows, results = [], {"ideal_s": ideal_s, "runs": []}
    for slow in (float(s) for s in args.slow.split(",")):
        for kind in ("DataLoader", "EchoLoader, echo 1", "EchoLoader, echo 2", "EchoLoader, auto"):
            r = run_job(kind, args.ranks, slow, args.examples)
            per_epoch = r["wall_s"] * fresh_steps / r["steps"]
            agree = r["agree_s"] / r["wall_s"]
            results["runs"].append({"slow": slow, "kind": kind, **r, "epoch_equivalent_s": per_epoch})
            most = "-" if kind == "DataLoader" else f"{r['most']} (bound {math.ceil(r['echo']) + 1})"
            rows.append((f"x{slow:g}", kind, str(r["steps"]), f"{r['wall_s']:.2f}", f"{per_epoch:.2f}",
                         f"{per_epoch / ideal_s:.2f}", f"{r['echo']:.2f}", most, f"{agree:.1%}"))
    print(f"ideal (no straggler, echo 1): {ideal_s:.2f} s per epoch of {fresh_steps} steps\n")
    common.print_table(("straggler", "loader", "steps", "wall s", "s per epoch of steps", "vs ideal",
                        "echo", "most deliveries of an example", "agreement / wall"), rows)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
