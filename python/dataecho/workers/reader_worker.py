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
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _core
from ..examples.columns import Columns
from ..examples.fields import Field, field_value
from ..examples.objects import LeafMap
from ..examples.structure import Structure
from ..reading.chunking import claimed
from ..reading.map_readers import map_reader
from . import info
from .life import guard, report, send

_OK, _CLOSED = _core.Status.OK, _core.Status.CLOSED
_REPORT_EVERY_S = 0.1


@dataclass
class WorkerSpec:
    """Everything a worker needs, pickled to it once at start."""

    region: str | None  # None: no buffer yet; read the probe share first (dataecho.workers.probe)
    fields: list[Field] | None
    structure: Structure | None
    source: Any
    transform: Any
    worker_id: int
    num_workers: int
    seed: int
    map_style: bool
    order: Any  # map-style: the rank's reading order (dataset index per position)
    worker_init_fn: Any = None  # called with worker_id once, before reading
    chunk: int = 1  # map-style: positions claimed at a time
    probe: int = 0  # with no region: the examples the probe reads in all (map-style: positions 0 to probe - 1)
    persistent: bool = False  # wait for the next epoch on the task pipe after this one


@dataclass
class _Started:
    """What a worker read for the probe: kept until the buffer comes, then put first."""

    kept: list  # (sequence number, example transformed)
    iterator: Any = None  # iterable sources: where reading goes on (None: exhausted)


def main(spec: WorkerSpec, conn: Any, lifeline: Any, tasks: Any = None) -> None:
    """Runs one worker until the source is exhausted or the parent closes the
    buffer; ``lifeline`` reaches EOF when the process that owns the loader is gone.

    ``worker_init_fn`` is called first. With no region yet, the worker reads
    its share of the probe, sends it to the parent (``("probe", worker,
    [(seq, example), ...])``) and waits on ``tasks`` for the region (a dict of
    the WorkerSpec fields that change), where it puts what it read first. With
    ``spec.persistent``, the worker then waits there for the next epoch: such a
    dict (``region``, ``order``, ...), or None to exit. The source,
    ``worker_init_fn``, the seeds and ``get_worker_info()`` stay those of the
    first epoch, as in DataLoader.
    """
    parent = guard(lifeline)
    if parent is None:
        return
    worker_info = info.WorkerInfo(spec.worker_id, spec.num_workers, spec.seed, spec.source)
    info.set_worker_info(worker_info)
    _seed_and_inform(worker_info)
    started = None
    try:
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(spec.worker_id)
        if spec.region is None:
            started = _probe(spec)
            try:
                conn.send(("probe", spec.worker_id, started.kept))
            except Exception as exc:  # pickling can fail with many exception types
                raise TypeError(f"dataset: worker {spec.worker_id} read examples that cannot be pickled back to "
                                f"the loader, which learns their structure from them "
                                f"({type(exc).__name__}: {exc})") from None
    except BaseException as error:  # reported to the parent, which raises it
        report(conn, spec.worker_id, error)
        return
    spec = dataclasses.replace(spec, worker_init_fn=None)
    if started is not None and (spec := _next_task(spec, tasks)) is None:
        return
    _epoch(spec, conn, parent, started)
    while spec.persistent and (spec := _next_task(spec, tasks)) is not None:
        _epoch(spec, conn, parent)


def _next_task(spec: WorkerSpec, tasks: Any) -> WorkerSpec | None:
    """The spec of this worker's next epoch, from the task pipe; None to exit."""
    try:
        update = tasks.recv()
    except (EOFError, OSError):
        return None
    return None if update is None else dataclasses.replace(spec, **update)


def _probe(spec: WorkerSpec) -> _Started:
    """Reads this worker's share of the probe: map-style, the positions below
    ``spec.probe`` that are its own (``position % num_workers == worker_id``);
    iterables, its shard's first ``ceil(probe / num_workers)`` examples,
    numbered as ``_epoch`` numbers them."""
    if spec.map_style:
        reader = map_reader(spec.source, spec.transform, spec.order)
        return _Started([(p, reader.one(p)) for p in range(spec.worker_id, spec.probe, spec.num_workers)])
    iterator, kept = iter(spec.source), []
    for k in range(-(-spec.probe // spec.num_workers)):
        example = next(iterator, _END)
        if example is _END:
            return _Started(kept, None)
        kept.append((k * spec.num_workers + spec.worker_id,
                     example if spec.transform is None else spec.transform(example)))
    return _Started(kept, iterator)


def _epoch(spec: WorkerSpec, conn: Any, parent: int, started: _Started | None = None) -> None:
    """Reads this worker's share of one epoch into the buffer region
    ``spec.region``; ``started``: what the probe read, put first."""
    leaf_map = LeafMap(spec.fields, "pickle")  # object leaves travel pickled, in the carrier
    try:
        producer = _core.Producer(spec.region, [f.decl() for f in leaf_map.native])
    except BaseException as error:
        report(conn, spec.worker_id, error)
        return
    send(conn, ("ready", spec.worker_id))
    meter = _Meter(producer, spec.worker_id)
    orphaned = lambda: os.getppid() != parent  # noqa: E731
    try:
        kept = started.kept if started is not None else []
        going = all(_produce(spec, producer, leaf_map, meter, orphaned, example, seq, transformed=True)
                    for seq, example in kept)
        if going and spec.map_style:
            _read_map(spec, producer, leaf_map, meter, orphaned)
        elif going:
            it = iter(spec.source) if started is None else started.iterator
            for k in itertools.count(len(kept)) if it is not None else ():
                start = time.perf_counter()
                example = next(it, _END)
                meter.busy(time.perf_counter() - start)
                # Interleaved numbering: worker w's k-th example is k * W + w.
                seq = k * spec.num_workers + spec.worker_id
                if example is _END or not _produce(spec, producer, leaf_map, meter, orphaned, example, seq):
                    break
        meter.flush()
        send(conn, ("done", spec.worker_id))
    except BaseException as error:  # reported to the parent, which raises it
        meter.flush()
        report(conn, spec.worker_id, error)


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
            try:
                status, done = producer.put_each(read, rows, 1.0, seq, done)
            except ValueError as error:
                raise _located(error, spec, seq) from None
            if status == _CLOSED or (done < rows and orphaned()):
                return
        meter.produced(rows)
        start = time.perf_counter()


def _produce(spec: WorkerSpec, producer: Any, leaf_map: LeafMap, meter: _Meter, orphaned: Any, example: Any,
             seq: int, transformed: bool = False) -> bool:
    """Transforms (unless ``transformed``) and puts example number `seq`; False
    once the parent closed the buffer."""
    start = time.perf_counter()
    if spec.transform is not None and not transformed:
        example = spec.transform(example)
    leaves = spec.structure.flatten(example)
    arrays = leaf_map.example([field_value(v, f, None, "example") for v, f in zip(leaves, spec.fields)])
    meter.busy(time.perf_counter() - start)
    while True:
        try:
            status = producer.put(arrays, 1.0, seq)
        except ValueError as error:
            raise _located(error, spec, seq) from None
        if status == _OK:
            meter.produced(1)
            return True
        if status == _CLOSED or orphaned():
            return False


def _located(error: ValueError, spec: WorkerSpec, seq: int) -> ValueError:
    """The buffer's error about "example i" of a put, naming the example as the
    dataset knows it, and saying what counts against the ragged budget here."""
    match = re.match(r"example (\d+): (.*)", str(error), re.S)
    if match is None or "ragged_bytes" not in str(error):
        return error
    position = seq + int(match.group(1))
    if spec.map_style:
        name = f"dataset[{int(spec.order[position])}]"
    else:
        name = f"example {position} of worker {spec.worker_id}"
    return ValueError(f"{name}: {match.group(2)}; with worker processes, object leaves (str, bytes, ...) travel "
                      f"pickled and count against ragged_bytes as ragged values do")


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
