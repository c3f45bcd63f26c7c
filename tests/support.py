"""What the whole suite shares: one id/payload scheme, one map-style source, one
ledger, checked drains, threads that keep their outcome, child interpreters, and
the only place that reads the package's internals.

Every example is ``{"id": i, "payload": payload_of(i)}``: its bytes derive from
its id, so a torn, misplaced or recycled row shows as a payload that does not
match its id. Test modules, fault scenarios and child scripts import this
module by name (worker processes started by forkserver or spawn get the
parent's ``sys.path``), so its sources and transforms are picklable.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

import dataecho
from dataecho.reading.source import SAMPLE

TESTS = Path(__file__).resolve().parent
PAYLOAD = 16  # bytes of id-derived payload per example
FIRST = SAMPLE  # examples an epoch reads itself first, to learn the structure (fewer if the source has fewer)
FIELDS = {"id": ((), "int64"), "payload": ((PAYLOAD,), "uint8")}


# ---- examples whose bytes are derived from their id ----


def payload_of(ids: Any) -> np.ndarray:
    """Bytes that depend on the id and on the byte position.

    Every byte is below 211, so never the poison build's 0xDB: a row of 0xDB can
    only come from recycled memory.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return ((ids[:, None] * 131 + np.arange(PAYLOAD)[None, :] * 7 + 3) % 211).astype(np.uint8)


def examples(ids: Any) -> dict[str, np.ndarray]:
    """Stacked examples for ``put_many``."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return {"id": ids, "payload": payload_of(ids)}


def one(i: int) -> dict[str, Any]:
    """One example for ``put``, or for a source to return."""
    return {"id": np.int64(i), "payload": payload_of([i])[0]}


def id_buffer(**kwargs: Any) -> dataecho.ShuffleBuffer:
    """A ShuffleBuffer of id/payload examples."""
    return dataecho.ShuffleBuffer(FIELDS, **kwargs)


def checked_ids(batch: dict[str, np.ndarray]) -> np.ndarray:
    """The batch's ids (a copy), after checking that every payload byte belongs to
    its id (and, in ragged examples, every token, box and name)."""
    ids = np.asarray(batch["id"])
    payload = np.asarray(batch["payload"])
    assert ids.ndim == 1 and payload.shape == (len(ids), PAYLOAD), (ids.shape, payload.shape)
    if not np.array_equal(payload, payload_of(ids)):
        bad = np.flatnonzero((payload != payload_of(ids)).any(axis=1))
        raise AssertionError(f"corrupt payload for ids {ids[bad][:5].tolist()}")
    if "tokens" in batch:
        check_ragged(ids, batch)
    return ids.copy()


# ---- ragged examples: lengths, values and objects derived from the id ----


def tokens_of(i: int) -> np.ndarray:
    """Example i's token ids: a length from 0 to 2,999 derived from the id (every
    11th empty, every 97th 2,000 or more), int32 values from the id and position."""
    n = 0 if i % 11 == 0 else 2000 + i % 1000 if i % 97 == 0 else (i * 37) % 300
    return ((i * 131 + np.arange(n) * 7 + 3) % 30011).astype(np.int32)


def boxes_of(i: int) -> np.ndarray:
    """Example i's boxes: i % 6 rows of 4 float32."""
    return np.arange(4, dtype=np.float32) + np.full((i % 6, 1), i, dtype=np.float32)


def name_of(i: int) -> Any:
    """Example i's name: a str, bytes or None (a leaf that is not an array)."""
    return None if i % 5 == 0 else f"example {i}".encode() if i % 5 == 1 else f"example {i}"


def ragged_one(i: int) -> dict[str, Any]:
    """Example i with ragged leaves and an object leaf beside its id and payload."""
    return {**one(i), "tokens": tokens_of(i), "boxes": boxes_of(i), "name": name_of(i)}


def rows(leaf: Any) -> list[np.ndarray]:
    """A batch's ragged leaf as one NumPy array per row, whatever its form: a
    Ragged, a JaxRagged, a jagged nested tensor, or a Padded of arrays, tensors
    or JAX arrays."""
    if isinstance(leaf, dataecho.JaxRagged):
        values, offsets = np.asarray(leaf.values), np.asarray(leaf.offsets)
        return [values[start:end] for start, end in zip(offsets[:-1], offsets[1:])]
    if isinstance(leaf, dataecho.Padded):
        data, lengths = np.asarray(leaf.data), np.asarray(leaf.lengths)
        assert (np.asarray(leaf.mask).sum(axis=1) == lengths).all(), "the mask covers each row's length"
        return [row[:n] for row, n in zip(data, lengths)]
    if isinstance(leaf, dataecho.Ragged):
        return list(leaf)
    return [t.numpy() for t in leaf.unbind()]  # a nested tensor


def check_ragged(ids: np.ndarray, batch: dict[str, Any]) -> None:
    """Every row's tokens, boxes and name belong to its id."""
    names = batch["name"]
    assert isinstance(names, list) and len(names) == len(ids), type(names)
    for i, tokens, boxes, name in zip(ids.tolist(), rows(batch["tokens"]), rows(batch["boxes"]), names):
        assert np.array_equal(tokens, tokens_of(i)) and tokens.dtype == np.int32, f"tokens of id {i}"
        assert np.array_equal(boxes, boxes_of(i)), f"boxes of id {i}"
        assert name == name_of(i), f"name of id {i}: {name!r}"


# ---- sources and transforms (module level: worker processes unpickle them) ----


class InjectedFault(Exception):
    """The exception a test injects into a pipeline."""


def injected(kind: str, message: str) -> Exception:
    """The exception a test injects: InjectedFault ("fault") or StopIteration ("stop")."""
    return StopIteration(message) if kind == "stop" else InjectedFault(message)


def read_record(source: Records, i: int) -> Any:
    """Record i of `source`; a named frame, so that a traceback shows where a read failed."""
    if i == source.fail_at:
        time.sleep(source.fail_after_s)
        raise injected(source.fail_with, f"record {i} is corrupt")
    if source.delay_s:
        time.sleep(source.delay_s)
    if source.jitter and source._rng.random() < source.jitter:
        time.sleep(0.002)
    return shaped(int(i), source.form)


def shaped(i: int, form: str) -> Any:
    """Example i as a dict (``one(i)``), a dict with ragged leaves
    (``ragged_one(i)``), an (id, payload) tuple, or the bare id."""
    if form == "dict":
        return one(i)
    if form == "ragged":
        return ragged_one(i)
    if form == "tuple":
        return (np.int64(i), payload_of([i])[0])
    return i


class Records:
    """The map-style source: record i is ``one(i)``.

    Args:
        n: number of records.
        delay_s: every read sleeps this long (a slow upstream; the GIL is released).
        fail_at: reading this index raises InjectedFault (after `fail_after_s`).
        fail_after_s: how long the failing read takes.
        fail_with: "fault" (InjectedFault) or "stop" (StopIteration, as a next()
            on an exhausted iterator in user code raises).
        count_reads: count reads per index in ``reads`` (in the process that reads:
            with worker processes, in their copies).
        jitter: the chance that a read pauses 2 ms. The pauses are drawn from a
            seeded generator, but which reads get them depends on thread timing,
            so the timing of a run is not repeatable, which is the point.
        form: "dict" (``one(i)``), "ragged" (``ragged_one(i)``), "tuple" (id,
            payload) or "scalar" (the id).
    """

    def __init__(
        self,
        n: int,
        delay_s: float = 0.0,
        fail_at: int | None = None,
        fail_after_s: float = 0.0,
        count_reads: bool = False,
        jitter: float = 0.0,
        form: str = "dict",
        fail_with: str = "fault",
    ) -> None:
        self.n, self.delay_s, self.fail_at, self.fail_after_s = n, delay_s, fail_at, fail_after_s
        self.fail_with = fail_with
        self.jitter, self.form = jitter, form
        self.reads: Counter | None = Counter() if count_reads else None
        self._rng = random.Random(n)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        example = read_record(self, i)
        if self.reads is not None:
            with self._lock:
                self.reads[i] += 1
        return example

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]  # a lock does not pickle; each copy gets its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # Hypothesis prints the source of a failing example
        return f"Records({self.n}, form={self.form!r})"


def generate_records(stream: Stream, start: int, step: int) -> Iterable[Any]:
    """Records start, start + step, ...; a named frame, like read_record."""
    info = dataecho.get_worker_info()
    for i in range(start, stream.n, step):
        if i == stream.fail_at:
            raise InjectedFault(f"the stream broke at record {i}")
        example = shaped(i, stream.form)
        if stream.tag_worker:
            example = {**example, "worker": -1 if info is None else info.id}
        yield example


class Stream:
    """An iterable source of records 0..n-1 (iterable again every epoch); in
    worker processes each worker reads its own shard.

    Args:
        n: number of records.
        fail_at: the stream raises InjectedFault when it reaches this record.
        form: as for Records.
        tag_worker: add a "worker" field, the id of the worker process that read
            the record (-1 outside one); form "dict" only.
    """

    def __init__(self, n: int, fail_at: int | None = None, form: str = "dict", tag_worker: bool = False) -> None:
        self.n, self.fail_at, self.form, self.tag_worker = n, fail_at, form, tag_worker

    def __iter__(self) -> Iterable[Any]:
        info = dataecho.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return generate_records(self, start, step)

    def __repr__(self) -> str:
        return f"Stream({self.n}, form={self.form!r})"


class RestartableStream:
    """An iterable of examples 0..n-1 that can restart part-way
    (dataecho.reading.restart): the state of one of its iterators is the id of
    its next example. It counts the examples it makes (``made``)."""

    def __init__(self, n: int) -> None:
        self.n, self.made = n, 0

    def __iter__(self) -> Iterable[Any]:
        return self.iter_from(0)

    def iter_from(self, state: int) -> Any:
        return _Counted(self, state)

    def state_of(self, iterator: Any) -> int:
        return iterator.next_id


class _Counted:
    """A RestartableStream's iterator."""

    def __init__(self, stream: RestartableStream, next_id: int) -> None:
        self.stream, self.next_id = stream, next_id

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.next_id >= self.stream.n:
            raise StopIteration
        self.stream.made += 1
        self.next_id += 1
        return one(self.next_id - 1)


def with_pid(example: dict[str, Any]) -> dict[str, Any]:
    """A transform that adds a Python number: the pid of the process that ran it."""
    return {**example, "pid": os.getpid()}


def with_pid_and_tensor(example: dict[str, Any]) -> dict[str, Any]:
    """with_pid, and a torch tensor of the id."""
    import torch

    return {**with_pid(example), "t": torch.tensor([int(example["id"])], dtype=torch.int64)}


def suicide_at_500(example: dict[str, Any]) -> dict[str, Any]:
    """A transform whose process kills itself (SIGKILL) at record 500."""
    if example["id"] == 500:
        os.kill(os.getpid(), 9)
    return example


WORKER_MARK = -1  # set by mark_worker in a worker process


def mark_worker(worker_id: int) -> None:
    """A worker_init_fn: marks this process as worker `worker_id`."""
    global WORKER_MARK
    WORKER_MARK = worker_id


class MarkedRecords(Records):
    """Records whose examples carry the mark mark_worker left in the reading process."""

    def __getitem__(self, i: int) -> Any:
        return {**super().__getitem__(i), "mark": np.int64(WORKER_MARK)}


class Stall:
    """A transform that sleeps `seconds` on every example read in a worker process
    (not in the loader's own process, which reads one to learn the structure)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        if dataecho.get_worker_info() is not None:
            time.sleep(self.seconds)
        return example


class ExitAt:
    """A transform whose worker process ends at record `record`: by ``os._exit(status)``
    (as user code or a library may), or by SIGKILL with ``status=None``."""

    def __init__(self, record: int, status: int | None = 0) -> None:
        self.record, self.status = record, status

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        if int(example["id"]) == self.record and dataecho.get_worker_info() is not None:
            if self.status is None:
                os.kill(os.getpid(), 9)
            os._exit(self.status)
        return example


class QuotaExceeded(Exception):
    """An exception whose constructor takes other arguments than its message,
    a common library pattern: it pickles, but does not unpickle."""

    def __init__(self, bucket: str, retry_after: float) -> None:
        super().__init__(f"quota of {bucket} exceeded; retry after {retry_after} s")
        self.bucket, self.retry_after = bucket, retry_after


class RaiseAt:
    """A transform that, in a worker process, at record `record`, calls
    ``sys.exit(0)`` (``"exit"``), raises KeyboardInterrupt (``"interrupt"``) or
    QuotaExceeded (``"quota"``)."""

    def __init__(self, record: int, what: str) -> None:
        self.record, self.what = record, what

    def __call__(self, example: dict[str, Any]) -> dict[str, Any]:
        if int(example["id"]) == self.record and dataecho.get_worker_info() is not None:
            if self.what == "exit":
                sys.exit(0)
            if self.what == "interrupt":
                raise KeyboardInterrupt
            raise QuotaExceeded("images", 2.5)
        return example


# ---- what went in and what came out ----


class Ledger:
    """What a buffer accepted and what it delivered, key by key, from any thread.

    Keys are ids, or any hashable key of a row where examples have no id.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepted: Counter = Counter()
        self.delivered: Counter = Counter()
        self.sizes: list[int] = []  # rows of each delivered batch, in order

    def accept(self, keys: Iterable[Any]) -> None:
        keys = [int(k) if isinstance(k, (int, np.integer)) else k for k in keys]
        with self._lock:
            self.accepted.update(keys)

    def deliver(self, keys: Iterable[Any]) -> None:
        keys = list(keys)
        with self._lock:
            self.delivered.update(keys)
            self.sizes.append(len(keys))

    @property
    def ids(self) -> list[Any]:
        """Every accepted key, as often as it was accepted."""
        return list(self.accepted.elements())

    def __len__(self) -> int:
        return sum(self.accepted.values())


def echo_bounds(echo: float) -> tuple[int, int]:
    """How often an example may be delivered at a fixed echo factor."""
    return math.floor(echo), math.ceil(echo)


def check_exact(delivered: Counter, accepted: Iterable[int], echo: float, what: str = "") -> None:
    """Every accepted id delivered floor(e) or ceil(e) times (exactly e when it is
    an integer), and nothing else delivered."""
    accepted = Counter(int(i) for i in accepted)
    twice = [i for i, c in accepted.items() if c > 1]
    assert not twice, f"{what}ids accepted twice: {twice[:5]}"
    strangers = [i for i in delivered if i not in accepted]
    assert not strangers, f"{what}delivered ids that were never accepted: {sorted(strangers)[:5]}"
    lo, hi = echo_bounds(echo)
    wrong = {i: delivered.get(i, 0) for i in accepted if not lo <= delivered.get(i, 0) <= hi}
    assert not wrong, (
        f"{what}{len(wrong)} of {len(accepted)} ids delivered outside [{lo}, {hi}] times (echo {echo}): "
        f"{dict(list(wrong.items())[:5])}"
    )


def check_at_most(delivered: Counter, valid: Callable[[int], bool], echo: float, what: str = "") -> None:
    """A partial delivery: only valid ids, none more often than ceil(e)."""
    invalid = [i for i in delivered if not valid(i)]
    assert not invalid, f"{what}delivered invalid ids {sorted(invalid)[:5]}"
    hi = math.ceil(echo)
    over = {i: c for i, c in delivered.items() if c > hi}
    assert not over, f"{what}ids delivered more than {hi} times: {dict(list(over.items())[:5])}"


def check_buffer_totals(buf: dataecho.ShuffleBuffer, accepted: int, delivered: Counter) -> None:
    """The buffer's counters agree with the ledger, and every slot came back."""
    stats = buf.stats()
    assert stats["fresh"] == accepted, (stats["fresh"], accepted)
    assert stats["delivered"] == sum(delivered.values()), (stats["delivered"], sum(delivered.values()))
    assert free_slots(buf) == buf.capacity, (free_slots(buf), buf.capacity)


def check_no_repeats_in_batches(batches: list[np.ndarray], batch_size: int) -> None:
    """No batch of ids holds one twice while at least ``batch_size`` examples
    are left to deliver (resident): only at the stream's end may one repeat."""
    for i, batch in enumerate(batches):
        if len(set(np.concatenate(batches[i:]).tolist())) >= batch_size:
            assert len(np.unique(batch)) == len(batch), f"an example twice in batch {i} of {len(batches)}: {batch}"


def counts(batches: Iterable[np.ndarray]) -> Counter:
    """How often each id occurs in a list of id arrays."""
    c: Counter = Counter()
    for ids in batches:
        c.update(ids.tolist())
    return c


# ---- draining, checked ----


def drain(batches: Iterable[dict[str, np.ndarray]], delivered: Counter, step_s: float = 0.0) -> int:
    """Iterates a buffer or an epoch to its end, checking every batch and counting
    its ids in `delivered`; sleeps `step_s` after each batch (a training step).

    Returns:
        The number of batches.
    """
    taken = 0
    for batch in batches:
        delivered.update(checked_ids(batch).tolist())
        taken += 1
        if step_s:
            time.sleep(step_s)
    return taken


def take_refused(epoch: Iterable[dict[str, np.ndarray]], refused: list[str]) -> list[np.ndarray]:
    """Takes batches from `epoch` to its end as one of several consumer threads:
    a RuntimeError (another thread is inside next()) is noted in `refused` and
    the take tried again. Returns the checked ids of each batch taken."""
    taken = []
    while True:
        try:
            batch = next(epoch)
        except StopIteration:
            return taken
        except RuntimeError as error:
            refused.append(str(error))
            continue
        taken.append(checked_ids(batch))


def drain_ids(buf: Iterable[dict[str, np.ndarray]], check_payload: bool = True) -> list[np.ndarray]:
    """Iterates to the end; returns each batch's ids (copied), checking payloads."""
    return [checked_ids(b) if check_payload else b["id"].copy() for b in buf]


# ---- threads that keep their outcome ----


class Task(threading.Thread):
    """A daemon thread that keeps its function's result or exception and when it ended."""

    def __init__(self, fn: Callable[[], Any], name: str = "task") -> None:
        super().__init__(name=name, daemon=True)
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # kept for the test to judge
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self._fn = None  # drop the closure's references (buffers) with the thread


def start(fn: Callable[[], Any], name: str = "task") -> Task:
    task = Task(fn, name)
    task.start()
    return task


def join_all(tasks: Iterable[Task], timeout_s: float, what: str) -> None:
    """Waits for every task, at most `timeout_s` in all; fails naming those still running."""
    tasks = list(tasks)
    deadline = time.monotonic() + timeout_s
    for task in tasks:
        task.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in tasks if t.is_alive()]
    assert not stuck, f"{what}: threads still running after {timeout_s} s: {stuck}"


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Polls `predicate` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def start_producers(buf: dataecho.ShuffleBuffer, id_chunks: list, close: bool = True) -> list[Task]:
    """One thread per list of id chunks, each calling put_many on its chunks; the
    last one to finish closes the buffer."""
    remaining = [len(id_chunks)]
    lock = threading.Lock()

    def produce(chunks: list) -> None:
        try:
            for chunk in chunks:
                buf.put_many(examples(chunk))
        finally:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last and close:
                buf.close()

    return [start(lambda chunks=chunks: produce(chunks), f"producer-{p}") for p, chunks in enumerate(id_chunks)]


def join_producers(tasks: list[Task], timeout_s: float = 30.0) -> None:
    """Waits for the producers of start_producers; raises the first one's error."""
    join_all(tasks, timeout_s, "producers")
    for task in tasks:
        if task.error is not None:
            raise task.error


# ---- child interpreters ----

# A suite started as a background job inherits SIGINT ignored, and so do its
# children: a child that expects Ctrl-C must install Python's handler itself.
CHILD_PRELUDE = f"""\
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {str(TESTS)!r})
"""


def child_script(code: str) -> str:
    """`code` (dedented) after CHILD_PRELUDE: Ctrl-C raises KeyboardInterrupt in
    the child, and the child can import this module."""
    return CHILD_PRELUDE + textwrap.dedent(code)


def kill_owner(loader_args: str, settle_s: float = 1.0, within_s: float = 5.0,
               start: str = "it = iter(loader)") -> dict[int, str]:
    """Starts a process that builds ``EchoLoader(<loader_args>)`` with worker
    processes and runs `start` (starts an epoch), SIGKILLs it after `settle_s`,
    and returns the processes it had started (workers, forkserver, resource
    tracker) still running `within_s` later; any left are killed before returning."""
    from processes import family, pid_alive

    script = child_script(
        f"""
        import time
        import dataecho
        from support import ExitAt, Records, Stall, Stream
        if __name__ == "__main__":
            loader = dataecho.EchoLoader({loader_args})
            {start}
            time.sleep({settle_s})
            print("ready", flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise AssertionError("the owner process did not start its epoch")
        started = family(proc.pid)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + within_s
        while any(pid_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {pid: command for pid, command in started.items() if pid_alive(pid)}
    finally:
        proc.kill()
        proc.stdout.close()
        for pid in family(proc.pid):
            os.kill(pid, 9)


def run_python(code: str, timeout: float = 30.0, **kwargs: Any) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (see child_script), bounded by `timeout`."""
    return subprocess.run(
        [sys.executable, "-c", child_script(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        **kwargs,
    )


# ---- buffer and loader diagnostics ----


def free_slots(buf: dataecho.ShuffleBuffer) -> int:
    """Slots not holding an example; equals the capacity once a buffer has drained."""
    return buf.stats()["free_slots"]


def slot_stride(buf: dataecho.ShuffleBuffer) -> int:
    """Bytes from one slot to the next."""
    return buf.slot_bytes


def batch_blocks_allocated(buf: dataecho.ShuffleBuffer) -> int:
    """Batch memory blocks the buffer's pool has allocated so far."""
    return buf.stats()["batch_blocks"]


def kept_bytes(loader: dataecho.EchoLoader) -> int:
    """Bytes of echo-buffer memory the loader keeps for its next epoch."""
    return loader._memory.kept_bytes


def objects_held(epoch: Any) -> int:
    """Examples whose Python objects an epoch's echo buffer holds by reference."""
    epoch.start()
    codec = epoch.stages[0]._buffer.codec
    return 0 if codec is None else codec.held


def worker_pids(loader: dataecho.EchoLoader) -> list[int]:
    """The pids of the worker processes of the loader's current epoch."""
    return [worker["pid"] for worker in loader.stats()["workers"]]


def spy_on_last_stage(epoch: Any) -> list[set[int]]:
    """Records the addresses of the arrays of every batch an epoch's last stage
    hands out (to check that what the loop gets views them: no copy)."""
    native: list[set[int]] = []
    epoch.start()  # the first epoch builds its stages once the workers' first examples came
    last = epoch.stages[-1]
    upstream = last.next

    def spy(timeout_s: float | None = None) -> Any:
        batch = upstream(timeout_s)
        addresses = set()
        for leaf in batch.arrays:
            if isinstance(leaf, dataecho.Ragged):
                addresses |= {leaf.values.ctypes.data, leaf.offsets.ctypes.data}
            elif isinstance(leaf, np.ndarray):
                addresses.add(leaf.ctypes.data)
        native.append(addresses)
        return batch

    last.next = spy
    return native


class Captions:
    """``{"id": i, "caption": str}``, short but for one 1 MiB caption (at
    ``long_at``): an object leaf whose size the first examples do not show."""

    def __init__(self, n: int, long_at: int) -> None:
        self.n, self.long_at = n, long_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "caption": ("x" * (1 << 20)) if i == self.long_at else f"caption {i}"}


# ---- augmentations for augment worker processes (picklable: module level) ----


def noisy_augment(example: dict[str, Any], rng: Any) -> dict[str, Any]:
    """Draws from the delivery's generator; says which process ran it."""
    return {**example, "noise": np.int64(rng.integers(0, 1 << 30)), "augmented_in": np.int64(os.getpid())}


class AugmentDies:
    """An augment whose process dies at example ``at``: SIGKILL (``"kill"``) or
    an exit of status 0 (``"exit"``), as user code may do."""

    def __init__(self, at: int, how: str) -> None:
        self.at, self.how = at, how

    def __call__(self, example: dict[str, Any], rng: Any) -> dict[str, Any]:
        if int(example["id"]) == self.at:
            if self.how == "kill":
                os.kill(os.getpid(), 9)
            os._exit(0)
        return example


class AugmentStalls:
    """An augment that, in each process, returns its first ``after`` examples at
    once and then sleeps ``seconds`` on each."""

    def __init__(self, after: int, seconds: float) -> None:
        self.after, self.seconds, self.calls = after, seconds, 0

    def __call__(self, example: dict[str, Any], rng: Any) -> dict[str, Any]:
        self.calls += 1
        if self.calls > self.after:
            time.sleep(self.seconds)
        return example


class AugmentReshapes:
    """An augment that adds a leaf ``"extra"`` of 2 zeros, and of 3 for example ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, example: dict[str, Any], rng: Any) -> dict[str, Any]:
        return {**example, "extra": np.zeros(3 if int(example["id"]) == self.at else 2, np.float32)}


# ---- states of the composed pipelines (dataecho.grain, dataecho.nodes) ----


def intake_of(state: dict[str, Any]) -> dict[str, Any]:
    """The echo buffer's intake in an echo step's state (the EchoLoader's state, kept as one JSON string)."""
    import json

    return json.loads(state["echo"]["loader"])["stages"]["intake"]


def structure_of_state(value: Any) -> Any:
    """The keys and types of a state, recursively (a list's length included)."""
    if isinstance(value, dict):
        return {key: structure_of_state(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, *map(structure_of_state, value)]
    return type(value).__name__


def losses(trials: int, seed: int, trial: Callable[[Any], set]) -> dict[int, int]:
    """Runs ``trial(rng)`` (which returns the ids a trial lost) ``trials`` times
    from one seeded generator; the trials that lost some, with how many."""
    rng = np.random.default_rng(seed)
    lost = {}
    for number in range(trials):
        missing = trial(rng)
        if missing:
            lost[number] = len(missing)
    return lost
