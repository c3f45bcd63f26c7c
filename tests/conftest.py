"""Shared helpers: examples whose payload is derived from their id, so that a
torn or misplaced byte is detected, and bounded producer/consumer runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter

import numpy as np
import pytest

import dataecho

PAYLOAD = 24  # bytes of id-derived payload per example


def payload_of(ids: np.ndarray) -> np.ndarray:
    """Bytes that depend on the id and on the byte position."""
    ids = np.asarray(ids, dtype=np.int64)
    return ((ids[:, None] * 31 + np.arange(PAYLOAD)[None, :] * 7) % 251).astype(np.uint8)


def id_buffer(**kwargs) -> dataecho.ShuffleBuffer:
    fields = {"id": ((), "int64"), "payload": ((PAYLOAD,), "uint8")}
    return dataecho.ShuffleBuffer(fields, **kwargs)


def examples(ids: np.ndarray) -> dict[str, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64)
    return {"id": ids, "payload": payload_of(ids)}


def start_producers(buf, id_chunks, close=True) -> list[threading.Thread]:
    """One thread per chunk list, each calling put_many on its chunks; the last
    one to finish closes the buffer."""
    remaining = [len(id_chunks)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def produce(chunks):
        try:
            for chunk in chunks:
                buf.put_many(examples(chunk))
        except BaseException as exc:  # reported by the test through `errors`
            errors.append(exc)
        finally:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last and close:
                buf.close()

    threads = [threading.Thread(target=produce, args=(chunks,), daemon=True) for chunks in id_chunks]
    for t in threads:
        t.errors = errors  # type: ignore[attr-defined]
        t.start()
    return threads


def drain_ids(buf, check_payload=True) -> list[np.ndarray]:
    """Iterates to the end; returns each batch's ids (copied), checking payloads."""
    batches = []
    for batch in buf:
        ids = batch["id"]
        if check_payload:
            np.testing.assert_array_equal(batch["payload"], payload_of(ids))
        batches.append(ids.copy())
    return batches


def join_all(threads, timeout=30.0) -> None:
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "producer thread did not finish"
    errors = threads[0].errors if threads else []
    if errors:
        raise errors[0]


def counts(batches) -> Counter:
    c: Counter = Counter()
    for ids in batches:
        c.update(ids.tolist())
    return c


def run_python(code: str, timeout: float = 30.0, **kwargs) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter, bounded by `timeout`."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        **kwargs,
    )


@pytest.fixture
def seed(request) -> int:
    """A per-test seed, printed on failure so that a run can be replayed."""
    value = int(os.environ.get("DATAECHO_TEST_SEED", "12345"))
    request.node.user_properties.append(("seed", value))
    return value
