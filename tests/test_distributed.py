"""Data-parallel sharding: disjoint shards that cover the dataset, equal batch
counts on every rank, with torch.distributed (gloo, two processes) and with
explicit rank / world_size."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import dataecho

TESTS = str(Path(__file__).parent)


def shard_ids(n, rank, world_size, **kwargs):
    loader = dataecho.EchoLoader(
        range(n), batch_size=16, rank=rank, world_size=world_size, seed=3, num_workers=2, **kwargs
    )
    batches = [b.copy() for b in loader]
    return batches, loader


@pytest.mark.parametrize("n,world_size,drop_last", [(1000, 2, False), (1003, 4, False), (1003, 4, True)])
def test_explicit_ranks_shard_disjointly_and_evenly(n, world_size, drop_last):
    shards, lengths = [], []
    for rank in range(world_size):
        batches, loader = shard_ids(n, rank, world_size, echo_factor=1.5, drop_last=drop_last)
        assert len(batches) == len(loader), "len() is exact with several ranks"
        lengths.append(len(batches))
        shards.append(Counter(np.concatenate(batches).tolist()))
    assert len(set(lengths)) == 1, f"unequal batch counts per rank: {lengths}"
    distinct = [set(s) for s in shards]
    if drop_last:
        # The tail that does not divide evenly is dropped, and so is each rank's
        # short last batch: what is left is disjoint, in full batches.
        assert all(not (a & b) for i, a in enumerate(distinct) for b in distinct[i + 1 :]), "shards overlap"
        assert sum(len(s) for s in distinct) <= n - n % world_size
        assert all(sum(s.values()) == lengths[0] * 16 for s in shards)
    else:
        union = set().union(*distinct)
        assert union == set(range(n)), "the shards cover the dataset"
        # Padding repeats at most world_size - 1 indices, as DistributedSampler does.
        assert sum(len(s) for s in distinct) - n <= world_size - 1
        # Each rank's examples are echoed 1 or 2 times, exactly 1.5 on average.
        per_rank = -(-n // world_size)
        assert all(sum(s.values()) == per_rank + per_rank // 2 for s in shards)


def test_ranks_shuffle_with_different_seeds_but_share_the_permutation():
    a, _ = shard_ids(512, 0, 2, echo_factor=1)
    b, _ = shard_ids(512, 1, 2, echo_factor=1)
    assert not set(np.concatenate(a)) & set(np.concatenate(b))
    # The second epoch draws a new permutation: the shards change.
    loader = dataecho.EchoLoader(range(512), batch_size=16, rank=0, world_size=2, seed=3, echo_factor=1)
    first = set(np.concatenate(list(loader)))
    second = set(np.concatenate(list(loader)))
    assert first != second and len(first) == len(second) == 256


def test_bad_rank_arguments():
    with pytest.raises(ValueError, match="rank, world_size: give both"):
        dataecho.EchoLoader(range(10), rank=0)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size"):
        dataecho.EchoLoader(range(10), rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        dataecho.EchoLoader(range(10), rank=0, world_size=0)
    with pytest.raises(ValueError, match="echo_factor: 'auto'.*world_size=2"):
        dataecho.EchoLoader(range(10), rank=0, world_size=2, echo_factor="auto")


RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
sys.path.insert(0, {tests!r})
import dataecho
from support import Records
if __name__ == "__main__":
    dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method="tcp://127.0.0.1:{port}")
    loader = dataecho.EchoLoader(Records(2001), batch_size=32, echo_factor=2.5, deterministic=True)
    ids = [b["id"].tolist() for b in loader]
    # Every rank must agree on the number of steps, or a collective would hang.
    import torch
    steps = torch.tensor([len(ids)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    json.dump({{"rank": dist.get_rank(), "batches": ids, "max_steps": int(steps), "len": len(loader)}},
              open(sys.argv[2], "w"))
    dist.destroy_process_group()
"""


def test_two_processes_on_gloo(tmp_path):
    pytest.importorskip("torch.distributed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT.format(tests=TESTS, port=port)))
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / f"rank{rank}.json")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    ids = [Counter(i for batch in r["batches"] for i in batch) for r in results]
    assert len(results[0]["batches"]) == len(results[1]["batches"]) == results[0]["max_steps"] == results[0]["len"]
    assert set(ids[0]) | set(ids[1]) == set(range(2001))
    assert len(set(ids[0]) & set(ids[1])) <= 1, "only the padding index may repeat across ranks"
