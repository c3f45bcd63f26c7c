"""Fault injection: seeded scenarios, each in a subprocess with its own timeout.

The scenarios live in the faults package, one module per kind (see its
docstring); each kind has several variants and takes every parameter from its seed:

    error_thread, error_process   an exception in source/transform/augment at a random record
    stop_iteration                StopIteration raised by source/transform/augment (threads, processes)
    owner_killed                  SIGKILL of the process that owns worker processes
    worker_exit                   a worker process that exits (status 0, 3, SIGKILL) before its share is done
    close_put, close_iter         close() while puts, or the consumer, are blocked
    close_storm                   close() from 8 threads at once, producers and consumer running
    delete_buffer                 a running buffer deleted (the last reference in any thread)
    sigint_buffer, sigint_loader  SIGINT while blocked in put / next / an EchoLoader epoch
    exit                          interpreter exit, normal and by an uncaught exception, work running
    fork                          a running buffer (or epoch) used in a forked child
    reuse                         iterating again after the end, epochs, abandoned epochs
    timeout                       random small timeouts on put / put_many / next_batch

Scenarios of one kind run several to a subprocess, two subprocesses at a time;
each reports on its own and gets its own test id, which names its seed. The
seeds derive from a base seed, DATAECHO_TEST_SEED (default 12345), so that

    DATAECHO_TEST_SEED=<base> python -m pytest tests/test_faults.py -k <id>

or, for one scenario, ``python tests/faults <kind:variant> <seed>``
replays a failure (the failure message prints both). DATAECHO_FAULT_SCALE
multiplies the number of scenarios (a soak run), DATAECHO_FAULT_JOBS the
subprocesses at a time.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import deque
from pathlib import Path

import pytest
from faults.registry import SCENARIOS

TESTS = Path(__file__).resolve().parent
PROGRAM = TESTS / "faults"  # python tests/faults runs the package
BASE_SEED = int(os.environ.get("DATAECHO_TEST_SEED", "12345"))
SCALE = float(os.environ.get("DATAECHO_FAULT_SCALE", "1"))
JOBS = int(os.environ.get("DATAECHO_FAULT_JOBS", "2"))
SCENARIO_TIMEOUT_S = 20.0  # inside the subprocess: dump every thread's stack and exit
GRACE_S = 10.0  # the parent kills a subprocess that overruns the above by this much
WAIT_S = 90.0  # a test waits this long for its scenario (pytest's limit is 120 s)

# kind: (scenarios per run, scenarios per subprocess), the slowest kinds first so
# that the two subprocesses finish together
PLAN = {
    "exit": (12, 4),
    "owner_killed": (6, 3),
    "worker_exit": (6, 3),
    "sigint_loader": (12, 6),
    "error_process": (10, 5),
    "reuse": (18, 6),
    "second_consumer": (8, 4),
    "stale_iterator": (9, 3),
    "delete_buffer": (15, 8),
    "timeout": (22, 11),
    "error_thread": (36, 12),
    "stop_iteration": (10, 5),
    "close_put": (20, 10),
    "close_storm": (20, 10),
    "sigint_buffer": (15, 8),
    "fork": (18, 9),
    "close_iter": (16, 8),
    "delete_loader": (6, 3),
    "put_many_cycle": (4, 4),
    "augment_after_abort": (3, 3),
    "start_interrupted": (3, 3),
}


def scenario_seed(kind: str, index: int) -> int:
    return zlib.crc32(f"{BASE_SEED}:{kind}:{index}".encode())


def _plan() -> list:
    params = []
    for kind, (count, _) in PLAN.items():
        variants = SCENARIOS[kind][1]
        for index in range(max(1, round(count * SCALE))):
            spec, seed = f"{kind}:{variants[index % len(variants)]}", scenario_seed(kind, index)
            params.append(pytest.param(spec, seed, id=f"{spec}-{index}-seed{seed}"))
    return params


def _batch_size(spec: str) -> int:
    kind = spec.split(":")[0]
    return PLAN[kind][1]


class Runner:
    """Runs the selected scenarios in subprocesses, JOBS at a time, in test order;
    each test waits for its own result."""

    def __init__(self, scenarios: list[tuple[str, int]], stderr_dir: Path, jobs: int) -> None:
        self._dir = stderr_dir
        self._pending: deque[list[tuple[str, int]]] = deque()
        for spec, seed in scenarios:
            last = self._pending[-1] if self._pending else None
            if last and last[0][0].split(":")[0] == spec.split(":")[0] and len(last) < _batch_size(spec):
                last.append((spec, seed))
            else:
                self._pending.append([(spec, seed)])
        self._results: dict[tuple[str, int], dict] = {}
        self._cond = threading.Condition()
        self._procs: set[subprocess.Popen] = set()
        self._closed = False
        self._batches = 0
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(jobs)]
        for thread in self._threads:
            thread.start()

    def result(self, spec: str, seed: int, timeout_s: float) -> dict | None:
        with self._cond:
            self._cond.wait_for(lambda: (spec, seed) in self._results, timeout_s)
            return self._results.get((spec, seed))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            procs = list(self._procs)
        for proc in procs:
            _kill(proc)
        for thread in self._threads:
            thread.join(10)

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._pending:
                    return
                batch = self._pending.popleft()
                self._batches += 1
                number = self._batches
            self._run(batch, number)

    def _record(self, key: tuple[str, int], result: dict) -> None:
        with self._cond:
            self._results[key] = result
            self._cond.notify_all()

    def _run(self, batch: list[tuple[str, int]], number: int) -> None:
        log = self._dir / f"batch-{number}.stderr"
        command = [sys.executable, "-u", str(PROGRAM), "--protocol", str(log), "--timeout", str(SCENARIO_TIMEOUT_S)]
        command += [str(x) for pair in batch for x in pair]
        env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        with open(log, "w") as stderr:
            proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=TESTS, env=env, start_new_session=True
            )
        with self._cond:
            self._procs.add(proc)
        lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        todo = list(batch)
        current, offset = None, 0
        deadline = time.monotonic() + 60  # to start up and report the first scenario
        try:
            while todo:
                try:
                    line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    _kill(proc)
                    failed = current or todo[0]
                    self._record(failed, _failure(f"no result within {SCENARIO_TIMEOUT_S + GRACE_S} s", log, offset))
                    todo.remove(failed)
                    break
                if line is None:
                    _wait(proc, 10)
                    if current is not None:
                        self._record(current, _failure(f"the subprocess ended (exit code {proc.returncode}) "
                                                       "during the scenario", log, offset))
                        todo.remove(current)
                    elif proc.returncode != 3:  # 3: it stopped after a scenario left something behind
                        self._record(todo[0], _failure(f"the subprocess failed (exit code {proc.returncode})", log, 0))
                        todo.pop(0)
                    break
                record = json.loads(line)
                key = (record["spec"], record["seed"])
                if record["event"] == "start":
                    current, offset = key, record["stderr_offset"]
                    deadline = time.monotonic() + SCENARIO_TIMEOUT_S + GRACE_S
                else:
                    self._record(key, record)
                    todo.remove(key)
                    current = None
                    deadline = time.monotonic() + 60
        finally:
            _wait(proc, 5)
            _kill(proc)
            reader.join(10)
            proc.stdout.close()
            with self._cond:
                self._procs.discard(proc)
                if todo and not self._closed:
                    self._pending.appendleft(todo)  # a fresh subprocess for the rest


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait(proc, 10)


def _failure(message: str, log: Path, offset: int) -> dict:
    try:
        with open(log, errors="replace") as f:
            f.seek(offset)
            text = f.read()[-6000:]
    except OSError:
        text = ""
    return {"ok": False, "error": f"{message}; stderr (the stacks of a hang are here):\n{text}", "elapsed_s": None}


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    selected = [
        (item.callspec.params["spec"], item.callspec.params["seed"])
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_fault_scenario" and item.module is request.module
    ]
    runner = Runner(selected, tmp_path_factory.mktemp("faults"), JOBS)
    yield runner
    runner.close()


@pytest.mark.parametrize("spec,seed", _plan())
def test_fault_scenario(spec, seed, runner, request):
    result = runner.result(spec, seed, WAIT_S)
    replay = (
        f"replay: python tests/faults {spec} {seed}\n"
        f"    or: DATAECHO_TEST_SEED={BASE_SEED} python -m pytest tests/test_faults.py -k '{request.node.callspec.id}'"
    )
    if result is None:
        pytest.fail(f"{spec} (seed {seed}, base seed {BASE_SEED}): no result within {WAIT_S} s\n{replay}", pytrace=False)
    if not result["ok"]:
        pytest.fail(f"{spec} (seed {seed}, base seed {BASE_SEED}) failed:\n{result['error']}\n{replay}", pytrace=False)
