"""The moments a real job saves and the ways frameworks resume: a state any
checkpointer takes (plain values, through JSON and ``torch.load`` with
``weights_only=True``), a state taken after an epoch's last batch, ``set_epoch``
after ``iter()``, after ``load_state_dict``, and a state after an error."""

from __future__ import annotations

import io
import json
from collections import Counter

import numpy as np
import pytest
from support import InjectedFault, Records, RestartableStream, Stream

import dataecho

N = 600


def noisy(example, rng):
    return {"id": example["id"], "noise": rng.integers(0, 1 << 30)}


def make(source=None, **kwargs):
    args = {"batch_size": 16, "echo_factor": 2, "shuffle_buffer": 128, "num_workers": 2, "seed": 3}
    args.update(kwargs)
    return dataecho.EchoLoader(source if source is not None else Records(N), **args)


def ids(batch):
    return np.asarray(batch["id"]).tolist()


PLACEMENTS = {
    "example": {},
    "fractional": {"echo_factor": 1.5, "drop_last": True},
    "augment": {"augment": noisy},
    "augment-processes": {"augment": noisy, "worker_type": "process"},
    "batch-echo": {"echo_at": "batch", "shuffle_buffer": 4},
    "iterable": {"source": RestartableStream(N)},
    "iterable-augment": {"source": RestartableStream(N), "augment": noisy, "num_workers": 1},
    "no-order": {"deterministic": False, "num_workers": 1, "source": RestartableStream(N)},
}


def _json_and_torch(state):
    torch = pytest.importorskip("torch")
    as_json = json.loads(json.dumps(state))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return as_json, torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_every_state_is_plain_values_any_checkpointer_takes(name):
    kwargs = dict(PLACEMENTS[name])
    source = kwargs.pop("source", None)
    loader = make(source, **kwargs)
    reference = [ids(b) for b in make(source, **kwargs)] if kwargs.get("deterministic", True) else None
    states = [loader.state_dict()]
    epoch, taken = iter(loader), []
    for batch in epoch:
        taken.append(ids(batch))
        if len(taken) in (1, 7):
            states.append(loader.state_dict())
    states.append(loader.state_dict())
    for state in states:
        as_json, loaded = _json_and_torch(state)
        assert as_json == state == loaded, "plain values: JSON and torch.load(weights_only=True) give them back"
    if reference is not None:
        cut = 7
        resumed = make(source, **kwargs)
        resumed.load_state_dict(json.loads(json.dumps(states[2])))
        with_warnings = [ids(b) for b in resumed]
        assert taken[:cut] + with_warnings == reference == taken


@pytest.mark.parametrize("name", ["example", "fractional", "augment", "batch-echo"])
def test_a_state_after_the_last_batch_resumes_into_the_next_epoch(name):
    # Lightning's epoch-end checkpoint is taken after the last batch, before
    # the iterator says it is spent (it stops at len()): the next epoch, not an
    # empty one, follows. (An iterable has no len(): where the iterator has not
    # said it is spent, its state is where reading stood, and a resume reads on.)
    kwargs = dict(PLACEMENTS[name])
    source = kwargs.pop("source", None)
    whole = make(source, **kwargs)
    first = [ids(b) for b in whole]
    second = [ids(b) for b in whole]
    loader = make(source, **kwargs)
    epoch = iter(loader)
    for _ in range(len(first)):
        next(epoch)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["stages"] is None
    resumed = make(source, **kwargs)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert [ids(b) for b in resumed] == second


def epoch_of(number, source=None, **kwargs):
    """Epoch ``number`` of an uninterrupted loader."""
    reference = make(source, **kwargs)
    reference.set_epoch(number)
    return [ids(b) for b in reference]


def test_an_iterables_state_once_its_iterator_is_spent_is_the_next_epochs_start():
    loader = make(RestartableStream(N))
    first = [ids(b) for b in loader]
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["stages"] is None
    resumed = make(RestartableStream(N))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    second = [ids(b) for b in resumed]
    assert second == epoch_of(1, RestartableStream(N)) and second != first


def test_set_epoch_after_iter_before_the_first_batch_applies():
    # Lightning calls iter() in setup_data, then set_epoch before the first batch.
    third = epoch_of(3)
    loader = make()
    epoch = iter(loader)
    loader.set_epoch(3)
    assert [ids(b) for b in epoch] == third
    assert loader.next_epoch == 3 and loader.stats()["epochs"]["complete"] == 1
    later = iter(loader)
    next(later)
    loader.set_epoch(5)  # after the first batch: for the next epoch, as in DataLoader
    assert [ids(b) for b in later][-1] == third[-1]


def test_set_epoch_after_loading_a_mid_epoch_state_moves_it_to_that_epoch():
    # As StatefulDataLoader reads its sampler's epoch: the same batches
    # delivered of the epoch set, where the position can be worked out.
    second = epoch_of(2)
    saving = make()
    epoch = iter(saving)
    for _ in range(5):
        next(epoch)
    loader = make()
    loader.load_state_dict(saving.state_dict())
    loader.set_epoch(2)
    assert [ids(b) for b in loader] == second[5:]
    loader = make(RestartableStream(N))
    stream = make(RestartableStream(N))
    epoch = iter(stream)
    next(epoch)
    loader.load_state_dict(stream.state_dict())
    with pytest.warns(UserWarning, match=r"set_epoch\(2\).*epoch 2 starts from its beginning"):
        loader.set_epoch(2)
    assert sum(len(ids(b)) for b in loader) == 2 * N


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_after_an_error_in_the_dataset_resumes_after_the_last_batch(num_workers):
    # The emergency checkpoint a job saves on an error: nothing already
    # delivered comes again, nothing after it is lost.
    reference = [ids(b) for b in make(num_workers=num_workers)]
    failing = make(Records(N, fail_at=int(np.random.default_rng(0).permutation(N)[300])), num_workers=num_workers)
    taken = []
    with pytest.raises(InjectedFault):
        for batch in failing:
            taken.append(ids(batch))
    assert 0 < len(taken) < len(reference)
    state = json.loads(json.dumps(failing.state_dict()))
    assert sum(batches for _, batches in state["history"]) == len(taken)
    resumed = make(num_workers=num_workers)
    resumed.load_state_dict(state)
    assert taken + [ids(b) for b in resumed] == reference


def test_a_state_after_an_error_in_an_iterable_is_refused_not_silently_the_epochs_start():
    failing = make(Stream(N, fail_at=300))
    with pytest.raises(InjectedFault):
        for _ in failing:
            pass
    with pytest.raises(ValueError, match="the epoch ended on an error"):
        failing.state_dict()


def test_an_iterable_with_augment_takes_back_its_own_states_after_its_source_ended():
    loader = make(RestartableStream(N), augment=noisy, num_workers=1)
    reference = [ids(b) for b in make(RestartableStream(N), augment=noisy, num_workers=1)]
    taken, states = [], []
    for batch in loader:
        taken.append(ids(batch))
        states.append((len(taken), loader.state_dict()))
    *states, (_, last) = states
    # After the last batch, before the iterator said it is spent: where reading stood (an iterable has no
    # len()), or, once the stages knew the epoch ended, the next epoch's start. Either resumes to nothing more.
    if last["stages"] is not None:
        states.append((len(taken), last))
    for cut, state in states[-12:]:
        resumed = make(RestartableStream(N), augment=noisy, num_workers=1)
        resumed.load_state_dict(state)
        rest = [ids(b) for b in resumed]
        assert taken[:cut] + rest == reference, f"resumed after batch {cut}"
    assert Counter(i for b in taken for i in b) == Counter({i: 2 for i in range(N)})


@pytest.mark.parametrize("library", ["grain", "nodes"])
def test_a_pipelines_echo_with_augment_takes_back_its_states_once_its_upstream_ended(library):
    # The echo step reads its upstream to the end well before its last element
    # behind an augment stage: every state from then on resumes a fresh pipeline.
    pytest.importorskip("grain" if library == "grain" else "torchdata")
    from checkpoint_cases import ids as item_ids
    from checkpoint_cases import pipeline_step

    case = {"source": library, "n": 120, "echo_factor": 2, "batch_size": 8, "shuffle_buffer": 64, "augment": True}
    reference, _, _ = pipeline_step(case)
    whole = [item_ids(item) for item in reference]
    running, state_of, _ = pipeline_step(case)
    states = []
    for taken in range(1, len(whole) + 1):
        assert item_ids(next(running)) == whole[taken - 1]
        states.append(json.loads(json.dumps(state_of())))
    for cut in range(len(whole) - 10, len(whole) + 1):
        resumed, _, load = pipeline_step(case)
        load(states[cut - 1])
        assert whole[:cut] + [item_ids(item) for item in resumed] == whole, f"resumed after element {cut}"
