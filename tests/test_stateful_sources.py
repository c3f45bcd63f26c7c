"""Samplers and map-style datasets that keep their own state, resumed as
torchdata's ``StatefulDataLoader`` resumes them: the epoch a state stood in
goes on exactly, and so do the epochs after it, which depend on where the
sampler's generator or the dataset's own settings stood."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader.sampler import BatchSampler, RandomSampler, StatefulDistributedSampler

import dataecho

N = 120


class Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def epochs(loader: dataecho.EchoLoader, count: int, first: list | None = None) -> list[list[list[int]]]:
    """``count`` epochs of batches as lists; ``first``: batches already taken of the first."""
    out = []
    for _ in range(count):
        out.append((first or []) + [batch.tolist() for batch in loader])
        first = None
    return out


def interrupted(make, cut: int, count: int = 3) -> tuple[list, dict]:
    """``count`` epochs of a job stopped after ``cut`` batches of its first and
    resumed by a new loader over new objects, its state passed through
    ``torch.save``/``torch.load`` as a checkpoint would."""
    first = make()
    epoch = iter(first)
    taken = [next(epoch).tolist() for _ in range(cut)]
    state = first.state_dict()
    first.close()
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    return epochs(resumed, count, taken), state


SAMPLERS = {
    # Its iterator keeps the generator's state: each epoch draws the next permutation.
    "RandomSampler": lambda ds: {"sampler": RandomSampler(ds, generator=generator(5))},
    # It keeps how many indices it gave: a resume that left it there would skip a whole epoch.
    "StatefulDistributedSampler": lambda ds: {"sampler": StatefulDistributedSampler(ds, 1, 0, shuffle=True, seed=3)},
    "BatchSampler": lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds, generator=generator(7)), 10, False)},
}


@pytest.mark.parametrize("kind", list(SAMPLERS))
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_sampler_resumes_its_epoch_and_the_epochs_after(kind, workers):
    def make() -> dataecho.EchoLoader:
        ds = Numbers()
        batching = {} if kind == "BatchSampler" else {"batch_size": 10}
        return dataecho.EchoLoader(ds, **batching, **SAMPLERS[kind](ds), echo_factor=1, num_workers=workers, seed=1)

    reference = epochs(make(), 3)
    assert reference[0] != reference[1] or kind == "StatefulDistributedSampler", "each epoch a new permutation"
    got, state = interrupted(make, 4)
    assert got == reference, "the rest of the epoch, then the same epochs as the uninterrupted job"
    assert "sampler" in state["stages"]["intake"], "the sampler's own state is saved beside its order"


def test_a_stateful_sampler_over_an_echoed_epoch_resumes_exactly():
    def make() -> dataecho.EchoLoader:
        ds = Numbers()
        return dataecho.EchoLoader(ds, batch_size=10, sampler=RandomSampler(ds, generator=generator(2)),
                                   echo_factor=2, shuffle_buffer=30, num_workers=2, seed=4)

    reference = epochs(make(), 2)
    got, _ = interrupted(make, 7, 2)
    assert got == reference


class Stepping:
    """A sampler without a length whose iterator says where it stands and goes
    on from there (an iterator over a seeded stream of indices); it counts the
    indices its iterators gave."""

    def __init__(self, seed: int) -> None:
        self.seed, self.given = seed, 0

    def __iter__(self):
        return SteppingIterator(self)


class SteppingIterator:
    def __init__(self, sampler: Stepping) -> None:
        self.sampler, self.at = sampler, 0
        self.order = np.random.default_rng(sampler.seed).permutation(N)

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.at == N:
            raise StopIteration
        self.at += 1
        self.sampler.given += 1
        return int(self.order[self.at - 1])

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def test_a_sampler_without_a_length_goes_on_from_its_own_state():
    samplers = []

    def make() -> dataecho.EchoLoader:
        samplers.append(Stepping(9))
        return dataecho.EchoLoader(Numbers(), batch_size=10, sampler=samplers[-1], echo_factor=1, num_workers=2,
                                   seed=1)

    reference = epochs(make(), 1)
    got, state = interrupted(make, 3, 1)
    assert got == reference
    read = len(state["stages"]["intake"]["order"])
    assert state["stages"]["intake"]["sampler"] == {"iterator": {"at": read}}, "taken with the indices read"
    assert samplers[-1].given == N - read, "the resumed sampler was not asked again for the indices the state saved"


class Curriculum(Numbers):
    """A map-style dataset with its own state: a level the training loop
    raises, which changes the examples it gives."""

    def __init__(self) -> None:
        self.level, self.loads = 0, 0

    def __getitem__(self, i: int) -> int:
        return 1000 * self.level + i

    def state_dict(self) -> dict:
        return {"level": self.level}

    def load_state_dict(self, state: dict) -> None:
        self.level, self.loads = state["level"], self.loads + 1


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_stateful_map_dataset_gets_its_own_state_back(worker_type):
    def make(dataset: Curriculum) -> dataecho.EchoLoader:
        return dataecho.EchoLoader(dataset, batch_size=10, echo_factor=1, num_workers=2, worker_type=worker_type,
                                   seed=1)

    dataset = Curriculum()
    loader = make(dataset)
    for _ in loader:
        pass
    dataset.level = 3  # the loop moved on to a harder level
    assert loader.state_dict()["dataset"] == {"level": 3}, "taken from the dataset as the state is"
    state = loader.state_dict()
    fresh = Curriculum()
    resumed = make(fresh)
    resumed.load_state_dict(state)
    assert (fresh.level, fresh.loads) == (3, 1), "loaded as the state is, before the resumed epoch reads"
    values = sorted(v for batch in resumed for v in batch.tolist())
    assert values == [3000 + i for i in range(N)], "the workers read the dataset as its state left it"


def test_a_state_keeps_no_dataset_state_for_a_dataset_without_one():
    loader = dataecho.EchoLoader(Numbers(), batch_size=10, echo_factor=1, num_workers=0, seed=1)
    assert "dataset" not in loader.state_dict()


def test_a_sampler_state_that_is_not_one_is_refused_naming_its_key():
    def make() -> dataecho.EchoLoader:
        ds = Numbers()
        return dataecho.EchoLoader(ds, batch_size=10, sampler=RandomSampler(ds, generator=generator(5)),
                                   echo_factor=1, num_workers=0, seed=1)

    loader = make()
    epoch = iter(loader)
    next(epoch)
    state = loader.state_dict()
    loader.close()
    state["stages"]["intake"]["sampler"] = {"generator": 5}
    with pytest.raises(ValueError, match=r"\['intake'\]\['sampler'\]"):
        make().load_state_dict(state)
