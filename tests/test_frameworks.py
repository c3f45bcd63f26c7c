"""Checkpoints where people train: an EchoLoader interrupted part-way through
an epoch (or at its end) under Lightning, Hugging Face's Trainer (with
dataecho.transformers.EchoLoaderCallback) and Accelerate, on one process and on
two CPU ranks (gloo), then resumed in new processes by the framework's own
resume and nothing else (tests/frameworks.py runs each process). Across the two runs, every rank must train on exactly the batches an
uninterrupted run yields: every example its echo count in the interrupted
epoch, ``len(loader)`` batches per epoch, and the next epoch in its order.

The clients are in the test extra: a missing one fails the import, it is never skipped.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from frameworks import BATCH, EPOCHS, N, STOP, ledger, make_loader
from support import TESTS, checked_ids, run_python


PER_EPOCH = N * 2 // BATCH  # batches per epoch at echo_factor=2 on one rank
ERROR_LINE = re.compile(r"(\[rank\d+\]: )?[\w.]*(Error|Exception|Interrupt)\b")  # a traceback's last line


def run(framework: str, out: Path, phase: str, arg: str = "", ranks: int = 1, timeout_s: float = 45) -> None:
    """Runs one run of tests/frameworks.py to its end: ``ranks`` processes
    started together, each told its rank as torchrun would (Lightning then
    starts none itself); what each writes goes to ``out/<phase>-rank<r>.log``."""
    env = {**os.environ, "DATAECHO_TEST_DEVICES": str(ranks),
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks))
    logs = [out / f"{phase}-rank{rank}.log" for rank in range(ranks)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as f:  # a file, not a pipe: a rank that writes much never waits for the reader
            # A session of its own: whatever it started is killed with it on a timeout.
            procs.append(subprocess.Popen(
                [sys.executable, str(TESTS / "frameworks.py"), framework, str(out), phase, arg],
                stdout=f, stderr=subprocess.STDOUT, cwd=out, start_new_session=True,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} if ranks > 1 else env))
    deadline, failures, tails = time.monotonic() + timeout_s, [], []
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                os.killpg(other.pid, signal.SIGKILL)
                other.wait()
            raise AssertionError(f"{framework} {phase}: rank {rank} not finished within {timeout_s} s") from None
        if proc.returncode != 0:  # the error each rank ended with first, then the end of what it wrote
            written = logs[rank].read_text(errors="replace")
            errors = [line for line in written.splitlines() if ERROR_LINE.match(line)]
            failures.append(f"rank {rank}: exit {proc.returncode}: {(errors or ['?'])[-1][:400]}")
            tails.append(f"---- rank {rank}:\n{written[-2500:]}")
    if failures:
        raise AssertionError(f"{framework} {phase} {arg}:\n" + "\n".join(failures + tails))


def uninterrupted(echo: float = 2.0, **shard: Any) -> list[list[list[int]]]:
    """The batches (ids) of epochs 0 and 1 of the loader the frameworks train on, run bare."""
    loader = make_loader(echo, **shard)
    epochs = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        epochs.append([checked_ids(batch).tolist() for batch in loader])
    return epochs


def assert_resumed(first: dict[int, list], resumed: dict[int, list], reference: list[list], trained: int,
                   rank: int = 0) -> None:
    """The interrupted run trained ``trained`` batches of epoch 0; with the
    resumed run's, they are exactly the uninterrupted epoch 0, and the resumed
    run's epoch 1 is the uninterrupted epoch 1."""
    assert sorted(first) == [0] and len(first[0]) == trained, \
        f"rank {rank}: the interrupted run trained {[(e, len(b)) for e, b in first.items()]} (epoch, batches)"
    epoch0 = first[0] + resumed.get(0, [])
    counts = Counter(i for batch in epoch0 for i in batch)
    expected = Counter(i for batch in reference[0] for i in batch)
    assert counts == expected, (f"rank {rank}, epoch 0 over both runs: missing {dict(expected - counts)}, "
                                f"extra {dict(counts - expected)}")
    assert len(epoch0) == len(reference[0]), f"rank {rank}: epoch 0 took {len(epoch0)} batches, not {len(reference[0])}"
    assert epoch0 == reference[0], f"rank {rank}: epoch 0's batches are not the uninterrupted run's"
    epoch1 = resumed.get(1, [])
    assert len(epoch1) == len(reference[1]), f"rank {rank}: epoch 1 took {len(epoch1)} batches, not {len(reference[1])}"
    assert epoch1 == reference[1], f"rank {rank}: epoch 1's batches are not the uninterrupted run's"


def test_the_reference_delivers_every_example_twice_per_epoch():
    # What the framework tests compare with: each epoch, every id exactly twice, len(loader) batches.
    for epoch in uninterrupted():
        assert len(epoch) == PER_EPOCH == len(make_loader())
        assert Counter(i for batch in epoch for i in batch) == Counter({i: 2 for i in range(N)})


# ---- Lightning ----


def test_lightning_resumes_mid_epoch_from_its_checkpoint(tmp_path):
    # ModelCheckpoint every STOP steps, fit stopped by max_steps; a new Trainer: fit(ckpt_path=...).
    run("lightning", tmp_path, "first", "mid")
    run("lightning", tmp_path, "resume", f"checkpoints/epoch=0-step={STOP}.ckpt")
    assert_resumed(ledger(tmp_path, "first"), ledger(tmp_path, "resume"), uninterrupted(), STOP)


def test_lightning_resumes_from_an_epoch_end_checkpoint(tmp_path):
    run("lightning", tmp_path, "first", "end")
    run("lightning", tmp_path, "resume", f"checkpoints/epoch=0-step={PER_EPOCH}.ckpt")
    assert_resumed(ledger(tmp_path, "first"), ledger(tmp_path, "resume"), uninterrupted(), PER_EPOCH)


def test_lightning_ddp_resumes_every_rank_mid_epoch(tmp_path):
    # Lightning saves rank 0's checkpoint (the loader's state in it) and hands it to every rank.
    run("lightning", tmp_path, "first", "mid", ranks=2)
    run("lightning", tmp_path, "resume", f"checkpoints/epoch=0-step={STOP}.ckpt", ranks=2)
    shards = []
    for rank in range(2):
        reference = uninterrupted(rank=rank, world_size=2)
        shards.append(set(i for batch in reference[0] for i in batch))
        assert_resumed(ledger(tmp_path, "first", rank), ledger(tmp_path, "resume", rank), reference, STOP, rank)
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(N)), "the ranks' shards"


# ---- Hugging Face Trainer ----


def test_hf_trainer_resumes_mid_epoch_with_the_callback_from_a_moved_checkpoint(tmp_path):
    run("hf", tmp_path, "first")
    saved = tmp_path / "hf" / f"checkpoint-{STOP}"
    assert {p.name for p in saved.glob("dataecho_loader_*")} == {"dataecho_loader_0.json"}
    # Resumed from a folder the Trainer did not name: the callback reads the one train() was given.
    (tmp_path / "elsewhere").mkdir()
    saved.rename(tmp_path / "elsewhere" / "saved")
    run("hf", tmp_path, "resume", "elsewhere/saved")
    assert_resumed(ledger(tmp_path, "first"), ledger(tmp_path, "resume"), uninterrupted(), STOP)


def test_hf_trainer_ddp_resumes_every_rank_mid_epoch(tmp_path):
    # Two ranks, each saving its own state beside its rng_state_<rank>.pth, and reading it back.
    run("hf", tmp_path, "first", ranks=2)
    saved = tmp_path / "hf" / f"checkpoint-{STOP}"
    assert sorted(p.stem for p in saved.glob("dataecho_loader_*")) == ["dataecho_loader_0", "dataecho_loader_1"]
    run("hf", tmp_path, "resume", f"hf/checkpoint-{STOP}", ranks=2)
    for rank in range(2):
        reference = uninterrupted(rank=rank, world_size=2)
        assert_resumed(ledger(tmp_path, "first", rank), ledger(tmp_path, "resume", rank), reference, STOP, rank)


def test_hf_callback_resumes_each_rank_from_its_state_and_a_new_world_size_from_rank_0s(tmp_path):
    # The callback's events called as a Trainer of two ranks, then of one, calls them.
    from dataecho.transformers import EchoLoaderCallback

    reference = [uninterrupted(rank=rank, world_size=2)[0] for rank in range(2)]
    control = SimpleNamespace()
    for rank in range(2):
        loader = make_loader(rank=rank, world_size=2)
        taken = [checked_ids(b).tolist() for _, b in zip(range(3), loader)]  # 3 batches, not a 4th
        assert taken == reference[rank][:3]
        args = SimpleNamespace(output_dir=str(tmp_path), process_index=rank, world_size=2, ignore_data_skip=False)
        EchoLoaderCallback().on_save(args, SimpleNamespace(global_step=3, trial_name=None), control,
                                     train_dataloader=loader)
        loader.close()
    folder = tmp_path / "checkpoint-3"
    assert len(list(folder.glob("dataecho_loader_*"))) == 2

    same = make_loader(rank=1, world_size=2)
    args = SimpleNamespace(output_dir=str(tmp_path), process_index=1, world_size=2, ignore_data_skip=False)
    EchoLoaderCallback(same).on_train_begin(args, SimpleNamespace(global_step=3, trial_name=None), control)
    assert args.ignore_data_skip, "the Trainer must skip nothing: the loader resumes itself"
    assert reference[1][:3] + [checked_ids(b).tolist() for b in same] == reference[1]

    one = make_loader()
    args = SimpleNamespace(output_dir=str(tmp_path), process_index=0, world_size=1, ignore_data_skip=True)
    EchoLoaderCallback().on_train_begin(args, SimpleNamespace(global_step=3, trial_name=None), control,
                                        train_dataloader=one)
    rest = [i for b in one for i in checked_ids(b).tolist()]
    counts = Counter(rest) + Counter(i for r in range(2) for b in reference[r][:3] for i in b)
    assert set(counts) == set(range(N)) and set(counts.values()) == {2}, "each example twice over both jobs"


def test_hf_callback_names_the_fix_when_the_trainer_trains_on_another_loader(tmp_path):
    from dataecho.transformers import EchoLoaderCallback

    args = SimpleNamespace(output_dir=str(tmp_path), process_index=0, world_size=1, ignore_data_skip=False)
    with pytest.raises(TypeError, match="return the EchoLoader from get_train_dataloader"):
        EchoLoaderCallback().on_train_begin(args, SimpleNamespace(global_step=0), None, train_dataloader=[1, 2])


def test_import_dataecho_imports_no_framework():
    proc = run_python("""
        import sys
        import dataecho
        print(sorted(m for m in ("transformers", "accelerate", "pytorch_lightning") if m in sys.modules))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]"]


# ---- Accelerate ----


def test_accelerate_resumes_mid_epoch_with_register_for_checkpointing(tmp_path):
    run("accelerate", tmp_path, "first", f"2:{STOP}")
    assert (tmp_path / "prepare-rank0.json").read_text() == '{"unchanged": true}', "prepare() wraps no EchoLoader"
    run("accelerate", tmp_path, "resume", f"2:{STOP}")
    assert_resumed(ledger(tmp_path, "first"), ledger(tmp_path, "resume"), uninterrupted(), STOP)


def test_accelerate_resumes_every_rank_from_the_main_process_state_at_a_fractional_factor(tmp_path):
    # save_state writes custom_checkpoint_0.pkl on the main process only: rank 1 resumes from rank 0's
    # state. At echo 1.5 each rank delivers floor(48 * 1.5) = 72 examples an epoch, each once or twice.
    run("accelerate", tmp_path, "first", "1.5:4", ranks=2)
    run("accelerate", tmp_path, "resume", "1.5:4", ranks=2)
    for rank in range(2):
        reference = uninterrupted(1.5, rank=rank, world_size=2)
        assert set(Counter(i for b in reference[0] for i in b).values()) == {1, 2}
        assert_resumed(ledger(tmp_path, "first", rank), ledger(tmp_path, "resume", rank), reference, 4, rank)
