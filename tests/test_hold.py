"""Large examples held by reference (``hold``): batches gathered straight from
the arrays handed over, each array kept alive until its examples' last echo is
gathered and let go of then, never written, and every guarantee of the copying
path kept: values, echo counts, order, timeouts, and nothing leaked."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections import Counter

import numpy as np
import pytest

import dataecho
from dataecho.native.hold import HOLD_MIN_BYTES

IMAGE = 2 * HOLD_MIN_BYTES  # bytes per example: holdable
FIELDS = {"id": ((), "int64"), "image": ((IMAGE,), "uint8")}


def image_of(ids) -> np.ndarray:
    """Bytes derived from the id and the byte position, never the poison byte."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return ((ids[:, None] * 131 + np.arange(IMAGE)[None, :] * 7 + 3) % 211).astype(np.uint8)


def stacked(ids) -> dict[str, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64)
    return {"id": ids, "image": image_of(ids)}


def drained(buf: dataecho.ShuffleBuffer) -> list[int]:
    """Every id delivered, after checking each row's bytes against its id."""
    seen = []
    for batch in buf:
        assert np.array_equal(batch["image"], image_of(batch["id"])), "a row's bytes do not match its id"
        seen += batch["id"].tolist()
    return seen


def buffer(**kwargs) -> dataecho.ShuffleBuffer:
    return dataecho.ShuffleBuffer(FIELDS, **{"capacity": 64, "batch_size": 8, **kwargs})


@pytest.mark.parametrize("echo", [1, 2, 1.5])
def test_put_holds_each_example_until_its_last_echo(seed, echo):
    buf = buffer(echo_factor=echo, seed=seed)
    arrays = [stacked([i]) for i in range(40)]
    for a in arrays:
        buf.put({"id": a["id"][0], "image": a["image"][0]})
    assert buf.held == 40, "each example's image is held, not copied"
    buf.close()
    counts = Counter(drained(buf))
    assert set(counts) == set(range(40))
    if echo == int(echo):
        assert set(counts.values()) == {echo}
    assert buf.held == 0, "every held array is let go of once its last echo is gathered"


def test_a_held_array_is_read_only_and_the_copy_path_leaves_it_alone():
    held = buffer(seed=0)
    image = image_of([3])[0]
    held.put({"id": 3, "image": image})
    with pytest.raises(ValueError, match="read-only"):
        image[0] = 1
    copying = buffer(seed=0, hold=False)
    other = image_of([4])[0]
    copying.put({"id": 4, "image": other})
    assert other.flags.writeable and copying.held == 0
    other[:] = 0  # the buffer has its own copy
    copying.close()
    assert drained(copying) == [4]
    held.close()
    assert drained(held) == [3]


def hand_over(buf: dataecho.ShuffleBuffer, i: int, staging: np.ndarray, how: str) -> None:
    """Puts example ``i`` whose image is ``staging``: one example (``put``) or a
    stack of one (``put_many``, held with ``hold=True``)."""
    if how == "put":
        buf.put({"id": i, "image": staging})
    else:
        buf.put_many({"id": np.array([i]), "image": staging})


@pytest.mark.parametrize("how,hold", [("put", "auto"), ("put_many", True)])
def test_a_staging_array_is_read_only_while_held_and_writeable_after_its_last_echo(how, hold):
    buf = buffer(capacity=1, batch_size=1, echo_factor=1, seed=0, hold=hold)  # a batch per put
    staging = image_of([0]) if how == "put_many" else image_of([0])[0]
    batches = []
    for i in range(3):  # the caller refills one array for every example
        staging[...] = image_of([i]).reshape(staging.shape)
        hand_over(buf, i, staging, how)
        assert buf.held == 1
        with pytest.raises(ValueError, match="read-only"):
            staging[...] = 0
        batches.append(buf.next_batch(timeout=30))  # the example's only echo: the buffer lets go of it
        assert buf.held == 0 and staging.flags.writeable
    staging[...] = 0
    assert [b["id"].tolist() for b in batches] == [[0], [1], [2]]
    for batch in batches:
        assert np.array_equal(batch["image"], image_of(batch["id"])), "a batch is not the staging array"
    buf.close()


@pytest.mark.parametrize("end", ["drained", "auto-echo", "drop_last", "buffer-dropped"])
@pytest.mark.parametrize("how,hold", [("put", "auto"), ("put_many", True)])
def test_staging_arrays_are_writeable_again_once_the_buffer_ends_or_is_gone(how, hold, end):
    # drop_last and auto echo end with examples resident whose echoes never come.
    echo = {"drained": 2, "auto-echo": "auto", "drop_last": 1, "buffer-dropped": 2}[end]
    buf = buffer(batch_size=4, echo_factor=echo, seed=0, hold=hold, drop_last=end == "drop_last")
    staging = [image_of([i]) if how == "put_many" else image_of([i])[0] for i in range(10)]
    staging[9].flags.writeable = False  # the caller's own flag: kept
    for i, array in enumerate(staging):
        hand_over(buf, i, array, how)
    assert buf.held == 10 and not any(a.flags.writeable for a in staging)
    if end == "buffer-dropped":
        del buf
        gc.collect()
    else:
        buf.close()
        seen = Counter(drained(buf))
        assert set(seen) <= set(range(10)) and len(seen) >= (8 if end == "drop_last" else 10)
        assert buf.held == 0, "nothing is held after the end"
    assert [a.flags.writeable for a in staging] == [True] * 9 + [False]
    staging[0][...] = 0


def test_a_view_of_much_larger_memory_is_copied_not_held():
    # Holding a row of a stacked array (or of a block read from a store) would
    # keep all of it alive for one example.
    big = image_of(np.arange(100))
    buf = buffer(seed=0)
    buf.put({"id": 3, "image": big[3]})
    assert buf.held == 0 and big[3].flags.writeable
    big[3] = 0  # the buffer has its copy
    own = big[5].copy()
    buf.put({"id": 5, "image": own})
    assert buf.held == 1
    buf.close()
    assert sorted(drained(buf)) == [3, 5]


def test_small_fields_are_copied():
    buf = buffer(seed=0)
    label = np.arange(4)
    buf.put_many({"id": label, "image": image_of(label)})
    buf.put({"id": 9, "image": image_of([9])[0]})
    assert buf.held == 1, "the image of put() only: ids are below the threshold, put_many copies by default"
    buf.close()
    assert sorted(drained(buf)) == [0, 1, 2, 3, 9]


def test_put_many_holds_views_with_hold_true_and_lets_the_source_go(seed):
    source = stacked(np.arange(200))
    before = sys.getrefcount(source["image"])
    buf = buffer(echo_factor=2, seed=seed, hold=True)
    consumer = threading.Thread(target=lambda: result.extend(drained(buf)))
    result: list[int] = []
    consumer.start()
    for start in range(0, 200, 25):
        buf.put_many({"id": source["id"][start:start + 25], "image": source["image"][start:start + 25]})
    buf.close()
    consumer.join(30)
    assert not consumer.is_alive()
    assert Counter(result) == Counter({i: 2 for i in range(200)})
    assert buf.held == 0
    gc.collect()
    after = sys.getrefcount(source["image"])  # outside the assert: its rewriting keeps subexpressions alive
    assert after == before, "no view of the source is kept"
    assert source["image"].flags.writeable, "only the views handed over are made read-only"


def test_put_many_copies_by_default():
    source = stacked(np.arange(16))
    buf = buffer(seed=0)
    buf.put_many(source)
    assert buf.held == 0 and source["image"].flags.writeable
    source["image"][:] = 0  # does not reach the buffer
    buf.close()
    assert sorted(drained(buf)) == list(range(16))


def test_a_buffer_dropped_with_examples_resident_lets_go_of_them():
    images = [image_of([i])[0] for i in range(30)]
    counts = [sys.getrefcount(a) for a in images]
    buf = buffer(seed=0, prefetch=2)
    for i in range(30):
        buf.put({"id": i, "image": images[i]})
    first = buf.next_batch()  # batches assembled and waiting too
    assert np.array_equal(first["image"], image_of(first["id"]))
    assert buf.held > 0
    del buf, first
    gc.collect()
    assert [sys.getrefcount(a) for a in images] == counts


def test_a_put_that_times_out_holds_nothing_more():
    buf = buffer(capacity=8, seed=0, hold=True)
    source = stacked(np.arange(60))
    with pytest.raises(TimeoutError) as raised:
        buf.put_many(source, timeout=0.2)
    put = raised.value.examples_put
    assert 0 < put < 60 and buf.held == put, "only the rows that went in are held"
    extra = image_of([99])[0]
    before = sys.getrefcount(extra)
    with pytest.raises(TimeoutError):
        buf.put({"id": 99, "image": extra}, timeout=0.05)
    assert sys.getrefcount(extra) == before and buf.held == put
    buf.close()
    assert sorted(drained(buf)) == list(range(put))


def test_held_and_copied_give_the_same_batches(seed):
    def batches(hold):
        buf = buffer(echo_factor=1.5, seed=seed, hold=hold)
        for i in range(60):
            if i % 2:
                buf.put({"id": i, "image": image_of([i])[0]})
            else:
                buf.put_many(stacked([i]))
        buf.close()
        return [b["id"].tolist() for b in buf]

    assert batches(True) == batches(False), "holding changes where bytes come from, not the order"


def test_producer_threads_holding_at_once(seed):
    buf = buffer(capacity=128, batch_size=16, echo_factor=2, seed=seed)
    ids = np.arange(2000).reshape(4, -1)

    def produce(part):
        for start in range(0, len(part), 10):
            chunk = part[start:start + 10]
            buf.put_many(stacked(chunk)) if start % 20 else [buf.put({"id": i, "image": image_of([i])[0]})
                                                             for i in chunk]

    threads = [threading.Thread(target=produce, args=(part,)) for part in ids]
    for t in threads:
        t.start()
    seen: list[int] = []
    consumer = threading.Thread(target=lambda: seen.extend(drained(buf)))
    consumer.start()
    for t in threads:
        t.join(60)
    buf.close()
    consumer.join(60)
    assert Counter(seen) == Counter({i: 2 for i in range(2000)})
    assert buf.held == 0


def test_hold_is_checked():
    with pytest.raises(ValueError, match="hold"):
        buffer(hold="yes")
    with pytest.raises(ValueError, match="hold"):
        buffer(hold=1)


class Images:
    """A map-style dataset that returns a fresh array per read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"id": np.int64(i), "image": image_of([i])[0]}


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_delivers_large_examples_a_dataset_returns(seed, workers):
    # Copied into slots (the loader keeps them from one epoch to the next).
    loader = dataecho.EchoLoader(Images(300), batch_size=16, echo_factor=2, shuffle_buffer=64, num_workers=workers,
                                 seed=seed)
    for _ in range(2):
        counts = Counter()
        for batch in loader:
            assert np.array_equal(batch["image"], image_of(batch["id"]))
            counts.update(batch["id"].tolist())
        assert counts == Counter({i: 2 for i in range(300)})


def test_loader_over_an_array_gathers_from_it_and_leaves_it_as_it_was(seed):
    ids = np.arange(500, dtype="<i8")
    source = image_of(ids)
    source[:, :8] = ids.view(np.uint8).reshape(-1, 8)  # each row names its index
    before = sys.getrefcount(source)
    loader = dataecho.EchoLoader(source, batch_size=32, echo_factor=2, shuffle_buffer=128, seed=seed)
    rows = Counter()
    for batch in loader:
        batch = np.asarray(batch)
        named = batch[:, :8].copy().view("<i8").ravel()
        assert np.array_equal(batch, source[named])
        rows.update(named.tolist())
    assert rows == Counter({i: 2 for i in range(500)})
    assert source.flags.writeable, "a source array is read, never made read-only"
    del loader, batch
    gc.collect()
    assert sys.getrefcount(source) == before


@pytest.mark.parametrize("nbytes", [32768, 40001, 153600])
@pytest.mark.parametrize("hold", [True, False])
def test_rows_streamed_into_batches_arrive_whole(seed, nbytes, hold):
    # Rows of 32 KiB or more are written into slots (when copied) and into
    # batches with streaming stores, whatever their alignment (40001: every row
    # starts at another offset), put stacked or one by one.
    def rows(ids):
        ids = np.asarray(ids, dtype=np.int64)
        return ((ids[:, None] * 131 + np.arange(nbytes)[None, :] * 7 + 3) % 211).astype(np.uint8)

    buf = dataecho.ShuffleBuffer({"id": ((), "int64"), "x": ((nbytes,), "uint8")}, capacity=32, batch_size=5,
                                 echo_factor=2, seed=seed, hold=hold)
    ids = np.arange(24)
    source = rows(ids)
    for start in range(0, 12, 6):
        buf.put_many({"id": ids[start:start + 6], "x": source[start:start + 6]})
    for i in range(12, 24):
        buf.put({"id": ids[i], "x": source[i].copy()})
    buf.close()
    seen = Counter()
    for batch in buf:
        assert np.array_equal(batch["x"], rows(batch["id"]))
        seen.update(batch["id"].tolist())
    assert seen == Counter({i: 2 for i in range(24)})


# ---- what a dataset returns, held by EchoLoader where nothing else holds it ----

ROW = 40_000  # bytes per example: at least FRESH_MIN_BYTES


def row_of(i: int) -> np.ndarray:
    """Bytes derived from the id and the byte position, the id in the first eight."""
    row = ((np.arange(ROW) * 7 + i * 131 + 3) % 211).astype(np.uint8)
    row[:8] = np.array([i], dtype="<i8").view(np.uint8)
    return row


class Returned:
    """A map-style dataset that notes (weakly) every array its ``__getitem__``
    returned, and whether any of them was read-only, as a buffer holding it
    makes it, when it returned the next; ``form`` says what it returns."""

    def __init__(self, n: int, form: str) -> None:
        self.n, self.form, self.refs, self.seen_held = n, form, [], False
        self.kept = [row_of(i) for i in range(n)] if form == "kept" else None
        self.block = np.stack([row_of(i) for i in range(n)]) if form == "view" else None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.seen_held = self.seen_held or any(not r().flags.writeable for r in self.refs[-64:] if r() is not None)
        if self.form == "kept":
            row = self.kept[i]
        elif self.form == "view":
            row = self.block[i]
        else:
            row = row_of(i)  # a new array: fresh
        self.refs.append(weakref.ref(row) if self.form != "view" else weakref.ref(self.block))
        example = {"id": i, "x": row} if self.form in ("dict", "kept", "view") else (i, row) if self.form == "tuple" \
            else row
        return example


def test_fresh_arrays_from_the_dataset_are_held_until_batched_then_let_go():
    for form in ("dict", "tuple", "bare"):
        dataset = Returned(600, form)
        loader = dataecho.EchoLoader(dataset, batch_size=32, echo_factor=2, shuffle_buffer=256, num_workers=1, seed=1)
        rows = Counter()
        for batch in loader:
            x = np.asarray(batch["x"] if form == "dict" else batch[1] if form == "tuple" else batch)
            for row in x:
                i = int(row[:8].copy().view("<i8")[0])
                assert np.array_equal(row, row_of(i)), "every row is one example's bytes, whole"
                rows[i] += 1
        assert rows == Counter({i: 2 for i in range(600)}), form
        assert dataset.seen_held, f"{form}: a new array the dataset returned was held (read-only while held)"
        loader.close()
        del batch, x
        gc.collect()
        assert all(r() is None for r in dataset.refs), f"{form}: every held array is let go"


@pytest.mark.parametrize("form", ["kept", "view"])
def test_arrays_the_dataset_keeps_or_views_are_copied_never_held(form):
    dataset = Returned(300, form)
    loader = dataecho.EchoLoader(dataset, batch_size=32, echo_factor=2, shuffle_buffer=128, num_workers=1, seed=1)
    seen = Counter()
    for batch in loader:
        for i, row in zip(batch["id"].tolist(), np.asarray(batch["x"])):
            assert np.array_equal(row, row_of(i))
            seen[i] += 1
    assert seen == Counter({i: 2 for i in range(300)})
    assert not dataset.seen_held, "what the dataset keeps is never made read-only: it is copied"
    if form == "kept":
        assert all(row.flags.writeable for row in dataset.kept)
