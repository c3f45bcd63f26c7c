"""echo_factor="auto" on several ranks (dataecho.pipeline.stages.lockstep): the ranks'
epochs end together, or every rank raises naming the cause, where a rank has
no batch, its input fails, or its loop leaves early. Real processes on gloo
(tests/ranks.py), each rank bounded (ranks.BOUND_S) far below the process
group's timeout, so that a hang fails fast."""

from __future__ import annotations

import pytest
from ranks import run_ranks

TIMEOUT_S = 25.0  # a backstop: each rank ends itself after ranks.BOUND_S
EMPTY = "had no batch to deliver this epoch"
STOPPED = "RuntimeError: EchoLoader: rank 1 ended this epoch early"
OUT_OF_STEP = "RuntimeError: EchoLoader: the ranks' lockstep agreements are out of step"
EVERY = 8  # LockstepSpec.every


def _epochs(scenario: str, world_size: int, tmp_path, arg: str) -> list[list[list]]:
    """Per rank, [batches, error or None] of each epoch it ran."""
    return [r["epochs"] for r in run_ranks(scenario, world_size, tmp_path, arg, timeout_s=TIMEOUT_S)]


@pytest.mark.parametrize(("case", "world_size"), [("short", 2), ("short", 3), ("later", 2)])
def test_a_rank_without_a_batch_stops_every_rank_at_its_first_batch_naming_it(tmp_path, case, world_size):
    # "short": the ranks but 0 read 3 examples, no batch of 8 with drop_last, in every epoch;
    # "later": rank 1's second epoch is empty. Each rank steps with a collective of its own.
    ranks = _epochs("auto_with_an_empty_rank", world_size, tmp_path, case)
    named = "rank 1 of 2" if world_size == 2 else "ranks 1, 2 of 3"
    if case == "later":
        assert {tuple(epochs[0]) for epochs in ranks} == {(ranks[0][0][0], None)}, "the same full first epoch"
        assert ranks[0][0][0] >= 64 // 8
    failed = [epoch for epochs in ranks for epoch in (epochs[1:] if case == "later" else epochs)]
    for batches, error in failed:
        assert batches == 0 and error.startswith("RuntimeError") and f"{named} {EMPTY}" in error, error


def test_an_epoch_empty_on_every_rank_is_empty_everywhere(tmp_path):
    assert _epochs("auto_with_an_empty_rank", 2, tmp_path, "all") == [[[0, None], [0, None]]] * 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_rank_whose_input_fails_mid_epoch_stops_the_others_within_two_agreements(tmp_path, workers):
    # Rank 1's stream raises at record 200 of 400 in the first epoch, 16 examples read ahead:
    # well into the epoch; in the loop's thread (0), or in a reading thread whose error stops the epoch.
    (ours, *after_0), (theirs, *after_1) = _epochs("auto_with_a_failing_rank", 2, tmp_path, f"0:200:16:{workers}")
    assert theirs[1] == "InjectedFault: the stream broke at record 200", "the failing rank raises its own error"
    assert ours[1].startswith(STOPPED), ours[1]
    # Rank 1 posts "stopped" as its next agreement; rank 0 reads it one agreement later.
    assert theirs[0] < ours[0] <= theirs[0] + 2 * EVERY and ours[0] % EVERY == 0, (ours, theirs)
    assert after_0 == after_1 and all(n > 0 and e is None for n, e in after_0), "the next epochs run in step"


@pytest.mark.parametrize("arg", ["0:50:4096:0", "1:5:4096:2"])
def test_a_rank_whose_input_fails_before_its_first_batch_stops_every_rank_at_once(tmp_path, arg):
    # Rank 1's stream raises while it fills its buffer (4096) for its first batch: in the first
    # epoch, read in the loop's thread; or in the second, whose stages exist from iter() on.
    failing = int(arg[0])
    ours, theirs = _epochs("auto_with_a_failing_rank", 2, tmp_path, arg)
    record = arg.split(":")[1]
    assert theirs.pop(failing) == [0, f"InjectedFault: the stream broke at record {record}"]
    stopped = ours.pop(failing)
    assert stopped[0] == 0 and stopped[1].startswith(STOPPED), stopped
    assert ours == theirs and all(n > 0 and e is None for n, e in ours), "the other epochs run in step"


def test_a_loop_left_early_on_one_rank_raises_out_of_step_on_both_then_runs_in_step(tmp_path):
    # Rank 1 leaves its first epoch after 3 batches and starts another; rank 0 goes on.
    ours, theirs = _epochs("auto_left_early_on_one_rank", 2, tmp_path, "")
    assert theirs[0] == [3, None]
    # Rank 0's agreement at batch 8 pairs with rank 1's next epoch's first: read at batch 16.
    assert ours[0][0] == 2 * EVERY and ours[0][1].startswith(OUT_OF_STEP), ours[0]
    assert theirs[1][0] == 0 and theirs[1][1] == ours[0][1]
    assert ours[1] == theirs[2] and ours[1][0] > 0 and ours[1][1] is None, "the next epoch runs in step"


@pytest.mark.parametrize("arg", ["empty", "failed"])
def test_a_rank_whose_epoch_built_no_stages_takes_part_in_the_first_agreement(tmp_path, arg):
    # What an epoch that read no example, or failed before its stages existed, does on its rank.
    ours, theirs = _epochs("lockstep_without_stages", 2, tmp_path, arg)
    if arg == "empty":
        assert ours == theirs and ours[0][0] == 0 and f"rank 1 of 2 {EMPTY}" in ours[0][1]
    else:
        assert theirs == [[0, None]], "the caller raises its own error"
        assert ours[0][0] == 0 and ours[0][1].startswith(STOPPED)


def test_a_rank_that_never_reads_an_example_stops_every_rank_naming_it(tmp_path):
    # Rank 1's stream is empty from the first epoch on: it never learns the examples' structure.
    ranks = _epochs("auto_with_an_empty_rank", 2, tmp_path, "iterable")
    for batches, error in [epoch for epochs in ranks for epoch in epochs]:
        assert batches == 0 and f"rank 1 of 2 {EMPTY}" in error, error
