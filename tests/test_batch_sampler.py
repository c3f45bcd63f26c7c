"""``batch_sampler``: the sampler's batches exactly, in its order, as torch's
DataLoader yields them (at ``echo_factor=1``), echoed whole above it; its
refusals; and exact resumes of the saved epoch's batches."""

from __future__ import annotations

import random
import threading
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler  # noqa: E402
from support import InjectedFault, Records, checked_ids, tokens_of  # noqa: E402

import dataecho  # noqa: E402
from dataecho.config.echo import exact_deliveries  # noqa: E402


class ByLength:
    """Length bucketing with a token budget: indices sorted by their tokens'
    length, cut into batches whose padded size (longest x count) stays within
    ``budget``: batches of varying size, the same every epoch."""

    def __init__(self, n: int, budget: int = 1500) -> None:
        order = sorted(range(n), key=lambda i: (len(tokens_of(i)), i))
        self.batches: list[list[int]] = [[]]
        for i in order:
            longest = max(len(tokens_of(i)), 1)
            if self.batches[-1] and longest * (len(self.batches[-1]) + 1) > budget:
                self.batches.append([])
            self.batches[-1].append(i)

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


class Reshuffled:
    """A new random batching each time it is iterated (batches of 1 to ``most``),
    from a seeded generator: a fresh one with the same seed repeats the sequence.
    No ``__len__``; ``set_epoch`` is recorded."""

    def __init__(self, n: int, seed: int, most: int = 6) -> None:
        self.n, self.most, self.rng, self.epochs = n, most, random.Random(seed), []

    def __iter__(self):
        indices = list(range(self.n))
        self.rng.shuffle(indices)
        while indices:
            size = self.rng.randint(1, self.most)
            yield indices[:size]
            indices = indices[size:]

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def sevens(n: int) -> BatchSampler:
    return BatchSampler(SequentialSampler(range(n)), 7, drop_last=False)


def loader(dataset, batch_sampler, **kwargs) -> dataecho.EchoLoader:
    return dataecho.EchoLoader(dataset, batch_sampler=batch_sampler, **kwargs)


def batch_ids(batches) -> list[tuple[int, ...]]:
    return [tuple(checked_ids(b).tolist()) for b in batches]


# ---- the batches are DataLoader's ----


@pytest.mark.parametrize("num_workers", [0, 2, 4])
@pytest.mark.parametrize("sampler", ["sevens", "by_length"])
def test_at_echo_1_the_batches_are_dataloaders(num_workers, sampler, seed):
    # Reads pause at random, so that workers finish their batches out of order.
    dataset = Records(120, jitter=0.5)
    batch_sampler = sevens(120) if sampler == "sevens" else ByLength(120)
    expected = list(DataLoader(dataset, batch_sampler=batch_sampler))
    for output in ("numpy", "torch"):
        got = list(loader(dataset, batch_sampler, num_workers=num_workers, echo_factor=1, output=output, seed=seed))
        assert len(got) == len(expected) == len(batch_sampler)
        for ours, theirs in zip(got, expected):
            for key in ("id", "payload"):
                leaf = ours[key] if output == "torch" else torch.from_numpy(ours[key])
                assert isinstance(ours[key], torch.Tensor) == (output == "torch")
                assert leaf.dtype == theirs[key].dtype and torch.equal(leaf, theirs[key]), key
    assert len({len(b) for b in batch_sampler}) > 1, "batches of varying size"


def pad(examples) -> tuple:
    """A collate_fn for ragged examples: ids, and tokens padded to the batch's longest."""
    ids = torch.tensor([int(e["id"]) for e in examples])
    tokens = [torch.tensor(np.array(e["tokens"])) for e in examples]
    return ids, torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True), [e["name"] for e in examples]


@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_collate_fn_gets_each_sampler_batch_as_the_dataset_returned_it(num_workers, seed):
    dataset = Records(150, jitter=0.5, form="ragged")
    batch_sampler = ByLength(150, budget=3000)
    expected = list(DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=pad))
    for output in ("numpy", "torch"):
        got = list(loader(dataset, batch_sampler, num_workers=num_workers, echo_factor=1, collate_fn=pad,
                          output=output, seed=seed))
        assert len(got) == len(expected)
        for (ids, tokens, names), (their_ids, their_tokens, their_names) in zip(got, expected):
            assert torch.equal(ids, their_ids) and torch.equal(tokens, their_tokens) and names == their_names


def test_batches_of_their_own_shape_are_stacked_as_dataloader_stacks_them(seed):
    # Aspect-ratio buckets: within a batch one shape, from batch to batch another.
    class Images:
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return {"id": i, "image": np.full((3, 4 + i % 4, 6 - i % 4), i, dtype=np.float32)}

    buckets = [[i for i in range(40) if i % 4 == k][j:j + 3] for k in range(4) for j in range(0, 10, 3)]
    random.Random(seed).shuffle(buckets)
    expected = list(DataLoader(Images(), batch_sampler=buckets))
    for num_workers in (0, 2):
        got = list(loader(Images(), buckets, num_workers=num_workers, echo_factor=1, output="torch", seed=seed))
        assert [b["image"].shape for b in got] == [b["image"].shape for b in expected]
        assert all(torch.equal(a["image"], b["image"]) and torch.equal(a["id"], b["id"])
                   for a, b in zip(got, expected))


def test_a_leaf_that_varies_within_a_later_batch_is_declared_ragged():
    class Growing:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"t": np.arange(3 if i < 3 else i)}

    batches = [[0, 1, 2], [3, 4, 5]]  # the first batch read shows one length
    with pytest.raises(ValueError, match=r"field 't' expected shape \(3,\), got \(4,\); .* declare it in `ragged`"):
        list(loader(Growing(), batches, num_workers=0, echo_factor=1))
    got = list(loader(Growing(), batches, num_workers=0, echo_factor=1, ragged=["t"]))
    assert [[len(row) for row in b["t"]] for b in got] == [[3, 3, 3], [3, 4, 5]]


# ---- echo: whole batches ----


def extra(number: int, factor: float) -> int:
    """Deliveries of a batch beyond floor(e), by its number (batch echo's exact counts)."""
    f = factor - int(factor)
    return int((number + 1) * f) - int(number * f)


@pytest.mark.parametrize("echo", [2, 1.5])
@pytest.mark.parametrize("num_workers", [0, 3])
def test_every_sampler_batch_is_delivered_whole_its_exact_count(echo, num_workers, seed):
    batch_sampler = ByLength(200)
    sampled = [tuple(b) for b in batch_sampler]
    echoed = loader(Records(200, jitter=0.3), batch_sampler, num_workers=num_workers, echo_factor=echo, seed=seed)
    delivered = batch_ids(echoed)
    assert len(delivered) == len(echoed) == exact_deliveries(len(sampled), echo)
    counts = Counter(delivered)
    assert set(counts) == set(sampled), "every batch whole, and nothing else"
    assert [counts[b] for b in sampled] == [int(echo) + extra(n, echo) for n, b in enumerate(sampled)]
    assert all(a != b for a, b in zip(delivered, delivered[1:])), "a repeat never follows its original"
    assert echoed.stats()["this_epoch"]["fresh"] == 200


@pytest.mark.parametrize("output,device", [("numpy", None), ("torch", None), ("torch", "cpu")])
def test_a_change_to_a_delivered_batch_does_not_reach_its_repeat(output, device, seed):
    dataset, batch_sampler = Records(60), ByLength(60, budget=900)
    seen = set()
    for batch in loader(dataset, batch_sampler, num_workers=2, echo_factor=2, output=output, device=device,
                        seed=seed):
        key = tuple(checked_ids(batch).tolist())
        if output == "torch":
            batch["payload"].fill_(0)  # a repeat still arrives intact (checked_ids above)
        elif key not in seen:
            with pytest.raises(ValueError, match="read-only"):
                batch["payload"][0] = 0
        seen.add(key)
    assert len(seen) == len(batch_sampler)


def test_repeats_of_bfloat16_leaves_are_their_own_tensors(seed):
    # A leaf of a dtype NumPy lacks comes out as a tensor even with NumPy output:
    # its repeats are copies, which the chain learns from the first batch read.
    class Halves:
        def __len__(self):
            return 30

        def __getitem__(self, i):
            return {"id": i, "h": torch.full((2,), float(i), dtype=torch.bfloat16)}

    seen = Counter()
    for batch in loader(Halves(), sevens(30), num_workers=2, echo_factor=2, seed=seed):
        ids = batch["id"].tolist()
        assert batch["h"].dtype == torch.bfloat16 and batch["h"][:, 0].tolist() == [float(i) for i in ids]
        batch["h"].fill_(-1)  # in place: a later delivery of the batch stays intact
        seen[tuple(ids)] += 1
    assert sorted(seen.values()) == [2] * 5


# ---- refusals, as DataLoader's and dataecho's own ----


@pytest.mark.parametrize("kwargs", [{"batch_size": 4}, {"batch_size": None}, {"shuffle": True},
                                    {"sampler": [0, 1]}, {"drop_last": True}])
def test_batch_sampler_excludes_what_dataloader_excludes(kwargs):
    message = "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
    with pytest.raises(ValueError, match=message):
        DataLoader(range(10), batch_sampler=[[0, 1]], **kwargs)
    with pytest.raises(ValueError, match=message):
        loader(range(10), [[0, 1]], **kwargs)


@pytest.mark.parametrize("kwargs,error,pattern", [
    ({"augment": lambda x: x}, ValueError, r"augment: .*batch_sampler.*`transform`.*`collate_fn`"),
    ({"worker_type": "process"}, ValueError, r"worker_type: worker processes do not read a batch_sampler"),
    ({"multiprocessing_context": "spawn", "num_workers": 1}, ValueError, r"worker_type: .*batch_sampler"),
    ({"echo_at": "example", "echo_factor": 2}, ValueError, r"echo_at: 'example' .* batch_sampler's batches"),
    ({"echo_at": "example", "echo_factor": "auto"}, ValueError, r"echo_at: 'example'"),
    ({"dataset": iter(range(10))}, ValueError, r"batch_sampler: needs a map-style dataset"),
    ({"batch_sampler": 5}, TypeError, r"batch_sampler: expected a torch BatchSampler"),
])
def test_what_would_break_the_samplers_batches_is_refused(kwargs, error, pattern):
    args = {"dataset": range(10), "batch_sampler": [[0, 1], [2]], **kwargs}
    with pytest.raises(error, match=pattern):
        dataecho.EchoLoader(**args)


def test_example_echoing_at_factor_1_and_shuffle_false_are_accepted():
    for kwargs in ({"echo_at": "example", "echo_factor": 1}, {"shuffle": False, "echo_factor": 1}):
        assert [b.tolist() for b in loader(list(range(10)), [[3, 1], [2], [0, 9, 8]], **kwargs)] == \
            [[3, 1], [2], [0, 9, 8]]
    assert loader(range(10), [[0]]).echo_at == "batch", "batch echoing by default with a batch_sampler"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_sampler_items_must_be_indices_of_the_dataset(num_workers):
    cases = [([[0, 1.5]], TypeError, r"batch_sampler: expected it to yield int indices, got 1.5"),
             ([[0, "7"]], TypeError, r"batch_sampler: expected it to yield int indices, got '7'"),
             ([[0, 1], [10]], IndexError, r"batch_sampler: yielded index 10, outside the dataset's 10"),
             ([[0], 3], TypeError, r"batch_sampler: expected it to yield lists of int indices, got 3"),
             ([[0], []], ValueError, r"batch_sampler: batch 1 is empty")]
    for batches, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            next(iter(loader(list(range(10)), batches, num_workers=num_workers, echo_factor=1)))
    tensors = [[torch.tensor(3), np.int64(4)], np.array([5])]
    assert [b.tolist() for b in loader(list(range(10)), tensors, num_workers=num_workers, echo_factor=1)] == \
        [[3, 4], [5]]


# ---- workers: errors, worker_init_fn, timeout ----


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_workers_error_is_raised_from_next(num_workers, seed):
    epoch = iter(loader(Records(80, fail_at=37), sevens(80), num_workers=num_workers, echo_factor=2, seed=seed))
    taken = []
    with pytest.raises(InjectedFault, match="record 37 is corrupt"):
        for batch in epoch:
            taken.append(checked_ids(batch))
    assert all(37 not in ids for ids in taken)


def test_worker_init_fn_runs_in_each_worker_thread_before_it_reads(seed):
    events, lock = [], threading.Lock()

    class Logged(Records):
        def __getitem__(self, i):
            with lock:
                events.append(("read", threading.current_thread()))
            return super().__getitem__(i)

    def init(worker_id):
        with lock:
            events.append((worker_id, threading.current_thread()))

    delivered = batch_ids(loader(Logged(300, jitter=0.5), sevens(300), num_workers=3, worker_init_fn=init,
                                 echo_factor=1, seed=seed))
    assert sorted(i for b in delivered for i in b) == list(range(300))
    first = {}
    for what, thread in events:
        first.setdefault(thread, what)
    assert "read" not in first.values(), "every reading thread's first event is its worker_init_fn"
    assert sorted(first.values()) == [0, 1, 2]
    assert threading.current_thread() not in first, "the loop's thread reads nothing, the first batch included"


def test_timeout_applies_to_a_batch_read_by_a_worker():
    slow = loader(Records(4, delay_s=1.0), [[0], [1]], num_workers=1, echo_factor=1, timeout=0.2)
    with pytest.raises(RuntimeError, match=r"timed out after 0.2 seconds"):
        next(iter(slow))
    slow.close()


# ---- len, attributes, set_epoch ----


def test_len_attributes_and_set_epoch_are_dataloaders():
    batch_sampler = sevens(50)
    torch_loader = DataLoader(range(50), batch_sampler=batch_sampler)
    for echo, batches in ((1, 8), (2, 16), (1.5, 12)):
        echoed = loader(range(50), batch_sampler, echo_factor=echo)
        assert len(echoed) == batches == sum(1 for _ in echoed)
    echoed = loader(range(50), batch_sampler, echo_factor=1)
    assert (echoed.batch_size, echoed.batch_sampler, echoed.drop_last) == \
        (torch_loader.batch_size, torch_loader.batch_sampler, torch_loader.drop_last) == (None, batch_sampler, False)
    reshuffled = Reshuffled(50, seed=1)
    unsized = loader(range(50), reshuffled, echo_factor=1)
    with pytest.raises(TypeError, match="batch_sampler has no len"):
        len(unsized)
    unsized.set_epoch(3)
    unsized.sampler.set_epoch(4)  # tools call it on the loader's sampler
    assert reshuffled.epochs == [3, 4] and unsized.next_epoch == 4


# ---- checkpoints ----


def whole_epoch(make, **kwargs) -> list[tuple[int, ...]]:
    """One uninterrupted epoch of a loader from ``make`` (a fresh sampler: the same batching)."""
    return batch_ids(make(**kwargs))


@pytest.mark.parametrize("echo", [1, 2])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("sampler", ["reshuffled", "torch_random"])
def test_a_resume_finishes_the_saved_epochs_batches(echo, num_workers, sampler, seed):
    dataset = Records(90, jitter=0.3)

    def make(batch_sampler=None):
        if batch_sampler is None:
            batch_sampler = Reshuffled(90, seed) if sampler == "reshuffled" else \
                BatchSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)), 4, False)
        return loader(dataset, batch_sampler, num_workers=num_workers, echo_factor=echo, seed=seed)

    expected = whole_epoch(make)
    assert whole_epoch(make) == expected and len(expected) > 20
    for cut in (0, 1, 4, len(expected) // 2, len(expected) - 1, len(expected)):
        interrupted = make()
        epoch = iter(interrupted)
        before = batch_ids(next(epoch) for _ in range(cut))
        state = interrupted.state_dict()
        # The same arguments: the same sampler, which now gives another batching.
        resumed = make(interrupted.batch_sampler)
        resumed.load_state_dict(state)
        after = batch_ids(resumed)
        if cut == len(expected):  # after the last batch: the next epoch's start, the sampler's new batching
            assert state["epoch"] == 1 and state["stages"] is None and before == expected
            assert sorted(after) != sorted(expected)
            assert sorted(i for b in after for i in b) == sorted(i for b in expected for i in b)
            continue
        assert before + after == expected, f"cut after {cut} batches"
        assert sorted(batch_ids(resumed)) != sorted(expected), "the next epoch is the sampler's new batching"


def test_a_state_taken_after_break_resumes_where_the_loop_left(seed):
    dataset = Records(90)
    make = lambda sampler=None: loader(dataset, sampler or Reshuffled(90, seed), num_workers=2,  # noqa: E731
                                       echo_factor=2, seed=seed)
    expected = whole_epoch(make)
    interrupted, before = make(), []
    for batch in interrupted:
        before.append(tuple(checked_ids(batch).tolist()))
        if len(before) == 7:
            break
    state = interrupted.state_dict()
    resumed = make(interrupted.batch_sampler)
    resumed.load_state_dict(state)
    assert before + batch_ids(resumed) == expected


@pytest.mark.parametrize("key,value,pattern", [
    ("next_batch", 10 ** 6, r"\['next_batch'\]: expected an int in \[0, "),
    ("bounds", np.array([0, 5, 3]), r"\['bounds'\]: expected where each batch starts"),
    ("bounds", np.array([1, 90]), r"\['bounds'\]"),
    ("queued", [{"rows": np.array([], dtype=np.uint64)}], r"\['queued'\]\[0\]\['rows'\]: an empty batch"),
    ("queued", [{"rows": np.array([10 ** 6])}], r"\['queued'\]\[0\]\['rows'\]: positions beyond"),
    ("queued", "all", r"\['queued'\]: expected a list of batches"),
])
def test_a_tampered_state_is_refused_naming_the_key(key, value, pattern, seed):
    make = lambda: loader(Records(90), Reshuffled(90, seed), num_workers=2, echo_factor=2, seed=seed)  # noqa: E731
    saved = make()
    epoch = iter(saved)
    next(epoch)
    state = saved.state_dict()
    state["stages"]["intake"][key] = value
    with pytest.raises(ValueError, match=r"state\['stages'\]\['intake'\]" + pattern):
        make().load_state_dict(state)
