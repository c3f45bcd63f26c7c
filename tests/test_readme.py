"""The README's Quickstart is a script a newcomer pastes and runs: it runs
here as written, in a fresh interpreter, and trains on what it says."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
from support import run_python

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def quickstart() -> str:
    """The first Python block under the README's "## Quickstart"."""
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the Quickstart has a Python block"
    return match.group(1)


def test_the_quickstart_runs_as_written_and_echoes_every_example_twice():
    pytest.importorskip("torch")
    code = quickstart()
    assert "..." not in code.replace("consumer_wait_fraction, ...", ""), "no placeholder left to fill in"
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert stats["fresh"] == 2 * 8192, "two whole epochs read"
    assert stats["delivered"] == 2 * stats["fresh"], "each example delivered echo_factor=2 times"
    assert stats["echo_factor_achieved"] == 2.0
    assert stats["repetition"]["deliveries"] == [0, 0, 0, 0, 8192], "each example 4 times over the two epochs"
