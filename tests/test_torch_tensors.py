"""torch integration: zero-copy tensors, pinned blocks, and DeviceMover's
ordering and release rules, checked against a fake backend that logs every
stream and event call and completes events only when the test says so."""

from __future__ import annotations

import contextlib
import gc
import random
import warnings
import weakref
from collections import namedtuple

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs torch: pip install 'dataecho[torch]'")

from dataecho.pipeline.stages.device_copy import DeviceMover  # noqa: E402
from dataecho.tensors.convert import to_torch  # noqa: E402
from dataecho.tensors.pinned import allocate_pinned, pinned_pointers  # noqa: E402
from support import examples, id_buffer, join_producers, payload_of, run_python, start_producers  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
Pair = namedtuple("Pair", ["x", "y"])


def assert_view(tensor, array):
    """The tensor is a zero-copy view of the array: same address, and a write
    through the array shows in the tensor."""
    assert tensor.data_ptr() == array.ctypes.data
    assert tuple(tensor.shape) == array.shape
    flat = array.reshape(-1)
    old = flat[0].copy()
    flat[0] = 1 if array.dtype != np.bool_ else not flat[0]
    assert tensor.reshape(-1)[0].item() == flat[0].item()
    flat[0] = old


# ---- to_torch ----


def test_lazy_import_of_torch():
    result = run_python(
        """
        import sys, dataecho, dataecho.tensors.convert, dataecho.pipeline.stages.device_copy
        print("torch" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"], "importing dataecho must not import torch"


def test_single_array_is_a_zero_copy_view():
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    tensor = to_torch(array)
    assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
    assert_view(tensor, array)
    array[1, 2, 3] = -7.5
    assert tensor[1, 2, 3].item() == -7.5


def test_tensor_keeps_the_array_alive():
    array = np.full(1 << 16, 42, dtype=np.int64)
    alive = weakref.ref(array)
    tensor = to_torch(array)
    del array
    gc.collect()
    assert alive() is not None and bool((tensor == 42).all())
    del tensor
    gc.collect()
    assert alive() is None


def test_structure_is_preserved():
    rng = np.random.default_rng(0)
    a, b, c, d, e = (rng.integers(0, 100, size=(3, i + 1)).astype(np.int32) for i in range(5))
    tree = {"z": a, "a": (b, [c, {"deep": d}]), "pair": Pair(e, a)}
    out = to_torch(tree)
    assert list(out) == ["z", "a", "pair"], "key order is kept"
    assert isinstance(out["a"], tuple) and isinstance(out["a"][1], list)
    assert isinstance(out["a"][1][1], dict) and type(out["pair"]) is Pair
    for tensor, array in [
        (out["z"], a), (out["a"][0], b), (out["a"][1][0], c), (out["a"][1][1]["deep"], d),
        (out["pair"].x, e), (out["pair"].y, a),
    ]:
        assert_view(tensor, array)
    assert to_torch({}) == {} and to_torch([]) == [] and to_torch(()) == ()


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("bool", "bool"), ("int8", "int8"), ("uint8", "uint8"), ("int16", "int16"), ("uint16", "uint16"),
        ("int32", "int32"), ("uint32", "uint32"), ("int64", "int64"), ("uint64", "uint64"),
        ("float16", "float16"), ("float32", "float32"), ("float64", "float64"),
        ("complex64", "complex64"), ("complex128", "complex128"),
    ],
)
def test_numeric_dtypes_round_trip(dtype, expected):
    rng = np.random.default_rng(1)
    array = (rng.integers(0, 100, size=(4, 5)) % (2 if dtype == "bool" else 100)).astype(dtype)
    tensor = to_torch(array)
    assert tensor.dtype == getattr(torch, expected)
    assert_view(tensor, array)
    np.testing.assert_array_equal(tensor.numpy(), array)


def test_zero_size_and_zero_dim_arrays():
    assert to_torch(np.zeros((0, 3), np.float32)).shape == (0, 3)
    scalar = np.array(3.5)
    tensor = to_torch(scalar)
    assert tensor.shape == () and tensor.item() == 3.5 and tensor.data_ptr() == scalar.ctypes.data


def test_strided_views_stay_zero_copy():
    base = np.arange(40, dtype=np.int64).reshape(4, 10)
    view = base[:, ::3]
    tensor = to_torch(view)
    assert tensor.data_ptr() == view.ctypes.data
    assert tensor.stride() == (10, 3)
    base[2, 6] = -1
    assert tensor[2, 2].item() == -1


def test_read_only_array_is_shared_without_a_warning():
    array = np.arange(10, dtype=np.int32)
    array.flags.writeable = False
    filters = list(warnings.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = to_torch({"ro": array})["ro"]
    assert warnings.filters == filters, "to_torch must not leave warning filters changed"
    assert tensor.data_ptr() == array.ctypes.data
    np.testing.assert_array_equal(tensor.numpy(), array)


def test_read_only_array_in_a_fresh_interpreter_does_not_warn():
    # torch warns only once per process, so check where it has not warned yet.
    result = run_python(
        """
        import warnings, numpy as np
        warnings.simplefilter("error")
        from dataecho.tensors.convert import to_torch
        array = np.arange(6, dtype=np.float32)
        array.flags.writeable = False
        tensor = to_torch(array)
        assert tensor.data_ptr() == array.ctypes.data
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


@pytest.mark.parametrize(
    "bad",
    [
        np.array([b"ab", b"cd"]),
        np.array(["ab", "cd"]),
        np.array([object(), None], dtype=object),
        np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]),
        np.zeros(2, dtype="datetime64[s]"),
        np.zeros(2, dtype="V4"),
    ],
    ids=["bytes", "str", "object", "structured", "datetime", "void"],
)
def test_unsupported_dtypes_name_the_field_path(bad):
    tree = {"image": np.zeros(3, np.uint8), "meta": (np.zeros(1), [bad])}
    with pytest.raises(TypeError, match=r"tree\['meta'\]\[1\]\[0\].*dtype"):
        to_torch(tree)


def test_arrays_torch_cannot_view_name_the_path():
    with pytest.raises(ValueError, match=r"tree\['x'\]: cannot view.*negative"):
        to_torch({"x": np.arange(5)[::-1]})
    with pytest.raises(ValueError, match=r"tree\[1\]: cannot view.*byte order"):
        to_torch([np.zeros(2), np.zeros(2, ">i4")])


def test_non_array_leaves_are_rejected():
    with pytest.raises(TypeError, match=r"tree\['n'\]: expected a numpy.ndarray, got int"):
        to_torch({"n": 3})
    with pytest.raises(TypeError, match=r"tree: expected a numpy.ndarray, got Tensor"):
        to_torch(torch.zeros(2))


def test_buffer_batches_become_zero_copy_tensors(seed):
    buf = id_buffer(capacity=64, batch_size=16, seed=seed)
    threads = start_producers(buf, [[np.arange(i, i + 50) for i in range(0, 500, 50)]])
    kept = []
    for batch in buf:
        tensors = to_torch(batch)
        assert tensors["id"].data_ptr() == batch["id"].ctypes.data
        assert tensors["payload"].data_ptr() == batch["payload"].ctypes.data
        kept.append((tensors, batch["id"].copy()))
        del batch, tensors
    join_producers(threads)
    # The tensors alone keep their batches' memory: every kept one is unchanged.
    gc.collect()
    for tensors, ids in kept:
        np.testing.assert_array_equal(tensors["id"].numpy(), ids)
        np.testing.assert_array_equal(tensors["payload"].numpy(), payload_of(ids))
    assert sorted(np.concatenate([ids for _, ids in kept]).tolist()) == list(range(500))


# ---- pinned memory ----


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_allocate_pinned_without_cuda_raises_at_once():
    with pytest.raises(RuntimeError, match=r"pin_memory=True needs CUDA"):
        allocate_pinned(1024, 2)


def test_allocate_pinned_arguments_are_checked():
    with pytest.raises(ValueError, match="nbytes"):
        allocate_pinned(0, 1)
    with pytest.raises(ValueError, match="count"):
        allocate_pinned(16, -1)
    with pytest.raises(TypeError, match="count"):
        allocate_pinned(16, 2.0)


def test_allocate_pinned_asks_torch_for_pinned_blocks(monkeypatch):
    calls = []
    real_empty = torch.empty

    def spy_empty(*args, **kwargs):
        calls.append((args, dict(kwargs)))
        kwargs.pop("pin_memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", spy_empty)
    blocks = allocate_pinned(4096, 3)
    assert calls == [((4096,), {"dtype": torch.uint8, "pin_memory": True})] * 3
    assert [b.numel() for b in blocks] == [4096] * 3
    assert len({b.data_ptr() for b in blocks}) == 3


def test_pinned_pointers_report_address_and_size():
    blocks = [torch.empty(n, dtype=torch.uint8) for n in (16, 4096)] + [torch.empty(3, dtype=torch.float64)]
    assert pinned_pointers(blocks) == [(b.data_ptr(), n) for b, n in zip(blocks, (16, 4096, 24))]
    with pytest.raises(ValueError, match=r"blocks\[0\] is not contiguous"):
        pinned_pointers([torch.empty(4, 4)[:, 0]])


# ---- DeviceMover, against a fake backend ----


class FakeEvent:
    def __init__(self, number: int) -> None:
        self.number = number
        self.done = False
        self.recorded_on = None


class FakeBackend:
    """Logs every call; an event completes only when the test sets ``done``
    (or when something synchronizes on it)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.events: list[FakeEvent] = []
        self.current = "default"
        self.fail_copy_at: int | None = None
        self.copies = 0

    def current_stream(self):
        return self.current

    def new_stream(self):
        self.log.append(("new_stream",))
        return "copy"

    @contextlib.contextmanager
    def stream_context(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def new_event(self):
        event = FakeEvent(len(self.events))
        self.events.append(event)
        return event

    def record(self, event, stream):
        event.recorded_on = stream
        self.log.append(("record", event.number, stream))

    def query(self, event):
        return event.done

    def synchronize(self, event):
        self.log.append(("synchronize", event.number))
        event.done = True

    def wait(self, stream, event):
        self.log.append(("wait", stream, event.number))

    def copy(self, tensor, device, non_blocking):
        self.copies += 1
        if self.copies == self.fail_copy_at:
            raise RuntimeError("copy failed")
        self.log.append(("copy", self.current, non_blocking, tensor.data_ptr()))
        return tensor.clone()

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", tensor.data_ptr(), stream))


def batch(i: int):
    return {"x": torch.full((4,), i, dtype=torch.int64), "y": (torch.arange(3) + 10 * i,)}


def fake_mover():
    backend = FakeBackend()
    return DeviceMover("cpu", backend=backend), backend


def test_copies_are_non_blocking_on_the_copy_stream_then_an_event_is_recorded():
    mover, backend = fake_mover()
    host = batch(1)
    backend.log.clear()
    mover.submit(host)
    ptrs = [host["x"].data_ptr(), host["y"][0].data_ptr()]
    assert backend.log == [("copy", "copy", True, p) for p in ptrs] + [("record", 0, "copy")]
    assert len(mover) == 1


def test_take_returns_batches_in_order_after_the_consumer_waits_on_their_event():
    mover, backend = fake_mover()
    for i in range(4):
        mover.submit(batch(i))
    for i in range(4):
        backend.log.clear()
        out = mover.take()
        assert out["x"].tolist() == [i] * 4 and out["y"][0].tolist() == [10 * i, 10 * i + 1, 10 * i + 2]
        ptrs = [out["x"].data_ptr(), out["y"][0].data_ptr()]
        # The wait on this batch's own event comes first, then every tensor is
        # marked as used by the consumer's stream.
        assert backend.log == [("wait", "default", i)] + [("record_stream", p, "default") for p in ptrs]
        assert len(mover) == 3 - i
    mover.close()


def test_on_done_waits_for_the_event_and_keeps_submission_order():
    mover, backend = fake_mover()
    done: list[int] = []
    for i in range(3):
        mover.submit(batch(i), on_done=lambda i=i: done.append(i))
    assert mover.poll() == 0 and done == []
    mover.take()
    assert done == [], "taking a batch does not release its host memory"
    backend.events[1].done = True
    assert mover.poll() == 0 and done == [], "batch 1 waits for batch 0"
    backend.events[0].done = True
    assert mover.poll() == 2 and done == [0, 1]
    assert mover.poll() == 0 and done == [0, 1], "exactly once"
    backend.events[2].done = True
    mover.submit(batch(3), on_done=lambda: done.append(3))  # submit polls too
    assert done == [0, 1, 2]
    mover.close()
    assert done == [0, 1, 2, 3]


def test_host_tree_stays_alive_until_released():
    mover, backend = fake_mover()
    host = batch(0)
    alive = weakref.ref(host["x"])
    mover.submit(host)
    del host
    gc.collect()
    assert alive() is not None, "a copy may still read the host tensor"
    backend.events[0].done = True
    mover.poll()
    gc.collect()
    assert alive() is None


def test_close_synchronizes_and_releases_everything_once():
    mover, backend = fake_mover()
    done: list[int] = []
    for i in range(5):
        mover.submit(batch(i), on_done=lambda i=i: done.append(i))
    backend.events[0].done = True
    mover.take()
    mover.take()
    backend.log.clear()
    mover.close()
    assert done == [0, 1, 2, 3, 4]
    assert backend.log == [("synchronize", i) for i in range(1, 5)]
    assert len(mover) == 0 and mover.closed
    mover.close()
    assert done == [0, 1, 2, 3, 4] and backend.log == [("synchronize", i) for i in range(1, 5)]


def test_close_runs_every_on_done_even_if_one_raises():
    mover, _ = fake_mover()
    done: list[int] = []

    def failing():
        done.append(0)
        raise OSError("pool gone")

    mover.submit(batch(0), on_done=failing)
    mover.submit(batch(1), on_done=lambda: done.append(1))
    with pytest.raises(OSError, match="pool gone"):
        mover.close()
    assert done == [0, 1]
    mover.close()
    assert done == [0, 1]


def test_misuse_raises_clear_errors():
    mover, _ = fake_mover()
    with pytest.raises(IndexError, match="no batch waiting"):
        mover.take()
    mover.submit(batch(0))
    mover.take()
    with pytest.raises(IndexError, match="no batch waiting"):
        mover.take()
    mover.close()
    with pytest.raises(RuntimeError, match="closed"):
        mover.take()
    with pytest.raises(RuntimeError, match="closed"):
        mover.submit(batch(1))
    with pytest.raises(ValueError, match="device"):
        DeviceMover("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_mover_without_cuda_raises():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        DeviceMover("cuda")


def test_rejected_batches_are_not_accepted():
    mover, backend = fake_mover()
    done: list[int] = []
    with pytest.raises(TypeError, match=r"host_tree\['y'\]\[0\]: expected a torch.Tensor"):
        mover.submit({"x": torch.zeros(2), "y": (np.zeros(2),)}, on_done=lambda: done.append(0))
    assert len(mover) == 0 and backend.events == [] and not any(e[0] == "copy" for e in backend.log)
    # A copy failing half-way: the queued copies are waited for before the error.
    backend.fail_copy_at = 2
    with pytest.raises(RuntimeError, match="copy failed"):
        mover.submit(batch(1), on_done=lambda: done.append(1))
    assert backend.log[-2:] == [("record", 0, "copy"), ("synchronize", 0)]
    assert len(mover) == 0
    mover.close()
    assert done == []


def test_random_interleavings_keep_every_invariant(seed):
    rng = random.Random(seed)
    for _ in range(20):
        mover, backend = fake_mover()
        done: list[int] = []
        taken: list[int] = []
        submitted = 0

        def release(i):
            assert backend.events[i].done, f"seed {seed}: batch {i} released before its copy completed"
            done.append(i)

        for _ in range(200):
            op = rng.random()
            if op < 0.35:
                mover.submit(batch(submitted), on_done=lambda i=submitted: release(i))
                submitted += 1
            elif op < 0.6 and len(mover):
                out = mover.take()
                taken.append(int(out["x"][0]))
            elif op < 0.85 and backend.events:
                rng.choice(backend.events).done = True
            else:
                mover.poll()
            assert len(mover) == submitted - len(taken)
            assert done == list(range(len(done))), f"seed {seed}: out of order"
        mover.close()
        assert taken == list(range(len(taken))), f"seed {seed}"
        assert done == list(range(submitted)), f"seed {seed}: each on_done once, in order"


# ---- DeviceMover on the CPU backend ----


def test_cpu_mover_copies_and_releases_at_once():
    done: list[int] = []
    with DeviceMover("cpu") as mover:
        hosts = [to_torch(examples(np.arange(i * 8, i * 8 + 8))) for i in range(3)]
        for i, host in enumerate(hosts):
            mover.submit(host, on_done=lambda i=i: done.append(i))
            assert done == list(range(i + 1)), "a CPU copy is complete when submit returns"
        for i, host in enumerate(hosts):
            out = mover.take()
            assert out["id"].device.type == "cpu"
            assert out["id"].tolist() == list(range(i * 8, i * 8 + 8))
            # The host block goes back to the pool: the batch must not alias it.
            assert out["id"].data_ptr() != host["id"].data_ptr()
            assert torch.equal(out["payload"], host["payload"])
    assert mover.closed


# ---- on a GPU ----


@needs_cuda
def test_pinned_blocks_are_pinned_and_distinct():
    blocks = allocate_pinned(1 << 20, 3)
    assert all(b.is_pinned() and b.dtype == torch.uint8 and b.numel() == 1 << 20 for b in blocks)
    pointers = pinned_pointers(blocks)
    assert pointers == [(b.data_ptr(), 1 << 20) for b in blocks]
    starts = sorted(p for p, _ in pointers)
    assert all(b - a >= 1 << 20 for a, b in zip(starts, starts[1:])), "blocks overlap"


@needs_cuda
def test_cuda_mover_round_trips_on_a_side_stream():
    gen = torch.Generator().manual_seed(0)
    mover = DeviceMover("cuda")
    assert mover.stream != torch.cuda.current_stream() and mover.stream != torch.cuda.default_stream()
    host = [torch.randint(0, 1 << 30, (1 << 16,), generator=gen).pin_memory() for _ in range(4)]
    for t in host:
        mover.submit({"t": t})
    for t in host:
        out = mover.take()["t"]
        assert out.is_cuda and torch.equal(out.cpu(), t)
    mover.close()


@needs_cuda
def test_cuda_on_done_runs_after_the_copy_and_the_consumer_waits():
    # on_done overwrites the host block, as the pool would by reusing it. If it
    # ran before the copy completed, or the consumer did not wait on the copy
    # event, the device values would differ.
    n = 1 << 24  # 128 MiB of int64: the copy takes long enough to race
    blocks = [(torch.arange(n, dtype=torch.int64) + i).pin_memory() for i in range(3)]
    expected = [int(b.sum()) for b in blocks]
    with DeviceMover("cuda") as mover:
        for b in blocks:
            mover.submit(b, on_done=lambda b=b: b.fill_(-1))
        sums = [int(mover.take().sum()) for _ in blocks]
    assert sums == expected
    assert all(bool((b == -1).all()) for b in blocks), "close() released every block"
