"""The checkpoint fuzzer, run long: random configurations saved at random
moments, sent through torch.save/torch.load or JSON, loaded by a job of the
same or another world size, each checked against the same job run without
interruption (tests/checkpoint_cases.py says what a case draws and which laws
it checks; CI runs a small seeded budget of the same cases in
tests/test_checkpoint_fuzz.py).

Prints the cases run by kind, and every case that broke a law, with its seed
(replay one with ``DATAECHO_CHECKPOINT_SEED=<seed> DATAECHO_CHECKPOINT_CASES=1
python -m pytest tests/test_checkpoint_fuzz.py``). Exits 1 if any did.

Usage:
    python bench/fuzz_checkpoints.py [--first 1000] [--cases 500]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import common

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from checkpoint_cases import draw, run_case  # noqa: E402


def kind(case: dict) -> str:
    """A case's kind, for the table: its source, and for loaders, its placement and how it resumed."""
    if case["source"] in ("grain", "nodes"):
        return f"{case['source']} pipeline"
    move = "same world size" if case["world"] == case["new_world"] else "another world size"
    return f"EchoLoader, {move}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--first", type=int, default=1000, help="the first seed (CI runs 0 to 23)")
    parser.add_argument("--cases", type=int, default=500)
    args = parser.parse_args()
    import torch

    common.print_header(common.machine(torch=torch.__version__), "cases run and laws broken; fewer broken is better")
    runs, broken, moments = Counter(), [], Counter()
    started = time.perf_counter()
    for seed in range(args.first, args.first + args.cases):
        case = draw(seed)
        runs[kind(case)] += 1
        moments[case["moment"]] += 1
        try:
            run_case(seed)
        except Exception as error:  # noqa: BLE001 - every broken case is reported, then the next runs
            broken.append((seed, kind(case), "".join(traceback.format_exception_only(error)).strip()[:400]))
    elapsed = time.perf_counter() - started
    failed = Counter(k for _, k, _ in broken)
    common.print_table(["cases", "run", "broken"], [[k, str(n), str(failed[k])] for k, n in sorted(runs.items())])
    print(f"moments: {dict(sorted(moments.items()))}")
    print(f"{args.cases} cases (seeds {args.first} to {args.first + args.cases - 1}) in {elapsed:.0f} s, "
          f"{len(broken)} broken")
    for seed, what, message in broken:
        print(f"  seed {seed} ({what}): {message}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
