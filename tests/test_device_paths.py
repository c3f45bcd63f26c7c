"""The CUDA paths of the device copy, as a GPU would run them: copies that land
only when their event completes, a device that fails under the loader, the
loader closed with copies in flight or from another thread, page-locking
that fails, and streams made on the loader's own device.

Without a GPU they run against fakes of torch.cuda (tests/test_torch_tensors.py's
FakeBackend, here made to copy as a DMA engine does); the tests named ``cuda``
that need one run on a GPU and skip elsewhere.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs torch: pip install 'dataecho[torch]'")

import dataecho  # noqa: E402
from dataecho.pipeline.stages import delivery  # noqa: E402
from dataecho.pipeline.stages.delivery import DeliverySpec, DeliveryStage  # noqa: E402
from dataecho.pipeline.stages.device_copy import CudaBackend, DeviceMover  # noqa: E402
from dataecho.pipeline.stages.stage import Batch  # noqa: E402
from dataecho.tensors.pinned import allocate_pinned  # noqa: E402
from support import run_python  # noqa: E402
from test_torch_tensors import FakeBackend, batch  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
WIDTH = 8  # int64 values per row: row i holds i * WIDTH, ..., i * WIDTH + WIDTH - 1
DEVICE_FAILED = "CUDA error: device-side assert triggered"


class DmaBackend(FakeBackend):
    """A FakeBackend whose copies land when their event completes, as a DMA
    engine's do: ``copy`` returns an empty tensor, filled from the host memory
    only then, and holds no reference to the host tensor (a DMA engine does
    not keep it alive): one gone by then was given back, its memory free for
    reuse under the copy (``released_in_flight``); one whose memory a later
    copy reads while the first is in flight was reused (``reused_in_flight``).
    An event completes, with every earlier one (one copy stream: in order),
    when the consumer's stream waits on it (its kernels need the values), when
    something synchronizes on it, or at its ``lag``-th query. ``fail()`` makes
    every later call raise, as a CUDA context does after a device-side assert."""

    def __init__(self, lag: int = 2) -> None:
        super().__init__()
        self.lag = lag
        self.wait_completes = True  # False: the consumer's wait is on the device only, as CUDA's is
        self.most_in_flight = 0  # the most copies in flight at once, seen as each was queued
        # Per event number: (the host tensor, weakly; its address; its bytes; the device tensor).
        self.transfers: dict[int, list[tuple[weakref.ref, int, int, torch.Tensor]]] = {}
        self.queries: Counter = Counter()
        self.failed = False
        self.reused_in_flight: list[int] = []  # host addresses read again while a copy from them was in flight
        self.released_in_flight: list[int] = []  # host tensors gone before their copy landed

    def fail(self) -> None:
        self.failed = True

    def _check(self) -> None:
        if self.failed:
            raise RuntimeError(DEVICE_FAILED)

    def copy(self, tensor, device, non_blocking):
        self._check()
        self.copies += 1
        if self.copies == self.fail_copy_at:
            raise RuntimeError("copy failed")
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for pending in self.transfers.values():
            for _, address, size, _ in pending:
                if nbytes and size and start < address + size and address < start + nbytes:
                    self.reused_in_flight.append(start)
        self.most_in_flight = max(self.most_in_flight, sum(not e.done for e in self.events))
        out = torch.empty_like(tensor)
        # submit() made the batch's event before its copies: this copy is the last event's.
        self.transfers.setdefault(len(self.events) - 1, []).append((weakref.ref(tensor), start, nbytes, out))
        self.log.append(("copy", self.current, non_blocking, tensor.data_ptr()))
        return out

    def complete(self, event) -> None:
        for earlier in self.events[: event.number + 1]:
            for host, address, _, out in self.transfers.pop(earlier.number, []):
                src = host()
                if src is None:
                    self.released_in_flight.append(address)
                else:
                    out.copy_(src)
            earlier.done = True

    def query(self, event):
        self._check()
        self.queries[event.number] += 1
        if self.queries[event.number] >= self.lag:
            self.complete(event)
        return event.done

    def synchronize(self, event):
        self.log.append(("synchronize", event.number))
        self._check()
        self.complete(event)

    def wait(self, stream, event):
        self._check()
        self.log.append(("wait", stream, event.number))
        if self.wait_completes:
            self.complete(event)

    def record_stream(self, tensor, stream):
        self._check()
        super().record_stream(tensor, stream)


@pytest.fixture
def backends(monkeypatch):
    """Every DeviceMover the loader makes for device="cpu" runs on a new DmaBackend, listed here."""
    made: list[DmaBackend] = []

    def mover(device, **options):
        made.append(DmaBackend())
        return DeviceMover(device, backend=made[-1], **options)

    monkeypatch.setattr(delivery, "DeviceMover", mover)
    return made


def id_rows(n: int, width: int = WIDTH) -> np.ndarray:
    """``n`` rows of ``width`` int64: row i holds i * width, ..., i * width + width - 1."""
    return np.arange(n * width, dtype=np.int64).reshape(n, width)


def ids_of(rows: torch.Tensor) -> list[int]:
    """The ids of a batch's rows (of :func:`id_rows`), each row checked whole: a
    row copied from a block the pool reused would hold another row's values, or a mix."""
    width = rows.shape[1]
    ids = rows[:, 0] // width
    assert torch.equal(rows, ids[:, None] * width + torch.arange(width, device=rows.device)), "a row was torn"
    return ids.tolist()


def device_loader(n: int, **kwargs) -> dataecho.EchoLoader:
    return dataecho.EchoLoader(id_rows(n), batch_size=16, echo_factor=1, output="torch", device="cpu", **kwargs)


# ---- the host blocks and the copies that read them ----


def test_a_host_block_is_reused_only_after_its_copy_completed(backends):
    # The native pool recycles a batch's block once nothing holds it; copies land only as
    # their events complete. A block given back before its copy completed would be written
    # with a later batch while the copy reads it, and the delivered ids would be wrong.
    n = 2048
    delivered = []
    for _ in range(2):  # two loaders, an epoch each
        with device_loader(n, prefetch_factor=1) as loader:
            for rows in loader:
                delivered += ids_of(rows)
    assert sorted(delivered) == sorted(list(range(n)) * 2)
    assert not any(b.released_in_flight for b in backends), "host memory was given back before its copy landed"
    assert not any(b.reused_in_flight for b in backends), "a host block was read again while a copy was in flight"
    assert all(e.done for b in backends for e in b.events) and not any(b.transfers for b in backends)


def test_each_batch_is_waited_for_by_the_stream_current_at_take(backends):
    with device_loader(256) as loader:
        epoch = iter(loader)
        next(epoch)
        backend = backends[-1]
        backend.current = "training"  # the loop runs its step under a stream of its own
        backend.log.clear()
        ids_of(next(epoch))
    waits = [entry for entry in backend.log if entry[0] == "wait"]
    assert waits == [("wait", "training", 1)]
    assert [entry[2] for entry in backend.log if entry[0] == "record_stream"] == ["training"]
    assert backend.log.index(waits[0]) < min(i for i, e in enumerate(backend.log) if e[0] == "record_stream")


def test_copies_in_flight_are_bounded_as_the_pinned_pool_is_sized(backends):
    # The host never waits for a copy to use its batch (the consumer's stream does), so a
    # consumer faster than the link would hold ever more host blocks in flight: past the
    # pool's pinned blocks (sized for two in flight) batches would go to pageable memory.
    stage = DeliveryStage(DeliverySpec("cpu"), GatedUpstream(gate_at=0))
    backend = backends[-1]
    backend.lag, backend.wait_completes = 10 ** 9, False  # only a host wait completes a copy
    for _ in range(10):
        stage.next()
    assert backend.most_in_flight == 2
    synchronized = [entry[1] for entry in backend.log if entry[0] == "synchronize"]
    assert synchronized == list(range(9)), "each submit waited for the copy two batches back"
    stage.join(1.0)
    assert all(e.done for e in backend.events)


# ---- a device that fails ----


def test_close_after_a_device_failure_waits_for_every_copy_and_keeps_their_memory():
    backend = DmaBackend(lag=10 ** 9)
    mover = DeviceMover("cpu", backend=backend)
    done: list[int] = []
    hosts = [batch(i) for i in range(3)]
    alive = [weakref.ref(h["x"]) for h in hosts]
    for i, host in enumerate(hosts):
        mover.submit(host, on_done=lambda i=i: done.append(i))
    backend.synchronize(backend.events[0])
    mover.poll()
    assert done == [0]
    del hosts, host
    backend.fail()  # the training step hit a device-side assert: the context is gone
    backend.log.clear()
    with pytest.raises(RuntimeError, match="device-side assert"):
        mover.close()
    # Every batch was tried (no hang, no early return); the copies that could not be seen
    # complete are not released, and their host memory stays held: nothing may reuse it.
    assert backend.log == [("synchronize", 1), ("synchronize", 2)]
    assert done == [0] and mover.closed and len(mover) == 0
    gc.collect()
    assert [ref() is not None for ref in alive] == [False, True, True]
    mover.close()  # idempotent: nothing left to wait for
    assert done == [0]


def test_a_failed_copy_on_a_failed_device_raises_the_copys_error():
    backend = DmaBackend()
    mover = DeviceMover("cpu", backend=backend)
    host = batch(0)
    alive = weakref.ref(host["x"])
    backend.fail_copy_at = 2

    def fail_then_synchronize(event):
        backend.fail()  # the copy's error left the device unusable: the wait fails too
        return DmaBackend.synchronize(backend, event)

    backend.synchronize = fail_then_synchronize
    with pytest.raises(RuntimeError, match="copy failed"):
        mover.submit(host)
    del host
    gc.collect()
    assert alive() is not None, "a copy from it may still be queued: its memory is kept"
    assert len(mover) == 0


def test_the_loader_closes_cleanly_after_a_device_error_in_the_step(backends):
    loader = device_loader(4096)
    epoch = iter(loader)
    ids_of(next(epoch))
    backend = backends[-1]
    backend.lag = 10 ** 9  # copies complete only when waited for
    ids_of(next(epoch))
    assert not backend.events[-1].done, "the next batch's copy is in flight"
    with pytest.raises(RuntimeError, match="device-side assert"):
        backend.fail()
        raise RuntimeError(DEVICE_FAILED)  # what the training step raised
    with pytest.warns(RuntimeWarning, match="closing the device copies: RuntimeError: CUDA error"):
        loader.close()
    # The epoch ended as a whole: its other stages were joined, and it was counted.
    assert loader.stats()["epochs"]["stopped"] == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("dataecho")]
    assert ids_of(next(iter(loader))), "a new epoch runs"
    loader.close()


# ---- closing with copies in flight ----


def test_closing_the_loader_waits_for_the_copies_in_flight(backends):
    loader = device_loader(4096)
    epoch = iter(loader)
    kept = [next(epoch) for _ in range(3)]
    backend = backends[-1]
    backend.lag = 10 ** 9  # nothing completes unless waited for
    kept.append(next(epoch))
    assert backend.transfers, "a copy is in flight"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.close()
    assert not backend.transfers and all(e.done for e in backend.events)
    assert backend.log[-1][0] == "synchronize"
    assert len({i for rows in kept for i in ids_of(rows)}) == 4 * 16


class GatedUpstream:
    """An upstream stage whose batches of id rows come at once, but the
    ``gate_at``-th, which waits for ``gate``."""

    def __init__(self, gate_at: int) -> None:
        self.gate, self.gate_at, self.taken = threading.Event(), gate_at, 0
        self.waiting = threading.Event()

    def next(self, timeout_s=None) -> Batch:
        self.taken += 1
        if self.taken == self.gate_at:
            self.waiting.set()
            assert self.gate.wait(10.0)
        rows = id_rows(16 * self.taken)[-16:]
        return Batch(None, (rows,), np.arange(16 * (self.taken - 1), 16 * self.taken))


def run_in_thread(fn):
    """Starts ``fn`` in a thread; returns the thread and a list that gets its result or exception."""
    result: list = []

    def call():
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, result


def test_closed_from_another_thread_while_the_consumer_waits_upstream(backends):
    # The consumer has a batch in flight and waits upstream for the next; another thread
    # closes the epoch. The consumer then gets its batch from upstream: it must end
    # quietly rather than submit to a closed mover (or queue a copy no one waits for).
    upstream = GatedUpstream(gate_at=3)
    stage = DeliveryStage(DeliverySpec("cpu"), upstream)
    backend = backends[-1]
    ids_of(stage.next().arrays[0])
    consumer, result = run_in_thread(stage.next)
    assert upstream.waiting.wait(10.0)
    stage.stop()
    stage.join(1.0)
    upstream.gate.set()
    consumer.join(10.0)
    assert len(result) == 1 and isinstance(result[0], StopIteration), result
    assert all(e.done for e in backend.events) and not backend.transfers
    assert backend.copies == 2, "nothing was copied after the close"


def test_closed_from_another_thread_while_the_consumer_submits(backends):
    # join() waits for a submit under way, then waits for its copy too.
    upstream = GatedUpstream(gate_at=0)
    stage = DeliveryStage(DeliverySpec("cpu"), upstream)
    backend = backends[-1]
    ids_of(stage.next().arrays[0])
    in_copy, release = threading.Event(), threading.Event()
    plain_copy = backend.copy

    def slow_copy(tensor, device, non_blocking):
        in_copy.set()
        assert release.wait(10.0)
        return plain_copy(tensor, device, non_blocking)

    backend.copy = slow_copy
    consumer, result = run_in_thread(stage.next)
    assert in_copy.wait(10.0)
    closer, _ = run_in_thread(lambda: stage.join(1.0))
    closer.join(0.2)
    assert closer.is_alive(), "join() waits for the submit under way"
    release.set()
    consumer.join(10.0)
    closer.join(10.0)
    assert len(result) == 1
    assert all(e.done for e in backend.events) and not backend.transfers, "every copy was waited for"


# ---- page-locked memory ----


def test_page_locking_that_fails_says_so_and_frees_what_it_locked(monkeypatch):
    made: list[weakref.ref] = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if len(made) == 2:
            raise RuntimeError("CUDA error: out of memory")
        tensor = real_empty(*args, **kwargs)
        made.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(RuntimeError, match=r"could not page-lock batch memory, block 3 of 4 \(1\.0 MiB each, "
                                           r"4\.0 MiB in all\): CUDA error: out of memory\. Use pin_memory=False"
                       ) as caught:
        allocate_pinned(1 << 20, 4)
    assert isinstance(caught.value.__cause__, RuntimeError)
    del caught
    gc.collect()
    assert len(made) == 2 and all(ref() is None for ref in made), "the blocks locked so far are freed"


def test_pinned_blocks_are_allocated_with_their_cuda_device_current(monkeypatch):
    current: list = [None]
    seen: list = []

    @contextlib.contextmanager
    def device(target):
        previous, current[0] = current[0], target
        try:
            yield
        finally:
            current[0] = previous

    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        seen.append(current[0])
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch, "empty", empty)
    allocate_pinned(64, 2, device="cuda:1")
    allocate_pinned(64, 1)
    allocate_pinned(64, 1, device="cpu")
    assert seen == [torch.device("cuda:1")] * 2 + [None, None] and current == [None]


# ---- streams on the loader's own device ----


class FakeStream:
    def __init__(self, device=None) -> None:
        self.device = torch.device(device)


def test_cuda_streams_are_made_on_the_movers_device(monkeypatch):
    asked: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device) or "consumer")
    for name, expected in (("cuda:1", "cuda:1"), ("cuda", "cuda:1"), ("cuda:0", "cuda:0")):
        mover = DeviceMover(name)
        assert mover.device == torch.device(expected)
        assert mover.stream.device == torch.device(expected), "the copy stream is on the mover's device"
    assert CudaBackend(torch.device("cuda:1")).current_stream() == "consumer"
    assert asked == [torch.device("cuda:1")], "the consumer's stream is asked of the mover's device"


# ---- on a GPU ----


def _checked_ids_on_device(loader, step=None) -> list[int]:
    """The ids of every batch's rows (of :func:`id_rows`), each row checked whole
    on the device, on the consumer's stream, after ``step``; -1 for a torn row."""
    ids = []
    for rows in loader:
        assert rows.is_cuda
        if step is not None:
            step()
        width = rows.shape[1]
        first = rows[:, :1] // width
        torn = (rows != first * width + torch.arange(width, device=rows.device)).any(dim=1)
        ids.append(torch.where(torn, -1, first[:, 0]))
    return torch.cat(ids).tolist()


@needs_cuda
def test_cuda_loader_batches_are_whole_under_a_slow_step():
    # Large rows, and a step that keeps the device busy before each batch is read: a
    # consumer that did not wait for the copy, or a pinned block reused under a copy,
    # would read torn or repeated rows.
    n = 2048
    a = torch.randn(2048, 2048, device="cuda")

    def step():
        for _ in range(4):
            a.matmul(a)

    # 64 KiB rows, 4 MiB batches
    with dataecho.EchoLoader(id_rows(n, 1 << 13), batch_size=64, echo_factor=1, output="torch", pin_memory=True,
                             device="cuda") as loader:
        ids = _checked_ids_on_device(loader, step)
    assert -1 not in ids, "a row was torn"
    assert sorted(ids) == list(range(n))


@needs_cuda
def test_cuda_pinned_batches_are_page_locked():
    with dataecho.EchoLoader(id_rows(1024), batch_size=64, output="torch", pin_memory=True) as loader:
        first = next(iter(loader))
        assert first.is_pinned() and not first.is_cuda


@needs_cuda
def test_cuda_mover_on_an_explicit_device_index():
    index = torch.cuda.device_count() - 1
    host = torch.arange(1 << 16).pin_memory()
    with DeviceMover(f"cuda:{index}") as mover:
        assert mover.stream.device == torch.device("cuda", index)
        mover.submit(host)
        out = mover.take()
        assert out.device == torch.device("cuda", index) and torch.equal(out.cpu(), host)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_mover_on_another_device_than_the_current_one():
    torch.cuda.set_device(0)
    host = torch.arange(1 << 20).pin_memory()
    with DeviceMover("cuda:1") as mover:
        assert mover.stream.device == torch.device("cuda", 1)
        mover.submit(host)
        assert torch.cuda.current_device() == 0, "submit leaves the current device as it was"
        out = mover.take()
        assert out.device == torch.device("cuda", 1) and torch.equal(out.cpu(), host)
    with dataecho.EchoLoader(id_rows(512), batch_size=64, echo_factor=1, output="torch", pin_memory=True,
                             device="cuda:1") as loader:
        assert sorted(_checked_ids_on_device(loader)) == list(range(512))
    assert torch.cuda.current_device() == 0


@needs_cuda
def test_cuda_loader_closed_with_copies_in_flight():
    n, width = 512, 1 << 15  # 256 KiB rows, 16 MiB batches
    source = id_rows(n, width)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = dataecho.EchoLoader(source, batch_size=64, echo_factor=1, output="torch", pin_memory=True,
                                     device="cuda")
        epoch = iter(loader)
        first = next(epoch)  # the next batch's copy is queued now
        loader.close()
        assert epoch.closed
        rows = first.cpu().numpy()
        np.testing.assert_array_equal(rows, source[rows[:, 0] // width])
        total = sum(len(b) for b in loader)  # a new epoch after the close
        loader.close()
    assert total == n


@needs_cuda
def test_cuda_error_in_the_step_closes_the_loader_cleanly():
    # A device-side assert leaves the process's CUDA context unusable: in a child process.
    result = run_python(
        """
        import os, sys, warnings, numpy as np, torch, dataecho
        source = np.arange(4096 * 1024, dtype=np.int64).reshape(4096, 1024)
        loader = dataecho.EchoLoader(source, batch_size=64, output="torch", pin_memory=True, device="cuda")
        epoch = iter(loader)
        next(epoch)
        try:
            torch.zeros(4, device="cuda")[torch.tensor([1 << 20], device="cuda")].sum().item()
            print("no error")
        except RuntimeError as exc:
            print("step failed")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader.close()
        print("closed", loader.stats()["epochs"]["stopped"] + loader.stats()["epochs"]["failed"])
        print("warned", any("device copies" in str(w.message) for w in caught))
        sys.stdout.flush()
        os._exit(0)  # what the process does at exit with a failed CUDA context is not the loader's
        """,
        timeout=90.0,
    )
    lines = result.stdout.split("\n")
    assert "step failed" in lines, result.stdout + result.stderr
    assert "closed 1" in lines, result.stdout + result.stderr
