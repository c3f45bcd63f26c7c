"""Fixtures; the helpers the tests share are in support.py."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def seed(request) -> int:
    """A per-test seed, printed on failure so that a run can be replayed."""
    value = int(os.environ.get("DATAECHO_TEST_SEED", "12345"))
    request.node.user_properties.append(("seed", value))
    return value
