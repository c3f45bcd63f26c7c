"""DataLoader's and StatefulDataLoader's behaviour, case by case, against
``EchoLoader(..., echo_factor=1)`` with the same keywords: each test runs the
torch loader and dataecho's on the same dataset and asserts the same result
where dataecho promises it (the differences it keeps are in
docs/from-dataloader.md, and tested there as differences)."""

from __future__ import annotations

import os
import pickle
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import ChainDataset, DataLoader, RandomSampler  # noqa: E402
from torch_sources import (  # noqa: E402
    CountingIterable, Described, FailsAt, Locked, Pairs, Seeds, ShardedByTorch, Slow, seed_12345,
)

import dataecho  # noqa: E402

stateful = pytest.importorskip("torchdata.stateful_dataloader")

# torchdata 0.11 calls a torch function that torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def echo(dataset, *args, **kwargs):
    return dataecho.EchoLoader(dataset, *args, echo_factor=1, **kwargs)


def same(a, b) -> bool:
    """Equal trees of tensors, arrays, numbers and strings, of the same types."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


# ---- what iter() does, and what collate_fn gets ----


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_with_len_is_read_as_an_iterable(num_workers):
    torch_batches = [b.tolist() for b in DataLoader(CountingIterable(20), batch_size=4)]
    echo_batches = [b.tolist() for b in echo(CountingIterable(20), 4, shuffle=False, num_workers=num_workers)]
    assert echo_batches == torch_batches
    chained = ChainDataset([CountingIterable(5), CountingIterable(3)])
    assert [b.tolist() for b in echo(chained, 4, shuffle=False)] == [b.tolist() for b in DataLoader(chained, 4)]
    with pytest.raises(ValueError, match="sampler: needs a map-style dataset"):
        echo(CountingIterable(20), 4, sampler=[0, 1])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collate_fn_gets_the_examples_the_dataset_returned(num_workers):
    def collate(examples):
        return torch.stack([torch.as_tensor(x) for x, _ in examples]), torch.tensor([y for _, y in examples])

    expected = list(DataLoader(Pairs(30), batch_size=8, collate_fn=collate))
    got = list(echo(Pairs(30), 8, False, collate_fn=collate, num_workers=num_workers))
    assert same(got, expected)
    identity = list(DataLoader(Described(10), batch_size=4, collate_fn=lambda b: b))
    for output in ("numpy", "torch"):
        got = list(echo(Described(10), 4, False, collate_fn=lambda b: b, output=output, num_workers=num_workers))
        # Tensors come back as tensors, but read-only views of the batch memory: compare values.
        assert [[{k: v for k, v in e.items() if k not in ("t", "r")} for e in b] for b in got] == \
            [[{k: v for k, v in e.items() if k not in ("t", "r")} for e in b] for b in identity]
        assert all(same(e["t"], t["t"]) and list(e["r"]) == list(t["r"])
                   for b, c in zip(got, identity) for e, t in zip(b, c))
        assert type(got[0][0]["np"]) is np.float32 and type(got[0][0]["id"]) is int


def test_default_batches_collate_a_range_per_position_and_list_strings():
    expected = next(iter(DataLoader(Described(6), batch_size=3)))
    got = next(iter(echo(Described(6), 3, False, output="torch")))
    assert got["name"] == expected["name"] and [r.tolist() for r in got["r"]] == [r.tolist() for r in expected["r"]]
    strings = np.array(["a", "bb", "ccc", "dddd"])
    assert next(iter(echo(strings, 2, False, output="torch"))) == next(iter(DataLoader(strings, 2)))


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_batch_size_none_yields_each_example_alone(output):
    expected = list(DataLoader(Pairs(7), batch_size=None))
    got = list(echo(Pairs(7), None, False, output=output))
    if output == "torch":
        assert same(got, expected), "converted as default_convert does"
    else:
        assert [(x.tolist(), y) for x, y in got] == [(x.tolist(), y) for x, y in expected]
    assert echo(Pairs(7), None).batch_size is None and len(echo(Pairs(7), None)) == 7
    with pytest.raises(ValueError, match="drop_last"):
        echo(Pairs(7), None, drop_last=True)
    repeated = Counter(int(x[0]) for x, _ in dataecho.EchoLoader(Pairs(7), None, echo_factor=2))
    assert repeated == Counter({i: 2 for i in range(7)}), "each example repeated, as usual"


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_the_first_examples_are_read_by_the_workers_after_worker_init_fn(worker_type):
    torch_seeds = {e["seed"] for b in DataLoader(Seeds(), batch_size=4, num_workers=2, worker_init_fn=seed_12345)
                   for e in [dict(zip(b, v)) for v in zip(*b.values())]}
    loader = echo(Seeds(), 4, num_workers=2, worker_init_fn=seed_12345, worker_type=worker_type,
                  collate_fn=lambda b: b)
    examples = [e for b in loader for e in b]
    assert {e["seed"] for e in examples} == {int(s) for s in torch_seeds} == {12345}
    if worker_type == "process":
        assert os.getpid() not in {e["pid"] for e in examples}, "no example is read in the training process"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_in_the_dataset_comes_from_next_not_iter(num_workers):
    for loader in (DataLoader(FailsAt(10, 0), batch_size=2, num_workers=num_workers),
                   echo(FailsAt(10, 0), 2, False, num_workers=num_workers)):
        epoch = iter(loader)  # no read here
        with pytest.raises(KeyError, match="no example 0"):
            next(epoch)


def test_a_slow_first_read_is_bounded_by_timeout():
    for loader in (DataLoader(Slow(3.0), batch_size=2, num_workers=1, timeout=0.5),
                   echo(Slow(3.0), 2, False, num_workers=1, timeout=0.5)):
        epoch = iter(loader)
        with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
            next(epoch)
        del epoch


def test_a_dataset_holding_multiprocessing_objects_reaches_worker_processes():
    dataset = Locked(24)
    expected = sorted(i for b in DataLoader(dataset, batch_size=4, num_workers=2,
                                            multiprocessing_context="forkserver") for i in b.tolist())
    got = sorted(i for b in echo(dataset, 4, num_workers=2, multiprocessing_context="forkserver")
                 for i in b.tolist())
    assert got == expected == list(range(24)) and dataset.reads.value == 48


# ---- samplers ----


def test_sampler_items_must_be_indices():
    with pytest.raises(TypeError, match=r"sampler: expected it to yield int indices, got 1.5"):
        next(iter(echo(list(range(10)), 2, sampler=[1.5, 2.7])))
    with pytest.raises(TypeError, match=r"sampler: expected it to yield int indices, got '7'"):
        next(iter(echo(list(range(10)), 2, sampler=["7", "8"])))
    with pytest.raises(IndexError, match=r"sampler: yielded index 1180591620717411303424"):
        next(iter(echo(list(range(10)), 2, sampler=[2 ** 70])))
    tensors = [torch.tensor(3), np.int64(4)]
    assert next(iter(echo(list(range(10)), 2, sampler=tensors))).tolist() == [3, 4]


class Forever:
    """A sampler that samples for ever, without __len__."""

    def __iter__(self):
        i = 0
        while True:
            yield i % 10
            i += 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_infinite_sampler_is_read_lazily(num_workers):
    loader, expected = echo(list(range(10)), 4, sampler=Forever(), num_workers=num_workers), DataLoader(
        list(range(10)), 4, sampler=Forever())
    got, want = iter(loader), iter(expected)
    assert [next(got).tolist() for _ in range(30)] == [next(want).tolist() for _ in range(30)]


# ---- the loader object ----


def test_arguments_cannot_be_set_later_and_the_class_is_generic():
    for loader in (DataLoader(Pairs(4)), echo(Pairs(4))):
        with pytest.raises(ValueError, match="batch_size"):
            loader.batch_size = 5
    assert dataecho.EchoLoader[list].__origin__ is dataecho.EchoLoader


def test_a_batch_larger_than_the_default_buffer():
    assert [len(b) for b in echo(list(range(10_000)), 5000)] == [len(b) for b in DataLoader(list(range(10_000)),
                                                                                              5000)]


def test_many_worker_processes_warn_as_dataloader_does():
    cpus = len(os.sched_getaffinity(0))
    with pytest.warns(UserWarning, match=f"num_workers={cpus + 1}: this EchoLoader will create"):
        echo(Pairs(4), num_workers=cpus + 1, worker_type="process")
    with pytest.warns(UserWarning, match="num_workers=1000: .* reading threads"):
        echo(Pairs(4), num_workers=1000)


def test_nested_tensors_are_refused_by_name():
    nested = [{"x": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)}] * 4
    with pytest.raises(TypeError, match="leaf 'x' is a nested tensor"):
        next(iter(echo(nested, 2)))


# ---- checkpoints: StatefulDataLoader's pattern ----


def take(epoch, count):
    return [b if isinstance(b, list) else b.tolist() for _, b in zip(range(count), epoch)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_state_after_break_resumes_the_broken_epoch_with_the_same_keywords(shuffle):
    # No seed: a restarted job builds its loader with the same keywords and loads the state.
    results = {}
    for name, make in (("torch", lambda: stateful.StatefulDataLoader(list(range(100)), batch_size=10,
                                                                      shuffle=shuffle)),
                       ("echo", lambda: echo(list(range(100)), 10, shuffle))):
        loader = make()
        seen = []
        for batch in loader:
            seen += batch.tolist()
            if len(seen) == 30:
                break
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        rest = [i for b in resumed for i in b.tolist()]
        assert sorted(seen + rest) == list(range(100)), name
        results[name] = (seen, rest)
    if not shuffle:
        assert results["echo"] == results["torch"]


@pytest.mark.parametrize("num_workers", [0, 2, 4])
@pytest.mark.parametrize("cut", [1, 5])
def test_an_iterable_resumes_at_its_cut(num_workers, cut):
    def torch_loader():
        return stateful.StatefulDataLoader(ShardedByTorch(60), batch_size=6, num_workers=0,
                                           collate_fn=lambda b: [e["id"] for e in b])

    def echo_loader():
        return echo(ShardedByTorch(60), 6, num_workers=num_workers, collate_fn=lambda b: [e["id"] for e in b])

    for make in (torch_loader, echo_loader):
        loader = make()
        epoch = iter(loader)
        seen = [i for b in take(epoch, cut) for i in b]
        state = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        rest = [i for b in resumed for i in b]
        assert sorted(seen + rest) == list(range(60))


def test_a_random_sampler_resumes_its_own_permutation():
    def make():
        return echo(list(range(100)), 10, sampler=RandomSampler(range(100)))

    loader = make()
    epoch = iter(loader)
    seen = [i for b in take(epoch, 4) for i in b]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    rest = [i for b in resumed for i in b.tolist()]
    assert sorted(seen + rest) == list(range(100)), "the saved permutation, not a new one"


def test_seeded_order_does_not_depend_on_the_workers():
    def order(num_workers):
        return [b.tolist() for b in echo(list(range(500)), 16, seed=3, num_workers=num_workers, transform=slow_id)]

    assert order(2) == order(2) == order(0) == order(4)


def slow_id(i):
    # Reads whose time varies, so that two threads finish out of order.
    for _ in range((i * 7919) % 300):
        pass
    return i
