"""torch DataLoader's keywords and habits on EchoLoader: the epoch rule
(set_epoch), num_workers=0, collate_fn, sampler, worker_init_fn, timeout,
generator, multiprocessing_context, prefetch_factor, and the attributes tools read."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter

import numpy as np
import pytest
from support import FIRST, InjectedFault, MarkedRecords, Records, Stall, Stream, checked_ids, mark_worker, one

import dataecho


def ids(batches) -> Counter:
    return Counter(i for b in batches for i in checked_ids(b).tolist())


# ---- the epoch rule ----


def test_set_epoch_keeps_ranks_on_one_permutation_despite_an_extra_iter(seed):
    # Two ranks of a data-parallel job; rank 0 peeks at a batch before epoch 1.
    ranks = [dataecho.EchoLoader(Records(32), batch_size=4, echo_factor=1, shuffle_buffer=4, rank=r, world_size=2,
                                 seed=seed) for r in range(2)]
    for epoch in range(3):
        if epoch == 1:
            next(iter(ranks[0]))  # logging the shapes of one batch
        seen: Counter = Counter()
        for loader in ranks:
            loader.set_epoch(epoch)
            seen += ids(loader)
        assert seen == Counter(range(32)), f"epoch {epoch}: ranks overlap or miss examples"


def test_without_set_epoch_each_iter_is_the_next_epoch_and_set_epoch_fixes_it(seed):
    loader = dataecho.EchoLoader(Records(64), batch_size=8, echo_factor=1, num_workers=1, shuffle_buffer=8, seed=seed)
    orders = [list(loader.sampler) for _ in range(1)]
    first = [checked_ids(b).tolist() for b in loader]
    second = [checked_ids(b).tolist() for b in loader]
    assert first != second and loader.next_epoch == 2 and loader.stats()["epoch"] == 1
    loader.set_epoch(0)
    assert list(loader.sampler) == orders[0], "the sampler view shows the order of the epoch set"
    assert [checked_ids(b).tolist() for b in loader] == first
    assert [checked_ids(b).tolist() for b in loader] == first, "an iter() after set_epoch does not move it"
    assert loader.next_epoch == 0
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)
    with pytest.raises(TypeError, match="epoch"):
        loader.set_epoch(1.0)


def test_an_epoch_left_before_its_first_batch_does_not_count(seed):
    # Lightning calls iter() once to check that a loader iterates, then again for
    # its first epoch, and only then set_epoch(0).
    def make():
        return dataecho.EchoLoader(Records(64), batch_size=8, echo_factor=1, deterministic=True, seed=seed)

    reference = make()
    epochs = [[checked_ids(b).tolist() for b in reference] for _ in range(2)]
    loader = make()
    iter(loader)  # dropped at once
    kept = iter(loader)
    iter(loader)  # supersedes `kept` before its first batch, and is dropped too
    assert loader.next_epoch == 0
    assert [checked_ids(b).tolist() for b in loader] == epochs[0]
    assert [checked_ids(b).tolist() for b in loader] == epochs[1]
    with pytest.raises(RuntimeError, match="ended by a later iter"):
        next(kept)
    # A loader resumed from a checkpoint keeps it through such a check too.
    first = make()
    epoch = iter(first)
    head = [checked_ids(next(epoch)).tolist() for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    iter(resumed)
    assert head + [checked_ids(b).tolist() for b in resumed] == epochs[0]


def test_set_epoch_reaches_a_sampler_and_the_sampler_view_reaches_the_loader(seed):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    source = Records(40)
    sampler = DistributedSampler(source, num_replicas=2, rank=1, shuffle=True, seed=seed % 1000)
    loader = dataecho.EchoLoader(source, batch_size=5, echo_factor=1, shuffle_buffer=5, sampler=sampler, seed=seed)
    for epoch in (0, 3):
        loader.set_epoch(epoch)
        assert sampler.epoch == epoch
        expected = Counter(list(sampler))
        assert ids(loader) == expected and len(expected) == 20
    assert loader.sampler is sampler and len(loader) == 4
    own = dataecho.EchoLoader(source, batch_size=5, seed=seed)
    own.sampler.set_epoch(7)  # what Lightning calls on a loader's sampler
    assert own.next_epoch == 7 and len(own.sampler) == 40 and sorted(own.sampler) == list(range(40))
    del torch


# ---- num_workers=0 ----


class ThreadRecords(Records):
    """Records that note the thread reading each one."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.threads: set[int] = set()

    def __getitem__(self, i: int):
        self.threads.add(threading.get_ident())
        return super().__getitem__(i)


@pytest.mark.parametrize("echo", [1, 2, "auto"])
def test_num_workers_0_reads_in_the_calling_thread_only(echo, seed):
    source = ThreadRecords(500)
    loader = dataecho.EchoLoader(source, batch_size=16, echo_factor=echo, num_workers=0, shuffle_buffer=64, seed=seed)
    delivered = ids(loader)
    assert source.threads == {threading.get_ident()}
    assert set(delivered) == set(range(500))
    if echo != "auto":
        assert set(delivered.values()) == {echo}
    stream = dataecho.EchoLoader(iter(range(100)), batch_size=8, echo_factor=1, num_workers=0, seed=seed)
    assert sorted(i for b in stream for i in b.tolist()) == list(range(100))


def test_num_workers_0_raises_the_sources_errors_in_the_loop(seed):
    loader = dataecho.EchoLoader(Records(300, fail_at=150), batch_size=8, num_workers=0, shuffle_buffer=32, seed=seed)
    with pytest.raises(InjectedFault, match="record 150"):
        ids(loader)
    stops = dataecho.EchoLoader(Records(300, fail_at=150, fail_with="stop"), batch_size=8, num_workers=0, seed=seed)
    with pytest.raises(RuntimeError, match="raised StopIteration"):
        ids(stops)


@pytest.mark.parametrize("workers", [{"num_workers": 0}, {"num_workers": 2},
                                     {"num_workers": 2, "worker_type": "process"}])
def test_an_error_from_the_dataset_is_raised_once_then_the_epoch_is_over(workers, seed):
    # A loop that catches the error and asks again ends: the error stopped the epoch's stages, with every
    # kind of reader alike (torch's DataLoader goes on with the next batches; docs/from-dataloader.md).
    loader = dataecho.EchoLoader(Records(300, fail_at=150), batch_size=8, shuffle_buffer=32, seed=seed, **workers)
    epoch, errors, batches = iter(loader), 0, 0
    for _ in range(1000):
        try:
            next(epoch)
            batches += 1
        except InjectedFault:
            errors += 1
        except StopIteration:
            break
    else:
        pytest.fail("next() never ended the epoch after the error")
    assert errors == 1 and batches < 300 * 2 // 8


# ---- collate_fn, sampler, worker_init_fn ----


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_collate_fn_gets_each_batchs_examples_as_views(output, seed):
    if output == "torch":
        pytest.importorskip("torch")
    calls = []

    def collate(examples):
        calls.append(len(examples))
        assert all(set(e) == {"id", "payload"} for e in examples)
        assert all(not np.asarray(e["payload"]).flags.owndata for e in examples if output == "numpy")
        return [int(e["id"]) for e in examples], len(examples)

    loader = dataecho.EchoLoader(Records(100), batch_size=16, echo_factor=2, collate_fn=collate, output=output,
                                 seed=seed)
    batches = list(loader)
    assert Counter(i for b, _ in batches for i in b) == Counter({i: 2 for i in range(100)})
    assert calls == [n for _, n in batches] and sum(calls) == 200


def test_collate_fn_gets_a_0_d_tensor_as_the_dataset_returned_it(seed):
    torch = pytest.importorskip("torch")

    class Scalars(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return {"loss_weight": torch.tensor(float(i)), "x": torch.ones(2)}

    given = []
    loader = dataecho.EchoLoader(Scalars(), batch_size=4, echo_factor=1, num_workers=0, seed=seed,
                                 collate_fn=lambda examples: given.extend(examples) or len(examples))
    assert sum(loader) == 32
    assert {tuple(e["loss_weight"].shape) for e in given} == {()}, "shape (), as torch's collate_fn is given"
    assert sorted(float(e["loss_weight"]) for e in given) == [float(i) for i in range(32)]
    one = next(iter(dataecho.EchoLoader(Scalars(), batch_size=None, num_workers=0, output="torch", seed=seed)))
    assert one["loss_weight"].shape == () and one["x"].shape == (2,), "batch_size=None: the example as it was"


def test_a_sampler_of_lists_with_batch_size_none_is_refused_naming_batch_sampler():
    torch = pytest.importorskip("torch")
    lists = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(64)), 8, False)
    with pytest.raises(TypeError, match=r"sampler: yields lists of indices .* pass it as batch_sampler= instead"):
        next(iter(dataecho.EchoLoader(Records(64), sampler=lists, batch_size=None)))
    loader = dataecho.EchoLoader(Records(64), batch_sampler=lists, echo_factor=1)  # what it says to do
    assert [checked_ids(b).tolist() for b in loader] == [list(range(i, i + 8)) for i in range(0, 64, 8)]
    with pytest.raises(ValueError, match="worker processes do not read a batch_sampler's batches: those are read"):
        dataecho.EchoLoader(Records(64), batch_sampler=lists, num_workers=2, worker_type="process")


def test_a_sampler_decides_the_order_of_reads(seed):
    order = [5, 3, 3, 9, 0, 0, 0, 7]  # a curriculum with repeats
    loader = dataecho.EchoLoader(Records(10), batch_size=4, echo_factor=1, shuffle_buffer=4, sampler=order,
                                 seed=seed)
    assert ids(loader) == Counter(order) and len(loader) == 2
    bad = dataecho.EchoLoader(Records(10), batch_size=4, sampler=[1, 10], seed=seed)
    with pytest.raises(IndexError, match="sampler: yielded index 10"):
        iter(bad)


def test_a_weighted_random_sampler_is_followed(seed):
    torch = pytest.importorskip("torch")
    from torch.utils.data import WeightedRandomSampler

    weights = [0.0] * 10 + [1.0] * 10  # the first half never drawn
    sampler = WeightedRandomSampler(weights, num_samples=200, generator=torch.Generator().manual_seed(seed % 1000))
    loader = dataecho.EchoLoader(Records(20), batch_size=10, echo_factor=1, sampler=sampler, seed=seed)
    delivered = ids(loader)
    assert sum(delivered.values()) == 200 and set(delivered) <= set(range(10, 20))


def test_worker_init_fn_runs_once_in_each_thread_worker(seed):
    calls = []
    loader = dataecho.EchoLoader(Records(200), batch_size=8, num_workers=3,
                                 worker_init_fn=lambda i: calls.append((i, threading.current_thread())), seed=seed)
    ids(loader)
    assert sorted(i for i, _ in calls) == [0, 1, 2]
    # The thread objects themselves (kept alive here): idents are reused once a thread ends.
    assert len({t for _, t in calls}) == 3 and threading.current_thread() not in {t for _, t in calls}


def test_worker_init_fn_runs_in_each_worker_process_before_it_reads(seed):
    loader = dataecho.EchoLoader(MarkedRecords(400, delay_s=0.0005), batch_size=8, num_workers=2,
                                 worker_type="process", worker_init_fn=mark_worker, seed=seed)
    marks = {}
    for batch in loader:
        marks.update(zip(batch["id"].tolist(), batch["mark"].tolist()))
    assert len(marks) == 400
    # Every example is read in a worker, after its init: the first ones too, which tell the structure.
    assert set(marks.values()) == {0, 1}


# ---- timeout, generator, multiprocessing_context, prefetch_factor ----


def test_timeout_raises_when_no_batch_comes_in_time(seed):
    loader = dataecho.EchoLoader(Records(100), batch_size=8, num_workers=1, worker_type="process", transform=Stall(60),
                                 timeout=0.5, seed=seed)
    with pytest.raises(RuntimeError, match=r"timed out after 0.5 seconds"):
        next(iter(loader))
    loader.close()


def test_generator_seeds_the_order_when_no_seed_is_given():
    torch = pytest.importorskip("torch")

    def order(**kwargs):
        loader = dataecho.EchoLoader(Records(64), batch_size=8, echo_factor=1, num_workers=1, shuffle_buffer=8, **kwargs)
        return [checked_ids(b).tolist() for b in loader]

    assert order(generator=torch.Generator().manual_seed(3)) == order(generator=torch.Generator().manual_seed(3))
    assert order(generator=torch.Generator().manual_seed(3)) != order(generator=torch.Generator().manual_seed(4))
    assert order(generator=torch.Generator().manual_seed(3), seed=11) == order(seed=11), "a seed takes precedence"


def test_torch_manual_seed_seeds_the_order_when_neither_seed_nor_generator_is_given():
    # As RandomSampler draws its seed from torch's default generator.
    torch = pytest.importorskip("torch")

    def order(manual_seed: int, **kwargs) -> list:
        torch.manual_seed(manual_seed)
        loader = dataecho.EchoLoader(Records(64), batch_size=8, echo_factor=1, num_workers=1, shuffle_buffer=8, **kwargs)
        return [checked_ids(b).tolist() for b in loader]

    assert order(5) == order(5), "the same torch.manual_seed, the same order"
    assert order(5) != order(6)
    assert order(5, seed=11) == order(6, seed=11), "a seed given takes precedence"
    torch.manual_seed(5)
    drawn = dataecho.EchoLoader(Records(64), batch_size=8).config.seed
    torch.manual_seed(5)
    assert torch.empty((), dtype=torch.int64).random_().item() & ((1 << 63) - 1) == drawn, "one draw, as RandomSampler"


def test_multiprocessing_context_means_worker_processes_and_prefetch_factor_is_per_worker():
    import multiprocessing

    with pytest.warns(UserWarning, match="num_workers=3: this EchoLoader will create 3 worker processes") \
            if (os.cpu_count() or 1) < 3 else contextlib.nullcontext():  # as DataLoader warns
        loader = dataecho.EchoLoader(Records(10), num_workers=3, multiprocessing_context="spawn", prefetch_factor=4)
    assert (loader.worker_type, loader.multiprocessing_context, loader.prefetch_factor) == ("process", "spawn", 4)
    assert loader.config.prefetch == 12, "batches assembled ahead: prefetch_factor per worker"
    context = dataecho.EchoLoader(Records(10), num_workers=1,
                                  multiprocessing_context=multiprocessing.get_context("spawn"))
    assert (context.worker_type, context.multiprocessing_context) == ("process", "spawn")


def test_the_attributes_tools_read():
    source = Records(100)
    loader = dataecho.EchoLoader(dataset=source, batch_size=10, num_workers=4, echo_factor=1)
    assert loader.dataset is source and loader.batch_size == 10 and loader.num_workers == 4
    assert loader.batch_sampler is None and len(loader) == 10 and len(loader.sampler) == 100


def test_num_workers_0_with_deterministic_matches_workers_and_resumes(seed):
    # Deterministic intake admits a put only within a window of what the assembler
    # has taken: reading inline must wait for it, never take it for a full buffer.
    def make(**kwargs):
        return dataecho.EchoLoader(Records(300), batch_size=8, echo_factor=2, shuffle_buffer=32, deterministic=True,
                                   seed=seed, **kwargs)

    for _ in range(5):
        inline = [checked_ids(b).tolist() for b in make(num_workers=0)]
        assert inline == [checked_ids(b).tolist() for b in make(num_workers=3)]
    first = make(num_workers=0)
    epoch = iter(first)
    head = [checked_ids(next(epoch)).tolist() for _ in range(10)]
    resumed = make(num_workers=0)
    resumed.load_state_dict(first.state_dict())
    assert head + [checked_ids(b).tolist() for b in resumed] == inline


# ---- shuffle=False ----


def _in_order_ids(loader) -> list[list[int]]:
    return [checked_ids(b).tolist() for b in loader]


def _batched(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


IN_ORDER_CASES = {
    "threads": {"num_workers": 4},
    "inline": {"num_workers": 0},
    "processes": {"worker_type": "process", "num_workers": 2},
    "augment": {"augment": lambda example: example, "num_workers": 3},
    "batch echo at 1": {"echo_at": "batch", "num_workers": 3},
    "torch output": {"output": "torch", "num_workers": 2},
    "drop_last": {"drop_last": True, "num_workers": 2},
    "small buffer": {"shuffle_buffer": 7, "num_workers": 2},
}


@pytest.mark.parametrize("case", list(IN_ORDER_CASES))
def test_shuffle_false_at_echo_1_yields_the_datasets_order(case, seed):
    # An evaluation loop: batches in exactly the dataset's order, as DataLoader(shuffle=False),
    # whatever the workers' timing (reads jitter) and over two epochs.
    kwargs = IN_ORDER_CASES[case]
    if kwargs.get("output") == "torch":
        pytest.importorskip("torch")
    loader = dataecho.EchoLoader(Records(1003, jitter=0.02), batch_size=7, echo_factor=1, shuffle=False,
                                 seed=seed, **kwargs)
    expected = _batched(list(range(1003)), 7)
    if kwargs.get("drop_last"):
        expected = expected[:-1]
    for _ in range(2):
        assert _in_order_ids(loader) == expected


def test_shuffle_false_follows_a_samplers_order_and_each_ranks_shard(seed):
    order = [int(i) for i in np.random.default_rng(seed % 2**32).permutation(300)]
    loader = dataecho.EchoLoader(Records(300, jitter=0.02), batch_size=16, echo_factor=1, sampler=order, num_workers=3,
                                 seed=seed)
    assert _in_order_ids(loader) == _batched(order, 16)
    ranks = [dataecho.EchoLoader(Records(300), batch_size=16, echo_factor=1, shuffle=False, rank=r, world_size=2,
                                 num_workers=2, seed=seed) for r in range(2)]
    # As DistributedSampler(shuffle=False): rank r reads r, r + 2, r + 4, ...
    assert [_in_order_ids(loader) for loader in ranks] == [_batched(list(range(r, 300, 2)), 16) for r in range(2)]


def test_shuffle_false_over_an_iterable_read_by_threads_keeps_its_order(seed):
    stream = Stream(500)
    loader = dataecho.EchoLoader(stream, batch_size=32, echo_factor=1, shuffle=False, num_workers=3, seed=seed)
    assert _in_order_ids(loader) == _batched(list(range(500)), 32)


def test_shuffle_false_with_echo_mixes_repeats_within_the_buffer(seed):
    # Echoed repeats must be spread apart, so the buffer mixes what it holds:
    # the order follows the dataset's only roughly (documented).
    loader = dataecho.EchoLoader(Records(4000), batch_size=50, echo_factor=2, shuffle=False, shuffle_buffer=256,
                                 seed=seed)
    delivered = [i for batch in _in_order_ids(loader) for i in batch]
    assert Counter(delivered) == Counter({i: 2 for i in range(4000)})
    assert delivered[:100] != sorted(delivered[:100])  # mixed ...
    quarters = [np.mean(delivered[q * 2000:(q + 1) * 2000]) for q in range(4)]
    assert quarters == sorted(quarters) and quarters[-1] - quarters[0] > 2000  # ... yet in the dataset's drift


def test_the_positional_parameters_are_dataloaders_in_its_order():
    import inspect

    torch = pytest.importorskip("torch")
    ours = list(inspect.signature(dataecho.EchoLoader).parameters.values())
    theirs = list(inspect.signature(torch.utils.data.DataLoader).parameters.values())
    positional = [p.name for p in ours if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == [p.name for p in theirs if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][:13]
    assert positional[-1] == "generator" and ours[len(positional)].kind is inspect.Parameter.KEYWORD_ONLY
    # DataLoader's keyword-only parameters are keyword-only here too, under the same names.
    keyword_only = {p.name for p in ours if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"prefetch_factor", "persistent_workers", "pin_memory_device"} <= keyword_only
    assert inspect.signature(dataecho.EchoLoader).parameters["batch_size"].default == 1


def test_positional_arguments_mean_what_they_mean_to_dataloader():
    loader = dataecho.EchoLoader(Records(200), 20, True, echo_factor=1, seed=3)
    assert (loader.batch_size, loader.shuffle) == (20, True)
    order = [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(order) == list(range(200)) and order != list(range(200)), "shuffled, every example once"
    in_order = dataecho.EchoLoader(Records(200), 20, False, echo_factor=1)
    assert [i for batch in in_order for i in batch["id"].tolist()] == list(range(200))
    with pytest.raises(TypeError):
        dataecho.EchoLoader(Records(10), 2, True, None, None, 0, None, False, False, 0, None, None, None, 2.0)


# ---- no user code in iter(): the workers read the first examples ----


class Barrier:
    """A dataset whose first read in each worker waits until every worker has
    started reading (a collective set-up): it deadlocks a loader whose first
    reads are made by one thread alone."""

    def __init__(self, workers: int) -> None:
        self.barrier = threading.Barrier(workers, timeout=10)
        self.started = threading.local()

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        if not getattr(self.started, "done", False):
            self.barrier.wait()
            self.started.done = True
        return i


def test_a_dataset_that_waits_for_all_its_workers_is_read_by_all_of_them():
    loader = dataecho.EchoLoader(Barrier(2), batch_size=8, echo_factor=1, num_workers=2, timeout=20)
    assert sorted(i for b in loader for i in b.tolist()) == list(range(64))


class Iterated:
    """An iterable that records which thread runs its __iter__."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def __iter__(self):
        self.threads.append(threading.current_thread())
        return iter(range(50))


@pytest.mark.parametrize("num_workers", [None, 2])
def test_iter_runs_no_user_code_in_the_calling_thread(num_workers):
    iterable = Iterated()
    loader = dataecho.EchoLoader(iterable, batch_size=10, echo_factor=1, num_workers=num_workers)
    epoch = iter(loader)
    assert sorted(i for b in epoch for i in b.tolist()) == list(range(50))
    assert len(iterable.threads) == 1 and iterable.threads[0] is not threading.main_thread()
    inline = Iterated()
    assert sorted(i for b in dataecho.EchoLoader(inline, 10, num_workers=0, echo_factor=1) for i in b.tolist()) \
        == list(range(50))
    assert inline.threads == [threading.main_thread()], "num_workers=0 reads in the loop's thread, as DataLoader"


class Resumable:
    """An iterable that restores its own position, as the datasets torchdata's
    StatefulDataLoader resumes: ``state_dict()`` says where its iteration
    stands, ``load_state_dict`` makes the next ``iter()`` go on from there."""

    def __init__(self, n: int) -> None:
        self.n, self.next, self._loaded, self.loads = n, 0, None, []

    def __iter__(self):
        self.next, self._loaded = (self._loaded or 0), None  # a new epoch starts over, a loaded state goes on
        return self._examples()

    def _examples(self):
        while self.next < self.n:
            self.next += 1
            yield one(self.next - 1)

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.loads.append(state["next"])
        self._loaded = state["next"]


@pytest.mark.parametrize("cut", [3, 17])
def test_an_iterable_with_state_dict_resumes_from_its_own_state(cut, seed):
    def loader(source: Resumable) -> dataecho.EchoLoader:
        return dataecho.EchoLoader(source, batch_size=8, echo_factor=2, shuffle_buffer=32, num_workers=1, seed=seed)

    reference = [checked_ids(b).tolist() for b in loader(Resumable(300))]
    first = loader(Resumable(300))
    epoch = iter(first)
    taken = [checked_ids(next(epoch)).tolist() for _ in range(cut)]
    state = first.state_dict()
    first.close()
    restored = Resumable(300)
    restored.load_state_dict({"next": 300})  # a framework restored the dataset already, as StatefulDataLoader does
    resumed = loader(restored)
    resumed.load_state_dict(state)
    rest = [checked_ids(b).tolist() for b in resumed]
    assert taken + rest == reference, "the same batches as the uninterrupted epoch"
    assert len(restored.loads) == 2, "the resume loaded the dataset's state (after the framework's own)"
    assert restored.loads[-1] <= min(i for batch in rest for i in batch), "from at or before what it names"
