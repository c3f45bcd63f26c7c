"""Datasets that write their examples straight into the loader's memory:
``read_into(index, out)`` is called instead of ``__getitem__`` for large
examples of NumPy arrays read by threads, each example then copied once (from
its slot into its batch), with every guarantee of ``__getitem__``'s path kept:
values, echo counts, errors, resume; and a ``read_into`` that keeps ``out`` is
refused, since the loader reuses that memory."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import dataecho
from dataecho.examples.columns import FRESH_MIN_BYTES

ROW = FRESH_MIN_BYTES + 1000  # bytes per example: written into the loader's memory
N = 300


def row_of(i: int, nbytes: int = ROW) -> np.ndarray:
    """Bytes derived from the id and the byte position, the id in the first eight."""
    row = ((np.arange(nbytes) * 7 + i * 131 + 3) % 211).astype(np.uint8)
    row[:8] = np.array([i], dtype="<i8").view(np.uint8)
    return row


class Writes:
    """A dataset of dict examples (an image row and a label) that counts how
    each of its two ways was used; ``keep`` keeps ``out``, ``fail_at`` raises."""

    def __init__(self, n: int = N, nbytes: int = ROW, keep: bool = False, fail_at: int | None = None) -> None:
        self.n, self.nbytes, self.keep, self.fail_at = n, nbytes, keep, fail_at
        self.calls = Counter()
        self.kept: list = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.calls["getitem"] += 1
        return {"image": row_of(i, self.nbytes), "label": i % 10}

    def read_into(self, i: int, out: dict) -> None:
        self.calls["read_into"] += 1
        if i == self.fail_at:
            raise KeyError(f"record {i} is missing")
        out["image"][:] = row_of(i, self.nbytes)
        out["label"][...] = i % 10
        if self.keep:
            self.kept.append(out["image"][:8])


def delivered(loader: dataecho.EchoLoader) -> Counter:
    seen = Counter()
    for batch in loader:
        for image, label in zip(np.asarray(batch["image"]), np.asarray(batch["label"]).tolist()):
            i = int(image[:8].copy().view("<i8")[0])
            assert np.array_equal(image, row_of(i, len(image))) and label == i % 10, "every example whole"
            seen[i] += 1
    return seen


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("echo", [1, 2])
def test_large_examples_are_written_into_the_loader_and_delivered_whole(workers, echo):
    dataset = Writes()
    loader = dataecho.EchoLoader(dataset, batch_size=16, echo_factor=echo, shuffle_buffer=64, num_workers=workers,
                                 seed=3)
    assert delivered(loader) == Counter({i: echo for i in range(N)})
    # All but each reading thread's first batch (or the first examples), read before the structure was known.
    assert dataset.calls["read_into"] >= N - 16 * max(1, workers), "the rest written in place"
    assert dataset.calls["getitem"] + dataset.calls["read_into"] == N, "each example read once"


@pytest.mark.parametrize("case", ["small", "processes", "transform"])
def test_read_into_is_not_used_where_it_would_not_save_a_copy(case):
    dataset = Writes(n=120, nbytes=1024 if case == "small" else ROW)
    options = {"small": {}, "processes": {"worker_type": "process", "num_workers": 2},
               "transform": {"transform": lambda e: e}}[case]
    echo = 2 if case == "small" else 1  # at echo 1 read_into writes batches in place, whatever their size
    loader = dataecho.EchoLoader(dataset, batch_size=8, echo_factor=echo, seed=3, **options)
    assert delivered(loader) == Counter({i: echo for i in range(120)})
    if case != "processes":  # processes read their own copies of the dataset: its counters stay there
        assert dataset.calls["read_into"] == 0 and dataset.calls["getitem"] == 120


@pytest.mark.parametrize("echo", [1, 2])
def test_a_read_into_that_keeps_out_is_refused_and_the_epoch_ends(echo):
    loader = dataecho.EchoLoader(Writes(keep=True), batch_size=16, echo_factor=echo, num_workers=1, seed=3)
    with pytest.raises(ValueError, match="read_into: kept its out array"):
        for _ in loader:
            pass


def test_an_error_in_read_into_is_raised_once_then_the_epoch_is_over():
    loader = dataecho.EchoLoader(Writes(fail_at=150), batch_size=16, echo_factor=1, num_workers=1, seed=3)
    epoch = iter(loader)
    with pytest.raises(KeyError, match="record 150 is missing"):
        for _ in epoch:
            pass
    with pytest.raises(StopIteration):
        next(epoch)


@pytest.mark.parametrize("echo", [1, 2])
def test_a_state_taken_while_examples_are_written_in_place_resumes_exactly(echo):
    def make() -> dataecho.EchoLoader:
        return dataecho.EchoLoader(Writes(), batch_size=16, echo_factor=echo, shuffle_buffer=64, num_workers=2,
                                   seed=5)

    def ids(batch) -> list[int]:
        return [int(image[:8].copy().view("<i8")[0]) for image in np.asarray(batch["image"])]

    reference = [ids(b) for b in make()]
    first = make()
    epoch = iter(first)
    taken = [ids(next(epoch)) for _ in range(7)]
    state = first.state_dict()
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert taken + [ids(b) for b in resumed] == reference


# ---- echo 1: batches written in place, one copy ----


def image_ids(batch) -> list[int]:
    return [int(image[:8].copy().view("<i8")[0]) for image in np.asarray(batch["image"])]


@pytest.mark.parametrize("drop_last", [False, True])
def test_at_echo_1_batches_are_the_orders_batches_written_in_place(drop_last):
    dataset = Writes(n=100)
    loader = dataecho.EchoLoader(dataset, batch_size=16, echo_factor=1, shuffle=False, drop_last=drop_last,
                                 num_workers=2, seed=3)
    batches = [image_ids(b) for b in loader]
    kept = 96 if drop_last else 100
    assert [i for b in batches for i in b] == list(range(kept)), "the reading order, cut into batches"
    assert [len(b) for b in batches] == [16] * 6 + ([] if drop_last else [4]) and len(loader) == len(batches)
    assert dataset.calls["getitem"] <= 2 * 16, "each reading thread's first batch tells the structure"


def test_at_echo_1_small_examples_are_written_in_place_too():
    dataset = Writes(n=64, nbytes=256)
    loader = dataecho.EchoLoader(dataset, batch_size=16, echo_factor=1, shuffle=False, num_workers=1, seed=3)
    assert [i for b in loader for i in image_ids(b)] == list(range(64))
    assert dataset.calls["read_into"] == 48, "all but the first batch, which tells the structure"


def test_batches_written_in_place_are_never_overwritten_while_held():
    torch = pytest.importorskip("torch")
    loader = dataecho.EchoLoader(Writes(n=160), batch_size=16, echo_factor=1, num_workers=2, seed=3)
    held, tensors, places = [], [], []
    for epoch in range(3):
        for number, batch in enumerate(loader):
            place = np.asarray(batch["image"]).__array_interface__["data"][0]
            assert place not in {np.asarray(b["image"]).__array_interface__["data"][0] for b, _ in held}
            places.append(place)
            if number in (0, 5):
                held.append((batch, np.asarray(batch["image"]).copy()))  # the arrays, and what they held
            if number == 3:
                tensors.append((torch.from_numpy(np.asarray(batch["image"])), np.asarray(batch["image"]).copy()))
            del batch
    assert len(set(places)) < len(places), "batch memory nothing holds is used again"
    for batch, then in held:
        assert np.array_equal(np.asarray(batch["image"]), then), "a batch still held was written over"
    for tensor, then in tensors:
        assert np.array_equal(tensor.numpy(), then), "memory a live tensor views was written over"
