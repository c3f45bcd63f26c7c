"""EchoLoader.stats(): per-epoch figures beside the totals, the flat form for
metrics loggers, and the ``dataecho`` logger's line per epoch."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import dataecho

from support import InjectedFault, Records, counts


def _loader(seed: int, **kw) -> dataecho.EchoLoader:
    kw = {"batch_size": 50, "echo_factor": 2, "seed": seed, **kw}
    return dataecho.EchoLoader(range(1000), **kw)


def test_this_epoch_is_apart_from_an_epoch_left_early(seed):
    loader = _loader(seed)
    peek = iter(loader)
    next(peek)  # a peek: the epoch reads ahead, delivers one batch
    running = loader.stats()
    del peek  # and is stopped
    dropped = loader.stats()
    delivered = sum(len(b) for b in loader)
    stats = loader.stats()
    assert running["this_epoch"]["state"] == "running" and running["this_epoch"]["delivered"] == 50
    assert dropped["this_epoch"]["state"] == "stopped" and dropped["this_epoch"]["epoch"] == 0
    this = stats["this_epoch"]
    assert this["state"] == "complete" and this["epoch"] == 1 == stats["epoch"]
    assert this["fresh"] == 1000 and this["delivered"] == delivered == 2000 and this["batches"] == 40
    assert this["echo_factor_achieved"] == 2.0
    # The totals count the peek's read-ahead too; the epochs say what happened.
    assert stats["delivered"] == 2050 and stats["batches"] == 41
    assert 1000 < stats["fresh"] <= 2000 and stats["echo_factor_achieved"] < 2.0
    assert stats["epochs"] == {"complete": 1, "stopped": 1, "failed": 0}


def test_a_running_epoch_counts_what_it_delivered_so_far(seed):
    loader = _loader(seed)
    assert loader.stats()["this_epoch"] is None
    it = iter(loader)
    for _ in range(7):
        next(it)
    this = loader.stats()["this_epoch"]
    assert this["state"] == "running" and this["batches"] == 7 and this["delivered"] == 350
    assert this["fresh"] >= 175  # at echo 2, 350 deliveries need at least 175 examples read
    assert 0.0 <= this["consumer_wait_fraction"] <= 1.0 and this["seconds"] > 0


def test_an_epoch_ended_by_an_error_is_failed(seed):
    loader = dataecho.EchoLoader(Records(100, fail_at=40), batch_size=10, seed=seed, num_workers=1)
    with pytest.raises(InjectedFault):
        list(loader)
    stats = loader.stats()
    assert stats["this_epoch"]["state"] == "failed" and stats["epochs"]["failed"] == 1


def test_flat_stats_are_numbers_under_prefixed_names_that_match_the_nested_ones(seed):
    loader = _loader(seed, num_workers=2)
    for _ in range(2):  # the second epoch knows the structure: the workers read every example
        list(loader)
    nested, flat = loader.stats(), loader.stats(flat=True)
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat.values())
    assert all(name.startswith("dataecho/") for name in flat)
    assert flat["dataecho/delivered"] == nested["delivered"] == 4000
    assert flat["dataecho/this_epoch/fresh"] == nested["this_epoch"]["fresh"] == 1000
    assert flat["dataecho/this_epoch/running"] == 0.0 and flat["dataecho/epochs/complete"] == 2
    assert flat["dataecho/workers/1/produced"] == nested["workers"][1]["produced"]
    assert sum(flat[f"dataecho/workers/{w}/produced"] for w in range(2)) == 1000
    bare = loader.stats(flat=True, prefix="")
    assert set(bare) == {name[len("dataecho/"):] for name in flat}
    assert "train/data/this_epoch/fresh" in loader.stats(flat=True, prefix="train/data")


def test_batch_echo_and_augment_counts_reach_stats(seed):
    # 1000 examples in 20 batches of 50; batch echo at 2 yields each batch twice.
    loader = _loader(seed, echo_at="batch", augment=lambda x: x + 1)
    delivered = [len(batch) for batch in loader]
    this = loader.stats()["this_epoch"]
    assert this["fresh_batches"] == 20 and this["delivered_batches"] == len(delivered) == 40
    assert this["augmented"] == sum(delivered) == 2000, "every repeat is augmented anew"
    plain = _loader(seed)
    list(plain)
    assert plain.stats()["this_epoch"]["fresh_batches"] == plain.stats()["augmented"] == 0
    assert loader.stats(flat=True)["dataecho/delivered_batches"] == 40


def test_each_epoch_is_logged_once_at_info_with_its_figures(seed, caplog):
    loader = _loader(seed)
    with caplog.at_level(logging.INFO, logger="dataecho"):
        next(iter(loader))
        seen = counts(loader)
    records = [r for r in caplog.records if r.name == "dataecho"]
    assert [r.levelno for r in records] == [logging.INFO] * 2
    assert records[0].getMessage().startswith("epoch 0 (stopped early): ")
    assert records[1].getMessage().startswith("epoch 1: 1000 fresh, 2000 delivered examples (echo factor 2.00)")
    assert "in 40 batches" in records[1].getMessage() and sum(seen.values()) == 2000
    figures = records[1].dataecho  # the same figures, flat, for structured logging
    assert figures["dataecho/epoch/epoch"] == 1 and figures["dataecho/epoch/delivered"] == 2000


def test_nothing_is_printed_by_default():
    code = "import dataecho\nfor _ in dataecho.EchoLoader(range(300), batch_size=30): pass\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
