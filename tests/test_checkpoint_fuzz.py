"""The checkpoint fuzzer (tests/checkpoint_cases.py): random configurations,
saved at random moments, sent through torch.save/torch.load and JSON, loaded
by a job of the same or another world size, against the uninterrupted job.

A small seeded budget here; ``python bench/fuzz_checkpoints.py`` runs a longer
one. A failure names its seed; to replay it, or to explore other cases:

    DATAECHO_CHECKPOINT_SEED=7 DATAECHO_CHECKPOINT_CASES=200 python -m pytest tests/test_checkpoint_fuzz.py
"""

from __future__ import annotations

import os

import pytest
from checkpoint_cases import run_case

FIRST = int(os.environ.get("DATAECHO_CHECKPOINT_SEED", "0"))
CASES = int(os.environ.get("DATAECHO_CHECKPOINT_CASES", "24"))


@pytest.mark.parametrize("seed", range(FIRST, FIRST + CASES))
def test_a_random_checkpoint_resumes_exactly(seed):
    pytest.importorskip("torch")
    run_case(seed)
