"""Echo as a torchdata node (dataecho.nodes.Echo), inside torchdata.nodes
pipelines and their Loader, with torchdata's own save/load-at-many-points
pattern, on the id/payload examples of support.py."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any, Iterator

import numpy as np
import pytest

from support import (check_exact, check_no_repeats_in_batches, checked_ids, counts, intake_of, losses, one,
                     payload_of, structure_of_state)

nodes = pytest.importorskip("torchdata.nodes")
import torch  # noqa: E402  (torchdata needs it)
from torchdata.nodes import Batcher, IterableWrapper, Loader, Mapper, ParallelMapper  # noqa: E402

from dataecho.nodes import Echo  # noqa: E402

N = 200  # examples in the source
BUFFER = 32  # the echo buffer's examples


def source(n: int = N) -> nodes.BaseNode:
    return Mapper(IterableWrapper(range(n)), one)


def echo(echo_factor: float | str = 2, batch_size: int | None = None, upstream: nodes.BaseNode | None = None,
         **options: Any) -> Echo:
    return Echo(upstream if upstream is not None else source(), echo_factor, BUFFER, 7, batch_size, **options)


def ids(item: Any) -> list[int]:
    """The ids of an item a pipeline yields (an example, a Batcher's list of
    examples, or a native batch), each payload checked against its id."""
    if isinstance(item, list):
        return [i for example in item for i in ids(example)]
    if np.ndim(item["id"]) == 0:
        assert np.array_equal(np.asarray(item["payload"]), payload_of([int(item["id"])])[0])
        return [int(item["id"])]
    return checked_ids({key: np.asarray(value) for key, value in item.items()}).tolist()


def epoch_ids(loader: Loader) -> list[list[int]]:
    return [ids(item) for item in loader]



@pytest.mark.parametrize("echo_factor", [1, 2, 3, 1.5])
def test_a_loader_yields_every_example_echoed_exactly_every_epoch(echo_factor):
    loader = Loader(echo(echo_factor))
    first, second = epoch_ids(loader), epoch_ids(loader)
    for epoch in (first, second):
        delivered = Counter(i for item in epoch for i in item)
        check_exact(delivered, range(N), echo_factor)
        assert sum(delivered.values()) == int(N * echo_factor)
    assert first != second, "each epoch is reshuffled, with its own echo seeds"


@pytest.mark.parametrize("batch_size", [None, 16])
def test_auto_delivers_every_example_at_least_once_and_at_most_max_echo_times(batch_size):
    # A batch may repeat an example here: once the loop outruns the source,
    # fewer than a batch of examples may be resident (the buffer's guarantee).
    delivered = Counter(i for item in Loader(echo("auto", batch_size, max_echo=3.0)) for i in ids(item))
    assert sorted(delivered) == list(range(N))
    assert max(delivered.values()) <= 3


@pytest.mark.parametrize("echo_factor", [1, 2, 3, 1.5])
def test_native_batches_never_hold_an_example_twice(echo_factor):
    batches = [np.asarray(ids(b)) for b in Loader(echo(echo_factor, batch_size=16))]
    assert all(len(b) == 16 for b in batches[:-1])
    check_no_repeats_in_batches(batches, 16)
    check_exact(counts(batches), range(N), echo_factor)


def test_an_example_comes_out_as_the_source_gave_it_and_batches_as_torch_tensors():
    made = IterableWrapper([{"step": i, "tensor": torch.tensor([i]), "text": f"str_{i}"} for i in range(20)])
    out = list(Loader(Echo(made, echo_factor=1, shuffle_buffer=8)))
    assert sorted(e["step"] for e in out) == list(range(20))
    assert all(torch.equal(e["tensor"], torch.tensor([e["step"]])) and e["text"] == f"str_{e['step']}" for e in out)
    batch = next(iter(Loader(echo(2, batch_size=16, output="torch"))))
    assert isinstance(batch["id"], torch.Tensor) and batch["payload"].shape == (16, 16)


def check_save_load(node: nodes.BaseNode, midpoint: int) -> None:
    """torchdata's save/load-at-a-midpoint pattern, for ``node``: a state taken
    at the start, at ``midpoint`` and at the end of epoch 0 each resumes what
    the uninterrupted loader yielded (the rest of epoch 0, then epoch 1)."""
    loader = Loader(node)
    initial = loader.state_dict()
    it = iter(loader)
    results = [ids(next(it)) for _ in range(midpoint)]
    middle = loader.state_dict()
    results += [ids(item) for item in it]
    end_of_0 = loader.state_dict()
    epoch_1 = epoch_ids(loader)

    loader.load_state_dict(middle)
    assert epoch_ids(loader) == results[midpoint:], "the rest of epoch 0"
    assert epoch_ids(loader) == epoch_1, "then epoch 1"
    loader.load_state_dict(initial)
    assert epoch_ids(loader) == results and epoch_ids(loader) == epoch_1, "from the start"
    stopped = Loader(node, restart_on_stop_iteration=False)
    stopped.load_state_dict(end_of_0)
    assert epoch_ids(stopped) == [], "epoch 0 has ended"
    restarted = Loader(node)
    restarted.load_state_dict(end_of_0)
    assert epoch_ids(restarted) == epoch_1, "the next epoch"


@pytest.mark.parametrize("midpoint", [0, 1, 17, 130, 399])
def test_save_and_load_one_by_one(midpoint):
    check_save_load(echo(2), midpoint)


@pytest.mark.parametrize("midpoint", [1, 11, 23])
@pytest.mark.parametrize("echo_factor", [2, 1.5])
def test_save_and_load_native_batches(echo_factor, midpoint):
    check_save_load(echo(echo_factor, batch_size=8), midpoint)


@pytest.mark.parametrize("midpoint", [2, 20])
def test_save_and_load_with_batcher_after_and_parallel_mapper_before(midpoint):
    # torchdata's own nodes around the echo: threads mapping in order upstream, batching downstream.
    upstream = ParallelMapper(IterableWrapper(range(N)), one, num_workers=2, method="thread", in_order=True)
    check_save_load(Batcher(echo(2, upstream=upstream), batch_size=8, drop_last=False), midpoint)



@pytest.mark.parametrize("echo_factor, batch_size", [(2, None), (1.5, 8), ("auto", 8)])
def test_the_echo_state_has_one_structure_at_every_item_of_two_epochs(echo_factor, batch_size):
    node = echo(echo_factor, batch_size)
    echoes = []
    for _ in range(2):
        node.reset()
        echoes.append(node.state_dict()["echo"])
        for _ in node:
            echoes.append(node.state_dict()["echo"])
        echoes.append(node.state_dict()["echo"])
    assert len(echoes) >= 2 * (N // 8 + 2), "a state before every item of two epochs and after their last"
    # The source's state is the source's own: the echo's has one structure throughout.
    expected = {"epoch": "int", "ended": "bool", "loader": "str"}
    other = [i for i, state in enumerate(echoes) if structure_of_state(state) != expected]
    assert not other, f"echo states of another structure at items {other[:5]} (of 0 to {len(echoes) - 1})"


class CountingRange:
    """A Stateful iterable (torchdata's protocol: ``state_dict``/``load_state_dict``),
    which ``IterableWrapper`` restores by its state instead of reading it again;
    it counts the examples it makes."""

    def __init__(self, n: int) -> None:
        self.n, self.made, self._next, self._resume = n, 0, 0, 0

    def __iter__(self) -> Iterator[dict]:
        start, self._resume = self._resume, 0
        self._next = start
        return self._from(start)

    def _from(self, start: int) -> Iterator[dict]:
        for i in range(start, self.n):
            self._next, self.made = i + 1, self.made + 1
            yield one(i)

    def state_dict(self) -> dict[str, int]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = state["next"]


def test_reset_restarts_a_stateful_upstream_from_the_state_it_nests():
    n = 3000  # a long stream: reading it again from its start would read it all
    made: list[CountingRange] = []

    def make() -> Echo:
        made.append(CountingRange(n))
        return Echo(IterableWrapper(made[-1]), echo_factor=2, shuffle_buffer=BUFFER, seed=7)

    whole = epoch_ids(Loader(make()))
    node = make()
    node.reset()
    seen = [ids(next(node)) for _ in range(4000)]
    state = node.state_dict()
    restart = intake_of(state)["restart"]["position"]
    assert state["source"] == {"_num_yielded": restart, "iterable": {"next": restart}}, \
        "the upstream node's own state, where the echo's reading must begin again"
    resumed = make()
    resumed.reset(state)
    assert seen + [ids(item) for item in resumed] == whole
    assert made[-1].made == n - restart, "the upstream is read from its restart point on, not from its start"
    assert restart >= n // 4, restart


def test_auto_resumes_from_where_the_source_had_been_read():
    node = echo("auto", batch_size=8, max_echo=3.0)
    node.reset()
    seen = Counter(i for _ in range(10) for i in ids(next(node)))
    state = node.state_dict()
    read = intake_of(state)["skip"]
    resumed = echo("auto", batch_size=8, max_echo=3.0)
    with pytest.warns(UserWarning, match=f"skips the {read} examples"):
        resumed.reset(state)
    rest = Counter(i for item in resumed for i in ids(item))
    assert sorted(rest) == list(range(read, N)) and max(rest.values()) <= 3
    assert set(seen) <= set(range(read))


def test_bad_arguments_and_states_are_named():
    with pytest.raises(TypeError, match="source: expected a torchdata.nodes.BaseNode"):
        Echo(range(10))
    with pytest.raises(ValueError, match="echo_factor"):
        Echo(source(), echo_factor=0.5)
    with pytest.raises(ValueError, match="output"):
        Echo(source(), output="arrow")
    node = echo(2)
    with pytest.raises(ValueError, match="initial_state: expected a dict with 'source' and 'echo'"):
        node.reset({"_num_yielded": 3})
    with pytest.raises(ValueError, match=r"initial_state\['echo'\]"):
        node.reset({"source": {}, "echo": {"epoch": 0}})
    good = node.state_dict()
    with pytest.raises(ValueError, match=r"initial_state\['echo'\]\['loader'\]: expected .* JSON string"):
        node.reset({**good, "echo": {**good["echo"], "loader": json.loads(good["echo"]["loader"])}})
    with pytest.raises(ValueError, match=r"initial_state\['echo'\]\['loader'\]: not the EchoLoader's state"):
        node.reset({**good, "echo": {**good["echo"], "loader": "{not json"}})
    state = Loader(echo(2)).state_dict()["root"]
    with pytest.raises(ValueError, match="saved with echo_factor=2"):
        echo(3).reset(state)


TRIALS = 25


def slow_one(i: int) -> dict:
    """An example made slowly enough that the echo's reading thread is mid-read when the consumer leaves."""
    time.sleep(0.0002)
    return one(i)


@pytest.mark.parametrize("batch_size", [None, 8])
def test_an_epoch_left_early_leaves_the_next_epoch_whole_with_auto(batch_size):
    # With "auto" the echo reads on a thread of its own: the epoch left early
    # must stop reading before the source is reset for the next one, or that
    # thread takes the next epoch's first examples.
    def trial(rng: np.random.Generator) -> set:
        node = echo("auto", batch_size, upstream=Mapper(IterableWrapper(range(N)), slow_one), max_echo=2.0)
        node.reset()
        for _ in range(int(rng.integers(1, 6))):
            next(node)
        node.reset(None)
        return set(range(N)) - {i for item in node for i in ids(item)}

    lost = losses(TRIALS, 11, trial)
    assert not lost, f"epoch 1 lost examples in {len(lost)} of {TRIALS} trials (seed 11), per trial: {lost}"
