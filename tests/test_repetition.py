"""The repetition report of ``EchoLoader.stats()``: deliveries per example and
the distances between an example's repeats, checked against a ledger built
from what the loop received; and auto echo's spread of its repeats."""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from itertools import pairwise

import numpy as np
import pytest

import dataecho


class Indexed:
    """A map-style dataset whose examples carry their index."""

    def __init__(self, n: int, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"index": np.int64(i), "x": np.full(4, i, dtype=np.float32)}


def _ledger(batches) -> dict[int, list[int]]:
    """Per example index, the batch numbers it was delivered in."""
    seen: dict[int, list[int]] = defaultdict(list)
    for k, batch in enumerate(batches):
        for i in np.asarray(batch["index"]).tolist():
            seen[i].append(k)
    return seen


def _bucket(gap: int) -> int:
    """A gap as the report gives it: exact below 256, then the lower bound of its power of two."""
    return gap if gap < 256 else 256 << ((gap // 256).bit_length() - 1)


def _expected(seen: dict[int, list[int]], read: int) -> dict:
    times = [len(ks) for ks in seen.values()]
    gaps = sorted(b - a for ks in seen.values() for a, b in pairwise(ks))
    histogram = [read - len(seen)] + [times.count(c) for c in range(1, max(times) + 1)]
    return {
        "deliveries": histogram, "max": max(times), "mean": pytest.approx(np.mean(times)),
        "spread": pytest.approx(np.std(times)), "distinct_fraction": pytest.approx(len(seen) / sum(times)),
        "repeats": len(gaps), "gap_min": _bucket(gaps[0]) if gaps else None,
        "gap_p05": _bucket(gaps[max(1, math.ceil(0.05 * len(gaps))) - 1]) if gaps else None,
    }


CASES = {
    "echo 2": {"echo_factor": 2},
    "echo 1.5": {"echo_factor": 1.5},
    "echo 3, inline": {"echo_factor": 3, "num_workers": 0},
    "batch echo": {"echo_factor": 2, "echo_at": "batch"},
    "augment after echo": {"echo_factor": 2, "augment": lambda example, rng: example},
    "process workers": {"echo_factor": 2, "worker_type": "process", "num_workers": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_report_matches_a_ledger_of_the_deliveries(seed, case):
    loader = dataecho.EchoLoader(Indexed(600), batch_size=16, seed=seed, shuffle_buffer=128, **CASES[case])
    seen = _ledger(loader)
    this = loader.stats()["this_epoch"]
    assert this["repetition"] == _expected(seen, this["fresh"])
    assert this["distinct"] == len(seen) == 600
    assert this["echo_factor_achieved"] == pytest.approx(sum(map(len, seen.values())) / 600)


def test_an_iterable_is_counted_by_position_in_the_stream(seed):
    stream = [{"index": np.int64(i)} for i in range(500)]
    loader = dataecho.EchoLoader(stream, batch_size=20, echo_factor=2.5, seed=seed, shuffle_buffer=100)
    seen = _ledger(loader)
    assert loader.stats()["this_epoch"]["repetition"] == _expected(seen, 500)


def test_a_part_epoch_counts_only_what_was_delivered(seed):
    loader = dataecho.EchoLoader(Indexed(2000), batch_size=16, echo_factor=2, seed=seed, num_workers=1)
    it = iter(loader)
    seen = _ledger(next(it) for _ in range(10))
    this = loader.stats()["this_epoch"]
    assert this["fresh"] > this["distinct"] == len(seen), "read ahead of what was delivered"
    assert this["echo_factor_achieved"] == pytest.approx(160 / len(seen)) and this["echo_factor_achieved"] >= 1.0
    assert this["repetition"] == _expected(seen, this["fresh"])
    del it
    assert loader.stats()["this_epoch"]["state"] == "stopped"
    assert loader.stats()["echo_factor_achieved"] >= 1.0


def test_the_run_counts_each_example_over_the_epochs(seed):
    loader = dataecho.EchoLoader(Indexed(300), batch_size=10, echo_factor=2, seed=seed)
    for _ in range(3):
        list(loader)
    run = loader.stats()["repetition"]
    assert run["deliveries"] == [0] * 6 + [300] and run["max"] == 6 and run["mean"] == 6.0
    assert run["bytes"] >= 300
    # A sampler over a subset: the examples it never gives count as delivered 0 times.
    subset = dataecho.EchoLoader(Indexed(300), batch_size=10, echo_factor=1, seed=seed,
                                 sampler=list(range(0, 300, 3)))
    list(subset)
    assert subset.stats()["repetition"]["deliveries"] == [198, 100]  # indices 0..297, every third given


def test_a_data_parallel_rank_reports_its_own_shard(seed):
    loader = dataecho.EchoLoader(Indexed(400), batch_size=10, echo_factor=2, seed=seed, rank=1, world_size=2)
    seen = _ledger(loader)
    this, run = loader.stats()["this_epoch"], loader.stats()["repetition"]
    assert this["repetition"] == _expected(seen, this["fresh"]) and len(seen) == 200
    assert run["deliveries"][2] == 200 and sum(run["deliveries"]) == max(seen) + 1


def test_each_epoch_logs_its_repetition(seed, caplog):
    loader = dataecho.EchoLoader(Indexed(200), batch_size=10, echo_factor=2, seed=seed)
    with caplog.at_level(logging.INFO, logger="dataecho"):
        list(loader)
    message = next(r for r in caplog.records if r.name == "dataecho").getMessage()
    assert "examples delivered: 200 x2 (at most 2 times each); repeats at least" in message
    flat = loader.stats(flat=True)
    assert flat["dataecho/this_epoch/repetition/deliveries/2"] == 200
    assert flat["dataecho/repetition/deliveries/2"] == 200


class Bursty:
    """Reads 2x too slowly for the step in runs of 200 examples, at once in the runs between."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if (i // 200) % 2 == 0:
            time.sleep(0.001)  # a step of 8 ms takes 16 examples: 0.5 ms each
        return {"index": np.int64(i)}


def test_auto_spreads_its_repeats_evenly(seed):
    """A variable-speed upstream, echo about 1.2: hardly any example reaches max_echo (4). Before the repeats
    were spread (uniformly drawn among those resident), 33-41 of the 2,400 did; the benchmark's target, the
    most at ceil(achieved) + 1, is measured by ``bench/bench_repetition.py --bursty``."""
    loader = dataecho.EchoLoader(Bursty(2400), batch_size=16, echo_factor="auto", seed=seed, num_workers=1,
                                 shuffle=False)
    seen = {}
    for batch in loader:
        time.sleep(0.008)  # the step
        for i in np.asarray(batch["index"]).tolist():
            seen[i] = seen.get(i, 0) + 1
    this = loader.stats()["this_epoch"]
    assert this["echo_factor_achieved"] > 1.05, "the slow runs made it echo"
    assert max(seen.values()) == this["repetition"]["max"] <= 4
    assert sum(1 for n in seen.values() if n == 4) <= 16, "at most a batch's worth at max_echo"
    assert len(seen) == 2400


def test_auto_keeps_an_examples_repeats_echo_gap_batches_apart(seed):
    loader = dataecho.EchoLoader(Indexed(800, delay_s=0.0005), batch_size=8, echo_factor="auto", max_echo=4,
                                 echo_gap=5, seed=seed, num_workers=1)
    seen = _ledger(loader)
    gaps = [b - a for ks in seen.values() for a, b in pairwise(ks)]
    assert gaps and min(gaps) >= 5
    assert loader.stats()["this_epoch"]["repetition"]["gap_min"] >= 5
    with pytest.raises(ValueError, match="echo_gap"):
        dataecho.EchoLoader(Indexed(8), echo_gap=0)


@pytest.mark.parametrize("read_s, low, high", [(0.0002, 2.5, 4.0), (0.0, 1.0, 1.1)], ids=["slow reads", "fast reads"])
def test_auto_with_num_workers_0_echoes_only_where_reads_are_the_bottleneck(seed, read_s, low, high):
    """The loop reads between its steps: 16 reads of 0.2 ms take 6x a step of 0.5 ms (echo up to max_echo,
    4), or a fraction of it (no echo)."""
    loader = dataecho.EchoLoader(Indexed(1600, delay_s=read_s), batch_size=16, echo_factor="auto", seed=seed,
                                 num_workers=0)
    seen = _ledger(_stepped(loader, 0.0005))
    this = loader.stats()["this_epoch"]
    assert low <= this["echo_factor_achieved"] <= high
    assert len(seen) == 1600 and this["repetition"] == _expected(seen, 1600)


def _stepped(loader, step_s: float):
    for batch in loader:
        time.sleep(step_s)  # the training step
        yield batch


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_reports_the_deliveries_before_the_checkpoint_too(seed, workers):
    kw = {"batch_size": 16, "echo_factor": 2, "seed": seed, "shuffle_buffer": 128, "num_workers": workers}
    loader = dataecho.EchoLoader(Indexed(600), **kw)
    it = iter(loader)
    before = [next(it) for _ in range(15)]
    state = json.loads(json.dumps(loader.state_dict()))  # plain values: JSON takes the ledger as it is
    del it
    resumed = dataecho.EchoLoader(Indexed(600), **kw)
    resumed.load_state_dict(state)
    after = list(resumed)
    seen = _ledger(before + after)
    assert sorted(seen) == list(range(600)) and all(len(ks) == 2 for ks in seen.values())
    assert resumed.stats()["this_epoch"]["repetition"] == _expected(seen, 600)
    state["stages"]["ledger"]["counts"] = "not a packed array"
    with pytest.raises(ValueError, match=r"state\['stages'\]\['ledger'\]\['counts'\]"):
        dataecho.EchoLoader(Indexed(600), **kw).load_state_dict(state)
