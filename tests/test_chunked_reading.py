"""Sources read in chunks (dataecho.reading): NumPy arrays, memmaps and buffers
copied natively by index, ``__getitems__``, Hugging Face Arrow tables, and the
per-example path's column conversion; and the default number of reading threads.

Every test checks what each example holds against its id, and counts every id.
"""

from __future__ import annotations

import array
import gc
import itertools
import threading
import time
from collections import Counter
from typing import Any

import dataecho
import datasets
import numpy as np
import pytest
import torch
from dataecho import _core
from dataecho.examples.fields import parse_fields
from dataecho.native.echo_buffer import NativeBuffer
from dataecho.native.sizing import buffer_config
from dataecho.reading.arrays import rows_contiguous
from dataecho.reading.chunking import CHUNK
from dataecho.workers.growth import AUTO_THREADS, GIL_BUSY_S, Growth, gil_wait_s
from support import FIRST, PAYLOAD, Records, boxes_of, drain, kept_bytes, payload_of

N = 1000


def id_rows(n: int, width: int = 8) -> np.ndarray:
    """Row i: i, then i * 3 + k for k in 1..width-1 (int64), so a row shows its id."""
    ids = np.arange(n, dtype=np.int64)[:, None]
    return np.concatenate([ids, ids * 3 + np.arange(1, width)[None, :]], axis=1)


def check_id_rows(batches: Any, n: int, echo: int = 1) -> None:
    seen: Counter = Counter()
    for batch in batches:
        batch = np.asarray(batch)
        expected = id_rows(n, batch.shape[1])[batch[:, 0]] if len(batch) else batch
        assert (batch == expected).all(), "a row does not belong to its id"
        seen.update(batch[:, 0].tolist())
    assert seen == Counter({i: echo for i in range(n)}), f"not every row exactly {echo} times"


# ---- arrays, memmaps, buffers ----


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("echo", [1, 2])
def test_a_numpy_array_is_read_natively_exactly(workers, echo, seed):
    loader = dataecho.EchoLoader(id_rows(N), batch_size=64, echo_factor=echo, num_workers=workers, seed=seed)
    check_id_rows(loader, N, echo)


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_processes_read_an_array_natively_exactly(persistent, seed):
    loader = dataecho.EchoLoader(id_rows(N), batch_size=64, echo_factor=2, num_workers=2, worker_type="process",
                                 persistent_workers=persistent, seed=seed)
    for _ in range(2):
        check_id_rows(loader, N, 2)
    loader.close()


class BatchedRows:
    """``__getitems__`` over id rows, picklable for worker processes."""

    def __init__(self, n: int) -> None:
        self.rows = id_rows(n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.rows[i]

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return list(self.rows[indices])


def test_worker_processes_read_getitems_exactly(seed):
    loader = dataecho.EchoLoader(BatchedRows(N), batch_size=64, echo_factor=1, num_workers=2, worker_type="process",
                                 seed=seed)
    check_id_rows(loader, N)


def test_a_memmap_is_read_natively_exactly(tmp_path, seed):
    path = tmp_path / "rows.bin"
    id_rows(N).tofile(path)
    rows = np.memmap(path, dtype=np.int64, mode="r", shape=(N, 8))
    check_id_rows(dataecho.EchoLoader(rows, batch_size=50, echo_factor=1, seed=seed), N)


def test_strided_rows_are_read_directly_and_rows_that_are_not_contiguous_by_a_copy(seed):
    wide = id_rows(2 * N, 16)
    every_other_row = wide[::2]  # rows strided, each row contiguous
    assert rows_contiguous(every_other_row) and not rows_contiguous(wide[:, ::2])
    seen = Counter()
    for batch in dataecho.EchoLoader(every_other_row, batch_size=64, echo_factor=1, seed=seed):
        assert (batch == wide[batch[:, 0]]).all()
        seen.update(batch[:, 0].tolist())
    assert seen == Counter(range(0, 2 * N, 2))
    columns = wide[:, ::2]  # each row's own bytes strided: gathered by NumPy first
    seen = Counter()
    for batch in dataecho.EchoLoader(columns, batch_size=64, echo_factor=1, seed=seed):
        assert (batch == wide[batch[:, 0]][:, ::2]).all()
        seen.update(batch[:, 0].tolist())
    assert seen == Counter(range(2 * N))


def test_a_tensor_dataset_is_read_natively_as_tuples_of_its_tensors(seed):
    ids = torch.arange(N)
    features = torch.from_numpy(id_rows(N, 6).astype(np.float32)).t().contiguous().t()  # rows strided
    dataset = torch.utils.data.TensorDataset(features, ids, torch.from_numpy(payload_of(np.arange(N))))
    seen: Counter = Counter()
    for x, i, payload in dataecho.EchoLoader(dataset, batch_size=64, echo_factor=1, seed=seed):
        assert x.dtype == np.float32 and i.dtype == np.int64 and payload.dtype == np.uint8
        assert (x == id_rows(N, 6)[i]).all() and (payload == payload_of(i)).all()
        seen.update(i.tolist())
    assert seen == Counter(range(N))
    raw = torch.utils.data.TensorDataset(ids, features.to(torch.bfloat16))  # a dtype NumPy lacks: read per example
    i, x = next(iter(dataecho.EchoLoader(raw, batch_size=64, echo_factor=1, seed=seed, output="torch")))
    assert x.dtype == torch.bfloat16 and (x.float() == features[i].to(torch.bfloat16).float()).all()


def test_a_buffer_protocol_source_is_read_as_its_array(seed):
    values = array.array("d", (float(i) for i in range(N)))
    batches = list(dataecho.EchoLoader(values, batch_size=64, echo_factor=1, seed=seed))
    assert all(b.dtype == np.float64 and b.ndim == 1 for b in batches)
    assert sorted(np.concatenate(batches).tolist()) == [float(i) for i in range(N)]


def test_an_array_with_a_sampler_reads_its_indices_in_its_order():
    rows = id_rows(100)
    loader = dataecho.EchoLoader(rows, batch_size=10, echo_factor=1, sampler=[5, 99, 7, 0, 7], num_workers=1)
    got = np.concatenate(list(loader))
    assert got[:, 0].tolist() == [5, 99, 7, 0, 7], "in the sampler's order (shuffle=False at echo 1)"


def test_put_each_refuses_what_would_touch_memory_out_of_bounds():
    buffer = NativeBuffer(parse_fields(((8,), "int64"))[0],
                          buffer_config(capacity=16, batch_size=4))
    rows = id_rows(4)
    with pytest.raises(IndexError, match="index 4 out of range for 4 rows"):
        buffer.put_each([(rows, np.array([0, 4], dtype=np.int64))], 2)
    with pytest.raises(ValueError, match="expected 2 indices"):
        buffer.put_each([(rows, np.array([0], dtype=np.int64))], 2)
    with pytest.raises(TypeError, match="int64 indices"):
        buffer.put_each([(rows, np.array([0, 1], dtype=np.int32))], 2)
    with pytest.raises(ValueError, match="not of the declared size"):
        buffer.put_each([(rows[:, :4], np.array([0, 1], dtype=np.int64))], 2)
    with pytest.raises(ValueError, match="not C-contiguous of the declared size"):
        buffer.put_each([[rows[0], rows[1].astype(np.int32)]], 2)
    with pytest.raises(TypeError, match="not an array"):
        buffer.put_each([[rows[0], 7]], 2)
    with pytest.raises(ValueError, match="expected 1 fields, got 2"):
        buffer.put_each([[rows[0]], [rows[1]]], 1)
    assert buffer.stats()["fresh"] == 0, "nothing was put by a refused call"
    assert buffer.put_each([(rows, np.array([3, 1], dtype=np.int64))], 2) == 2
    buffer.close()
    assert buffer.stats()["fresh"] == 2
    buffer.abort()


def test_exact_rows_counts_the_leading_arrays_that_match_their_field_exactly():
    field = ((2, 3), np.dtype(np.float32))
    good = np.zeros((2, 3), np.float32)
    assert _core.exact_rows([good, good], field) == 2
    assert _core.exact_rows([good, np.zeros((3, 2), np.float32), good], field) == 1, "same bytes, other shape"
    assert _core.exact_rows([good, np.zeros((2, 3), np.float64)], field) == 1
    assert _core.exact_rows([np.zeros((2, 6), np.float32)[:, ::2], good], field) == 0, "not contiguous"
    assert _core.exact_rows([1.0, good], field) == 0


@pytest.mark.parametrize("per_example", [False, True])
def test_an_epochs_buffer_memory_is_kept_for_the_next_epoch_and_freed_by_close(per_example, seed):
    gc.disable()  # an ended epoch gives its memory back at once: no cycle waits for the collector
    try:
        source = Records(N) if per_example else id_rows(N)
        loader = dataecho.EchoLoader(source, batch_size=64, echo_factor=2, seed=seed, num_workers=2)
        for _ in range(3):  # each epoch in the memory of the one before: still exact
            seen: Counter = Counter()
            if per_example:
                drain(loader, seen)
                assert seen == Counter({i: 2 for i in range(N)})
            else:
                check_id_rows(loader, N, 2)
            kept = kept_bytes(loader)
            assert kept >= N * 64, f"{kept} bytes kept after the epoch: less than its {N} slots"
        loader.close()
        assert kept_bytes(loader) == 0, "close() frees what the loader kept"
    finally:
        gc.enable()


# ---- __getitems__ ----


class Batched:
    """A map-style source with ``__getitems__``; records the index lists it gets,
    and the indices ``__getitem__`` gets."""

    def __init__(self, n: int) -> None:
        self.n, self.calls, self.singles = n, [], []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.singles.append(i)
        return {"id": i, "payload": payload_of([i])[0]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        self.calls.append(list(indices))
        return [{"id": i, "payload": payload_of([i])[0]} for i in indices]


def test_getitems_is_called_once_per_chunk_and_every_example_comes_once(seed):
    source = Batched(N)
    seen: Counter = Counter()
    drain(dataecho.EchoLoader(source, batch_size=100, echo_factor=1, seed=seed), seen)
    assert seen == Counter(range(N))
    assert len(source.singles) == FIRST, "__getitem__ reads only the first examples, which tell the structure"
    assert all(1 <= len(call) <= CHUNK for call in source.calls)
    assert sorted(sum(source.calls, source.singles)) == list(range(N)), "each index read once"


def test_getitems_returning_the_wrong_count_is_an_error_that_names_it():
    class Short(Batched):
        def __getitems__(self, indices):
            return super().__getitems__(indices)[:-1]

    source = Short(200)
    with pytest.raises(ValueError, match=r"__getitems__ returned \d+ examples for \d+ indices"):
        list(dataecho.EchoLoader(source, batch_size=16, echo_factor=1, num_workers=1))


def test_a_transform_runs_on_each_example_getitems_returns(seed):
    source = Batched(300)

    def transform(example):
        return {"id": example["id"], "payload": example["payload"], "twice": example["id"] * 2.0}

    for batch in dataecho.EchoLoader(source, batch_size=32, echo_factor=1, transform=transform, seed=seed):
        assert (batch["twice"] == batch["id"] * 2.0).all() and batch["twice"].dtype == np.float64


class SlowReads:
    """Reads that take 20 ms each (more than a chunk's time slice), counted."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.reads += 1
        time.sleep(0.02)
        return {"id": i, "payload": payload_of([i])[0]}

    def __iter__(self):
        return (self[i] for i in range(self.n))


@pytest.mark.parametrize("iterable", [False, True])
def test_slow_reads_are_put_as_they_come_not_a_whole_chunk_later(iterable, seed):
    source = SlowReads(200)
    loader = dataecho.EchoLoader(iter(source) if iterable else source, batch_size=2, shuffle_buffer=4,
                                 echo_factor=1, num_workers=1, seed=seed)
    epoch = iter(loader)
    next(epoch)
    assert source.reads < CHUNK // 4, f"the first batch came after {source.reads} reads: chunks wait for slow reads"
    epoch.close()


# ---- the per-example path's columns ----


class Mixed:
    """Leaves of every kind a put converts: Python numbers, NumPy scalars of
    another dtype (cast safely), arrays that are not contiguous, torch tensors."""

    def __len__(self) -> int:
        return 500

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        kinds = i % 4
        value = [1.5 * i, float(i), np.float64(i * 2.5), np.float32(i)][kinds]
        payload = payload_of([i])[0]
        strided = np.repeat(payload, 2)[::2]  # not contiguous: copied
        payload = [payload, strided, torch.from_numpy(payload.copy()), payload.astype(np.uint8)][kinds]
        return {"id": i, "value": value, "payload": payload}


def test_mixed_leaf_kinds_in_one_chunk_are_converted_as_single_puts_convert_them(seed):
    seen: Counter = Counter()
    # In order: the first example, a Python float and an array, decides the fields (float64, uint8).
    for batch in dataecho.EchoLoader(Mixed(), batch_size=50, echo_factor=1, shuffle=False, seed=seed):
        ids = batch["id"]
        assert batch["value"].dtype == np.float64 and batch["payload"].dtype == np.uint8
        expected = np.choose(ids % 4, [1.5 * ids, ids * 1.0, ids * 2.5, ids * 1.0])
        assert (batch["value"] == expected).all()
        assert (batch["payload"] == payload_of(ids)).all()
        seen.update(ids.tolist())
    assert seen == Counter(range(500))


def test_a_leaf_that_changes_kind_mid_chunk_names_its_path():
    class Changes(Mixed):
        def __getitem__(self, i):
            return {"id": i, "payload": payload_of([i])[0] if i != 123 else {"oops": 1}}

    with pytest.raises(TypeError, match="'payload'"):
        list(dataecho.EchoLoader(Changes(), batch_size=50, echo_factor=1, shuffle=False))


def test_an_out_of_range_python_int_in_a_chunk_raises_overflow():
    class Big(Mixed):
        def __getitem__(self, i):
            return {"id": i if i != 77 else 1 << 70, "payload": payload_of([i])[0]}

    with pytest.raises(OverflowError):
        list(dataecho.EchoLoader(Big(), batch_size=50, echo_factor=1, shuffle=False))


# ---- Hugging Face Arrow tables ----


@pytest.fixture(scope="module")
def hf_rows():
    ids = np.arange(N)
    return datasets.Dataset.from_dict({"id": ids, "x": payload_of(ids), "grid": id_rows(N, 6).reshape(N, 2, 3)})


@pytest.mark.parametrize("form", [None, "numpy", "torch"])
def test_an_arrow_dataset_is_read_in_columns_as_its_own_formats_give_them(hf_rows, form, seed):
    dataset = hf_rows.shuffle(seed=1) if form is None else hf_rows.with_format(form)  # indices mapping too
    seen: Counter = Counter()
    for batch in dataecho.EchoLoader(dataset, batch_size=64, echo_factor=1, seed=seed):
        assert list(batch) == ["id", "x", "grid"]
        # uint8 stays uint8 (pixels, bytes), where the dataset's own formats give int64; other integers: int64.
        assert batch["x"].dtype == np.uint8 and batch["x"].shape[1:] == (PAYLOAD,)
        assert batch["id"].dtype == np.int64 and batch["grid"].dtype == np.int64
        assert (batch["x"] == payload_of(batch["id"])).all()
        assert (batch["grid"].reshape(-1, 6) == id_rows(N, 6)[batch["id"]]).all()
        seen.update(batch["id"].tolist())
    assert seen == Counter(range(N))


def test_an_arrow_dataset_keeps_its_selected_columns(hf_rows, seed):
    dataset = hf_rows.with_format("numpy", columns=["x", "id"])
    batch = next(iter(dataecho.EchoLoader(dataset, batch_size=64, echo_factor=1, seed=seed)))
    assert list(batch) == list(dataset[0]) and sorted(batch) == ["id", "x"], "the columns, in the dataset's order"
    assert (batch["x"] == payload_of(batch["id"])).all()


def test_a_dataset_with_a_transform_of_its_own_is_read_through_it(hf_rows, seed):
    def doubled(batch):  # HF's with_transform: applied by the dataset to every row it returns
        return {"id": batch["id"], "twice": [2 * i for i in batch["id"]]}

    dataset = hf_rows.with_transform(doubled)
    batch = next(iter(dataecho.EchoLoader(dataset, batch_size=64, echo_factor=1, seed=seed)))
    assert list(batch) == ["id", "twice"] and (batch["twice"] == 2 * batch["id"]).all()
    half = hf_rows.with_format("torch", dtype=torch.float16)  # a format option: HF casts, so it reads the rows
    batch = next(iter(dataecho.EchoLoader(half, batch_size=64, echo_factor=1, seed=seed)))
    assert batch["x"].dtype == np.float16


def test_an_arrow_column_of_lists_of_any_length_is_read_packed_as_a_ragged_leaf(seed):
    # Lengths vary after the first rows, where nothing but the table's offsets tells.
    rows = [[i] * (0 if i < 50 else i % 7) for i in range(200)]
    dataset = datasets.Dataset.from_dict({"id": np.arange(200), "tokens": rows}).with_format("numpy")
    seen: Counter = Counter()
    for batch in dataecho.EchoLoader(dataset, batch_size=16, echo_factor=1, seed=seed):
        assert isinstance(batch["tokens"], dataecho.Ragged) and batch["tokens"].dtype == np.int64
        assert [row.tolist() for row in batch["tokens"]] == [rows[i] for i in batch["id"]]
        seen.update(batch["id"].tolist())
    assert seen == Counter(range(200))


def test_an_arrow_column_whose_inner_lists_vary_is_an_error_that_names_it():
    dataset = datasets.Dataset.from_dict({"boxes": [[[1, 2], [3, 4]]] * 100 + [[[1, 2, 3]]] * 100})
    with pytest.raises(ValueError, match="column 'boxes' holds lists of different lengths"):
        list(dataecho.EchoLoader(dataset, batch_size=16, echo_factor=1, shuffle=False, num_workers=1))


@pytest.mark.parametrize("hint", [None, ["boxes"]], ids=["found", "declared"])
def test_an_arrow_column_of_boxes_with_images_without_any_is_read_as_rows_of_4(hint):
    # COCO's boxes, List(List(float64)): an image without boxes is an empty row,
    # the first example's among them (id 0), so the first read holds no box at all.
    dataset = datasets.Dataset.from_dict({"id": np.arange(200), "boxes": [boxes_of(i).tolist() for i in range(200)]})
    assert dataset.features["boxes"] == datasets.List(datasets.List(datasets.Value("float64")))
    seen: Counter = Counter()
    for batch in dataecho.EchoLoader(dataset, batch_size=4, echo_factor=1, num_workers=0, shuffle=False, ragged=hint):
        # float64 in Arrow, float32 as the dataset's numpy and torch formats give it.
        assert isinstance(batch["boxes"], dataecho.Ragged) and batch["boxes"].dtype == np.float32
        for i, boxes in zip(batch["id"].tolist(), batch["boxes"]):
            assert boxes.shape == (i % 6, 4) and np.array_equal(boxes, boxes_of(i).astype(np.float32)), f"id {i}"
        seen.update(batch["id"].tolist())
    assert seen == Counter(range(200))


def with_none(rows: list, at: int) -> list:
    """``rows`` with row ``at`` missing (None)."""
    return rows[:at] + [None] + rows[at + 1:]


@pytest.mark.parametrize("rows", [
    with_none([[i, i] for i in range(200)], 150),  # lists of one length, one missing after the first rows
    with_none([[i, i] for i in range(200)], 1),  # ... among the first rows
    with_none([[i] * (i % 3) for i in range(200)], 150),  # lists of any length
    with_none([[[i, i]] * (1 + i % 3) for i in range(200)], 150),  # lists of lists
    [[[i, i]] * (1 + i % 3) for i in range(150)] + [[[1, 2], None]] * 50,  # an inner list missing
], ids=["fixed", "fixed-first", "ragged", "nested", "inner"])
def test_an_arrow_column_with_a_missing_row_is_an_error_that_names_it(rows):
    dataset = datasets.Dataset.from_dict({"id": np.arange(200), "boxes": rows})
    with pytest.raises(ValueError, match=r"column 'boxes' holds missing values \(None\)"):
        list(dataecho.EchoLoader(dataset, batch_size=16, echo_factor=1, shuffle=False, num_workers=0))


# ---- how many reading threads by default ----


class Slow:
    """Reads that wait (I/O): a sleep per example."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> dict[str, Any]:
        time.sleep(0.002)
        return {"id": i, "payload": payload_of([i])[0]}


def test_by_default_reads_that_wait_get_more_threads_and_every_example_comes_once(seed):
    loader = dataecho.EchoLoader(Slow(), batch_size=32, echo_factor=1, seed=seed)
    seen: Counter = Counter()
    drain(loader, seen)
    assert seen == Counter(range(600))
    workers = loader.stats()["workers"]
    assert len(workers) > 1, "a read that sleeps 2 ms on 0.1 ms of CPU gains from threads"
    assert sum(w["produced"] for w in workers) == 600, "the workers read every example, the first ones too"


def idle_gil() -> float:
    return 0.0  # nobody else holds the GIL (measured for real below, where a thread holds it)


def test_growth_asks_for_wall_over_cpu_threads_once_after_its_sample():
    io_bound = Growth(AUTO_THREADS, idle_gil)
    assert io_bound.observe(0.01, 0.001) == 0, "not decided before its sample"
    assert io_bound.observe(0.05, 0.001) == AUTO_THREADS - 1, "60 ms of wall on 2 ms of CPU: the limit"
    assert io_bound.observe(1.0, 0.0) == 0, "decided once"
    cpu_bound = Growth(AUTO_THREADS, idle_gil)
    assert cpu_bound.observe(0.06, 0.055) == 0, "a read that computes keeps one thread"
    half = Growth(AUTO_THREADS, idle_gil)
    assert half.observe(0.06, 0.02) == 2, "wall / cpu = 3 threads in all"
    assert Growth(1).observe(10.0, 0.0) == 0, "workers given: no growth"


def test_growth_adds_no_thread_whose_wait_is_the_gil():
    # A thread that waits for the GIL (held by a busy training loop) looks like
    # one that waits on I/O: wall time without CPU time.
    busy = threading.Event()
    stop = threading.Event()

    def training_loop():
        busy.set()
        while not stop.is_set():
            pass

    loop = threading.Thread(target=training_loop)
    loop.start()
    busy.wait()
    try:
        assert gil_wait_s() >= GIL_BUSY_S, "taking the GIL back waits for the busy thread"
        growth = Growth(AUTO_THREADS)
        assert growth.observe(0.06, 0.001) == 0 and growth.allowed == 1
    finally:
        stop.set()
        loop.join()
    idle = Growth(AUTO_THREADS, idle_gil)
    assert idle.observe(0.06, 0.001) == AUTO_THREADS - 1 and idle.allowed is None


def test_growth_stops_the_threads_it_added_once_the_gil_turns_busy(monkeypatch):
    import dataecho.workers.growth as growth_module

    waits = iter([0.0] + [0.005] * 10)  # idle when deciding, then a busy training loop
    growth = Growth(AUTO_THREADS, lambda: next(waits))
    assert growth.observe(0.06, 0.001) == AUTO_THREADS - 1
    monkeypatch.setattr(growth_module, "RECHECK_S", 0.0)
    growth._next_check = 0.0
    assert growth.observe(0.01, 0.001) == 0 and growth.allowed == 1, "the added threads stop at their next chunk"


def test_given_workers_are_kept_as_given(seed):
    loader = dataecho.EchoLoader(Slow(), batch_size=32, echo_factor=1, num_workers=1, seed=seed)
    drain(loader, Counter())
    assert len(loader.stats()["workers"]) == 1 and loader.num_workers == 1


def test_given_workers_all_read(seed):
    loader = dataecho.EchoLoader(Slow(), batch_size=32, echo_factor=1, num_workers=2, seed=seed)
    seen: Counter = Counter()
    drain(loader, seen)
    assert seen == Counter(range(600))
    assert [w["produced"] > 0 for w in loader.stats()["workers"]] == [True, True]


def test_threads_stopped_by_a_busy_gil_leave_no_claimed_example_unread(seed, monkeypatch):
    import dataecho.workers.growth as growth_module

    # Idle when deciding (threads are added), busy at every check after: the
    # added threads stop part-way through the epoch, each after a whole claim.
    waits = itertools.chain([0.0], itertools.repeat(0.005))
    monkeypatch.setattr(growth_module, "RECHECK_S", 0.0)
    monkeypatch.setattr(growth_module, "gil_wait_s", lambda: next(waits))
    expected = [b["id"].tolist() for b in dataecho.EchoLoader(Slow(), batch_size=32, num_workers=1, seed=seed)]
    loader = dataecho.EchoLoader(Slow(), batch_size=32, seed=seed)
    assert [b["id"].tolist() for b in loader] == expected, "deterministic: the same batches whatever the threads"
    workers = loader.stats()["workers"]
    assert len(workers) > 1 and sum(w["produced"] for w in workers) == 600
