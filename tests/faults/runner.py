"""Runs scenarios by name and seed: one by one with PASS / FAIL lines (a
replay), or under the protocol that tests/test_faults.py reads (JSON lines)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import faults
from faults.common import CLEANUP_S, FORBIDDEN, Baseline, assert_clean
from faults.exiting import exit_child
from faults.registry import SCENARIOS

STDERR_MARKERS = FORBIDDEN + ("Traceback (most recent call last)", "Exception ignored", "Exception in thread")


def run_one(spec: str, seed: int) -> None:
    """Runs scenario `spec` (kind:variant) with every parameter drawn from `seed`."""
    kind, variant = spec.split(":", 1)
    function, variants = SCENARIOS[kind]
    if variant not in variants:
        raise ValueError(f"{spec}: unknown variant; {kind} has {variants}")
    function(random.Random(seed), variant, seed)


def _emit(record: dict[str, Any]) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


def run_protocol(pairs: list[tuple[str, int]], log: Path, timeout_s: float) -> int:
    """Runs the scenarios in turn; `log` is the file this process's stderr goes to
    (and that of the worker processes it starts), read back per scenario."""
    for spec, seed in pairs:
        sys.stderr.flush()
        offset = log.stat().st_size
        _emit({"event": "start", "spec": spec, "seed": seed, "stderr_offset": offset})
        baseline = Baseline()
        started = time.monotonic()
        error = ""
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        try:
            run_one(spec, seed)
        except BaseException:  # noqa: BLE001 - every failure is this scenario's result
            error = traceback.format_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
        gc.collect()  # buffers caught in reference cycles go now, not in the next scenario
        left = baseline.wait_clean(1.0 if error else CLEANUP_S)
        if left and not error:
            error = f"the scenario left behind {left}"
        sys.stderr.flush()
        with open(log, errors="replace") as f:
            f.seek(offset)
            err = f.read()
        markers = [m for m in STDERR_MARKERS if m in err]
        if markers and not error:
            error = f"unexpected stderr ({markers}):\n{err[-4000:]}"
        _emit({"event": "end", "spec": spec, "seed": seed, "ok": not error, "error": error,
               "elapsed_s": round(time.monotonic() - started, 3)})
        if left:
            return 3  # the rest get a fresh process
    return 0


def run_replay(pairs: list[tuple[str, int]]) -> int:
    """Runs the scenarios in turn, printing PASS or FAIL (with the traceback) for each."""
    failed = 0
    for spec, seed in pairs:
        baseline = Baseline()
        started = time.monotonic()
        try:
            run_one(spec, seed)
            gc.collect()
            assert_clean(baseline, "after the scenario")
            print(f"PASS {spec} {seed} ({time.monotonic() - started:.2f} s)", flush=True)
        except BaseException:  # noqa: BLE001
            failed += 1
            print(f"FAIL {spec} {seed} ({time.monotonic() - started:.2f} s)\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    """The command line of ``python tests/faults`` (see the faults package)."""
    if argv[:1] == ["--exit-child"]:
        exit_child(argv[1], argv[2], int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python tests/faults", description=faults.__doc__.split("\n")[0])
    parser.add_argument("--protocol", metavar="LOG", help="JSON results on stdout; LOG is where stderr goes")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per scenario (protocol mode)")
    parser.add_argument("pairs", nargs="+", help="SPEC SEED [SPEC SEED ...], SPEC as kind:variant")
    args = parser.parse_args(argv)
    if len(args.pairs) % 2:
        parser.error("expected SPEC SEED pairs")
    pairs = [(args.pairs[i], int(args.pairs[i + 1])) for i in range(0, len(args.pairs), 2)]
    if args.protocol:
        return run_protocol(pairs, Path(args.protocol), args.timeout)
    return run_replay(pairs)
