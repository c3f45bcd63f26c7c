"""Data-parallel sharding: disjoint shards that cover the dataset, equal batch
counts on every rank, with torch.distributed (gloo, two processes) and with
explicit rank / world_size."""

from __future__ import annotations

import json
import math
import pickle
import socket
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import dataecho
import numpy as np
import pytest

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
    with pytest.raises(ValueError, match="echo_factor: 'auto'.*deterministic=True"):
        dataecho.EchoLoader(range(10), rank=0, world_size=2, echo_factor="auto", deterministic=True)
    # 'auto' on several ranks echoes in lockstep (see test_auto_echo_keeps_the_ranks_in_lockstep...).
    assert dataecho.EchoLoader(range(10), rank=0, world_size=2, echo_factor="auto")._planner.plan.lockstep is not None


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


# ---- resuming under another world size ----


def run_job(world_size, states=None, cut=None, epochs=1, json_states=False, **kwargs):
    """Every rank of a job (explicit ranks, one process): each loads `states`
    (a state, or every old rank's) where given, and either stops after `cut`
    batches (then returns their states) or runs `epochs`. Returns (delivered
    ids, states, batches per rank, len() per rank as it was after loading)."""
    seen, saved, lengths, sizes = Counter(), [], [], []
    for rank in range(world_size):
        loader = dataecho.EchoLoader(np.arange(1001), batch_size=16, rank=rank, world_size=world_size,
                                     shuffle_buffer=64, **kwargs)
        if states is not None:
            loader.load_state_dict(json.loads(json.dumps(states)) if json_states else states)
        sizes.append(len(loader) if not kwargs.get("echo_factor") == "auto" else None)
        batches = 0
        for _ in range(epochs if cut is None else 1):
            for batch in loader:
                seen.update(batch.tolist())
                batches += 1
                if batches == cut:
                    break
        saved.append(pickle.loads(pickle.dumps(loader.state_dict())))
        lengths.append(batches)
        loader.close()
    return seen, saved, lengths, sizes


ELASTIC = {
    "threads": {"echo_factor": 2, "num_workers": 2},
    "processes": {"echo_factor": 2, "num_workers": 2, "worker_type": "process"},
    "fractional": {"echo_factor": 1.5, "num_workers": 2},
    "augment": {"echo_factor": 2, "num_workers": 1, "augment": lambda x, rng: x},
}


def test_dealing_out_an_epochs_rest_gives_every_new_rank_as_many_batches():
    # What a job had not delivered, dealt out over the ranks of another: every
    # new rank yields as many batches, every example gets what it is owed (a
    # fresh one its echo count by its new position), and only a few deliveries
    # pad the ranks short of the most (fewer than a batch and an entry each). 64 ranks for a
    # few owed deliveries too: no rank is left without a batch.
    from dataecho.pipeline.progress import elastic
    from dataecho.pipeline.progress.replay import Ledger

    rng = np.random.default_rng(0)
    for trial in range(300):
        n, world = int(rng.integers(1, 300)), int(rng.choice([1, 2, 3, 4, 7, 64]))
        factor, batch = float(rng.choice([1, 1.5, 2, 3])), int(rng.choice([1, 4, 16]))
        target = rng.permutation(elastic.counts_by_position(0, n, factor))
        delivered = np.where(rng.random(n) < 0.5, 0, rng.integers(0, target + 1))
        dealing = elastic.Dealing(world, batch, factor, bool(rng.integers(2)), int(rng.choice([2 * batch, 64, 4096])),
                                  seed=trial, epoch=0, segment=1, augmented=bool(rng.integers(2)))
        ledger = Ledger(target, delivered)
        starts = elastic.dealt(ledger, dealing)
        counts = {elastic.start_batches(start, dealing) for start in starts}
        assert len(counts) == 1, (trial, counts)
        given, owed = elastic.assigned(starts, dealing, n), ledger.owed
        partly, fresh = (delivered > 0) & (owed > 0), (delivered == 0) & (owed > 0)
        assert (given[partly] >= owed[partly]).all() and (given[fresh] >= int(factor)).all(), trial
        needed = owed[partly].sum() + elastic.counts_by_position(0, fresh.sum(), factor).sum()
        # Entries of up to ceil(e) deliveries (and fresh examples of e) leave ranks that far apart at most.
        assert given.sum() - needed < world * (batch + -(-factor // 1)), (trial, given.sum(), needed)


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2)])
@pytest.mark.parametrize("case", list(ELASTIC))
def test_a_job_resumes_mid_epoch_under_another_world_size(old, new, case):
    kwargs = ELASTIC[case]
    factor = kwargs["echo_factor"]
    before, states, _, _ = run_job(old, cut=9, **kwargs)
    after, _, lengths, sizes = run_job(new, states=states, **kwargs)
    assert len(set(lengths)) == 1, f"every new rank yields as many batches: {lengths}"
    assert [9 + n for n in lengths] == sizes, "len() counts the batches of the epoch in all, the old job's included"
    counts = before + after
    assert set(counts) == set(range(1001))
    low, high = int(factor), -(-factor // 1)
    # The old job padded its shards (1001 over 2 or 4 ranks) as a distributed
    # sampler does, and the new ranks may pad to equal batch counts: a few
    # examples come once more, never fewer times than their count.
    assert all(low <= counts[i] for i in range(1001))
    extra = sum(max(0, c - int(high)) for c in counts.values())
    assert extra <= old + new * 16, f"{extra} deliveries beyond the echo count"
    if factor == int(factor) and case != "augment":
        assert sum(counts.values()) - 1001 * factor <= old * factor + new * 16


def test_a_job_resumes_at_an_epoch_boundary_under_another_world_size():
    _, states, _, _ = run_job(2, echo_factor=1, num_workers=2)
    assert all(s["epoch"] == 1 and s["stages"] is None for s in states)
    after, resumed, _, _ = run_job(4, states=states, echo_factor=1, num_workers=2)
    assert sorted(after) == list(range(1001)) and all(s["epoch"] == 2 for s in resumed)


@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (3, 3)])
def test_any_one_state_resumes_every_rank_of_a_job_of_any_world_size(old, new):
    # Lightning, Accelerate and HF Trainer save rank 0's checkpoint alone: each
    # rank's position follows from it (the seed, the epoch, the world sizes and
    # the batches delivered). Any one state resumes what the list of every
    # rank's resumes, through JSON too.
    kwargs = {"echo_factor": 1.5, "num_workers": 2, "seed": 5}
    _, states, _, _ = run_job(old, cut=7, **kwargs)
    whole, _, whole_lengths, _ = run_job(new, states=states, **kwargs)
    for state in states:
        seen, _, lengths, sizes = run_job(new, states=state, json_states=True, **kwargs)
        assert seen == whole and lengths == whole_lengths and [7 + n for n in lengths] == sizes


def test_any_rank_resumes_its_own_rest_of_the_epoch_from_rank_0s_state():
    kwargs = {"echo_factor": 2, "augment": lambda x, rng: x, "num_workers": 1}
    ranks = [dataecho.EchoLoader(np.arange(1001), batch_size=16, rank=r, world_size=2, shuffle_buffer=64, **kwargs)
             for r in range(2)]
    whole = [[b.tolist() for b in loader] for loader in ranks]
    _, states, _, _ = run_job(2, cut=11, **kwargs)
    for rank, loader in enumerate(ranks):
        loader.load_state_dict(states[0])
        assert len(loader) == len(whole[rank])
        assert [b.tolist() for b in loader] == whole[rank][11:], f"rank {rank}"


def test_a_rank_whose_position_cannot_be_worked_out_says_to_load_its_own_state():
    sampler = list(range(0, 1001, 2))
    saving = dataecho.EchoLoader(np.arange(1001), batch_size=16, rank=0, world_size=2, sampler=sampler)
    epoch = iter(saving)
    next(epoch)
    state = saving.state_dict()
    loader = dataecho.EchoLoader(np.arange(1001), batch_size=16, rank=1, world_size=2, sampler=sampler)
    with pytest.raises(ValueError, match="saved by rank 0 of 2, but this loader is rank 1 of 2.*load each rank's own"):
        loader.load_state_dict(state)
    _, states, _, _ = run_job(2, cut=3, echo_factor=2)
    with pytest.raises(ValueError, match="the states of all 2 ranks"):
        loader.load_state_dict(states[:1] + states[:1])


# ---- right by default, and auto echo in lockstep (real processes on gloo) ----


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_loader_built_before_the_process_group_reads_its_shard(tmp_path, world_size):
    from ranks import run_ranks

    results = run_ranks("built_before_the_group", world_size, tmp_path)
    shards = [set(r["ids"]) for r in results]
    assert all(r["world_size"] == world_size and len(r["ids"]) == 1000 // world_size for r in results)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert set().union(*shards) == set(range(1000)) and sum(len(s) for s in shards) == 1000, "disjoint shards"
    assert {r["len"] for r in results} == {1000 // world_size // 10}


def test_a_distributed_environment_without_a_process_group_warns_once():
    from support import run_python

    proc = run_python(
        """
        import os, warnings
        os.environ["WORLD_SIZE"] = "2"  # as torchrun sets it
        import numpy as np
        import dataecho
        warnings.simplefilter("always")
        loader = dataecho.EchoLoader(np.arange(100), batch_size=10, echo_factor=1)
        with warnings.catch_warnings(record=True) as caught:
            for _ in range(2):
                assert sum(len(b) for b in loader) == 100
        print(len([w for w in caught if "WORLD_SIZE=2" in str(w.message)]))
        """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1"], "one warning, at the first epoch"


def test_auto_echo_keeps_the_ranks_in_lockstep_while_one_straggles(tmp_path):
    from ranks import run_ranks

    slow, fast = run_ranks("auto_with_a_straggler", 2, tmp_path, "8")
    assert slow["batches"] == fast["batches"], "every rank yields as many batches"
    assert len(slow["counts"]) == len(fast["counts"]) == 200, "every example of each shard at least once"
    assert fast["repeats"] > slow["repeats"], "the fast rank repeats while the straggler's reads catch up"
    assert slow["echo_before_repeats"] > fast["echo_before_repeats"], "the straggler echoes more as it reads"
    for rank in (slow, fast):  # each rank's repetition report, against what its loop received
        times = list(rank["counts"].values())
        assert rank["report"]["max"] == max(times)
        assert rank["report"]["deliveries"][1:] == [times.count(c) for c in range(1, max(times) + 1)]
        # The fast rank repeats for most of the epoch: over its whole shard, read again, not its kept batches.
        assert max(times) <= math.ceil(rank["report"]["mean"]) + 1, rank["report"]
    # What the agreement costs is timed by bench/bench_stragglers.py, against a job without it.


def test_lightning_ddp_gives_each_rank_its_shard_of_a_loader_handed_to_fit(tmp_path):
    pytest.importorskip("pytorch_lightning")
    # Lightning builds the process group inside fit(), after the loader was made.
    proc = subprocess.run([sys.executable, str(Path(TESTS) / "lightning_ddp.py"), str(tmp_path), "2"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": f"{TESTS}:" +
                               __import__("os").environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world_size"] == 2 for r in ranks)
    seen = [Counter(r["ids"]) for r in ranks]
    assert len(ranks[0]["ids"]) == len(ranks[1]["ids"]) == 2 * 200, "each rank: its 200 examples, twice"
    assert set(seen[0]) | set(seen[1]) == set(range(400)) and not set(seen[0]) & set(seen[1])
    assert all(set(s.values()) == {2} for s in seen)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_job_of_two_ranks_resumes_on_four_from_its_gathered_states(tmp_path, kind):
    from ranks import run_ranks

    checkpoint = tmp_path / "states.pkl"
    before = run_ranks("elastic_save", 2, tmp_path, f"{kind}:{checkpoint}")
    after = run_ranks("elastic_load", 4, tmp_path, f"{kind}:{checkpoint}")
    assert len({r["batches"] for r in after}) == 1, "every new rank yields as many batches"
    counts = Counter(i for r in before + after for i in r["ids"])
    assert set(counts) == set(range(1000)) and set(counts.values()) <= {2, 3}
    assert sum(counts.values()) - 2000 <= 4 * 16, "only the new ranks' padding comes more than twice"


def test_an_epoch_resumed_twice_on_other_world_sizes_from_one_state_each_time():
    # 2 ranks, preempted; 4 ranks resume from rank 0's state, preempted; 3 ranks
    # resume from rank 2's. Each job's ranks work out their positions from the
    # epoch's history in the one state they are given.
    kwargs = {"echo_factor": 2, "num_workers": 1, "seed": 9}
    first, states, _, _ = run_job(2, cut=6, **kwargs)
    assert states[0]["history"] == [[2, 6]]
    second, states, _, _ = run_job(4, states=states[0], cut=4, **kwargs)
    assert states[2]["history"] == [[2, 6], [4, 4]]
    third, _, lengths, sizes = run_job(3, states=states[2], json_states=True, **kwargs)
    assert len(set(lengths)) == 1 and sizes == [6 + 4 + n for n in lengths]
    counts = first + second + third
    assert set(counts) == set(range(1001)) and min(counts.values()) == 2
    assert sum(counts.values()) - 2 * 1001 <= 2 * 2 + 4 * 18 + 3 * 18, "the shards' and the new ranks' padding"


@pytest.mark.parametrize("cut", [40, 62])
def test_an_old_rank_whose_intake_ended_owes_only_what_it_had_not_delivered(cut):
    # Behind augment the echo buffer has read its whole shard long before the
    # epoch ends (its state says the intake ended): the rest dealt out is what
    # was not yet delivered, not the shard again. Near the end there are fewer
    # deliveries owed than new ranks: every new rank still yields a batch.
    kwargs = {"echo_factor": 2, "augment": lambda x, rng: x, "num_workers": 2}
    before, states, lengths, _ = run_job(2, cut=cut, **kwargs)
    assert lengths == [cut, cut]
    for new in (4, 64) if cut == 62 else (4,):
        after, _, new_lengths, sizes = run_job(new, states=states[1], **kwargs)
        assert len(set(new_lengths)) == 1 and new_lengths[0] >= 1 and sizes == [cut + n for n in new_lengths]
        counts = before + after
        assert set(counts) == set(range(1001)) and min(counts.values()) == 2
        assert sum(counts.values()) - 2 * 1001 <= 2 * 2 + new * 18, f"{new} ranks: only padding comes again"
