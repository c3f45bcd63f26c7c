"""``augment`` in worker processes (``augment_workers="process"``, the default
with ``worker_type="process"``): the same batches as thread augment for the
same seed, in every placement it supports and across a resume; nothing of the
user's runs in the training process; the reading workers' fault guarantees."""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections import Counter

import numpy as np
import pytest
from support import AugmentDies, AugmentReshapes, AugmentStalls, Records, kill_owner, noisy_augment, with_pid

import dataecho

PLACEMENTS = {
    "echo 2": {"echo_factor": 2},
    "echo 1.5": {"echo_factor": 1.5},
    "batch echo": {"echo_factor": 2, "echo_at": "batch", "shuffle_buffer": 4},
}


def make(augment_workers, **kwargs):
    args = {"batch_size": 16, "num_workers": 2, "seed": 5, "augment": noisy_augment, "shuffle_buffer": 64,
            "augment_workers": augment_workers}
    return dataecho.EchoLoader(Records(600, form=kwargs.pop("form", "dict")), **{**args, **kwargs})


def rows(batch):
    return batch["id"].tolist(), batch["noise"].tolist()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_process_augment_gives_the_batches_thread_augment_gives(placement):
    kwargs = PLACEMENTS[placement]
    threads = [rows(b) for b in make("thread", **kwargs)]
    processes = make("process", **kwargs)
    batches = list(processes)
    assert [rows(b) for b in batches] == threads
    assert os.getpid() not in {p for b in batches for p in b["augmented_in"].tolist()}


def test_process_augment_resumes_exactly():
    uninterrupted = [rows(b) for b in make("thread", echo_factor=1.5)]
    loader = make("process", echo_factor=1.5)
    epoch = iter(loader)
    taken = [rows(next(epoch)) for _ in range(17)]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    loader.close()
    resumed = make("process", echo_factor=1.5)
    resumed.load_state_dict(state)
    assert taken + [rows(b) for b in resumed] == uninterrupted


def test_with_worker_processes_the_training_process_runs_no_user_code():
    loader = dataecho.EchoLoader(Records(300), batch_size=10, echo_factor=2, num_workers=2, worker_type="process",
                                 transform=with_pid, augment=noisy_augment, seed=1)
    assert loader.augment_workers == "process", "the default with worker processes"
    batches = list(loader)
    readers = {p for b in batches for p in b["pid"].tolist()}
    augmenters = {p for b in batches for p in b["augmented_in"].tolist()}
    assert os.getpid() not in readers | augmenters
    assert Counter(i for b in batches for i in b["id"].tolist()) == Counter({i: 2 for i in range(300)})


def test_ragged_and_object_leaves_go_through_augment_processes():
    threads = [(b["id"].tolist(), [r.tolist() for r in b["tokens"]], b["name"])
               for b in make("thread", form="ragged")]
    processes = [(b["id"].tolist(), [r.tolist() for r in b["tokens"]], b["name"])
                 for b in make("process", form="ragged")]
    assert processes == threads


@pytest.mark.parametrize("how,message", [("kill", "was killed by SIGKILL"), ("exit", r"exited \(status 0\)")])
def test_an_augment_worker_that_dies_is_the_loops_error(how, message):
    loader = make("process", augment=AugmentDies(250, how))
    with pytest.raises(RuntimeError, match=f"dataecho augment worker .* {message}"):
        for _ in loader:
            pass


def test_timeout_holds_while_the_augment_workers_stall():
    # Each worker augments two batches' rows at once, then stalls: the loop's own
    # thread, which feeds the workers and waits for their results, keeps the timeout.
    loader = make("process", augment=AugmentStalls(after=32, seconds=60.0), timeout=1.0)
    taken = 0
    with pytest.raises(RuntimeError, match=r"timed out after 1 seconds \(timeout=1\)"):
        for _ in loader:
            taken += 1
    assert taken >= 1
    loader.close()


@pytest.mark.parametrize("augment_workers", ["thread", "process"])
def test_a_result_of_another_shape_is_named(augment_workers):
    # Example 250 is augmented after the first batch, whose results fixed the leaf's shape.
    loader = make(augment_workers, augment=AugmentReshapes(250))
    with pytest.raises(ValueError, match=r"augment's result: .*'extra'.* \(3,\)"):
        for _ in loader:
            pass


def test_augment_workers_go_with_a_killed_owner():
    left = kill_owner("Records(100000, delay_s=0.001), batch_size=8, num_workers=1, augment_workers='process', "
                      "augment=__import__('support').noisy_augment")
    assert not left, f"processes outlived their owner: {left}"


def test_augment_workers_is_checked():
    with pytest.raises(ValueError, match="augment_workers: expected 'thread' or 'process'"):
        dataecho.EchoLoader(Records(10), augment=noisy_augment, augment_workers="fiber")
    with pytest.raises(TypeError, match="augment: worker_type='process' sends it to worker processes"):
        dataecho.EchoLoader(Records(10), augment=lambda e: e, augment_workers="process")


def pids(batches):
    return {p for b in batches for p in b["augmented_in"].tolist()}


def test_persistent_augment_workers_serve_every_epoch():
    threads = make("thread", echo_factor=1.5)
    expected = [[rows(b) for b in threads] for _ in range(3)]
    loader = make("process", echo_factor=1.5, persistent_workers=True)
    epochs = [list(loader) for _ in range(3)]
    assert [[rows(b) for b in epoch] for epoch in epochs] == expected
    assert len(pids(epochs[0])) == 2 and pids(epochs[1]) == pids(epochs[2]) == pids(epochs[0])
    loader.close()
    for pid in pids(epochs[0]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_persistent_augment_workers_outlive_an_epoch_left_part_way():
    threads = make("thread", echo_factor=2)
    expected = [rows(b) for b in threads]
    expected = [expected, [rows(b) for b in threads]]
    loader = make("process", echo_factor=2, persistent_workers=True)
    epoch = iter(loader)
    first = [next(epoch) for _ in range(5)]
    del epoch  # left part-way: the workers finish their tasks and wait
    second = list(loader)
    assert [rows(b) for b in second] == expected[1]
    assert pids(second) == pids(first)


def test_a_persistent_augment_worker_killed_between_epochs_is_replaced():
    loader = make("process", persistent_workers=True)
    first = pids(list(loader))
    victim = next(iter(first))
    os.kill(victim, signal.SIGKILL)
    while os.path.exists(f"/proc/{victim}"):  # reaped: gone before the next epoch starts
        time.sleep(0.01)
    second = list(loader)
    assert len(second) == 600 * 2 // 16 and pids(second).isdisjoint(first)
