"""The native stress tests (cpp/tests): configured, built and run from pytest.

The build goes to pytest's tmp_path, so nothing is written inside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NATIVE_TESTS = [
    "rng",
    "reservoir",
    "ring_basic",
    "ring_blocking",
    "ring_stress",
    "batch_pool",
    "buffer_accounting",
    "buffer_fractional_drop_last",
    "buffer_deterministic",
    "buffer_in_order",
    "buffer_put_each",
    "buffer_put_into",
    "buffer_held",
    "buffer_snapshot",
    "buffer_timeouts",
    "buffer_close",
    "buffer_stop",
    "buffer_destroy",
    "page_heap",
    "buffer_ragged",
    "buffer_ragged_modes",
    "buffer_ragged_blocking",
    "spread",
]


def _cxx_compiler() -> str | None:
    """The compiler CMake would pick: $CXX if set, else c++, g++ or clang++ on PATH."""
    from_env = os.environ.get("CXX", "").split()
    candidates = from_env[:1] or ["c++", "g++", "clang++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False
    )


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_native_stress_program(tmp_path, seed):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not on PATH: the native tests cannot be built")
    if _cxx_compiler() is None:
        pytest.skip("no C++ compiler on PATH (tried $CXX, c++, g++, clang++)")

    build = tmp_path / "build"
    configure = _run(
        [cmake, "-S", str(ROOT), "-B", str(build), "-DDATAECHO_CPP_TESTS=ON", "-DCMAKE_BUILD_TYPE=Release"],
        timeout_s=60,
    )
    assert configure.returncode == 0, f"cmake configure failed:\n{_tail(configure.stdout)}"
    compiled = _run([cmake, "--build", str(build), "-j2"], timeout_s=90)
    assert compiled.returncode == 0, f"cmake build failed:\n{_tail(compiled.stdout)}"

    # Single-config generators put the binary in the build tree's mirror of cpp/tests.
    binary = build / "cpp" / "tests" / "dataecho_tests"
    assert binary.is_file(), f"{binary} was not built"

    result = _run([str(binary), "--seed", str(seed), "--timeout-s", "40"], timeout_s=90)
    output = result.stdout
    assert result.returncode == 0, f"dataecho_tests exited with {result.returncode} (seed {seed}):\n{_tail(output)}"
    for name in NATIVE_TESTS:
        assert any(line.startswith(f"PASS {name} ") for line in output.splitlines()), (
            f"no PASS line for {name}:\n{_tail(output)}"
        )
    assert f"{len(NATIVE_TESTS)} passed, 0 failed" in output, _tail(output)
