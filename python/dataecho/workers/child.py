"""The entry point of a worker process (``worker_type="process"``).

A worker maps its parent's buffer region, reads the source, runs ``transform``,
and copies each example straight into a free slot of the parent's buffer: an
example's bytes are written once here and gathered once into a batch there.
It imports only NumPy and dataecho's own small modules; torch and the rest of
the user's world come in only if unpickling the source or transform needs them.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _core
from ..examples.columns import Columns
from ..examples.fields import Field, field_value
from ..examples.objects import LeafMap
from ..examples.structure import Structure
from ..reading.chunking import claimed
from ..reading.readers import map_reader
from . import info

_OK, _CLOSED = _core.Status.OK, _core.Status.CLOSED
_REPORT_EVERY_S = 0.1


@dataclass
class WorkerSpec:
    """Everything a worker needs, pickled to it once at start."""

    region: str
    fields: list[Field]
    structure: Structure
    source: Any
    transform: Any
    worker_id: int
    num_workers: int
    seed: int
    map_style: bool
    order: Any  # map-style: the rank's reading order (dataset index per position)
    worker_init_fn: Any = None  # called with worker_id once, before reading
    chunk: int = 1  # map-style: positions claimed at a time


def main(spec: WorkerSpec, conn: Any, lifeline: Any, tasks: Any = None) -> None:
    """Runs one worker until the source is exhausted or the parent closes the
    buffer; ``lifeline`` reaches EOF when the process that owns the loader is gone.

    With ``tasks`` (``persistent_workers``), the worker then waits there for the
    next epoch: a dict of the WorkerSpec fields that change (``region``,
    ``order``, ...), or None to exit. The source, ``worker_init_fn``, the seeds
    and ``get_worker_info()`` stay those of the first epoch, as in DataLoader.
    """
    # Ctrl-C reaches the whole process group; the parent decides, and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_owner(lifeline)
    parent = os.getppid()  # the loader, or the forkserver
    _die_with_parent()
    if os.getppid() != parent:
        return  # the parent died before the death signal was armed
    worker_info = info.WorkerInfo(spec.worker_id, spec.num_workers, spec.seed, spec.source)
    info.set_worker_info(worker_info)
    _seed_and_inform(worker_info)
    _epoch(spec, conn, parent)
    while tasks is not None:
        try:
            update = tasks.recv()
        except (EOFError, OSError):
            return
        if update is None:
            return
        _epoch(dataclasses.replace(spec, worker_init_fn=None, **update), conn, parent)


def _epoch(spec: WorkerSpec, conn: Any, parent: int) -> None:
    """Reads this worker's share of one epoch into the buffer region ``spec.region``."""
    leaf_map = LeafMap(spec.fields, "pickle")  # object leaves travel pickled, in the carrier
    try:
        producer = _core.Producer(spec.region, [f.decl() for f in leaf_map.native])
    except BaseException as error:
        _send(conn, ("error", spec.worker_id, error, traceback.format_exc()))
        return
    _send(conn, ("ready", spec.worker_id))
    meter = _Meter(producer, spec.worker_id)
    orphaned = lambda: os.getppid() != parent  # noqa: E731
    try:
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(spec.worker_id)
        if spec.map_style:
            _read_map(spec, producer, leaf_map, meter, orphaned)
        else:
            it = iter(spec.source)
            for k in itertools.count():
                start = time.perf_counter()
                example = next(it, _END)
                meter.busy(time.perf_counter() - start)
                # Interleaved numbering: worker w's k-th example is k * W + w.
                seq = k * spec.num_workers + spec.worker_id
                if example is _END or not _produce(spec, producer, leaf_map, meter, orphaned, example, seq):
                    break
        meter.flush()
        _send(conn, ("done", spec.worker_id))
    except BaseException as error:  # reported to the parent, which raises it
        meter.flush()
        if isinstance(error, RuntimeError) and isinstance(error.__cause__, StopIteration):
            error = error.__cause__  # a cause does not pickle: the parent's Failure wraps it again
        _send(conn, ("error", spec.worker_id, error, traceback.format_exc()))


_END = object()


def _read_map(spec: WorkerSpec, producer: Any, leaf_map: LeafMap, meter: _Meter, orphaned: Any) -> None:
    """Reads the positions this worker claims, a chunk at a time (dataecho.reading.chunking);
    a claimed position is also the example's sequence number."""
    reader = map_reader(spec.source, spec.transform, spec.order)
    start = time.perf_counter()
    columns = Columns(spec.structure, spec.fields, leaf_map.codec)
    for seq, rows, read in claimed(producer.claim_range, spec.chunk, reader, columns):
        meter.busy(time.perf_counter() - start)
        done = 0
        while done < rows:
            status, done = producer.put_each(read, rows, 1.0, seq, done)
            if status == _CLOSED or (done < rows and orphaned()):
                return
        meter.produced(rows)
        start = time.perf_counter()


def _produce(spec: WorkerSpec, producer: Any, leaf_map: LeafMap, meter: _Meter, orphaned: Any, example: Any,
             seq: int) -> bool:
    """Transforms and puts example number `seq`; False once the parent closed the buffer."""
    start = time.perf_counter()
    if spec.transform is not None:
        example = spec.transform(example)
    leaves = spec.structure.flatten(example)
    arrays = leaf_map.example([field_value(v, f, None, "example") for v, f in zip(leaves, spec.fields)])
    meter.busy(time.perf_counter() - start)
    while True:
        status = producer.put(arrays, 1.0, seq)
        if status == _OK:
            meter.produced(1)
            return True
        if status == _CLOSED or orphaned():
            return False


class _Meter:
    """Per-worker counters, published to the shared region every ~0.1 s."""

    def __init__(self, producer: Any, worker: int) -> None:
        self._producer, self._worker = producer, worker
        self._count, self._busy, self._last = 0, 0.0, time.perf_counter()

    def busy(self, seconds: float) -> None:
        self._busy += seconds

    def produced(self, count: int) -> None:
        self._count += count
        if time.perf_counter() - self._last > _REPORT_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self._producer.record(self._worker, self._count, int(self._busy * 1e9))
        self._count, self._busy, self._last = 0, 0.0, time.perf_counter()


def _send(conn: Any, message: tuple) -> None:
    try:
        conn.send(message)
    except Exception:
        # The exception itself may not pickle: send what can be shown.
        if message[0] == "error":
            _, worker, error, text = message
            conn.send(("error", worker, RuntimeError(f"{type(error).__name__}: {error}"), text))
        else:
            raise


def _seed_and_inform(worker: info.WorkerInfo) -> None:
    """Seeds this worker's global generators, as torch's DataLoader seeds its
    workers, and, where the source brought torch along (a torch Dataset),
    makes ``torch.utils.data.get_worker_info()`` return this worker's info, so
    that a dataset that shards itself with it (an IterableDataset, Hugging Face,
    WebDataset) reads its own shard here as it would under DataLoader."""
    random.seed(worker.seed)
    np.random.seed(worker.seed % (1 << 32))
    torch = sys.modules.get("torch")  # imported by unpickling the source, or not at all
    if torch is None:
        return
    torch.manual_seed(worker.seed)
    torch.set_num_threads(1)  # as DataLoader's workers: one per core, not one pool per worker
    try:
        import torch.utils.data._utils.worker as torch_worker
    except ImportError:  # a torch without this module: its get_worker_info() stays None
        return
    # The slot torch's own worker loop fills, the only one its get_worker_info() reads.
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker.id, num_workers=worker.num_workers, seed=worker.seed, dataset=worker.dataset
    )


def _watch_owner(lifeline: Any) -> None:
    """Ends this process as soon as the owner of the loader is gone, whatever this
    process is doing (waiting for a slot, or inside the user's code): nothing is
    ever written to the lifeline, so it becomes readable only at EOF, when its
    one writer, the owner, has exited."""

    def watch() -> None:
        try:
            lifeline.poll(None)
        except (OSError, EOFError):
            pass
        os._exit(0)  # nobody is left to report to

    threading.Thread(target=watch, name="dataecho-owner-watch", daemon=True).start()


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no worker outlives it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
