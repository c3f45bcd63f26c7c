"""``python -m dataecho demo``: the package's demonstration (see dataecho.demo)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m dataecho demo [options]   (python -m dataecho demo --help for the options)")
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"unknown command {argv[0]!r}; the command is: python -m dataecho demo [options]", file=sys.stderr)
        return 2
    from .demo.cli import main as demo

    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
