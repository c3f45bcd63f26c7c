"""Data-parallel scenarios, one process per rank: ``python ranks.py <scenario>
<rank> <world_size> <port> <out.json> [<arg>]``. Each rank joins a gloo
process group on 127.0.0.1:<port>, runs the scenario, and writes what it saw
as JSON. :func:`run_ranks` starts the processes and collects their results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

TESTS = Path(__file__).resolve().parent


def run_ranks(scenario: str, world_size: int, tmp: Path, arg: str = "", timeout_s: float = 120,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Runs ``scenario`` on ``world_size`` ranks; their results, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, str(TESTS / "ranks.py"), scenario, str(rank), str(world_size), str(port),
         str(tmp / f"{scenario}-{rank}.json"), arg],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        for rank in range(world_size)]
    failures = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(f"{scenario}: rank {rank} did not finish within {timeout_s} s") from None
        if proc.returncode != 0:
            failures.append(f"rank {rank} (exit {proc.returncode}):\n{err[-3000:]}")
    assert not failures, "\n".join(failures)
    return [json.loads((tmp / f"{scenario}-{rank}.json").read_text()) for rank in range(world_size)]


# ---- scenarios (run in the rank's process) ----


def built_before_the_group(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """A loader built before init_process_group shards when its epoch starts."""
    import dataecho

    loader = dataecho.EchoLoader(np.arange(1000), batch_size=10, echo_factor=1)
    _join(rank, world_size)
    length = len(loader)
    return {"len": length, "ids": [int(i) for b in loader for i in b.tolist()], "rank": loader.rank,
            "world_size": loader.world_size}


def auto_with_a_straggler(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """echo_factor="auto" on every rank, rank 0's reads ``arg`` times slower."""
    import torch
    import torch.distributed as dist
    from support import Records, checked_ids

    import dataecho

    _join(rank, world_size)
    slow = float(arg or 4)
    # Rank 0 reads 2 ms per example on 2 threads (8 ms a batch, against a 2 ms step); rank 1 at once.
    loader = dataecho.EchoLoader(Records(400, delay_s=0.00025 * slow if rank == 0 else 0.0), batch_size=8,
                                 echo_factor="auto", num_workers=2, seed=1)
    batches, started = [], time.perf_counter()
    for batch in loader:
        batches.append(checked_ids(batch).tolist())
        step = torch.ones(1)
        dist.all_reduce(step)  # the training step's collective: a rank that stopped early would hang it
        time.sleep(0.002)
    stats = loader.stats()
    repeats = stats["lockstep_repeats"]
    return {"batches": len(batches), "counts": Counter(i for b in batches for i in b), "repeats": repeats,
            "echo_before_repeats": (stats["delivered"] - 8 * repeats) / stats["fresh"],
            "agreement_s": stats["lockstep_wait_s"], "wall_s": time.perf_counter() - started}


def _elastic_loader(kind: str):
    import dataecho

    return dataecho.EchoLoader(np.arange(1000), batch_size=16, echo_factor=2, shuffle_buffer=64, num_workers=2,
                               worker_type=kind)


def elastic_save(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """Takes 9 batches, then gathers every rank's state as a job saving its
    checkpoint would (all_gather_object), and writes it: ``arg`` is
    ``<worker type>:<checkpoint path>``."""
    import pickle

    import torch.distributed as dist

    kind, path = arg.split(":", 1)
    _join(rank, world_size)
    loader = _elastic_loader(kind)
    ids = []
    for batch in loader:
        ids += batch.tolist()
        if len(ids) == 9 * 16:
            break
    states = [None] * world_size
    dist.all_gather_object(states, loader.state_dict())
    if rank == 0:
        Path(path).write_bytes(pickle.dumps(states))
    return {"ids": ids}


def elastic_load(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """Loads every old rank's state and runs the rest of the epoch."""
    import pickle

    kind, path = arg.split(":", 1)
    _join(rank, world_size)
    loader = _elastic_loader(kind)
    loader.load_state_dict(pickle.loads(Path(path).read_bytes()))
    batches = [b.tolist() for b in loader]
    return {"ids": [i for b in batches for i in b], "batches": len(batches)}


SCENARIOS = {"built_before_the_group": built_before_the_group, "auto_with_a_straggler": auto_with_a_straggler,
             "elastic_save": elastic_save, "elastic_load": elastic_load}


def _join(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            init_method=f"tcp://127.0.0.1:{os.environ['DATAECHO_TEST_PORT']}")


if __name__ == "__main__":
    name, rank, world_size, port, out = sys.argv[1:6]
    os.environ["DATAECHO_TEST_PORT"] = port
    sys.path.insert(0, str(TESTS))
    result = SCENARIOS[name](int(rank), int(world_size), sys.argv[6] if len(sys.argv) > 6 else "")
    Path(out).write_text(json.dumps(result, default=lambda o: dict(o) if isinstance(o, Counter) else str(o)))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
