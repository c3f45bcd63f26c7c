"""EchoLoader: the paper's three placements, fractional and adaptive factors,
producers, errors, structures, epochs, determinism and the torch hand-off."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, namedtuple

import dataecho
import numpy as np
import pytest
from processes import dataecho_threads
from support import (
    PAYLOAD,
    InjectedFault,
    Records,
    checked_ids,
    join_all,
    payload_of,
    spy_on_last_stage,
    start,
    take_refused,
)


def ids_of(batches):
    return Counter(itertools.chain.from_iterable(b["id"].tolist() for b in batches))


def stamping():
    """A function that adds a "stamp" field to an example: a number no other call gets."""
    stamps = itertools.count()
    lock = threading.Lock()

    def stamp(ex):
        with lock:
            return {**ex, "stamp": next(stamps)}

    return stamp


def stamps_by_id(batches):
    """id -> the stamps its deliveries carried, in delivery order."""
    stamps = {}
    for b in batches:
        for i, s in zip(b["id"].tolist(), b["stamp"].tolist()):
            stamps.setdefault(i, []).append(s)
    return stamps


@pytest.fixture(autouse=True)
def no_threads_from_earlier_tests():
    # An epoch dropped without close() stops its threads without joining them;
    # let those of earlier tests end, so that each test sees only its own.
    deadline = time.monotonic() + 5
    while dataecho_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    yield


# ---- placements ----


def test_example_echo_after_augmentation_repeats_the_transformed_example(seed):
    # Augmentation inside transform: echoed as is.
    loader = dataecho.EchoLoader(
        Records(2000, count_reads=True), batch_size=32, echo_factor=2, transform=stamping(), seed=seed
    )
    batches = list(loader)
    seen = ids_of(batches)
    assert sorted(seen) == list(range(2000)) and set(seen.values()) == {2}
    for stamps in stamps_by_id(batches).values():
        assert len(set(stamps)) == 1, "both deliveries carry the one transformed copy"
    assert loader.dataset.reads == Counter({i: 1 for i in range(2000)}), "each example is read once"


def test_example_echo_before_augmentation_augments_every_repeat_anew(seed):
    stamps = itertools.count()
    lock = threading.Lock()

    def augment(ex):
        with lock:
            stamp = next(stamps)
        # New fields and a new shape: batches take augment's structure.
        return {"id": ex["id"], "head": ex["payload"][:2].astype(np.int64) * 2, "stamp": stamp}

    loader = dataecho.EchoLoader(Records(2000), batch_size=32, echo_factor=3, augment=augment, seed=seed)
    batches = list(loader)
    assert batches[0]["head"].shape == (32, 2) and set(batches[0]) == {"id", "head", "stamp"}
    seen = ids_of(batches)
    assert sorted(seen) == list(range(2000)) and set(seen.values()) == {3}
    for b in batches:
        np.testing.assert_array_equal(b["head"], 2 * payload_of(b["id"])[:, :2].astype(np.int64))
    assert all(len(set(s)) == 3 for s in stamps_by_id(batches).values()), "each repeat is augmented anew"
    assert not dataecho_threads()


def test_augment_gets_read_only_views(seed):
    def augment(ex):
        ex["payload"] += 1  # an in-place change must not reach the repeat
        return ex

    loader = dataecho.EchoLoader(Records(100), batch_size=10, echo_factor=2, augment=augment, seed=seed)
    with pytest.raises(ValueError, match="read-only"):
        list(loader)


def test_batch_echo_yields_each_batch_e_times_never_twice_in_a_row(seed):
    loader = dataecho.EchoLoader(
        Records(3200), batch_size=32, echo_factor=3, echo_at="batch", shuffle_buffer=8, seed=seed
    )
    batches = list(loader)
    keys = [tuple(b["id"].tolist()) for b in batches]
    counts = Counter(keys)
    assert len(counts) == 100 and set(counts.values()) == {3}
    assert sorted(itertools.chain.from_iterable(counts)) == list(range(3200))
    # A repeat never follows its original while another batch is resident: only
    # the very end (one batch left with echoes to give) may repeat back to back.
    assert all(a != b for a, b in zip(keys[:-3], keys[1:-3])), "a repeat followed its original"
    # Repeats share memory and are read-only.
    with pytest.raises(ValueError, match="read-only"):
        batches[0]["payload"][0, 0] = 1
    assert len(batches) == len(loader) == 300


def test_batch_echo_with_augment_augments_each_delivery(seed):
    loader = dataecho.EchoLoader(
        Records(640), batch_size=32, echo_factor=2, echo_at="batch", augment=stamping(), seed=seed
    )
    batches = list(loader)
    seen = ids_of(batches)
    assert sorted(seen) == list(range(640)) and set(seen.values()) == {2}
    for b in batches:
        checked_ids(b)
    stamps = stamps_by_id(batches)
    assert all(len(set(s)) == 2 for s in stamps.values()), "each delivery is augmented anew"
    assert sorted(itertools.chain.from_iterable(stamps.values())) == list(range(1280)), "one call per delivery"


# ---- echo factors ----


def test_fractional_echo_factor_mean(seed):
    loader = dataecho.EchoLoader(range(20_000), batch_size=256, echo_factor=1.5, seed=seed)
    seen = Counter(itertools.chain.from_iterable(b.tolist() for b in loader))
    assert sorted(seen) == list(range(20_000)) and set(seen.values()) == {1, 2}
    assert abs(np.mean(list(seen.values())) - 1.5) < 0.015
    assert loader.stats()["echo_factor_achieved"] == pytest.approx(np.mean(list(seen.values())))


def test_auto_rises_under_a_slow_upstream(seed):
    loader = dataecho.EchoLoader(
        Records(300, delay_s=0.004), batch_size=16, echo_factor="auto", max_echo=4.0, num_workers=1,
        shuffle_buffer=256, seed=seed,
    )
    seen = ids_of(list(loader))
    assert sorted(seen) == list(range(300)) and max(seen.values()) <= 4
    assert loader.stats()["echo_factor_achieved"] > 2.5


def test_auto_stays_near_one_under_a_fast_upstream(seed):
    loader = dataecho.EchoLoader(
        range(20_000), batch_size=64, echo_factor="auto", max_echo=4.0, shuffle_buffer=1024, seed=seed
    )
    delivered = 0
    for batch in loader:
        delivered += len(batch)
        time.sleep(0.005)  # a training step far slower than reading, even on a loaded machine
    assert loader.stats()["echo_factor_achieved"] < 1.15
    assert delivered == loader.stats()["delivered"]


def test_auto_batch_echo_repeats_only_when_the_upstream_lags(seed):
    slow = dataecho.EchoLoader(
        Records(200, delay_s=0.005), batch_size=10, echo_factor="auto", echo_at="batch", num_workers=1, seed=seed
    )
    list(slow)
    assert slow.stats()["echo_factor_achieved"] > 2.0


# ---- producers, errors, shutdown ----


@pytest.mark.parametrize("where", ["source", "transform", "augment", "iterable"])
def test_errors_propagate_with_their_traceback_and_stop_every_thread(where, seed):
    def bad_transform(ex):
        if int(ex["id"]) == 777:
            raise InjectedFault("bad example 777")
        return ex

    def gen():
        for i in range(2000):
            if i == 500:
                raise InjectedFault("the stream broke")
            yield np.full(2, i)

    kwargs = {"batch_size": 16, "echo_factor": 2, "seed": seed, "shuffle": False}
    source = {"source": Records(2000, fail_at=777), "iterable": gen()}.get(where, Records(2000))
    if where == "transform":
        kwargs["transform"] = bad_transform
    if where == "augment":
        kwargs["augment"] = bad_transform
    loader = dataecho.EchoLoader(source, **kwargs)
    with pytest.raises(InjectedFault) as info:
        for _ in loader:
            pass
    frames = [f.name for f in info.traceback]
    assert {"read_record", "bad_transform", "gen"} & set(frames), frames
    deadline = time.monotonic() + 5
    while dataecho_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not dataecho_threads()


@pytest.mark.parametrize("where", ["source", "transform", "augment", "process"])
def test_stop_iteration_in_user_code_is_an_error_not_the_end(where, seed):
    # A next() on an exhausted iterator inside __getitem__, transform or augment
    # must not end the epoch silently, short of examples.
    def stops_at_300(ex):
        if int(ex["id"]) == 300:
            next(iter([]))
        return ex

    source = Records(1000, fail_at=300 if where in ("source", "process") else None, fail_with="stop")
    kwargs = {"batch_size": 10, "echo_factor": 1, "seed": seed}
    kwargs.update({"transform": {"transform": stops_at_300}, "augment": {"augment": stops_at_300},
                   "process": {"worker_type": "process"}}.get(where, {}))
    with pytest.raises(RuntimeError, match="raised StopIteration") as info:
        for _ in dataecho.EchoLoader(source, **kwargs):
            pass
    assert isinstance(info.value.__cause__, StopIteration)


@pytest.mark.parametrize("echo_at", ["example", "batch"])
def test_a_second_thread_taking_batches_gets_an_error_and_the_epoch_stays_exact(echo_at, seed):
    loader = dataecho.EchoLoader(Records(2000), batch_size=8, echo_factor=2, echo_at=echo_at, seed=seed)
    epoch = iter(loader)
    refused: list[str] = []
    consumers = [start(lambda: take_refused(epoch, refused), f"consumer-{i}") for i in range(2)]
    join_all(consumers, 60, "consumers")
    assert [c.error for c in consumers] == [None, None]
    assert all("another thread is already taking batches" in r for r in refused)
    taken = [ids for c in consumers for ids in c.result]
    assert len(taken) == len(loader) and set(ids_of([{"id": t} for t in taken]).values()) == {2}


def test_a_stale_iterator_says_so_instead_of_ending_quietly(seed):
    loader = dataecho.EchoLoader(Records(1000), batch_size=10, echo_factor=1, seed=seed)
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(RuntimeError, match="ended by a later iter"):
        next(first)
    assert sum(len(b["id"]) for b in second) == 1000, "the newer epoch is whole"
    with pytest.raises(RuntimeError, match="ended by a later iter"):
        list(zip(loader, loader))
    loader.close()
    closed = iter(loader)
    loader.close()  # closed by the user: it ends quietly
    assert list(closed) == []


def test_two_threads_starting_epochs_at_once_never_end_one_short(seed):
    loader = dataecho.EchoLoader(Records(2000, delay_s=0.0002), batch_size=10, echo_factor=1, seed=seed)
    outcomes, barrier = [], threading.Barrier(2)

    def run():
        barrier.wait()
        try:
            outcomes.append(sum(len(b["id"]) for b in loader))
        except RuntimeError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == 2
    assert all(o == 2000 or "ended by a later iter" in str(o) for o in outcomes), outcomes
    assert 2000 in outcomes


def test_leaving_an_epoch_early_stops_its_threads(seed):
    loader = dataecho.EchoLoader(Records(100_000), batch_size=32, echo_factor=2, num_workers=3, seed=seed)
    epoch = iter(loader)
    for i, _ in enumerate(epoch):
        if i == 5:
            break
    assert dataecho_threads()
    loader.close()
    assert not dataecho_threads()


def test_dropping_an_epoch_stops_its_threads(seed):
    # Leaving a for loop drops its iterator, the epoch: nothing else would stop it.
    loader = dataecho.EchoLoader(Records(100_000), batch_size=32, echo_factor=2, num_workers=3, seed=seed)
    for i, _ in enumerate(loader):
        if i == 5:
            break
    deadline = time.monotonic() + 3
    while dataecho_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not dataecho_threads()
    assert loader.stats()["batches"] == 6


def test_a_loader_nobody_else_holds_lives_as_long_as_its_epoch(seed):
    # `for batch in EchoLoader(...)` keeps only the epoch: it keeps the loader.
    batches = [b.copy() for b in dataecho.EchoLoader(range(1000), batch_size=100, echo_factor=2, seed=seed)]
    assert sorted(np.concatenate(batches).tolist()) == sorted(list(range(1000)) * 2)


def test_first_batch_comes_before_the_buffer_fills(seed):
    gate = threading.Event()

    def gen():
        for i in range(5000):
            if i == 1100:
                gate.wait(10)  # the source stalls after 1100 examples
            yield np.int64(i)

    loader = dataecho.EchoLoader(gen(), batch_size=32, echo_factor=1, shuffle_buffer=4096, seed=seed)
    start = time.monotonic()
    first = next(iter(loader))
    assert time.monotonic() - start < 5 and len(first) == 32
    gate.set()
    loader.close()


# ---- structures ----


Pair = namedtuple("Pair", "image label")


def test_mixed_structures_round_trip():
    torch = pytest.importorskip("torch")
    examples = [
        {"a": (np.full((2, 2), i, np.uint8), float(i)), "b": {"c": torch.full((3,), i), "d": np.bool_(i % 2)}}
        for i in range(64)
    ]
    loader = dataecho.EchoLoader(examples, batch_size=64, echo_factor=1, shuffle=False, seed=0)
    (batch,) = list(loader)
    order = np.argsort(batch["a"][1])
    assert batch["a"][0].dtype == np.uint8 and batch["a"][0].shape == (64, 2, 2)
    assert batch["b"]["c"].dtype == np.int64 and batch["b"]["d"].dtype == np.bool_
    np.testing.assert_array_equal(batch["b"]["c"][order][:, 0], np.arange(64))
    np.testing.assert_array_equal(batch["b"]["d"][order], np.arange(64) % 2 == 1)

    pairs = dataecho.EchoLoader([Pair(np.zeros(4), 1)] * 8, batch_size=4, echo_factor=1, seed=0)
    batch = next(iter(pairs))
    assert isinstance(batch, Pair) and batch.image.shape == (4, 4)
    plain = dataecho.EchoLoader([np.zeros(5, np.float32)] * 8, batch_size=4, echo_factor=1, seed=0)
    assert next(iter(plain)).shape == (4, 5)


@pytest.mark.parametrize(
    "bad,pattern",
    [
        ({"image": np.zeros((3, 3)), "label": 1}, r"'image'.*shape \(2, 2\).*\(3, 3\)"),
        ({"image": np.zeros((2, 2)), "label": 1.5}, r"'label'.*float64"),
        ({"image": np.zeros((2, 2))}, r"missing \['label'\]"),
        ((np.zeros((2, 2)), 1), "expected a dict"),
    ],
)
def test_a_mismatching_example_names_the_field(bad, pattern):
    examples = [{"image": np.zeros((2, 2)), "label": i} for i in range(50)] + [bad]
    loader = dataecho.EchoLoader(examples, batch_size=8, echo_factor=1, shuffle=False, num_workers=1, seed=0)
    with pytest.raises((TypeError, ValueError), match=pattern):
        list(loader)


# ---- epochs, length, determinism ----


def test_epochs_reshuffle_and_deliver_everything(seed):
    loader = dataecho.EchoLoader(Records(500), batch_size=50, echo_factor=2, seed=seed, num_workers=1)
    first = [b["id"].copy() for b in loader]
    second = [b["id"].copy() for b in loader]
    for epoch in (first, second):
        counts = Counter(np.concatenate(epoch).tolist())
        assert sorted(counts) == list(range(500)) and set(counts.values()) == {2}
        assert len(epoch) == len(loader) == 20
    assert not np.array_equal(np.concatenate(first), np.concatenate(second))
    assert loader.stats()["epoch"] == 1 and loader.stats()["fresh"] == 1000


def test_same_seed_one_worker_same_batches():
    def run(seed):
        loader = dataecho.EchoLoader(Records(1000), batch_size=32, echo_factor=1.5, num_workers=1, seed=seed)
        return np.concatenate([b["id"] for b in loader])

    np.testing.assert_array_equal(run(7), run(7))
    assert not np.array_equal(run(7)[:500], run(8)[:500])


def test_len_is_defined_only_where_it_is_fixed():
    assert len(dataecho.EchoLoader(range(1000), batch_size=64, echo_factor=2)) == 32
    assert len(dataecho.EchoLoader(range(1000), batch_size=64, echo_factor=2, drop_last=True)) == 31
    # Fractional factors give exact counts by position where the order is deterministic (the default).
    assert len(dataecho.EchoLoader(range(1000), batch_size=64, echo_factor=1.5)) == 24
    with pytest.raises(TypeError, match="fractional or 'auto'"):
        len(dataecho.EchoLoader(range(1000), echo_factor=1.5, deterministic=False))
    with pytest.raises(TypeError, match="fractional or 'auto'"):
        len(dataecho.EchoLoader(range(1000), echo_factor="auto"))
    with pytest.raises(TypeError, match="unknown length"):
        len(dataecho.EchoLoader(iter(range(1000))))


def test_len_of_an_iterable_dataset_with_len_is_its_word_for_it_as_in_dataloader():
    torch = pytest.importorskip("torch")

    class Sized(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(1000))

        def __len__(self):
            return 1000

    assert len(dataecho.EchoLoader(Sized(), batch_size=64, echo_factor=1)) == 16
    assert len(torch.utils.data.DataLoader(Sized(), batch_size=64)) == 16
    assert len(dataecho.EchoLoader(Sized(), batch_size=64, echo_factor=2, drop_last=True)) == 31
    loader = dataecho.EchoLoader(Sized(), batch_size=64, echo_factor=2, seed=1)
    assert sum(1 for _ in loader) == len(loader) == 32, "the batches the epoch yields"


def test_drop_last_yields_only_full_batches(seed):
    loader = dataecho.EchoLoader(range(1000), batch_size=64, echo_factor=1, drop_last=True, seed=seed)
    batches = list(loader)
    assert len(batches) == 15 and all(len(b) == 64 for b in batches)


# ---- torch ----


def test_torch_output_shares_the_native_batch_memory(seed):
    torch = pytest.importorskip("torch")
    loader = dataecho.EchoLoader(Records(256), batch_size=32, echo_factor=1, output="torch", seed=seed)
    epoch = iter(loader)
    native = spy_on_last_stage(epoch)
    batch = next(epoch)
    assert isinstance(batch["payload"], torch.Tensor) and batch["payload"].shape == (32, PAYLOAD)
    assert {batch["payload"].data_ptr(), batch["id"].data_ptr()} == native[-1], "no copy"
    checked_ids({name: tensor.numpy() for name, tensor in batch.items()})
    loader.close()


@pytest.mark.parametrize("echo", [1, 2, 2.5, "auto"])
def test_batch_echo_keeps_the_short_batch_last(echo, seed):
    # 4 full batches of 8 and one of 1: as with DataLoader, the short one (and
    # its repeats) come after every full batch, whatever the echo factor.
    for epoch_seed in range(seed, seed + 8):
        loader = dataecho.EchoLoader(Records(33), batch_size=8, echo_factor=echo, echo_at="batch",
                                     shuffle_buffer=4, seed=epoch_seed)
        sizes = [len(b["id"]) for b in loader]
        full = sizes.count(8)
        assert sizes == [8] * full + [1] * (len(sizes) - full), sizes
        assert 1 in sizes


def test_auto_batch_echo_repeats_nothing_after_the_short_batch():
    # The race the loader test above can only sometimes hit: the short batch has
    # been taken in and delivered, and the upstream is slow to say it is done.
    from dataecho.pipeline.stages.batch_echo import BatchEchoSpec, BatchEchoStage
    from dataecho.pipeline.stages.stage import Batch

    class Upstream:
        def __init__(self):
            self.sizes = [8, 8, 8, 1]

        def next(self, timeout):
            if self.sizes:
                return Batch(None, (np.zeros(self.sizes.pop(0)),))
            if timeout == 0.0:
                raise TimeoutError  # not over yet: the consumer would wait
            raise StopIteration

    spec = BatchEchoSpec(resident=4, batch_size=8, echo_factor=None, max_echo=4.0, exact=False)
    stage = BatchEchoStage(spec, Upstream(), seed=0)
    sizes = []
    with pytest.raises(StopIteration):
        while True:
            sizes.append(len(stage.next()))
    assert sizes == [8, 8, 8, 1]


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_batch_echo_repeats_survive_in_place_changes(output, seed):
    # A loop that normalises its batch in place (batch.sub_(mean)) must not change
    # the later deliveries of that batch: torch tensors get their own memory for
    # every delivery but the last; NumPy arrays are read-only views.
    if output == "torch":
        pytest.importorskip("torch")
    loader = dataecho.EchoLoader(Records(640), batch_size=32, echo_factor=3, echo_at="batch", shuffle_buffer=4,
                                 output=output, seed=seed)
    seen = Counter()
    for batch in loader:
        ids = np.asarray(batch["id"])
        np.testing.assert_array_equal(np.asarray(batch["payload"]), payload_of(ids), "a delivery arrived changed")
        seen.update(ids.tolist())
        if output == "torch":
            batch["payload"].zero_()
            batch["id"].add_(1_000_000)
        else:
            with pytest.raises(ValueError, match="read-only"):
                batch["payload"][:] = 0
    assert sorted(seen) == list(range(640)) and set(seen.values()) == {3}


def test_batch_echo_copies_outlive_the_epoch_unchanged(seed):
    # The copies come from the echo buffer's batch pool: a block is reused only
    # once no tensor of it is alive, however long the loop keeps them.
    pytest.importorskip("torch")
    loader = dataecho.EchoLoader(Records(640), batch_size=32, echo_factor=3, echo_at="batch", shuffle_buffer=4,
                                 output="torch", seed=seed)
    kept = list(loader)
    for batch in kept:
        np.testing.assert_array_equal(batch["payload"].numpy(), payload_of(batch["id"].numpy()))
    assert len(kept) == len(loader) == 60


def test_device_cpu_path_delivers_every_batch_in_order(seed):
    torch = pytest.importorskip("torch")
    loader = dataecho.EchoLoader(Records(320), batch_size=32, echo_factor=2, output="torch", device="cpu", seed=seed)
    batches = list(loader)
    assert len(batches) == 20 and all(b["payload"].device.type == "cpu" for b in batches)
    seen = Counter(torch.cat([b["id"] for b in batches]).tolist())
    assert sorted(seen) == list(range(320)) and set(seen.values()) == {2}


def test_without_cuda_pin_memory_warns_and_goes_on_and_devices_are_checked_when_built():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    # As torch's DataLoader: a warning, and unpinned batches.
    with pytest.warns(UserWarning, match="pin_memory=True, but CUDA is not available"):
        loader = dataecho.EchoLoader(Records(40), batch_size=8, echo_factor=1, pin_memory=True, output="torch")
    assert not loader.pin_memory
    assert sum(len(b["id"]) for b in loader) == 40
    with pytest.raises(RuntimeError, match="needs CUDA"):
        dataecho.EchoLoader(range(10), device="cuda")
    for device in ("mps", "meta", "xpu"):  # refused when built, not at the first batch
        with pytest.raises(ValueError, match="device: expected a 'cpu' or 'cuda' device"):
            dataecho.EchoLoader(range(10), device=device)
    with pytest.raises(ValueError, match="pin_memory_device"):
        dataecho.EchoLoader(range(10), pin_memory_device="mps")


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torch") or not __import__("torch").cuda.is_available(),
    reason="needs CUDA",
)
def test_pinned_batches_reach_the_gpu(seed):
    loader = dataecho.EchoLoader(
        Records(2048), batch_size=64, echo_factor=2, output="torch", pin_memory=True, device="cuda", seed=seed
    )
    total = 0
    for batch in loader:
        assert batch["payload"].is_cuda
        checked_ids({name: tensor.cpu().numpy() for name, tensor in batch.items()})
        total += len(batch["id"])
    assert total == 4096


# ---- bad arguments ----


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        ({"dataset": 5}, TypeError, "dataset"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"echo_factor": 0.5}, ValueError, "echo_factor"),
        ({"echo_factor": "twice"}, ValueError, "echo_factor"),
        ({"echo_at": "epoch"}, ValueError, "echo_at"),
        ({"transform": 3}, TypeError, "transform"),
        ({"augment": "flip"}, TypeError, "augment"),
        ({"shuffle_buffer": 0}, ValueError, "shuffle_buffer"),
        ({"shuffle_buffer": 10, "batch_size": 64}, ValueError, "shuffle_buffer"),
        ({"num_workers": -1}, ValueError, "num_workers"),
        ({"num_workers": 0, "worker_type": "process"}, ValueError, "num_workers"),
        ({"num_workers": 1.5}, TypeError, "num_workers"),
        ({"dataset": None}, TypeError, "dataset"),
        ({"batch_sampler": [[0, 1]], "batch_size": 2}, ValueError, "batch_sampler option is mutually exclusive"),
        ({"sampler": [0, 1], "shuffle": True}, ValueError, "sampler"),
        ({"sampler": 3}, TypeError, "sampler"),
        ({"dataset": iter(range(3)), "sampler": [0]}, ValueError, "sampler"),
        ({"collate_fn": "stack"}, TypeError, "collate_fn"),
        ({"worker_init_fn": 1}, TypeError, "worker_init_fn"),
        ({"prefetch_factor": 0}, ValueError, "prefetch_factor"),
        ({"prefetch_factor": 2, "num_workers": 0}, ValueError, "prefetch_factor"),
        ({"generator": 5}, TypeError, "generator"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"timeout": "1s"}, TypeError, "timeout"),
        ({"multiprocessing_context": "spawn", "num_workers": 0}, ValueError, "multiprocessing_context"),
        ({"multiprocessing_context": "spawn", "worker_type": "thread"}, ValueError, "multiprocessing_context"),
        ({"multiprocessing_context": 3}, TypeError, "multiprocessing_context"),
        ({"pin_memory_device": 0}, TypeError, "pin_memory_device"),
        ({"shuffle": "yes"}, TypeError, "shuffle"),
        ({"seed": -3}, ValueError, "seed"),
        ({"prefetch_factor": 0, "num_workers": 2}, ValueError, "prefetch_factor"),
        ({"source": range(3)}, TypeError, "source"),
        ({"workers": 2}, TypeError, "workers"),
        ({"max_echo": 0.9}, ValueError, "max_echo"),
        ({"output": "tensorflow"}, ValueError, "output"),
        ({"pin_memory": 1}, TypeError, "pin_memory"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    args = {"dataset": range(100), **kwargs}
    with pytest.raises(error, match=pattern):
        dataecho.EchoLoader(**args)


@pytest.mark.filterwarnings("ignore:num_workers=6:UserWarning")  # more worker processes than cores here
@pytest.mark.parametrize("kwargs", [{}, {"echo_factor": 1}, {"echo_at": "batch"}, {"echo_at": "batch", "echo_factor": 1},
                                    {"worker_type": "process"}])
def test_deterministic_workers_claim_chunks_within_the_echo_buffers_reorder_window(kwargs):
    # Each of the workers keeps two chunks in flight within the window the echo
    # buffer takes examples in through; a chunk as large as the window (batch
    # echoing once claimed a batch each against a window of one) lets one worker
    # read at a time.
    from dataecho.native.sizing import reorder_window
    from dataecho.pipeline.plan import plan

    loader = dataecho.EchoLoader(Records(4000), batch_size=64, num_workers=6, seed=0, **kwargs)
    intake = plan(loader.config).intake
    window = reorder_window(intake.capacity, 64)
    assert 2 * 6 * intake.workers.chunk(64, 6) <= max(window, 2 * 6), (intake.capacity, window)
    loader.close()


@pytest.mark.parametrize("output", ["numpy", "torch", "jax"])
def test_big_endian_leaves_come_in_native_byte_order_with_their_values(output, seed):
    # FITS files and network-order records: the rows are copied into batch memory anyway.
    if output != "numpy":
        pytest.importorskip(output)
    records = [{"x": np.arange(3, dtype=">f4") + i, "id": np.array(i, dtype=">i4"), "u": np.full(2, i, ">u2")}
               for i in range(64)]
    seen = []
    for batch in dataecho.EchoLoader(records, batch_size=8, echo_factor=1, seed=seed, output=output):
        ids = np.asarray(batch["id"])
        assert np.asarray(batch["x"]).dtype == np.float32 and ids.dtype == np.int32
        assert np.asarray(batch["x"]).dtype.isnative and np.asarray(batch["u"]).dtype == np.uint16
        np.testing.assert_array_equal(np.asarray(batch["x"]), np.arange(3)[None, :] + ids[:, None])
        np.testing.assert_array_equal(np.asarray(batch["u"]), np.stack([ids, ids], 1))
        seen += ids.tolist()
    assert sorted(seen) == list(range(64))
    rows = np.arange(128, dtype=">i4").reshape(64, 2)  # an array source, read natively by index
    batch = next(iter(dataecho.EchoLoader(rows, batch_size=8, echo_factor=1, shuffle=False, output=output)))
    np.testing.assert_array_equal(np.asarray(batch), np.arange(16).reshape(8, 2))


def test_an_iterable_that_yields_more_than_its_len_is_warned_of_as_in_dataloader():
    torch = pytest.importorskip("torch")

    class Longer(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(1000))

        def __len__(self):
            return 500

    loader = dataecho.EchoLoader(Longer(), batch_size=50, echo_factor=1, seed=0)
    assert len(loader) == 10
    with pytest.warns(UserWarning, match=r"len\(loader\) said 10 batches .* but the epoch yielded 20"):
        assert sum(1 for _ in loader) == 20
