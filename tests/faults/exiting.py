"""Interpreter exit, normal or by an uncaught exception, with work running."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import dataecho
from faults.common import CLEANUP_S, EXIT_S, FORBIDDEN, loader_options, pick_echo
from processes import pid_alive, shm_segments, worker_processes
from support import Records, checked_ids, id_buffer, one, wait_for, with_pid

PACKAGE = Path(__file__).resolve().parent  # runs as a program: python tests/faults


class InjectedExit(Exception):
    """Raised uncaught at the end of an exiting child."""


def exit_child(variant: str, mode: str, seed: int) -> None:
    """The body of an exiting child: starts work that is still running, then exits."""
    rng = random.Random(seed)
    if variant in ("put", "consumer"):
        capacity = rng.randint(1, 32)
        buf = id_buffer(capacity=capacity, batch_size=rng.randint(1, capacity), echo_factor=pick_echo(rng), seed=seed)

        def produce(p: int) -> None:
            for i in itertools.count(p * 10_000_000):
                buf.put(one(i))

        def consume() -> None:
            for batch in buf:
                checked_ids(batch)
                time.sleep(0.001)

        for p in range(rng.randint(1, 4)):
            threading.Thread(target=produce, args=(p,), daemon=True).start()
        if variant == "consumer":
            threading.Thread(target=consume, daemon=True).start()
        time.sleep(rng.uniform(0.03, 0.2))
    else:
        options = loader_options(rng)
        worker_type = "process" if variant == "loader_process" else "thread"
        if worker_type == "process":
            options["num_workers"] = rng.randint(1, 3)
            options["transform"] = with_pid
        loader = dataecho.EchoLoader(Records(100_000), seed=seed, worker_type=worker_type, **options)
        if variant == "loader_thread_consumer":

            def consume() -> None:
                for batch in loader:
                    checked_ids(batch)
                    time.sleep(0.001)

            threading.Thread(target=consume, daemon=True).start()
            time.sleep(rng.uniform(0.03, 0.2))
        else:
            epoch = iter(loader)
            for _ in range(rng.randint(1, 20)):
                checked_ids(next(epoch))
            if worker_type == "process":
                workers = [p.pid for p in worker_processes()]
                print("WORKERS", *workers, flush=True)
    print("EXITING", flush=True)
    if mode == "exception":
        raise InjectedExit(f"uncaught at exit (seed {seed})")


def exit_scenario(rng: random.Random, variant: str, seed: int) -> None:
    """A child interpreter exits (normally, or by an uncaught exception) with work
    running: within EXIT_S, with exit code 0 or 1, no crash message, no worker left."""
    variant, mode = variant.rsplit("_", 1)
    command = [sys.executable, "-u", str(PACKAGE), "--exit-child", variant, mode, str(seed)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        exiting_at = None
        for line in proc.stdout:
            if line.startswith("WORKERS"):
                workers = [int(w) for w in line.split()[1:]]
            if line.strip() == "EXITING":
                exiting_at = time.monotonic()
                break
        assert exiting_at is not None, f"the child ended early: {proc.communicate(timeout=10)[1][-3000:]}"
        try:
            _, err = proc.communicate(timeout=EXIT_S + 5)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the interpreter did not exit within {EXIT_S + 5} s") from None
        took = time.monotonic() - exiting_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < EXIT_S, f"the interpreter took {took:.2f} s to exit"
    expected = 1 if mode == "exception" else 0
    assert proc.returncode == expected, f"exit code {proc.returncode}, expected {expected}; stderr:\n{err[-3000:]}"
    for text in FORBIDDEN:
        assert text not in err, f"{text!r} in stderr:\n{err[-3000:]}"
    if mode == "exception":
        assert "InjectedExit: uncaught at exit" in err, err[-3000:]
    else:
        assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert workers or variant != "loader_process", "the child named no worker process"
    assert wait_for(lambda: not any(pid_alive(w) for w in workers), CLEANUP_S), "a worker outlived its parent"
    left = shm_segments(proc.pid)
    for name in left:
        os.unlink(f"/dev/shm/{name}")
    assert not left, f"the exited interpreter left {left} in /dev/shm (removed now)"
