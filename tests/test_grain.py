"""Echo as a Grain transformation (dataecho.grain.EchoIterDataset), inside real
Grain pipelines: source -> shuffle -> map -> EchoIterDataset -> batch, with
the id/payload examples of support.py."""

from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import pytest

from support import (check_exact, check_no_repeats_in_batches, checked_ids, counts, drain, intake_of, losses, one,
                     run_python, structure_of_state)

grain = pytest.importorskip("grain")
from dataecho.grain import EchoIterDataset  # noqa: E402  (after the guard)

N = 300  # examples in the source
BUFFER = 64  # the echo buffer's examples
SEED = 5


def pipeline(echo_factor: float | str = 2, batch_size: int | None = None, n: int = N, read: object = None,
             upstream: object = None, **options: object) -> grain.IterDataset:
    """Grain's source -> shuffle -> map -> to_iter_dataset, (``upstream``: then
    that, say ``mp_prefetch``), then the echo, then Grain's ``batch(8)`` where
    the echo yields examples one by one."""
    ds = grain.MapDataset.range(n).shuffle(seed=3).map(one)
    ds = ds.to_iter_dataset(read) if read is not None else ds.to_iter_dataset()
    ds = upstream(ds) if upstream is not None else ds
    ds = EchoIterDataset(ds, echo_factor, BUFFER, SEED, batch_size, **options)
    return ds if batch_size is not None else ds.batch(8)


def ids(batch: dict) -> list[int]:
    return checked_ids(batch).tolist()



@pytest.mark.parametrize("echo_factor", [1, 2, 3, 1.5, 2.25])
def test_every_example_is_echoed_exactly(echo_factor):
    delivered: Counter = Counter()
    drain(pipeline(echo_factor), delivered)
    check_exact(delivered, range(N), echo_factor)
    # A fixed factor is exact in total too: floor(n * e) deliveries.
    assert sum(delivered.values()) == int(N * echo_factor)


def test_the_echo_yields_each_example_as_the_parent_yielded_it():
    ds = grain.MapDataset.range(20).map(lambda i: (i, f"name {i}", {"x": np.full(3, i, np.float32)}))
    out = list(EchoIterDataset(ds.to_iter_dataset(), echo_factor=1, shuffle_buffer=8))
    assert sorted(out, key=lambda e: e[0])[5][:2] == (5, "name 5")
    assert all(e[2]["x"].dtype == np.float32 and (e[2]["x"] == e[0]).all() for e in out)
    assert sorted(e[0] for e in out) == list(range(20))


@pytest.mark.parametrize("batch_size", [None, 16], ids=["one by one, Grain's batch", "native batches"])
def test_auto_delivers_every_example_at_least_once_and_at_most_max_echo_times(batch_size):
    # A batch may repeat an example here: once the loop outruns the parent,
    # fewer than a batch of examples may be resident (the buffer's guarantee).
    delivered: Counter = Counter()
    drain(pipeline("auto", batch_size, max_echo=3.0), delivered)
    assert sorted(delivered) == list(range(N)), "every example at least once"
    assert max(delivered.values()) <= 3


@pytest.mark.parametrize("echo_factor", [1, 2, 3, 1.5])
def test_native_batches_never_hold_an_example_twice(echo_factor):
    batches = [checked_ids(b) for b in pipeline(echo_factor, batch_size=16)]
    assert all(len(b) == 16 for b in batches[:-1])
    check_no_repeats_in_batches(batches, 16)
    check_exact(counts(batches), range(N), echo_factor)


@pytest.mark.parametrize("batch_size", [None, 8], ids=["one by one, Grain's batch", "native batches"])
@pytest.mark.parametrize("echo_factor", [2, 1.5])
def test_a_saved_state_resumes_exactly_the_rest_of_the_stream(echo_factor, batch_size):
    whole = [ids(b) for b in pipeline(echo_factor, batch_size)]
    for cut in (0, 1, len(whole) // 3, len(whole) // 2 + 1, len(whole) - 1, len(whole)):
        it = iter(pipeline(echo_factor, batch_size))
        seen = [ids(next(it)) for _ in range(cut)]
        # As Grain's checkpoint handler saves it: JSON.
        state = json.loads(json.dumps(it.get_state()))
        it.close()
        resumed = iter(pipeline(echo_factor, batch_size))
        resumed.set_state(state)
        assert seen + [ids(b) for b in resumed] == whole, f"cut after {cut} batches"


def test_set_state_rewinds_an_iterator_that_went_on():
    whole = [ids(b) for b in pipeline(2)]
    it = iter(pipeline(2))
    seen = [ids(next(it)) for _ in range(20)]
    state = it.get_state()
    [next(it) for _ in range(30)]
    it.set_state(state)
    assert seen + [ids(b) for b in it] == whole


def test_the_state_nests_the_parent_state_and_names_examples_by_position():
    it = iter(pipeline(2, batch_size=8))
    [next(it) for _ in range(30)]
    state = it.get_state()
    assert set(state) == {"parent", "echo"}
    assert set(state["parent"]) == {"next_index"}, "the parent's own state, as it gave it"
    intake = intake_of(state)
    restart = intake["restart"]["position"]
    assert restart <= min(intake["positions"]) and restart <= intake["next_seq"]
    assert state["parent"]["next_index"] == restart, "the parent's state where the echo's reading must begin again"
    # The resident examples are named by position, with their echoes left; never stored.
    assert len(intake["positions"]) == len(intake["echoes"]) > 0 and all(1 <= e <= 2 for e in intake["echoes"])
    assert all(isinstance(p, int) for p in intake["positions"])



@pytest.mark.parametrize("echo_factor, batch_size", [(2, None), (1.5, 8), ("auto", 8)])
def test_the_state_has_one_structure_from_before_the_first_element_to_after_the_last(echo_factor, batch_size):
    it = iter(pipeline(echo_factor, batch_size))
    states = [it.get_state()]
    for _ in it:
        states.append(it.get_state())
    states.append(it.get_state())
    assert len(states) >= N // 8 + 2, "a state before every element and after the last"
    # The parent's state is the parent's own, as it gave it: the rest is the echo's.
    shapes = [structure_of_state({**state, "parent": None}) for state in states]
    assert shapes[0] == {"parent": "NoneType", "echo": {"epoch": "int", "ended": "bool", "loader": "str"}}
    other = [i for i, shape in enumerate(shapes) if shape != shapes[0]]
    assert not other, f"states of another structure at elements {other[:5]} (of 0 to {len(shapes) - 1})"
    assert structure_of_state(states[0]["parent"]) == structure_of_state(states[-1]["parent"])


@pytest.mark.parametrize("echo_factor, batch_size", [(2, None), (1.5, 8)])
def test_grains_own_checkpoint_check_passes(echo_factor, batch_size):
    # At every element: a state of the first one's structure, which set_state
    # gives back as it was, and from which the rest of the stream follows.
    grain.experimental.assert_equal_output_after_checkpoint(pipeline(echo_factor, batch_size, n=120))


class Calls:
    """A map that counts the examples it makes."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, i: int) -> dict:
        self.count += 1
        return one(i)


def test_a_restore_reads_the_parent_again_only_from_where_the_state_says():
    # A long stream: resuming by reading the parent from its start would read it all again.
    n, calls = 3000, Calls()

    def make() -> grain.IterDataset:
        # No prefetch threads, so that the map runs for exactly the examples the echo takes.
        ds = grain.MapDataset.range(n).map(calls).to_iter_dataset(grain.ReadOptions(num_threads=0))
        return EchoIterDataset(ds, echo_factor=2, shuffle_buffer=BUFFER, seed=SEED)

    whole = [int(e["id"]) for e in make()]
    it = iter(make())
    seen = [int(next(it)["id"]) for _ in range(4000)]
    state = it.get_state()
    it.close()
    restart = intake_of(state)["restart"]["position"]
    calls.count = 0
    resumed = iter(make())
    resumed.set_state(state)
    assert seen + [int(e["id"]) for e in resumed] == whole
    assert calls.count == n - restart, "the parent is read from the restart point on"
    assert restart >= n // 4, restart


def test_auto_resumes_from_where_the_parent_had_been_read():
    # "auto" echoes by timing: a resume goes on from where the parent was read,
    # and the examples resident in the buffer then are not delivered again.
    it = iter(pipeline("auto", batch_size=8, max_echo=3.0))
    seen = Counter(x for _ in range(20) for x in ids(next(it)))
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    read = intake_of(state)["skip"]
    resumed = iter(pipeline("auto", batch_size=8, max_echo=3.0))
    with pytest.warns(UserWarning, match=f"skips the {read} examples"):
        resumed.set_state(state)
    rest = Counter(x for b in resumed for x in ids(b))
    order = [int(e["id"]) for e in grain.MapDataset.range(N).shuffle(seed=3).map(one)]
    assert sorted(rest) == sorted(order[read:]), "every example the parent yields after where it was read"
    assert max(rest.values()) <= 3 and set(seen) <= set(order[:read])


def slow_one(i: int) -> dict:
    """An example made slowly enough that the echo's reading thread is mid-read when a state is set."""
    time.sleep(0.0002)
    return one(i)


def test_set_state_stops_the_reading_thread_before_it_moves_the_parent():
    # With "auto" the parent is read on a thread of the echo's own: set_state
    # must stop it before the parent is put back, or it takes examples from there.
    def trial(rng: np.random.Generator) -> set:
        parent = grain.MapDataset.range(N).map(slow_one).to_iter_dataset(grain.ReadOptions(num_threads=0))
        it = iter(EchoIterDataset(parent, "auto", BUFFER, SEED, 8, max_echo=2.0))
        start = it.get_state()
        for _ in range(int(rng.integers(1, 6))):
            next(it)
        it.set_state(start)
        return set(range(N)) - {i for batch in it for i in ids(batch)}

    lost = losses(20, 13, trial)
    assert not lost, f"examples lost after set_state in {len(lost)} of 20 trials (seed 13), per trial: {lost}"


def mp_prefetch(ds: grain.IterDataset) -> grain.IterDataset:
    # With JAX installed, Grain's worker processes read an absl flag, which
    # raises before the flags are parsed: a program without absl.app parses
    # them itself.
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))


def test_grain_worker_processes_upstream_of_the_echo():
    # The slow part runs in Grain's worker processes; the echo after them, in this one.
    it = iter(pipeline(2, batch_size=8, upstream=mp_prefetch))
    try:
        whole = [ids(b) for b in it]
    finally:
        it.close()
    check_exact(counts(np.asarray(b) for b in whole), range(N), 2)
    it = iter(pipeline(2, batch_size=8, upstream=mp_prefetch))
    resumed = iter(pipeline(2, batch_size=8, upstream=mp_prefetch))
    try:
        seen = [ids(next(it)) for _ in range(25)]
        state = json.loads(json.dumps(it.get_state()))
        resumed.set_state(state)
        assert seen + [ids(b) for b in resumed] == whole
    finally:
        it.close()
        resumed.close()


def test_bad_arguments_and_states_are_named():
    source = grain.MapDataset.range(10)
    with pytest.raises(TypeError, match=r"parent: .*\.to_iter_dataset\(\)"):
        EchoIterDataset(source)
    with pytest.raises(ValueError, match="echo_factor"):
        EchoIterDataset(source.to_iter_dataset(), echo_factor=0.5)
    with pytest.raises(ValueError, match="shuffle_buffer"):
        EchoIterDataset(source.to_iter_dataset(), shuffle_buffer=0)
    it = iter(EchoIterDataset(source.to_iter_dataset()))
    with pytest.raises(ValueError, match="state: expected a dict with 'parent' and 'echo'"):
        it.set_state({"next_index": 3})
    with pytest.raises(ValueError, match=r"state\['echo'\]"):
        it.set_state({"parent": {"next_index": 0}, "echo": {"epoch": -1}})
    good = it.get_state()
    with pytest.raises(ValueError, match=r"state\['echo'\]\['loader'\]: expected .* JSON string"):
        it.set_state({**good, "echo": {**good["echo"], "loader": json.loads(good["echo"]["loader"])}})
    with pytest.raises(ValueError, match=r"state\['echo'\]\['loader'\]: not the EchoLoader's state in JSON"):
        it.set_state({**good, "echo": {**good["echo"], "loader": "{not json"}})
    with pytest.raises(ValueError, match=r"state\['echo'\]\['loader'\]: expected an EchoLoader state"):
        it.set_state({**good, "echo": {**good["echo"], "loader": "[1, 2]"}})
    state = iter(pipeline(2)).get_state()
    with pytest.raises(ValueError, match="saved with echo_factor=2"):
        iter(pipeline(3)).set_state(state)


def test_importing_dataecho_imports_neither_grain_nor_torchdata():
    result = run_python(
        """
        import sys, dataecho
        print("grain" in sys.modules, "torchdata" in sys.modules)
        import dataecho.grain
        print("grain" in sys.modules, dataecho.grain.EchoIterDataset.__name__)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True", "EchoIterDataset"]
