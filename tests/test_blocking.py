"""Closing, blocking, timeouts, Ctrl-C and misuse across threads and processes:
every wait ends, promptly, with a clear outcome."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import dataecho
import numpy as np
import pytest
from support import child_script, examples, free_slots, id_buffer, one, run_python


def full_buffer(capacity=8, batch_size=4):
    buf = id_buffer(capacity=capacity, batch_size=batch_size, prefetch=1)
    for i in range(10_000):
        try:
            buf.put(one(i), timeout=0.2)
        except TimeoutError:
            return buf, i
    raise AssertionError("the buffer never filled up")


def test_put_blocks_when_full_and_resumes_when_the_consumer_drains():
    buf, accepted = full_buffer(capacity=8, batch_size=4)
    # Slots hold `capacity` examples; `prefetch` more sit in assembled batches.
    assert accepted == 8 + 4
    thread = threading.Thread(target=lambda: buf.put(one(99)), daemon=True)
    thread.start()
    time.sleep(0.1)
    assert thread.is_alive(), "put should block on a full buffer"
    buf.next_batch(timeout=5)
    thread.join(5)
    assert not thread.is_alive()
    buf.close()
    assert sum(len(b["id"]) for b in buf) + 4 == accepted + 1


def test_close_releases_blocked_producers_promptly():
    buf, _ = full_buffer()
    outcomes = []

    def blocked_put():
        start = time.monotonic()
        try:
            buf.put(one(-1))
            outcomes.append(("returned", 0.0))
        except dataecho.BufferClosed:
            outcomes.append(("closed", time.monotonic() - start))

    threads = [threading.Thread(target=blocked_put, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    closed_at = time.monotonic()
    buf.close()
    for t in threads:
        t.join(2)
    released = time.monotonic() - closed_at
    assert [o for o, _ in outcomes] == ["closed"] * 4
    assert released < 0.5
    # Everything accepted before close is still delivered.
    assert buf.stats()["fresh"] == sum(len(b["id"]) for b in buf)
    assert free_slots(buf) == 8


def test_close_releases_a_waiting_consumer_promptly():
    buf = id_buffer(capacity=16, batch_size=4)
    result = []

    def consume():
        result.append(list(buf))

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    buf.close()
    thread.join(2)
    assert not thread.is_alive() and result == [[]]
    assert time.monotonic() - start < 0.5


def test_close_delivers_a_partial_buffer():
    buf = id_buffer(capacity=1000, batch_size=64, echo_factor=2)
    buf.put_many(examples(np.arange(10)))
    buf.close()
    ids = np.concatenate([b["id"] for b in buf])
    assert sorted(ids.tolist()) == sorted(list(range(10)) * 2)


def test_timeouts_expire():
    buf = id_buffer(capacity=16, batch_size=4)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        buf.next_batch(timeout=0.15)
    assert 0.1 < time.monotonic() - start < 2

    full, _ = full_buffer()
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        full.put(one(0), timeout=0.15)
    assert 0.1 < time.monotonic() - start < 2
    with pytest.raises(TimeoutError) as info:
        full.put_many(examples(np.arange(3)), timeout=0.1)
    assert info.value.examples_put == 0
    full.close()


def test_put_after_close_raises_buffer_closed():
    buf = id_buffer(capacity=16, batch_size=4)
    buf.close()
    buf.close()  # idempotent
    assert buf.closed
    with pytest.raises(dataecho.BufferClosed, match="closed"):
        buf.put(one(0))
    with pytest.raises(dataecho.BufferClosed) as info:
        buf.put_many(examples(np.arange(3)))
    assert info.value.examples_put == 0
    assert issubclass(dataecho.BufferClosed, RuntimeError)


def test_context_manager_closes():
    with id_buffer(capacity=16, batch_size=4) as buf:
        buf.put_many(examples(np.arange(6)))
    assert buf.closed
    assert sum(len(b["id"]) for b in buf) == 6


def test_a_second_concurrent_consumer_gets_a_clear_error():
    buf = id_buffer(capacity=16, batch_size=4)
    thread = threading.Thread(target=lambda: list(buf), daemon=True)
    thread.start()
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match="another thread"):
        next(iter(buf))
    buf.close()
    thread.join(2)
    assert not thread.is_alive()


CTRL_C_PUT = """
    import sys, time, numpy as np, dataecho
    from support import free_slots
    buf = dataecho.ShuffleBuffer(((8,), "uint8"), capacity=4, batch_size=2, prefetch=1)
    ok = 0
    try:
        while True:
            buf.put(np.full(8, ok, np.uint8))
            ok += 1
            if ok == 6:
                print("blocked", flush=True)
    except KeyboardInterrupt:
        print("interrupted", ok, flush=True)
    # No slot leaked: everything accepted is delivered and all slots come back.
    buf.close()
    delivered = sum(len(b) for b in buf)
    print("delivered", delivered, "free", free_slots(buf), flush=True)
"""

CTRL_C_NEXT = """
    import dataecho
    buf = dataecho.ShuffleBuffer(((8,), "uint8"), capacity=4, batch_size=2)
    print("blocked", flush=True)
    try:
        next(iter(buf))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


@pytest.mark.parametrize("script", [CTRL_C_PUT, CTRL_C_NEXT], ids=["put", "next"])
def test_ctrl_c_interrupts_a_blocked_call(script):
    # child_script: the child installs Python's SIGINT handler itself, whatever
    # this process left it (ignored, in a suite started in the background).
    with subprocess.Popen(
        [sys.executable, "-u", "-c", child_script(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:  # closes the pipes on the way out
        try:
            assert proc.stdout.readline().strip() == "blocked"
            time.sleep(0.3)  # let it park in native code
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            line = proc.stdout.readline().split()
            latency = time.monotonic() - sent
            # Read the rest through the same file object: readline() may already
            # hold the next line in its buffer, which communicate() would not see.
            proc.wait(timeout=10)
            rest, err = proc.stdout.read(), proc.stderr.read()
        finally:
            proc.kill()
    assert line[:1] == ["interrupted"], err
    assert latency < 0.5, latency
    assert proc.returncode == 0, err
    if script is CTRL_C_PUT:
        accepted = int(line[1])
        assert rest.split() == ["delivered", str(accepted), "free", "4"]


def test_forked_child_gets_a_clear_error_and_exits():
    code = """
        import os, numpy as np, dataecho
        buf = dataecho.ShuffleBuffer(((8,), "uint8"), capacity=16, batch_size=4)
        buf.put_many(np.zeros((8, 8), np.uint8))
        pid = os.fork()
        if pid == 0:
            try:
                buf.put(np.zeros(8, np.uint8))
                os._exit(3)
            except RuntimeError as exc:
                ok = "forked child" in str(exc)
            del buf
            import gc; gc.collect()
            os._exit(0 if ok else 4)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        buf.close()
        print("parent", sum(len(b) for b in buf))
    """
    result = run_python(code, timeout=20)
    assert result.stdout.split() == ["child", "0", "parent", "8"], result.stderr


@pytest.mark.parametrize("num_workers", [0, 2])
def test_interpreter_exits_with_an_epoch_left_part_way(num_workers):
    # One epoch held by a global, one by a cycle that only the last collection,
    # after the modules are torn down, finds: neither may wait on native calls then.
    code = f"""
        import dataecho
        class Stream:
            def __iter__(self):
                return iter(range(1000))
        epochs = []
        for _ in range(2):
            loader = dataecho.EchoLoader(Stream(), batch_size=4, shuffle_buffer=32, num_workers={num_workers})
            epochs.append(iter(loader))
            for _ in range(5):
                next(epochs[-1])
        cycle = [epochs.pop()]
        cycle.append(cycle)
        print("exiting", flush=True)
    """
    result = run_python(code, timeout=20)
    assert result.returncode == 0 and result.stdout.split() == ["exiting"], result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


def test_interpreter_exits_with_producers_blocked():
    code = """
        import threading, numpy as np, dataecho
        buf = dataecho.ShuffleBuffer(((8,), "uint8"), capacity=4, batch_size=2)
        def produce():
            try:
                while True:
                    buf.put(np.zeros(8, np.uint8))
            except dataecho.BufferClosed:
                pass
        for _ in range(3):
            threading.Thread(target=produce, daemon=True).start()
        print("exiting", flush=True)
    """
    result = run_python(code, timeout=10)
    assert result.returncode == 0, result.stderr
    assert "terminate called" not in result.stderr and "Fatal" not in result.stderr


def test_a_put_that_the_stop_at_exit_releases_waits_for_the_exit(monkeypatch):
    # At interpreter exit the buffers are stopped before the interpreter finalizes:
    # a daemon producer blocked in put() then waits (bounded) for finalization,
    # which ends it quietly, instead of printing a BufferClosed traceback over the exit.
    from dataecho.native import echo_buffer as native

    buf = id_buffer(capacity=2, batch_size=1, echo_factor=1)
    for i in range(100):  # full: slots and prefetched batches (nobody takes them)
        try:
            buf.put(one(i), timeout=0.05)
        except TimeoutError:
            break
    outcome: list[str] = []

    def produce() -> None:
        try:
            buf.put(one(1000))
            outcome.append("put")
        except dataecho.BufferClosed:
            outcome.append("raised")

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    producer.join(0.2)
    assert producer.is_alive(), "the put did not block on a full buffer"
    monkeypatch.setattr(native, "_EXIT_PARK_S", 3.0)
    native._exiting.set()
    try:
        buf._native.shut_down()  # what the exit hook does to every buffer
        producer.join(0.5)
        assert producer.is_alive() and not outcome, f"the released put did not wait for the exit: {outcome}"
        producer.join(30)
        assert outcome == ["raised"], "the wait for the exit is bounded"
    finally:
        native._exiting.clear()
