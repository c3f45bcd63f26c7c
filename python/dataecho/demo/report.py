"""The demo's table and plot."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from .train import Run


def table(runs: list[Run], target: float) -> str:
    """Time to the target, fresh examples, steps, final accuracy, speed-up over the baseline."""
    base = runs[0].reached[0] if runs and runs[0].reached else math.nan
    header = ("configuration", "time to target", "fresh examples", "steps", "final val acc", "speed-up")
    rows = []
    for run in runs:
        if run.reached:
            seconds, fresh, steps, _ = run.reached
            rows.append((run.config.name, f"{seconds:.1f} s", f"{fresh:,}", f"{steps:,}",
                         f"{run.final_accuracy:.3f}", f"{base / seconds:.2f}x" if base == base else "-"))
        else:
            last = run.history[-1] if run.history else (0.0, 0, 0, 0.0)
            rows.append((run.config.name, f"> {last[0]:.0f} s (not reached)", f"{last[1]:,}", f"{last[2]:,}",
                         f"{run.final_accuracy:.3f}", "-"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        f"target: validation accuracy {target:.2f} (mean of the last 3 evaluations, every 10 steps); "
        f"speed-up = baseline time / time (higher is better)",
        "",
    ]
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def plot(runs: list[Run], target: float, path: Path, title: str) -> Path:
    """Validation accuracy against wall time and against fresh examples, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_fresh) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for run in runs:
        seconds = [r[0] for r in run.history]
        fresh = [r[1] for r in run.history]
        accuracy = [r[3] for r in run.history]
        style = {"linewidth": 2.2 if run is runs[0] else 1.6, "label": run.config.name}
        by_time.plot(seconds, accuracy, **style)
        by_fresh.plot(fresh, accuracy, **style)
    for axis, label in ((by_time, "wall time (s)"), (by_fresh, "fresh examples read")):
        axis.axhline(target, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel(label)
        axis.set_ylabel("validation accuracy")
        axis.set_ylim(max(0.0, target - 0.25), 1.0)
        axis.grid(alpha=0.3)
    by_time.set_title("accuracy against wall time")
    by_fresh.set_title("accuracy against fresh examples")
    by_fresh.legend(loc="lower right", fontsize=8)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


class Progress:
    """One status line per run on stderr, redrawn in place on a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, run: Run, max_seconds: float) -> None:
        seconds, fresh, steps, accuracy = run.history[-1]
        width = 24
        done = min(1.0, seconds / max_seconds)
        bar = "#" * int(done * width) + "." * (width - int(done * width))
        line = (f"  {run.config.name:<34} [{bar}] {seconds:5.1f}s  step {steps:5d}  "
                f"fresh {fresh:6d}  val acc {accuracy:.3f}")
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif seconds - self._last >= 5 or run.reached:
            print(line, file=sys.stderr, flush=True)
            self._last = seconds

    def end(self) -> None:
        self._last = 0.0
        if self.tty:
            print(file=sys.stderr, flush=True)
