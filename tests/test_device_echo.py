"""Echo on the device (``echo_at="device"``, dataecho.pipeline.stages.device_echo):
the same deliveries as the host's echo where their rules coincide, exact
resume, ranks, ``"auto"``, ``device_augment`` keyed by its generator, the
device memory it holds and gives back, and what it refuses.

Everything runs on ``device="cpu"`` (a torch device like any other); the CUDA
copies run against a fake of torch.cuda (tests/test_device_paths.py's
DmaBackend), and on a GPU the tests marked ``cuda``, which skip elsewhere.
"""

from __future__ import annotations

import io
import time
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="echo on the device needs torch: pip install 'dataecho[torch]'")

import dataecho  # noqa: E402
from dataecho.pipeline.stages import device_fresh, device_rows  # noqa: E402
from dataecho.pipeline.stages.device_copy import DeviceMover  # noqa: E402
from support import PAYLOAD, Records, checked_ids, one  # noqa: E402
from test_device_paths import DmaBackend  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
N, B = 256, 16


def device_loader(source=None, **kwargs) -> dataecho.EchoLoader:
    options = {"batch_size": B, "echo_factor": 2, "seed": 7, "shuffle_buffer": 64, "echo_at": "device",
               "device": "cpu", **kwargs}
    return dataecho.EchoLoader(Records(N) if source is None else source, **options)


def epoch_ids(loader, stop_after: int | None = None) -> list[list[int]]:
    out = []
    for batch in loader:
        assert batch["id"].device.type == loader.device.type and batch["payload"].device.type == loader.device.type
        out.append(checked_ids({key: value.cpu() for key, value in batch.items()}).tolist())
        if stop_after is not None and len(out) == stop_after:
            break
    return out


def check_no_duplicates_while_a_batch_is_left(batches: list[list[int]]) -> None:
    """No example twice in a batch, but where fewer than a batch of examples are
    left to deliver (the epoch's end, as the host's echo buffer does)."""
    for k, ids in enumerate(batches):
        if len(set(ids)) < len(ids):
            left = {i for later in batches[k:] for i in later}
            assert len(left) < B, f"batch {k} repeats an example with {len(left)} examples left"


# ---- what is delivered ----


@pytest.mark.parametrize("echo", [1, 2, 2.5, 3])
def test_device_echo_delivers_each_example_as_often_as_host_echo_does(echo):
    with device_loader(echo_factor=echo) as loader:
        batches = epoch_ids(loader)
        assert len(batches) == len(loader), "len(loader) is the number of batches yielded"
    with dataecho.EchoLoader(Records(N), batch_size=B, echo_factor=echo, seed=7, shuffle_buffer=64) as host:
        host_counts = Counter(i for batch in host for i in checked_ids(batch).tolist())
    counts = Counter(i for batch in batches for i in batch)
    assert counts == host_counts, "exact counts by position: the same examples get the fractional extra"
    assert set(counts) == set(range(N))
    assert all(len(batch) == B for batch in batches[:-1])
    check_no_duplicates_while_a_batch_is_left(batches)


def test_shuffle_false_at_echo_1_is_the_reading_order_as_on_the_host():
    with device_loader(echo_factor=1, shuffle=False) as loader:
        assert [i for batch in epoch_ids(loader) for i in batch] == list(range(N))


def test_repeats_are_shuffled_through_the_device_buffer():
    with device_loader(echo_factor=2, shuffle_buffer=128) as loader:
        batches = epoch_ids(loader)
    first, gaps = {}, []
    for k, batch in enumerate(batches):
        for i in batch:
            if i in first:
                gaps.append(k - first[i])
            first.setdefault(i, k)
    assert min(gaps) >= 0 and np.mean(gaps) > 2, "a repeat comes batches later, not in the next batch"
    assert len({gap for gap in gaps}) > 5, "repeats spread over many distances"


def test_drop_last_drops_only_the_short_last_batch():
    with device_loader(Records(250), echo_factor=2, drop_last=True) as loader:
        batches = epoch_ids(loader)
        assert len(batches) == len(loader) == 500 // B
    assert all(len(batch) == B for batch in batches)
    assert sum(map(len, batches)) == 500 - 500 % B


def test_an_iterable_source_and_worker_processes_with_a_host_transform(tmp_path):
    def stream():
        return (one(i) for i in range(N))

    class Source:
        def __iter__(self):
            return stream()

    with device_loader(Source(), echo_factor=2) as loader:
        counts = Counter(i for batch in epoch_ids(loader) for i in batch)
    assert counts == Counter({i: 2 for i in range(N)})
    with device_loader(worker_type="process", num_workers=2, transform=_plus_payload, echo_factor=3) as loader:
        batches = [(b["id"].tolist(), b["payload"][:, 0].tolist()) for b in loader]
    counts = Counter(i for ids, _ in batches for i in ids)
    assert counts == Counter({i: 3 for i in range(N)})
    assert all(p == int(_plus_payload(one(i))["payload"][0]) for ids, ps in batches for i, p in zip(ids, ps))


def _plus_payload(example):
    return {"id": example["id"], "payload": example["payload"] + 1}


# ---- resume ----


def _travel(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("cut", [1, 7, 20, 31])
def test_a_resumed_epoch_delivers_what_the_uninterrupted_one_does(cut):
    options = {"echo_factor": 2.5, "device_augment": noisy}
    with device_loader(**options) as loader:
        whole = [(b["id"].tolist(), b["payload"].tolist()) for b in loader]
    with device_loader(**options) as loader:
        epoch = iter(loader)
        head = [(b["id"].tolist(), b["payload"].tolist()) for _, b in zip(range(cut), epoch)]
        state = _travel(loader.state_dict())
    assert len(state["stages"]["device_echo"]["positions"]) > 0, "the device's rows are named by position"
    with device_loader(**options) as resumed:
        resumed.load_state_dict(state)
        tail = [(b["id"].tolist(), b["payload"].tolist()) for b in resumed]
    assert head + tail == whole


def test_a_state_the_stage_could_not_have_saved_is_refused_by_key():
    with device_loader() as loader:
        next(iter(loader))
        state = loader.state_dict()
    state["stages"]["device_echo"]["left"] = state["stages"]["device_echo"]["left"][:-1]
    with device_loader() as loader, pytest.raises(ValueError, match="device_echo.*differ in length"):
        loader.load_state_dict(state)


def test_a_state_saved_with_a_device_augment_resumes_only_a_loader_with_one():
    with device_loader(device_augment=noisy) as loader:
        epoch = iter(loader)
        next(epoch)
        state = loader.state_dict()
    with device_loader() as loader, pytest.raises(ValueError, match="saved with device_augment='given'"):
        loader.load_state_dict(state)


def test_auto_refuses_a_state_mid_epoch_saying_why():
    with device_loader(echo_factor="auto") as loader:
        epoch = iter(loader)
        next(epoch)
        with pytest.raises(ValueError, match="echo_at='device' needs deterministic=True"):
            loader.state_dict()


# ---- ranks ----


def test_two_ranks_share_the_examples_each_delivering_its_shard_exactly():
    seen, lengths = Counter(), []
    for rank in range(2):
        with device_loader(echo_factor=1.5, rank=rank, world_size=2) as loader:
            batches = epoch_ids(loader)
            lengths.append((len(batches), len(loader)))
        seen.update(i for batch in batches for i in batch)
    assert lengths[0] == lengths[1] and lengths[0][0] == lengths[0][1], "every rank yields len(loader) batches"
    assert sum(seen.values()) == 2 * (N // 2 + N // 4)
    assert set(seen) == set(range(N)) and set(seen.values()) <= {1, 2}


def test_auto_keeps_two_ranks_in_lockstep_with_echo_on_the_device(tmp_path):
    from ranks import run_ranks

    slow, fast = run_ranks("auto_with_a_straggler", 2, tmp_path, "8,device")
    assert slow["batches"] == fast["batches"], "every rank yields as many batches"
    assert len(slow["counts"]) == len(fast["counts"]) == 200, "every example of each shard at least once"
    assert slow["echo_before_repeats"] > 1, "the straggler echoes on the device while it reads"


# ---- "auto" ----


def test_auto_repeats_on_the_device_while_the_input_is_slow():
    slow = Records(N, delay_s=0.002)
    with device_loader(slow, echo_factor="auto", max_echo=3, echo_gap=2, num_workers=2) as loader:
        batches = epoch_ids(loader)
        stats = loader.stats()["this_epoch"]
    counts = Counter(i for batch in batches for i in batch)
    assert set(counts) == set(range(N)), "every example at least once"
    assert max(counts.values()) <= 3, "no example beyond max_echo"
    assert stats["delivered"] > N, "the step did not wait: it trained on repeats"
    last = {}
    for k, batch in enumerate(batches):
        assert len(set(batch)) == len(batch), "no example twice in a batch"
        for i in batch:
            assert k - last.get(i, -2) >= 2, "echo_gap: two deliveries of an example are 2 batches apart"
            last[i] = k
    assert stats["repetition"]["max"] == max(counts.values())


def test_auto_read_in_the_loops_thread_repeats_while_reading_costs_more_than_the_step():
    # num_workers=0: the loop's thread reads (16 ms a batch here), so nothing reads while it steps;
    # over time it reads for as long as it steps and repeats fill the rest, as the host's paced reading.
    delivered = []
    for step_s in (0.0, 0.05):
        with device_loader(Records(N, delay_s=0.001), echo_factor="auto", num_workers=0) as loader:
            counts = Counter()
            for batch in loader:
                counts.update(batch["id"].tolist())
                time.sleep(step_s)
        assert set(counts) == set(range(N)) and max(counts.values()) <= 4
        delivered.append(sum(counts.values()))
    assert delivered[0] > 2 * N, "a step that takes no time: mostly repeats"
    assert delivered[1] < delivered[0], "a step longer than the reads: fewer repeats"


# ---- device augment ----


def noisy(batch, generator):
    """A batched augment on the device: noise drawn from the generator it is given."""
    noise = torch.randint(0, 40, batch["payload"].shape, generator=generator, device=batch["payload"].device)
    return {"id": batch["id"], "payload": batch["payload"] + noise.to(batch["payload"].dtype)}


def test_device_augment_is_reproducible_from_its_generator_and_new_for_every_repeat():
    def run():
        with device_loader(device_augment=noisy) as loader:
            return [(b["id"].tolist(), b["payload"].tolist()) for b in loader]

    first, second = run(), run()
    assert first == second, "the same seed: the same augmented batches"
    views = {}
    for ids, payloads in first:
        for i, p in zip(ids, payloads):
            noise = np.asarray(p) - one(i)["payload"].astype(np.int64)
            assert noise.min() >= 0 and noise.max() < 40
            views.setdefault(i, []).append(tuple(noise))
    assert all(len(v) == 2 for v in views.values())
    assert sum(a != b for a, b in views.values()) == N, "each repeat is augmented anew"
    with device_loader(device_augment=noisy) as loader:
        assert loader.device_augment is noisy and loader.stats()["augmented"] == 0
        list(loader)
        assert loader.stats()["augmented"] == 2 * N


def test_device_augment_that_returns_another_structure_is_named():
    with device_loader(device_augment=lambda batch, generator: batch["payload"]) as loader:
        with pytest.raises(TypeError, match="device_augment: expected a dict"):
            next(iter(loader))


# ---- device memory ----


def test_the_device_buffer_is_bounded_and_given_back_at_the_end():
    row_bytes = 8 + PAYLOAD
    with device_loader(shuffle_buffer=96) as loader:
        epoch = iter(loader)
        next(epoch)
        memory = loader.stats()["this_epoch"]["device_memory"]
        assert memory["rows"] == 96 + B and memory["bytes"] == (96 + B) * row_bytes
        assert 0 < memory["resident"] <= 96
        stage = epoch._stages.chain.stages[-1]
        kept = stage._rows
        list(epoch)
    assert kept.nbytes == 0, "the device memory is given back when the epoch ends"
    with device_loader() as loader:
        epoch = iter(loader)
        next(epoch)
        kept = epoch._stages.chain.stages[-1]._rows
    assert kept.nbytes == 0, "... and when the loader is closed mid-epoch"


def test_a_device_buffer_that_does_not_fit_says_so(monkeypatch):
    monkeypatch.setattr(device_rows, "_free_bytes", lambda torch, device: 1000)
    with device_loader() as loader:
        with pytest.raises(RuntimeError, match=r"shuffle_buffer: with echo_at='device', 80 rows of 24 bytes"):
            next(iter(loader))


# ---- the CUDA copies, against a fake ----


def test_fresh_batches_reach_the_device_rows_whole_and_their_host_memory_only_after_the_copy(monkeypatch):
    made: list[DmaBackend] = []

    def mover(device, **options):
        made.append(DmaBackend())
        options.pop("backend", None)
        return DeviceMover(device, backend=made[-1], **options)

    monkeypatch.setattr(device_fresh, "DeviceMover", mover)
    handed_out = []  # the copy log's length as each batch was handed out
    with device_loader(echo_factor=2, prefetch_factor=1, shuffle_buffer=32) as loader:
        counts = Counter()
        for batch in loader:
            handed_out.append(len(made[-1].log))
            counts.update(checked_ids(batch).tolist())
    assert counts == Counter({i: 2 for i in range(N)}), "every row whole, from the copy that landed"
    backend = made[-1]
    assert not backend.released_in_flight and not backend.reused_in_flight
    log = backend.log
    waits = [(at, entry[2]) for at, entry in enumerate(log) if entry[0] == "wait"]
    assert len(waits) == N // B and all(log[at][1] == "default" for at, _ in waits), \
        "each fresh batch once, waited for by the consumer's stream before its rows are written"
    recorded = {entry[1]: at for at, entry in enumerate(log) if entry[0] == "record"}
    ahead = sum(any(recorded[event] < mark <= at for mark in handed_out) for at, event in waits)
    assert ahead >= len(waits) - 4, "past the first batches, each fresh copy starts a batch before it is needed"


# ---- what it refuses ----


@pytest.mark.parametrize("kwargs, error, match", [
    ({"device": None}, ValueError, "echo_at: 'device' keeps the examples on a torch device; give device="),
    ({"augment": lambda e: e}, ValueError, "augment: runs per example on the host"),
    ({"shuffle_buffer": 20}, ValueError, "shuffle_buffer: with echo_at='device', expected at least 2"),
    ({"ragged": ["payload"]}, ValueError, "ragged: echo_at='device' keeps examples as fixed-shape rows"),
    ({"device_augment": 3}, TypeError, "device_augment: expected a callable"),
    ({"echo_at": "example", "device_augment": noisy}, ValueError, "device_augment: augments the batches"),
    ({"echo_at": "nowhere"}, ValueError, "echo_at"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        device_loader(**kwargs)


def test_a_batch_sampler_is_refused():
    sampler = [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="echo_at: 'device' forms new batches"):
        dataecho.EchoLoader(Records(4), batch_sampler=sampler, echo_at="device", device="cpu")


def test_ragged_leaves_are_refused_by_path():
    with device_loader(Records(N, form="ragged")) as loader:
        with pytest.raises(ValueError, match="leaf 'tokens' is ragged"):
            next(iter(loader))


# ---- on a GPU ----


@needs_cuda
def test_cuda_device_echo_counts_rows_and_augment():
    with device_loader(echo_factor=3, device="cuda", pin_memory=True, device_augment=noisy) as loader:
        ids = [b["id"].cpu().tolist() for b in loader]
        assert loader.stats()["this_epoch"]["device_memory"]["bytes"] == 0
    assert Counter(i for b in ids for i in b) == Counter({i: 3 for i in range(N)})
    with device_loader(echo_factor=2, device="cuda", pin_memory=True) as loader:
        started = time.perf_counter()
        batches = epoch_ids(loader)
    assert Counter(i for b in batches for i in b) == Counter({i: 2 for i in range(N)}), time.perf_counter() - started


@needs_cuda
def test_cuda_device_echo_with_the_loop_switching_streams():
    # Each batch asked for under another stream: the rows' writes and gathers keep their order across them.
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    batches = []
    with device_loader(echo_factor=3, device="cuda") as loader:
        epoch = iter(loader)
        for k in range(10 ** 6):
            with torch.cuda.stream(streams[k % 2]):
                try:
                    batch = next(epoch)
                except StopIteration:
                    break
                batches.append(checked_ids({key: value.cpu() for key, value in batch.items()}).tolist())
    assert Counter(i for b in batches for i in b) == Counter({i: 3 for i in range(N)})
