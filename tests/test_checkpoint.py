"""state_dict() / load_state_dict(): a loader resumed from a state taken after
any batch yields exactly the batches the uninterrupted loader would have yielded
next, in every placement (example echo, batch echo, augment with its generator,
both), with thread or process workers, re-reading the examples it needs instead
of storing them."""

from __future__ import annotations

import json
import pickle
import threading

import numpy as np
import pytest
from support import FIRST, Records, RestartableStream
from support import Stream as RecordStream

import dataecho

N = 1000


def noisy(example, rng):
    """An augmentation whose randomness comes from the generator it is given."""
    return {"id": example["id"], "head": example["payload"][:4], "noise": rng.integers(0, 1 << 30)}


def own_noise(example):
    return {"id": example["id"], "noise": np.random.randint(1 << 30)}


def make(source=None, **kwargs):
    args = {"batch_size": 32, "echo_factor": 1.5, "shuffle_buffer": 256, "num_workers": 3, "seed": 7,
            "deterministic": True}
    args.update(kwargs)
    return dataecho.EchoLoader(source if source is not None else Records(N), **args)


def rows(batch):
    """What identifies a batch's rows: ids, with augment's draws where it made some."""
    ids = np.asarray(batch["id"]).tolist()
    return list(zip(ids, np.asarray(batch["noise"]).tolist())) if "noise" in batch else ids


def run(loader, epochs=2):
    return [rows(batch) for _ in range(epochs) for batch in loader]


def take_then_save(loader, count):
    """Takes `count` batches (crossing epochs as needed); returns them and the
    state after the last, pickled and back."""
    taken, epoch = [], iter(loader)
    while len(taken) < count:
        try:
            taken.append(rows(next(epoch)))
        except StopIteration:
            epoch = iter(loader)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    loader.close()
    return taken, state


def resume(state, epochs=2, **kwargs):
    loader = make(**kwargs)
    loader.load_state_dict(state)
    return run(loader, epochs - state["epoch"])


PLACEMENTS = {
    "echo1.5": {},
    "echo2": {"echo_factor": 2, "num_workers": 1},
    "echo2.5-drop_last": {"echo_factor": 2.5, "drop_last": True, "prefetch_factor": 1},
    "small-buffer": {"batch_size": 8, "shuffle_buffer": 40, "shuffle": False},
    "rank1of3": {"rank": 1, "world_size": 3},
    "augment": {"augment": noisy},
    "batch-echo": {"echo_at": "batch", "echo_factor": 2.5, "shuffle_buffer": 4},
    "batch-echo-augment": {"echo_at": "batch", "echo_factor": 2, "shuffle_buffer": 3, "augment": noisy},
    "augment-processes": {"augment": noisy, "num_workers": 2, "worker_type": "process", "drop_last": True},
}


@pytest.mark.parametrize("kwargs", list(PLACEMENTS.values()), ids=list(PLACEMENTS))
def test_resume_after_any_batch_yields_the_rest_exactly(kwargs):
    reference = run(make(**kwargs))
    assert run(make(**kwargs)) == reference, "deterministic=True: the same batches every run"
    per_epoch = len(reference) // 2
    for cut in (0, 1, 4, per_epoch // 2, per_epoch - 1, per_epoch, per_epoch + 2):
        taken, state = take_then_save(make(**kwargs), cut)
        assert taken + resume(state, **kwargs) == reference, f"resumed after batch {cut}"


@pytest.mark.parametrize("cut", [3, 60])
def test_resume_twice_in_one_epoch(cut):
    # A state taken from a resumed loader names the batches it has not replayed
    # yet, and the rows it has not augmented again yet; also one taken at once,
    # while the resumed stages are still reading back what they hold (and, near
    # the end, after the intake has finished).
    kwargs = {"augment": noisy, "echo_at": "batch", "echo_factor": 2, "shuffle_buffer": 3}
    reference = run(make(**kwargs), 1)
    assert cut < len(reference) - 1
    first, state = take_then_save(make(**kwargs), cut)
    loader = make(**kwargs)
    loader.load_state_dict(state)
    epoch = iter(loader)
    at_once = pickle.loads(pickle.dumps(loader.state_dict()))
    second = [rows(next(epoch))]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    loader.close()
    assert first + resume(at_once, 1, **kwargs) == reference
    assert first + second + resume(state, 1, **kwargs) == reference


def test_state_taken_before_the_resumed_augment_output_exists():
    # The augment workers of a resumed loader are held back before their first
    # results, so the stage's output buffer does not exist yet when the state is
    # taken: the state must still carry the output's restored position (its
    # pending rows are numbered far from 0). The timeout turns a regression (a
    # resume that waits forever for delivery 0) into an error.
    kwargs = {"echo_at": "batch", "echo_factor": 2, "shuffle_buffer": 3}
    reference = run(make(augment=noisy, **kwargs), 1)
    first, state = take_then_save(make(augment=noisy, **kwargs), 60)
    gate = threading.Event()

    def gated(example, rng):
        gate.wait()
        return noisy(example, rng)

    loader = make(augment=gated, **kwargs)
    loader.load_state_dict(state)
    epoch = iter(loader)  # held: the loader keeps only a weak reference to its epoch
    try:
        at_once = pickle.loads(pickle.dumps(loader.state_dict()))
    finally:
        gate.set()
        epoch.close()
    assert len(at_once["stages"]["augment"]["pending"]["deliveries"]) > 0
    assert first + resume(at_once, 1, augment=noisy, timeout=60, **kwargs) == reference


def test_resume_with_other_workers_and_worker_type():
    for kwargs in ({}, {"augment": noisy}):
        reference = run(make(num_workers=3, **kwargs))
        taken, state = take_then_save(make(num_workers=3, **kwargs), 10)
        assert taken + resume(state, num_workers=2, worker_type="process", **kwargs) == reference
        taken, state = take_then_save(make(num_workers=2, worker_type="process", **kwargs), 20)
        assert taken + resume(state, num_workers=1, **kwargs) == reference


def test_augment_draws_from_its_generator_the_same_for_any_workers():
    seen = []

    def augment(example, rng):
        seen.append(type(rng))
        return noisy(example, rng)

    reference = run(make(augment=augment, num_workers=1), 1)
    assert seen and set(seen) == {np.random.Generator}
    assert run(make(augment=noisy, num_workers=4), 1) == reference
    assert run(make(augment=noisy, num_workers=2, worker_type="process"), 1) == reference
    assert run(make(augment=noisy, num_workers=2, seed=8), 1) != reference, "another seed, other draws"
    draws = [noise for batch in reference for _, noise in batch]
    assert len(set(draws)) > 0.99 * len(draws), "every delivery draws from its own stream"


def test_the_state_is_small_and_names_every_resident_example():
    _, state = take_then_save(make(), 5)
    intake = state["stages"]["intake"]
    assert state["epoch"] == 0 and intake["next_seq"] > 0
    resident = len(intake["positions"])
    assert 0 < resident <= 256
    assert min(intake["echoes"]) >= 1 and max(intake["echoes"]) <= 2  # echo 1.5: 1 or 2 left
    # Indices are those of the epoch's order at the positions.
    assert len(set(intake["indices"])) == resident
    queued_rows = sum(len(q["rows"]) for q in intake["queued"])
    assert len(json.dumps(state)) <= 20 * resident + 8 * queued_rows + 3000


def test_the_state_with_augment_and_batch_echo_stays_small():
    _, state = take_then_save(make(augment=noisy, echo_at="batch", echo_factor=2, shuffle_buffer=4), 9)
    stages = state["stages"]
    assert len(stages["batch_echo"]["entries"]) <= 4
    pending = stages["augment"]["pending"]["deliveries"]
    # The output buffer's rows (capacity max(4 * batch_size, 256)) and those the 3 workers augment.
    assert len(pending) <= 256 + 3 * 32
    rows_named = sum(len(e["rows"]) for e in stages["batch_echo"]["entries"]) + len(pending)
    assert len(json.dumps(state)) <= 20 * len(stages["intake"]["positions"]) + 16 * rows_named + 6000


def test_resume_reads_only_resident_and_later_examples():
    source = Records(N, count_reads=True)
    taken, state = take_then_save(make(), 20)
    loader = make(source)
    loader.load_state_dict(state)
    rest = [rows(b) for b in loader]
    stages = state["stages"]
    intake = stages["intake"]
    queued_rows = sum(len(q["rows"]) for q in stages["intake"]["queued"] + stages["delivery"]["in_flight"])
    # Every example left to read, the resident ones and the queued rows; the structure comes with the state.
    assert sum(source.reads.values()) == (N - intake["next_seq"]) + len(intake["positions"]) + queued_rows
    assert taken + rest == run(make(), 1)


def test_state_before_iterating_and_after_loading():
    loader = make()
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["stages"] is None
    _, saved = take_then_save(make(), 7)
    loader.load_state_dict(saved)
    assert loader.state_dict()["stages"]["intake"]["next_seq"] == saved["stages"]["intake"]["next_seq"]


def test_state_at_an_epoch_boundary_starts_the_next_epoch():
    loader = make()
    first = [rows(b) for b in loader]
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["stages"] is None
    assert resume(state) == run(make())[len(first):]


class Stream:
    def __iter__(self):
        return iter(range(500))


def test_a_non_deterministic_iterable_resumes_by_skipping_what_was_taken():
    # deterministic=False: a state says how many examples were taken from the
    # iterator, not which were delivered; resuming says what it may lose.
    def loader_over(stream):
        return dataecho.EchoLoader(stream, batch_size=10, echo_factor=1, shuffle_buffer=50, seed=3,
                                   deterministic=False)

    loader = loader_over(Stream())
    epoch = iter(loader)
    seen = [next(epoch).tolist() for _ in range(10)]
    state = loader.state_dict()
    skip = state["stages"]["intake"]["skip"]
    assert 100 <= skip <= 500
    resumed = loader_over(Stream())
    with pytest.warns(UserWarning, match=f"skips the {skip} examples"):
        resumed.load_state_dict(state)
    rest = np.concatenate(list(resumed)).tolist()
    assert sorted(rest) == list(range(skip, 500)), "the skipped examples are not read again"
    assert len(set(sum(seen, [])) & set(rest)) == 0


@pytest.mark.parametrize("num_workers", [0, 2, 4])
@pytest.mark.parametrize("cut", [1, 7, 30])
def test_an_iterable_resumes_every_example_not_yet_delivered(num_workers, cut):
    # By default an iterable read by threads is read in a deterministic order:
    # a state names the examples by their position in the iteration, and the
    # resumed loader reads the iterable again up to there, keeping those.
    def loader_over(stream, **kwargs):
        return dataecho.EchoLoader(stream, batch_size=10, echo_factor=1, shuffle_buffer=50, num_workers=num_workers,
                                   transform=lambda x: x * 2, **kwargs)

    loader = loader_over(Stream())
    epoch = iter(loader)
    seen = [x for _ in range(cut) for x in next(epoch).tolist()]
    state = loader.state_dict()
    resumed = loader_over(Stream())
    resumed.load_state_dict(state)
    rest = np.concatenate(list(resumed)).tolist()
    assert sorted(seen + rest) == [2 * i for i in range(500)], "every example delivered once, across the two"
    assert rest == np.concatenate(list(loader_over(Stream(), seed=state["config"]["seed"]))).tolist()[10 * cut:]


def identity(example):
    return example


@pytest.mark.parametrize("num_workers, transform", [(0, None), (1, None), (3, identity)])
@pytest.mark.parametrize("cut", [1, 40, 150])
def test_a_restartable_iterable_resumes_from_its_saved_state_not_from_its_start(num_workers, transform, cut):
    # An iterable that can say where its iteration stands and restart there
    # (dataecho.reading.restart): the state keeps its state before the earliest
    # example the state names, and a resume reads it from there on.
    n = 2000

    def loader_over(stream):
        return dataecho.EchoLoader(stream, batch_size=10, echo_factor=2, shuffle_buffer=50, num_workers=num_workers,
                                   transform=transform, seed=3)

    whole = run(loader_over(RestartableStream(n)), epochs=1)
    taken, state = take_then_save(loader_over(RestartableStream(n)), cut)
    intake = state["stages"]["intake"]
    restart = intake["restart"]
    assert restart["state"] == restart["position"], "the stream's own state there: the id it yields next"
    assert restart["position"] <= min(intake["positions"] + [intake["next_seq"]])
    stream = RestartableStream(n)
    resumed = loader_over(stream)
    resumed.load_state_dict(state)
    assert taken + run(resumed, epochs=1) == whole
    assert stream.made == n - restart["position"], "read again from the restart point, not from the start"


def test_a_restartable_iterable_read_in_no_fixed_order_restarts_where_it_was_read():
    n = 2000
    loader = dataecho.EchoLoader(RestartableStream(n), batch_size=10, echo_factor="auto", shuffle_buffer=50, seed=3)
    _, state = take_then_save(loader, 30)
    skip, restart = state["stages"]["intake"]["skip"], state["stages"]["intake"]["restart"]["position"]
    assert restart <= skip
    stream = RestartableStream(n)
    resumed = dataecho.EchoLoader(stream, batch_size=10, echo_factor="auto", shuffle_buffer=50, seed=3)
    with pytest.warns(UserWarning, match=f"skips the {skip} examples"):
        resumed.load_state_dict(state)
    assert sorted(set(i for batch in run(resumed, epochs=1) for i in batch)) == list(range(skip, n))
    assert stream.made == n - restart


@pytest.mark.parametrize("source", [RecordStream, RestartableStream])
def test_a_state_taken_as_an_iterable_epoch_ends_resumes_its_last_batches(source):
    # Once the buffer's assembler has made the last batches, its own state no
    # longer says how far the iterable was read: the batches still queued do.
    def loader_over():
        return dataecho.EchoLoader(source(100), batch_size=4, echo_factor=2, shuffle_buffer=16, seed=0)

    whole = run(loader_over(), epochs=1)
    for trial in range(6):  # whether the assembler has exited yet is timing
        for cut in (len(whole) - 2, len(whole) - 1):
            taken, state = take_then_save(loader_over(), cut)
            resumed = loader_over()
            resumed.load_state_dict(state)
            assert taken + run(resumed, epochs=1) == whole, (trial, cut)


def test_bad_states_are_refused():
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
    with pytest.raises(ValueError, match="another version of dataecho"):
        make().load_state_dict({**state, "format": "dataecho.EchoLoader/1"})
    intake = state["stages"]["intake"]
    broken = {**state, "stages": {**state["stages"], "intake": {**intake, "indices": intake["indices"][::-1].copy()}}}
    with pytest.raises(ValueError, match="indices"):
        make().load_state_dict(broken)
    twice = {**intake, "positions": np.repeat(intake["positions"][:1], len(intake["positions"]))}
    with pytest.raises(ValueError, match="positions|indices"):
        make().load_state_dict({**state, "stages": {**state["stages"], "intake": twice}})
    with pytest.raises(ValueError, match="stages"):
        make().load_state_dict({**state, "stages": {"intake": intake}})


@pytest.mark.parametrize(
    "change",
    [{"batch_size": 64}, {"echo_factor": 2}, {"shuffle_buffer": 128}, {"echo_at": "batch"}, {"drop_last": True},
     {"shuffle": False}, {"augment": noisy}, {"max_echo": 3.0}],
    ids=lambda change: next(iter(change)),
)
def test_a_state_loads_only_where_it_decides_the_same_batches(change):
    # A mid-epoch state loaded into a loader that would batch differently would
    # resume with mixed batch sizes or wrong echo counts: refused, naming the argument.
    _, state = take_then_save(make(), 5)
    name = next(iter(change))
    with pytest.raises(ValueError, match=f"saved with {name}=.*this loader has {name}="):
        make(**change).load_state_dict(state)
    make(num_workers=1, prefetch_factor=4).load_state_dict(state)  # what does not decide the batches may differ


def test_unresumable_loaders_say_why():
    for kwargs, match in (({"deterministic": False}, "deterministic=True"), ({"augment": own_noise}, "rng")):
        loader = make(**kwargs)
        epoch = iter(loader)
        next(epoch)
        with pytest.raises(ValueError, match=match):
            loader.state_dict()
        epoch.close()
        assert loader.state_dict()["stages"] is None, "between epochs it works everywhere"


def test_resume_with_batches_on_their_way_to_the_device():
    # device= keeps one batch in flight ahead of the one yielded: the state puts
    # it first among the batches still to come, and a loader without a device
    # resumed from it yields it too.
    pytest.importorskip("torch")
    for extra in ({}, {"augment": noisy}):
        kwargs = {"device": "cpu", "output": "torch", **extra}
        reference = run(make(**kwargs))
        for cut in (1, 3, len(reference) // 3):
            taken, state = take_then_save(make(**kwargs), cut)
            assert len(state["stages"]["delivery"]["in_flight"]) >= 1
            assert taken + resume(state, **kwargs) == reference, f"resumed after batch {cut}"
            assert taken + resume(state, **extra) == reference, f"resumed after batch {cut} without a device"


def test_tampered_states_are_refused_naming_the_key():
    _, state = take_then_save(make(), 5)
    intake = state["stages"]["intake"]

    def tampered(**changes):
        return {**state, "stages": {**state["stages"], "intake": {**intake, **changes}}}

    for value, message in ((1000, r"\['echoes'\]: at most 2 echoes left"),
                           (2 ** 32 + 1, r"\['echoes'\]: values beyond 4294967295")):
        with pytest.raises(ValueError, match=message):
            make().load_state_dict(tampered(echoes=[value] * len(intake["echoes"])))
    with pytest.raises(ValueError, match=r"\['ended'\]: True, with examples resident"):
        make().load_state_dict(tampered(ended=True))
    with pytest.raises(ValueError, match=r"\['rng_state'\]: expected an int in \[0, 18446744073709551615\]"):
        make().load_state_dict(tampered(rng_state=2 ** 64))
    row = intake["positions"][0]
    with pytest.raises(ValueError, match=r"\['queued'\]\[0\]\['rows'\]: an example more than 2 times"):
        make().load_state_dict(tampered(queued=[{"rows": np.array([row, row, row], dtype=np.uint64)}]))
