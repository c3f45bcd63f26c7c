"""worker_type="process": worker processes write into the echo buffer's shared
slots; errors, killed workers and Ctrl-C end the epoch cleanly, and nothing
(child process, shared-memory segment) is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import dataecho
import numpy as np
import pytest
from dataecho.examples.fields import parse_fields
from dataecho.native.echo_buffer import NativeBuffer
from dataecho.native.sizing import buffer_config
from processes import descendants, shm_segments, worker_processes
from support import (
    Captions,
    ExitAt,
    InjectedFault,
    MarkedRecords,
    RaiseAt,
    Records,
    Stream,
    checked_ids,
    child_script,
    kill_owner,
    mark_worker,
    suicide_at_500,
    wait_for,
    with_pid,
    with_pid_and_tensor,
    worker_pids,
)


def dataecho_workers():
    return worker_processes() or list(descendants())


@pytest.fixture(autouse=True)
def nothing_left_behind():
    # This process's segments only: other runs on the machine have their own.
    before = set(shm_segments(os.getpid()))
    yield
    deadline = time.monotonic() + 3
    while (dataecho_workers() or set(shm_segments(os.getpid())) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not dataecho_workers(), f"a worker process outlived its epoch: {descendants()}"
    assert set(shm_segments(os.getpid())) <= before, "a shared-memory segment was left in /dev/shm"


def ids(batches):
    return Counter(np.concatenate([b["id"] for b in batches]).tolist())


def test_map_style_every_example_echoed_exactly(seed):
    loader = dataecho.EchoLoader(
        Records(3000), batch_size=64, echo_factor=2, num_workers=2, worker_type="process", seed=seed
    )
    batches = list(loader)
    seen = ids(batches)
    assert sorted(seen) == list(range(3000)) and set(seen.values()) == {2}
    for b in batches:
        checked_ids(b)
    stats = loader.stats()
    workers = stats["workers"]
    # One entry per worker process. How the work splits depends on when each
    # started (the first epoch also starts the forkserver): one may do it all.
    assert len(workers) == 2 and all(w["produced"] >= 0 and w["busy_s"] >= 0 for w in workers)
    assert len({w["pid"] for w in workers} - {os.getpid()}) == 2
    # The workers read every example, the first ones (which tell the structure) too.
    assert sum(w["produced"] for w in workers) == stats["fresh"] == 3000
    # A second epoch starts new workers and a new region.
    assert sorted(ids(list(loader))) == list(range(3000))


def test_iterable_shards_with_worker_info_and_transform_types(seed):
    pytest.importorskip("torch")
    loader = dataecho.EchoLoader(
        Stream(2000, tag_worker=True), batch_size=50, echo_factor=1, num_workers=2, worker_type="process",
        transform=with_pid_and_tensor, seed=seed,
    )
    batches = list(loader)
    seen = ids(batches)
    assert sorted(seen) == list(range(2000)) and set(seen.values()) == {1}
    worker_of = {i: w for b in batches for i, w in zip(b["id"].tolist(), b["worker"].tolist())}
    assert all(worker_of[i] == i % 2 for i in worker_of), "each worker read its own shard"
    pids = {p for b in batches for p in b["pid"].tolist()}
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(np.array_equal(b["t"][:, 0], b["id"]) for b in batches)
    assert dataecho.get_worker_info() is None


def test_a_torch_iterable_dataset_shards_itself_with_torch_worker_info(seed):
    # As under DataLoader(num_workers=2): each worker reads its shard, once.
    torch_sources = pytest.importorskip("torch_sources")
    loader = dataecho.EchoLoader(
        torch_sources.ShardedByTorch(400), batch_size=20, echo_factor=1, num_workers=2, worker_type="process", seed=seed,
    )
    batches = list(loader)
    rows = {}
    for b in batches:
        for i, worker, workers, worker_seed, own, draws in zip(
            b["id"].tolist(), b["worker"].tolist(), b["workers"].tolist(), b["seed"].tolist(),
            b["own_copy"].tolist(), b["draws"].tolist(),
        ):
            assert i not in rows, f"example {i} delivered twice"
            rows[i] = (worker, workers, worker_seed, own, tuple(draws))
    assert sorted(rows) == list(range(400))
    assert all(w == i % 2 and n == 2 and own for i, (w, n, _, own, _) in rows.items())
    seeds = {w: s for w, _, s, _, _ in rows.values()}
    assert len(set(seeds.values())) == 2, "a seed per worker"
    first_draws = [rows[w][4] for w in (0, 1)]  # each worker's first example: its generators' first draws
    assert first_draws[0] != first_draws[1], "random, NumPy and torch seeded per worker"
    assert dataecho.get_worker_info() is None


def test_unpicklable_source_or_transform_fails_at_construction():
    with pytest.raises(TypeError, match="dataset: worker_type='process'.*pickled"):
        dataecho.EchoLoader((i for i in range(10)), worker_type="process")
    with pytest.raises(TypeError, match="transform: worker_type='process'.*pickled"):
        dataecho.EchoLoader(range(10), worker_type="process", transform=lambda x: x)
    with pytest.raises(ValueError, match="multiprocessing_context: 'fork' is unsafe"):
        dataecho.EchoLoader(range(10), worker_type="process", multiprocessing_context="fork")
    with pytest.raises(ValueError, match="worker_type"):
        dataecho.EchoLoader(range(10), worker_type="greenlet")
    with pytest.raises(ValueError, match="workers: expected at most 256 worker processes"):
        dataecho.EchoLoader(range(10), num_workers=257, worker_type="process")


def test_worker_exception_is_raised_with_the_workers_traceback(seed):
    loader = dataecho.EchoLoader(
        Records(5000, fail_at=1234), batch_size=32, echo_factor=1, num_workers=2,
        worker_type="process", shuffle=False, seed=seed,
    )
    with pytest.raises(InjectedFault, match="record 1234 is corrupt") as info:
        for _ in loader:
            pass
    remote = info.value.__cause__
    assert "__getitem__" in str(remote) and "read_record" in str(remote) and "support.py" in str(remote)


def test_a_killed_worker_is_reported_within_a_second(seed):
    loader = dataecho.EchoLoader(
        Records(100_000, delay_s=0.0005), batch_size=16, echo_factor=1, num_workers=2,
        worker_type="process", seed=seed,
    )
    it = iter(loader)
    next(it)
    victim = next(iter(descendants()))
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"worker \d \(pid \d+\) was killed by SIGKILL"):
        for _ in it:
            pass
    assert time.monotonic() - killed_at < 1.5


def test_a_worker_that_kills_itself_mid_put_does_not_hang(seed):
    loader = dataecho.EchoLoader(
        Records(3000), batch_size=16, echo_factor=2, num_workers=2, worker_type="process",
        transform=suicide_at_500, seed=seed,
    )
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        list(loader)


@pytest.mark.parametrize("status", [0, 3])
def test_a_worker_that_exits_before_its_share_is_done_is_an_error(status, seed):
    # Exit status 0 too: the examples the worker would have read are missing.
    loader = dataecho.EchoLoader(
        Records(3000), batch_size=16, echo_factor=2, num_workers=2, worker_type="process",
        transform=ExitAt(500, status), seed=seed,
    )
    with pytest.raises(RuntimeError, match=rf"exited \(status {status}\) before finishing its share"):
        list(loader)


@pytest.mark.parametrize(("what", "message"), [
    ("exit", r"SystemExit\(0\) raised in dataecho worker \d by the dataset, transform or augment"),
    ("interrupt", r"KeyboardInterrupt\(\) raised in dataecho worker \d"),
    ("quota", r"support\.QuotaExceeded: quota of images exceeded; retry after 2\.5 s \(raised in dataecho worker"),
])
def test_what_a_worker_cannot_send_as_it_is_comes_as_a_runtime_error_with_its_message(what, message, seed):
    # sys.exit(0) in worker code must not end the training process with status 0 (nor a KeyboardInterrupt
    # come back as one); an exception that cannot be rebuilt keeps its type's name, message and traceback.
    loader = dataecho.EchoLoader(Records(3000), batch_size=16, echo_factor=1, num_workers=2,
                                 worker_type="process", transform=RaiseAt(700, what), seed=seed)
    with pytest.raises(BaseException) as info:  # noqa: PT011 - the type is the point: checked below
        list(loader)
    assert type(info.value) is RuntimeError, repr(info.value)
    assert re.search(message, str(info.value)), str(info.value)
    assert "RaiseAt" in str(info.value.__cause__) or "__call__" in str(info.value.__cause__), "the worker's traceback"


def test_leaving_early_stops_the_workers(seed):
    loader = dataecho.EchoLoader(
        Records(100_000), batch_size=16, echo_factor=1, num_workers=2, worker_type="process", seed=seed
    )
    epoch = iter(loader)
    for i, _ in enumerate(epoch):
        if i == 3:
            break
    assert len(descendants()) == 2, "two worker processes run"
    loader.close()
    assert not descendants()
    for i, _ in enumerate(loader):  # the loop drops the epoch when it leaves: that stops it too
        if i == 3:
            break
    assert not descendants()


def test_ctrl_c_in_the_parent_stops_the_workers():
    # child_script: the child installs Python's SIGINT handler itself, whatever
    # this process left it (ignored, in a suite started in the background).
    script = child_script(
        """
        import os
        import dataecho
        from processes import shm_segments, worker_processes
        from support import Records
        if __name__ == "__main__":
            loader = dataecho.EchoLoader(Records(10**6, delay_s=0.05), batch_size=64, echo_factor=1,
                                         num_workers=2, worker_type="process", seed=0)
            it = iter(loader)
            print("started", flush=True)
            try:
                next(it)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            print("left", len(worker_processes()), len(shm_segments(os.getpid())), flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(1.0)  # the workers are up and the parent waits for a batch
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert out.split() == ["interrupted", "left", "0", "0"], err
    assert not shm_segments(proc.pid), "the exited parent left a segment"


@pytest.mark.parametrize("blocked", ["in_put", "in_user_code"])
def test_a_killed_owner_takes_its_workers_and_helpers_with_it(blocked):
    # SIGKILL (the OOM killer, a preemption) runs no cleanup in the owner. Its
    # workers, children of the forkserver, must still notice and exit, whether
    # they wait for a free slot or sit in the user's code, and the forkserver and
    # resource tracker with them.
    stall_s = 0.0 if blocked == "in_put" else 60.0
    left = kill_owner(
        f"Records(10**6), batch_size=8, shuffle_buffer=8, echo_factor=1, num_workers=2, worker_type='process', "
        f"transform=Stall({stall_s}), seed=0"
    )
    assert not left, f"still running after the owner was killed: {left}"


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_exiting_before_the_workers_attach_leaves_nothing(ending):
    # The region's name is removed once every worker has mapped it; an interpreter
    # that exits before then (workers still starting) must remove it itself.
    script = child_script(
        f"""
        import os, threading, time
        import dataecho
        from support import Records, worker_pids
        if __name__ == "__main__":
            loader = dataecho.EchoLoader(Records(1000), batch_size=8, num_workers=2, worker_type="process")
            next(iter(loader))  # the first epoch learns the structure: a later one maps its region at once
            it = iter(loader)
            # A daemon thread holds the epoch: it is never collected at exit.
            threading.Thread(target=lambda held: time.sleep(60), args=(it,), daemon=True).start()
            print(os.getpid(), worker_pids(loader), flush=True)
            if {ending!r} == "raise":
                raise SystemExit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == (3 if ending == "raise" else 0), proc.stderr
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr
    pid, workers = proc.stdout.split(maxsplit=1)
    workers = eval(workers)
    assert len(workers) == 2
    deadline = time.monotonic() + 3
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers), "a worker outlived its parent"
    assert not shm_segments(int(pid)), "a segment was left"


def test_a_region_larger_than_dev_shm_is_a_clear_error():
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize + (64 << 20)
    slots = too_big // (1 << 20) + 1
    with pytest.raises(RuntimeError, match="cannot reserve .* in /dev/shm"):
        NativeBuffer(parse_fields(((1 << 20,), "uint8"))[0], buffer_config(capacity=slots, batch_size=1, shared=True))


# ---- persistent_workers ----


def persistent(source, **kwargs) -> dataecho.EchoLoader:
    args = {"batch_size": 16, "echo_factor": 1, "num_workers": 2, "worker_type": "process", "transform": with_pid,
            "persistent_workers": True}
    return dataecho.EchoLoader(source, **{**args, **kwargs})


def epoch_of(loader, n: int) -> set[int]:
    """Runs an epoch, checks that it gave each of the n examples once; returns
    the pids of the loader's worker processes, after checking that they read
    every example (the first ones, which tell the structure, too)."""
    seen, pids = Counter(), Counter()
    for batch in loader:
        seen.update(checked_ids(batch).tolist())
        pids.update(batch["pid"].tolist())
    assert seen == Counter(range(n))
    workers = set(worker_pids(loader))
    assert len(workers) == 2 and set(pids) <= workers
    return workers


@pytest.mark.parametrize("source", ["map", "iterable"])
def test_persistent_workers_serve_every_epoch(source, seed):
    n = 600
    with persistent(Records(n) if source == "map" else Stream(n), seed=seed) as loader:
        workers = epoch_of(loader, n)
        for _ in range(3):
            assert epoch_of(loader, n) == workers, "new worker processes for a later epoch"
        loader.close()
        assert not worker_processes()
        assert not epoch_of(loader, n) & workers, "closed workers came back"


def test_persistent_workers_outlive_an_epoch_left_early(seed):
    with persistent(Records(5000), seed=seed) as loader:
        epoch = iter(loader)
        for _ in range(3):
            next(epoch)
        workers = set(worker_pids(loader))
        del epoch  # a loop left early: the workers stop reading and wait for the next epoch
        assert epoch_of(loader, 5000) == workers


def test_persistent_workers_are_replaced_after_a_failure_or_a_death(seed):
    with persistent(Records(400, fail_at=333), seed=seed) as failing:
        with pytest.raises(InjectedFault):
            list(failing)
        assert not worker_processes(), "the workers of a failed epoch were kept"
    with persistent(Records(400), seed=seed) as loader:
        first = epoch_of(loader, 400)
        victim = sorted(first)[0]
        os.kill(victim, signal.SIGKILL)  # between epochs, idle (a worker that dies mid-epoch is an error)
        assert wait_for(lambda: victim not in {p.pid for p in worker_processes()}, 10)
        second = epoch_of(loader, 400)
        assert not second & first, "a pool with a dead worker was used again"
        assert epoch_of(loader, 400) == second


def test_persistent_workers_call_worker_init_fn_once_and_keep_their_info(seed):
    with dataecho.EchoLoader(MarkedRecords(300), batch_size=10, echo_factor=1, num_workers=2, worker_type="process",
                             worker_init_fn=mark_worker, persistent_workers=True, seed=seed) as loader:
        for epoch in range(3):
            marks = Counter(m for batch in loader for m in batch["mark"].tolist())
            assert sum(marks.values()) == 300 and set(marks) - {-1} <= {0, 1}, f"epoch {epoch}: {marks}"


def test_persistent_workers_go_with_a_killed_owner_while_idle():
    left = kill_owner(
        "Records(200), batch_size=8, echo_factor=1, num_workers=2, worker_type='process', persistent_workers=True, "
        "seed=0", start="list(loader)"
    )
    assert not left, f"still running after the owner was killed: {left}"


def test_persistent_workers_need_workers():
    with pytest.raises(ValueError, match="persistent_workers: needs num_workers > 0"):
        dataecho.EchoLoader(Records(10), num_workers=0, persistent_workers=True)
    with pytest.raises(TypeError, match="persistent_workers"):
        dataecho.EchoLoader(Records(10), persistent_workers="yes")
    threads = dataecho.EchoLoader(Records(100), batch_size=10, echo_factor=1, num_workers=2, persistent_workers=True)
    for _ in range(2):  # thread workers are started per epoch either way
        assert ids(threads) == Counter(range(100))


def test_a_long_object_leaf_goes_through_worker_processes_as_through_threads():
    # Objects travel pickled in the ragged memory, sized from the first examples:
    # a 1 MiB caption far down the dataset must still come through.
    def captions(**kwargs):
        return {b: len(c) for batch in dataecho.EchoLoader(Captions(200, long_at=123), batch_size=8, echo_factor=1,
                                                            num_workers=2, **kwargs)
                for b, c in zip(batch["id"].tolist(), batch["caption"])}

    assert captions(worker_type="process") == captions(worker_type="thread")
    with pytest.raises(ValueError, match=r"dataset\[123\]: its ragged values take .* with worker processes, "
                                         r"object leaves \(str, bytes, \.\.\.\) travel pickled"):
        captions(worker_type="process", ragged_bytes=1 << 16)


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    # Worker processes import the main script again; without the guard each
    # builds and iterates the loader while it starts, and exits (as under DataLoader).
    script = tmp_path / "train.py"
    script.write_text(
        "import dataecho\n"
        "loader = dataecho.EchoLoader(list(range(64)), batch_size=8, echo_factor=1, num_workers=2, worker_type='process')\n"
        "print(sum(1 for _ in loader))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert f"{script} has no `if __name__ == \"__main__\":` guard" in result.stderr, result.stderr[-2000:]
    assert "worker_type=\"thread\"" in result.stderr
    guarded = tmp_path / "guarded.py"
    guarded.write_text("if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in
                                                               script.read_text().splitlines()))
    result = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.split() == ["8"], result.stderr[-2000:]
