"""deterministic=True: the delivered sequence depends on (seed, epoch, rank,
world_size) alone, not on the number or kind of workers or their timing."""

from __future__ import annotations

import numpy as np
import pytest
from support import Records, Stream

import dataecho


def ids(**kwargs):
    args = {"batch_size": 32, "echo_factor": 1.5, "seed": 11, "deterministic": True}
    args.update(kwargs)
    loader = dataecho.EchoLoader(args.pop("dataset", Records(3000, jitter=0.05)), **args)
    return [b["id"].tolist() for b in loader], loader


def test_same_batches_for_any_number_of_threads():
    reference, loader = ids(num_workers=1)
    for workers in (2, 5):
        assert ids(num_workers=workers)[0] == reference
    assert len(reference) == len(loader)
    assert sum(map(len, reference)) == 3000 + 1500, "exactly floor(n * 0.5) examples get the extra echo"


def test_same_batches_with_process_workers():
    reference, _ = ids(num_workers=1, dataset=Records(2000))
    assert ids(num_workers=2, worker_type="process", dataset=Records(2000))[0] == reference


def test_same_batches_with_augment_and_batch_echo():
    def augment(example):  # deterministic per example
        return {"id": example["id"], "payload": example["payload"] * 2}

    for kwargs in ({"augment": augment}, {"echo_at": "batch", "echo_factor": 2.5}):
        assert ids(num_workers=1, **kwargs)[0] == ids(num_workers=4, **kwargs)[0]


def test_iterable_source_with_transform_workers():
    def double(x):
        return x * 2

    def run(workers):
        loader = dataecho.EchoLoader(iter(range(2000)), batch_size=32, echo_factor=2, transform=double,
                                     num_workers=workers, seed=2, deterministic=True)
        return np.concatenate(list(loader)).tolist()

    assert run(1) == run(4)


def test_seed_and_epoch_change_the_sequence():
    reference, _ = ids(num_workers=2)
    assert ids(num_workers=2, seed=12)[0] != reference
    loader = dataecho.EchoLoader(Records(3000, jitter=0.05), batch_size=32, echo_factor=1.5, seed=11, deterministic=True, num_workers=3)
    first = [b["id"].tolist() for b in loader]
    second = [b["id"].tolist() for b in loader]
    assert first == reference, "epoch 0 is the same whatever the worker count"
    assert second != first, "the next epoch has its own order"


def test_deterministic_refuses_auto():
    with pytest.raises(ValueError, match="echo_factor: 'auto'.*deterministic"):
        dataecho.EchoLoader(range(10), echo_factor="auto", deterministic=True)
    with pytest.raises(ValueError, match="deterministic: worker processes"):
        dataecho.EchoLoader(Stream(10, tag_worker=True), deterministic=True, worker_type="process")


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_deterministic_intake_has_room_for_a_batch_out_of_order(worker_type):
    # A batch's worth of examples may wait for an earlier one beside the resident
    # ones: with less room than 2 * batch_size, intake could stall (it did).
    with pytest.raises(ValueError, match=r"shuffle_buffer: with deterministic=True, expected at least 2 \* batch_size"):
        dataecho.EchoLoader(Records(100), batch_size=32, shuffle_buffer=63, deterministic=True)
    for epoch in range(3):
        loader = dataecho.EchoLoader(Records(1000, jitter=0.05), batch_size=32, shuffle_buffer=64, echo_factor=1,
                                     num_workers=4 if worker_type == "thread" else 2, deterministic=True,
                                     seed=epoch, worker_type=worker_type)
        ids = sorted(i for batch in loader for i in batch["id"].tolist())
        assert ids == list(range(1000))

