"""The device check's report: bench/device_check.sh's parts (the machine, the
build, the CUDA tests, each benchmark's JSON) gathered into one Markdown page
and one JSON file.

Every benchmark part writes the same structure (``--json``): name, title,
command, machine, device, reading, tables (title, header, rows of strings),
targets (target, shown, met: true, false or null where not measured here),
notes, seconds. A part that did not run, or wrote nothing, is reported as
such with the end of its log.

Usage:
    python bench/device_report.py PARTS_DIR OUT_MD OUT_JSON --mode gpu|cpu
"""

from __future__ import annotations

import argparse
import datetime
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

BENCHMARKS = ("handoff", "gpu_step", "paper", "scaling", "device_echo")
_MARKS = {True: "met", False: "NOT met", None: "not measured here"}


def tests_summary(junit: Path) -> dict[str, Any]:
    """Counts from a pytest JUnit file, and the names of the tests that failed or were skipped."""
    if not junit.is_file():
        return {"ran": False}
    root = ElementTree.parse(junit).getroot()
    cases = root.iter("testcase")
    failed, skipped, passed = [], [], 0
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped.append(f"{name} ({case.find('skipped').get('message', '')})")
        else:
            passed += 1
    return {"ran": True, "passed": passed, "failed": failed, "skipped": skipped}


def read_part(parts: Path, name: str) -> dict[str, Any]:
    """A benchmark's JSON, or what its log says where it wrote none."""
    path = parts / f"{name}.json"
    status = _read(parts / f"{name}.status")
    if path.is_file():
        try:
            part = json.loads(path.read_text())
            part["exit"] = status
            return part
        except json.JSONDecodeError as error:
            problem = f"its JSON could not be read ({error})"
    else:
        problem = "it wrote no JSON" if status is not None else "it did not run"
    log = _read(parts / f"{name}.log") or ""
    return {"name": name, "title": name, "exit": status, "error": problem, "log_tail": log[-2000:]}


def _read(path: Path) -> str | None:
    return path.read_text().strip() if path.is_file() else None


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page: machine, build, tests, then each benchmark's tables and targets."""
    lines = [f"# Device check ({report['mode']})", "",
             f"- date: {report['date']}", f"- command: `{report['command']}`",
             f"- seconds: {report['seconds']}"]
    lines += [f"- {key}: {value}" for key, value in report["machine"].items()]
    lines += ["", "## Build", "", f"- {report['build']}", "", "## CUDA tests", ""]
    tests = report["tests"]
    if not tests.get("ran"):
        lines.append("- did not run")
    else:
        lines.append(f"- {tests['passed']} passed, {len(tests['failed'])} failed, {len(tests['skipped'])} skipped")
        lines += [f"- failed: `{name}`" for name in tests["failed"]]
        lines += [f"- skipped: {name}" for name in tests["skipped"][:20]]
    for part in report["parts"]:
        lines += ["", f"## {part.get('title', part['name'])}", ""]
        if "error" in part:
            lines += [f"- did not complete: {part['error']} (exit {part.get('exit')})", "", "```",
                      part.get("log_tail", ""), "```"]
            continue
        lines += [f"- command: `{part.get('command', '')}`; device: {part.get('device', '')}; "
                  f"{part.get('seconds', 0):.0f} s; exit {part.get('exit')}", f"- {part.get('reading', '')}"]
        for table in part.get("tables", []):
            lines += ["", f"**{table['title']}**", "", "| " + " | ".join(table["header"]) + " |",
                      "|" + "---|" * len(table["header"])]
            lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
        if part.get("targets"):
            lines += ["", "Targets:", ""]
            lines += [f"- [{_MARKS[t['met']]}] {t['target']}: {t['shown']}" for t in part["targets"]]
        lines += [""] + [f"- {note}" for note in part.get("notes", [])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", type=Path)
    parser.add_argument("out_md", type=Path)
    parser.add_argument("out_json", type=Path)
    parser.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    parser.add_argument("--seconds", type=float, default=0.0)
    args = parser.parse_args()
    parts = args.parts
    machine = {}
    for line in (_read(parts / "machine.txt") or "").splitlines():
        key, _, value = line.partition(": ")
        if value:
            machine[key] = value
    report = {
        "mode": args.mode,
        "date": datetime.date.today().isoformat(),
        "command": "bash bench/device_check.sh" + (" --cpu" if args.mode == "cpu" else ""),
        "seconds": round(args.seconds),
        "machine": machine,
        "build": _read(parts / "build.txt") or "not run",
        "tests": tests_summary(parts / "cuda-tests.xml"),
        "parts": [read_part(parts, name) for name in BENCHMARKS],
    }
    args.out_json.write_text(json.dumps(report, indent=1))
    args.out_md.write_text(markdown(report))
    failed = report["tests"].get("failed") or any("error" in p or p.get("exit") not in ("0", None)
                                                  for p in report["parts"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
