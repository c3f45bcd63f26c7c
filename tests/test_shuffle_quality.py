"""Shuffle quality with fixed seeds: positions are mixed, the repeats of an
example are spread apart, batches hold distinct examples, and the order is a
function of the seed and the input alone."""

from __future__ import annotations

import numpy as np
import pytest
from support import drain_ids, examples, id_buffer, join_producers, start_producers


def deliver_in_order(n, seed, producer_chunks=100, **kwargs) -> np.ndarray:
    """Puts ids 0..n-1 in order from one producer; returns the delivered ids."""
    buf = id_buffer(seed=seed, **kwargs)
    threads = start_producers(buf, [np.array_split(np.arange(n), producer_chunks)])
    batches = drain_ids(buf, check_payload=False)
    join_producers(threads)
    return np.concatenate(batches)


def test_output_positions_are_well_mixed(seed):
    n, capacity = 40_000, 2048
    out = deliver_in_order(n, seed, capacity=capacity, batch_size=64)
    # Consecutive outputs go up or down with equal odds in a shuffled stream (a
    # sorted one would go up every time).
    up = np.mean(np.diff(out) > 0)
    assert abs(up - 0.5) < 0.02, up
    # An example is delivered about a buffer's worth of positions from where it
    # went in, in either direction, not in a narrow window around it.
    displacement = np.arange(n) - np.argsort(np.argsort(out))  # input index - output position
    assert np.median(np.abs(displacement)) > capacity / 4
    # Each stretch of `capacity` outputs draws from a wide range of inputs.
    for start in range(capacity * 4, n - capacity, capacity * 4):
        window = out[start : start + capacity]
        assert np.ptp(window) > capacity, (start, np.ptp(window))


def test_low_bits_of_output_positions_are_uniform(seed):
    n = 40_000
    out = deliver_in_order(n, seed, capacity=1024, batch_size=32)
    # Which residue class mod 8 an example lands in, by output position: a
    # chi-square test of independence over an 8 x 8 table.
    table = np.zeros((8, 8))
    np.add.at(table, (out % 8, np.arange(n) % 8), 1)
    expected = np.outer(table.sum(1), table.sum(0)) / n
    chi2 = ((table - expected) ** 2 / expected).sum()
    assert chi2 < 90, chi2  # 49 degrees of freedom: the 99.9th percentile is about 85


def test_repeats_spread_apart_and_spread_grows_with_capacity(seed):
    echo = 2
    n = 30_000
    gaps = {}
    for capacity in (256, 1024, 4096):
        out = deliver_in_order(n, seed, capacity=capacity, batch_size=64, echo_factor=echo)
        order = np.argsort(out, kind="stable")
        positions = order.reshape(n, echo)  # delivery positions of each id
        gaps[capacity] = float(np.mean(positions[:, 1] - positions[:, 0]))
        # The two deliveries of an example are about a buffer apart: each draw
        # picks one of ~capacity residents, so the wait is about capacity draws.
        assert capacity / 2 < gaps[capacity] < 2 * capacity, gaps
    # Four times the capacity, (nearly) four times the spread.
    assert gaps[1024] > 3 * gaps[256] and gaps[4096] > 3 * gaps[1024], gaps


def test_no_batch_repeats_an_example_while_enough_are_resident(seed):
    n, capacity, batch_size, echo = 50_000, 4096, 64, 2
    buf = id_buffer(capacity=capacity, batch_size=batch_size, echo_factor=echo, seed=seed)
    threads = start_producers(buf, [np.array_split(np.arange(n), 100)])
    batches = drain_ids(buf, check_payload=False)
    join_producers(threads)
    with_repeat = [i for i, ids in enumerate(batches) if len(np.unique(ids)) < len(ids)]
    # Only the drain at the very end can have fewer than batch_size distinct
    # examples resident: with e = 2 that is at most the last two batches.
    assert all(i >= len(batches) - 2 for i in with_repeat), with_repeat
    # For scale: a reservoir drawing with replacement would put a repeat in
    # about a fifth of these batches.
    assert len(with_repeat) <= 2


def test_same_seed_same_input_gives_same_order(seed):
    first = deliver_in_order(20_000, seed, capacity=512, batch_size=32, echo_factor=1.5)
    # Different chunking changes thread timing but not the input order.
    second = deliver_in_order(20_000, seed, producer_chunks=7, capacity=512, batch_size=32, echo_factor=1.5)
    np.testing.assert_array_equal(first, second)
    other = deliver_in_order(20_000, seed + 1, capacity=512, batch_size=32, echo_factor=1.5)
    assert not np.array_equal(first[: len(other)], other[: len(first)])


def test_same_seed_with_single_puts_and_a_slow_consumer(seed):
    def run():
        buf = id_buffer(capacity=64, batch_size=8, echo_factor=2, seed=seed, prefetch=1)
        threads = start_producers(buf, [[np.array([i]) for i in range(2000)]])
        out = []
        for i, batch in enumerate(buf):
            out.append(batch["id"].copy())
        join_producers(threads)
        return np.concatenate(out)

    np.testing.assert_array_equal(run(), run())


def test_initial_gates_the_first_batch():
    buf = id_buffer(capacity=100, batch_size=10, initial=30)
    assert buf.initial == 30
    buf.put_many(examples(np.arange(29)))
    with pytest.raises(TimeoutError):
        buf.next_batch(timeout=0.2)
    buf.put_many(examples(np.arange(29, 30)))
    assert len(buf.next_batch(timeout=5)["id"]) == 10
    buf.close()


def test_default_initial_is_a_quarter_of_capacity_but_at_least_a_batch():
    assert id_buffer(capacity=4096, batch_size=256).initial == 1024
    assert id_buffer(capacity=512, batch_size=256).initial == 256
    assert id_buffer(capacity=10, batch_size=10).initial == 10
