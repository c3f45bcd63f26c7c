"""Exact accounting: every example is delivered exactly as often as its echo
count says, intact, and the statistics agree with what the consumer saw."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from support import counts, drain_ids, free_slots, id_buffer, join_producers, start_producers

import dataecho


@pytest.mark.parametrize("echo", [1, 2, 3])
@pytest.mark.parametrize("capacity,batch_size", [(1, 1), (7, 3), (64, 64), (1000, 32)])
def test_integer_echo_delivers_each_example_exactly_e_times(echo, capacity, batch_size, seed):
    n = 5000
    buf = id_buffer(capacity=capacity, batch_size=batch_size, echo_factor=echo, seed=seed)
    threads = start_producers(buf, [np.array_split(np.arange(n), 50)])
    batches = drain_ids(buf)
    join_producers(threads)

    seen = counts(batches)
    assert sorted(seen) == list(range(n)), "an example was lost or invented"
    assert set(seen.values()) == {echo}
    assert all(len(b) == batch_size for b in batches[:-1])
    assert 1 <= len(batches[-1]) <= batch_size

    stats = buf.stats()
    assert stats["fresh"] == n
    assert stats["delivered"] == n * echo == sum(len(b) for b in batches)
    assert stats["batches"] == len(batches)
    assert stats["resident"] == 0 and stats["dropped"] == 0
    assert stats["echo_factor_achieved"] == echo
    assert free_slots(buf) == capacity, "a slot was not returned"


def test_fractional_echo_mean_within_one_percent(seed):
    n = 100_000
    buf = id_buffer(capacity=4096, batch_size=256, echo_factor=1.5, seed=seed)
    threads = start_producers(buf, [np.array_split(np.arange(n), 100)])
    batches = drain_ids(buf, check_payload=False)
    join_producers(threads)

    seen = counts(batches)
    assert sorted(seen) == list(range(n))
    assert set(seen.values()) == {1, 2}, "fractional echo must give floor(e) or floor(e) + 1"
    mean = sum(seen.values()) / n
    assert abs(mean - 1.5) < 0.015
    assert buf.stats()["echo_factor_achieved"] == pytest.approx(mean)


def test_single_field_buffer_yields_arrays_with_intact_payload(seed):
    buf = dataecho.ShuffleBuffer(((4, 8), "float32"), capacity=128, batch_size=16, seed=seed)
    values = np.arange(1000 * 32, dtype=np.float32).reshape(1000, 4, 8)

    def produce():
        buf.put_many(values[:500])
        for row in values[500:]:
            buf.put(row)
        buf.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    rows = np.concatenate([batch.copy() for batch in buf])
    thread.join(10)
    assert rows.shape == (1000, 4, 8) and rows.dtype == np.float32
    order = np.argsort(rows[:, 0, 0])
    np.testing.assert_array_equal(rows[order], values)


def test_drop_last_drops_only_the_short_tail(seed):
    n, batch_size = 1000, 64
    buf = id_buffer(capacity=256, batch_size=batch_size, echo_factor=2, seed=seed, drop_last=True)
    threads = start_producers(buf, [np.array_split(np.arange(n), 10)])
    batches = drain_ids(buf)
    join_producers(threads)
    assert all(len(b) == batch_size for b in batches)
    stats = buf.stats()
    assert stats["delivered"] == len(batches) * batch_size
    assert stats["delivered"] + stats["dropped"] == 2 * n
    assert stats["dropped"] == (2 * n) % batch_size
    assert free_slots(buf) == 256


def test_closed_empty_buffer_ends_iteration_at_once():
    buf = id_buffer(capacity=16, batch_size=4)
    buf.close()
    assert list(buf) == []
    assert buf.stats()["batches"] == 0


def test_dict_examples_put_one_by_one_keep_fields_together(seed):
    buf = dataecho.ShuffleBuffer(
        {"image": ((3, 5, 5), "uint8"), "label": ((), "int64"), "weight": ((2,), "float64")},
        capacity=64,
        batch_size=8,
        echo_factor=2,
        seed=seed,
    )

    def produce():
        for i in range(200):
            buf.put({"image": np.full((3, 5, 5), i % 256, np.uint8), "label": i, "weight": [i, -i]})
        buf.close()

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    total = 0
    for batch in buf:
        assert set(batch) == {"image", "label", "weight"}
        labels = batch["label"]
        assert batch["image"].shape == (len(labels), 3, 5, 5)
        np.testing.assert_array_equal(batch["image"][:, 0, 0, 0], labels % 256)
        np.testing.assert_array_equal(batch["weight"], np.stack([labels, -labels], axis=1))
        total += len(labels)
    thread.join(10)
    assert total == 400
