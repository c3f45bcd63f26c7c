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
    """echo_factor="auto" on every rank, rank 0's reads ``arg`` times slower
    (``"8,device"``: 8 times, with echo on the device, ``device="cpu"``)."""
    import dataecho
    import torch
    import torch.distributed as dist
    from support import Records, checked_ids

    _join(rank, world_size)
    slow, _, place = arg.partition(",")
    slow = float(slow or 4)
    where = {"echo_at": "device", "device": "cpu"} if place == "device" else {}
    # Rank 0 reads 2 ms per example on 2 threads (8 ms a batch, against a 2 ms step); rank 1 at once.
    loader = dataecho.EchoLoader(Records(400, delay_s=0.00025 * slow if rank == 0 else 0.0), batch_size=8,
                                 echo_factor="auto", num_workers=2, seed=1, **where)
    batches, started = [], time.perf_counter()
    for batch in loader:
        batches.append(checked_ids(batch).tolist())
        step = torch.ones(1)
        dist.all_reduce(step)  # the training step's collective: a rank that stopped early would hang it
        time.sleep(0.002)
    stats = loader.stats()
    repeats = stats["lockstep_repeats"]
    return {"batches": len(batches), "counts": Counter(i for b in batches for i in b), "repeats": repeats,
            "report": stats["this_epoch"]["repetition"],
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


# ---- lockstep scenarios: echo_factor="auto" where a rank has nothing to deliver, fails, or leaves ----


class _EpochSizes:
    """An iterable source whose epoch ``e`` yields records ``0..sizes[e]-1``
    (the last size for later epochs): a rank's shard of a stream it reads
    itself. ``fail_at``: (epoch, record) at which it raises InjectedFault."""

    def __init__(self, sizes: list[int], fail_at: tuple[int, int] | None = None) -> None:
        self.sizes, self.fail_at, self.epochs = sizes, fail_at, 0

    def __iter__(self) -> Any:
        from support import InjectedFault, one

        epoch, self.epochs = self.epochs, self.epochs + 1
        size = self.sizes[min(epoch, len(self.sizes) - 1)]
        for i in range(size):
            if (epoch, i) == self.fail_at:
                raise InjectedFault(f"the stream broke at record {i}")
            yield one(i)


def _auto_loader(source: Any, **kwargs: Any) -> Any:
    import dataecho

    kwargs.setdefault("num_workers", 0)
    return dataecho.EchoLoader(source, batch_size=8, echo_factor="auto", seed=1, **kwargs)


BOUND_S = 12  # a lockstep scenario's rank ends itself (SIGALRM) after this long: a hang fails fast, reaped


def _bounded_join(rank: int, world_size: int) -> None:
    import signal

    _join(rank, world_size)
    signal.alarm(BOUND_S)


def _epochs(loader: Any, count: int, step: bool = False, stop_after: int | None = None) -> list[list[Any]]:
    """[batches, error or None] of each of ``count`` epochs; ``step``: a
    training step's collective after each batch; ``stop_after``: the loop
    leaves (break) after that many batches."""
    import torch
    import torch.distributed as dist

    epochs = []
    for _ in range(count):
        batches, error = 0, None
        try:
            for _ in loader:
                batches += 1
                if step:
                    dist.all_reduce(torch.ones(1))
                if batches == stop_after:
                    break
        except Exception as e:  # noqa: BLE001 - what each rank saw is the result
            error = f"{type(e).__name__}: {e}"
        epochs.append([batches, error])
    return epochs


EMPTY_RANK_CASES = {  # case -> (rank 0's epoch sizes, the other ranks', drop_last)
    "iterable": ([64], [0], False),  # the others never see an example: their epochs learn no structure
    "short": ([64], [3], True),  # the others' 3 examples make no batch of 8
    "later": ([64], [40, 0], False),  # the others' second epoch is empty
    "all": ([3], [3], True),  # no rank has a batch: an empty epoch everywhere
}


def auto_with_an_empty_rank(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """echo_factor="auto" where every rank but 0 has no batch to deliver in
    some epoch (``arg``: a case of EMPTY_RANK_CASES): two epochs with a
    training step's collective, then a barrier (every rank alive, in step)."""
    import torch.distributed as dist

    _bounded_join(rank, world_size)
    sizes_0, sizes_others, drop_last = EMPTY_RANK_CASES[arg]
    loader = _auto_loader(_EpochSizes(sizes_0 if rank == 0 else sizes_others), drop_last=drop_last)
    epochs = _epochs(loader, 2, step=True)
    dist.barrier()
    return {"epochs": epochs}


def auto_with_a_failing_rank(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """echo_factor="auto" where rank 1's stream raises in one epoch, in a loop
    without a collective of its own (an evaluation); three epochs of the same
    loader on every rank. ``arg``: ``<epoch>:<record>:<shuffle_buffer>:<workers>``,
    where the stream raises, the examples the loader reads ahead, and its
    reading threads (0: the loop's own thread, where the error comes from the
    source itself; else a worker's error comes as the epoch stops)."""
    _bounded_join(rank, world_size)
    epoch, record, buffer, workers = (int(n) for n in arg.split(":"))
    source = _EpochSizes([400], fail_at=(epoch, record) if rank == 1 else None)
    return {"epochs": _epochs(_auto_loader(source, shuffle_buffer=buffer, num_workers=workers), 3)}


def auto_left_early_on_one_rank(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """echo_factor="auto" where rank 1 leaves its first epoch's loop after 3
    batches (break) while rank 0 goes on, in a loop without a collective of
    its own. Rank 1 runs three epochs, rank 0 two, each until it ends or raises."""
    _bounded_join(rank, world_size)
    loader = _auto_loader(_EpochSizes([200]), shuffle_buffer=16)
    if rank == 1:
        return {"epochs": _epochs(loader, 1, stop_after=3) + _epochs(loader, 2)}
    return {"epochs": _epochs(loader, 2)}


def lockstep_without_stages(rank: int, world_size: int, arg: str) -> dict[str, Any]:
    """Rank 0 runs an echo_factor="auto" epoch; every other rank plays an
    epoch that built no stages: it makes the loader's process group and takes
    part in the first agreement (``arg``: "empty", or "failed" before its
    stages existed), as the epoch does."""
    import torch.distributed as dist
    from dataecho.pipeline.stages.lockstep import agree_without_stages

    _bounded_join(rank, world_size)
    if rank == 0:
        epochs = _epochs(_auto_loader(_EpochSizes([64])), 1)
    else:
        group = dist.new_group(backend="gloo")  # as the loader makes its group, at its first epoch
        try:
            agree_without_stages(group, failed=arg == "failed")
            epochs = [[0, None]]
        except RuntimeError as e:
            epochs = [[0, f"{type(e).__name__}: {e}"]]
    dist.barrier()
    return {"epochs": epochs}


SCENARIOS = {"built_before_the_group": built_before_the_group, "auto_with_a_straggler": auto_with_a_straggler,
             "elastic_save": elastic_save, "elastic_load": elastic_load,
             "auto_with_an_empty_rank": auto_with_an_empty_rank, "auto_with_a_failing_rank": auto_with_a_failing_rank,
             "auto_left_early_on_one_rank": auto_left_early_on_one_rank,
             "lockstep_without_stages": lockstep_without_stages}


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
