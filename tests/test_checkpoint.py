"""state_dict() / load_state_dict(): a loader resumed from a state taken after
any batch yields exactly the batches the uninterrupted loader would have yielded
next, re-reading the resident examples instead of storing them."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from support import Records

import dataecho

N = 1000


def make(source=None, **kwargs):
    args = {"batch_size": 32, "echo_factor": 1.5, "shuffle_buffer": 256, "workers": 3, "seed": 7,
            "deterministic": True}
    args.update(kwargs)
    return dataecho.EchoLoader(source if source is not None else Records(N), **args)


def run(loader, epochs=2):
    return [batch["id"].tolist() for _ in range(epochs) for batch in loader]


def take_then_save(loader, count):
    """Takes `count` batches (crossing epochs as needed); returns them and the
    state after the last, pickled and back."""
    taken, epoch = [], iter(loader)
    while len(taken) < count:
        try:
            taken.append(next(epoch)["id"].tolist())
        except StopIteration:
            epoch = iter(loader)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    loader.close()
    return taken, state


def resume(state, epochs=2, **kwargs):
    loader = make(**kwargs)
    loader.load_state_dict(state)
    return run(loader, epochs - state["epoch"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"echo_factor": 2, "workers": 1},
        {"echo_factor": 2.5, "drop_last": True, "prefetch": 1},
        {"batch_size": 8, "shuffle_buffer": 40, "shuffle": False},
        {"rank": 1, "world_size": 3},
    ],
    ids=["echo1.5", "echo2", "echo2.5-drop_last", "small-buffer", "rank1of3"],
)
def test_resume_after_any_batch_yields_the_rest_exactly(kwargs):
    reference = run(make(**kwargs))
    per_epoch = len(reference) // 2
    for cut in (0, 1, 4, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 2):
        taken, state = take_then_save(make(**kwargs), cut)
        assert taken + resume(state, **kwargs) == reference, f"resumed after batch {cut}"


def test_resume_with_other_workers_and_worker_type():
    reference = run(make(workers=3))
    taken, state = take_then_save(make(workers=3), 10)
    assert taken + resume(state, workers=2, worker_type="process") == reference
    taken, state = take_then_save(make(workers=2, worker_type="process"), 20)
    assert taken + resume(state, workers=1) == reference


def test_the_state_is_small_and_names_every_resident_example():
    _, state = take_then_save(make(), 5)
    position = state["position"]
    assert state["epoch"] == 0 and position["next_seq"] > 0
    resident = len(position["positions"])
    assert 0 < resident <= 256
    assert position["echoes"].min() >= 1 and position["echoes"].max() <= 2  # echo 1.5: 1 or 2 left
    # Indices are those of the epoch's order at the positions.
    assert len(set(position["indices"].tolist())) == resident
    queued_rows = sum(len(q) for q in position["queued"])
    assert len(pickle.dumps(state)) <= 20 * resident + 8 * queued_rows + 1500


def test_resume_reads_only_resident_and_later_examples():
    source = Records(N, count_reads=True)
    taken, state = take_then_save(make(), 20)
    loader = make(source)
    loader.load_state_dict(state)
    rest = [b["id"].tolist() for b in loader]
    position = state["position"]
    queued_rows = sum(len(q) for q in position["queued"])
    # Every example left to read, the resident ones, the queued rows, and one to learn the structure.
    assert sum(source.reads.values()) == (N - position["next_seq"]) + len(position["positions"]) + queued_rows + 1
    assert taken + rest == run(make(), 1)


def test_state_before_iterating_and_after_loading():
    loader = make()
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["position"] is None
    _, saved = take_then_save(make(), 7)
    loader.load_state_dict(saved)
    assert loader.state_dict()["position"]["next_seq"] == saved["position"]["next_seq"]


def test_state_at_an_epoch_boundary_starts_the_next_epoch():
    loader = make()
    first = [b["id"].tolist() for b in loader]
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] is None
    assert resume(state) == run(make())[len(first):]


class Stream:
    def __iter__(self):
        return iter(range(500))


def test_iterable_source_resumes_by_skipping_what_was_taken():
    def loader_over(stream):
        return dataecho.EchoLoader(stream, batch_size=10, echo_factor=1, shuffle_buffer=50, seed=3)

    loader = loader_over(Stream())
    epoch = iter(loader)
    seen = [next(epoch).tolist() for _ in range(10)]
    state = loader.state_dict()
    skip = state["position"]["skip"]
    assert 100 <= skip <= 500
    resumed = loader_over(Stream())
    resumed.load_state_dict(state)
    rest = np.concatenate(list(resumed)).tolist()
    assert sorted(rest) == list(range(skip, 500)), "the skipped examples are not read again"
    assert len(set(sum(seen, [])) & set(rest)) == 0


def test_bad_states_and_unsupported_loaders_are_refused():
    loader = make()
    with pytest.raises(TypeError, match="state"):
        loader.load_state_dict([1, 2])
    _, state = take_then_save(make(), 3)
    with pytest.raises(ValueError, match="seed"):
        make(seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="length"):
        make(Records(N + 1)).load_state_dict(state)
    with pytest.raises(ValueError, match="format"):
        make().load_state_dict({**state, "format": "other"})
    broken = {**state, "position": {**state["position"], "indices": state["position"]["indices"][::-1].copy()}}
    with pytest.raises(ValueError, match="indices"):
        make().load_state_dict(broken)
    for kwargs, match in (({"deterministic": False}, "deterministic"), ({"echo_at": "batch"}, "batch")):
        loader = make(**kwargs)
        epoch = iter(loader)
        next(epoch)
        with pytest.raises(ValueError, match=match):
            loader.state_dict()
        epoch.close()


def test_resume_with_batches_on_their_way_to_the_device():
    # device= keeps one batch in flight ahead of the one yielded: the state puts
    # it first among the batches still to come.
    pytest.importorskip("torch")
    kwargs = {"device": "cpu", "output": "torch"}
    reference = run(make(**kwargs))
    for cut in (1, 3, len(reference) // 3):
        taken, state = take_then_save(make(**kwargs), cut)
        assert len(state["position"]["queued"]) >= 1
        assert taken + resume(state, **kwargs) == reference, f"resumed after batch {cut}"
