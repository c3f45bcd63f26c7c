"""The demo's table and plot, for either task: what is measured (accuracy,
higher is better; loss, lower is better) and what counts as fresh input
(examples; tokens) come from a :class:`Metric`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .train import Run


@dataclass(frozen=True)
class Metric:
    """What a run's history measures, as the table and plot name it.

    Attributes:
        name: the validation measure ("validation accuracy").
        short: its short form in columns and progress lines ("val acc").
        fresh: what the fresh input is counted in ("fresh examples").
        higher_is_better: accuracy: True; loss: False.
        unit: after the target's value ("" or " nats/token").
        every: steps between evaluations.
        fresh_width: digits of the fresh count in progress lines.
    """

    name: str
    short: str
    fresh: str
    higher_is_better: bool
    unit: str = ""
    every: int = 10
    fresh_width: int = 6


ACCURACY = Metric("validation accuracy", "val acc", "fresh examples", higher_is_better=True)
LOSS = Metric("validation loss", "val loss", "fresh tokens", higher_is_better=False, unit=" nats/token", every=25,
              fresh_width=8)


def _final(run: Run) -> float:
    return run.history[-1][3] if run.history else 0.0


def rows(runs: list[Run], metric: Metric = ACCURACY) -> tuple[list[str], list[list[str]]]:
    """The table's header and its rows, as text cells (one row per run): time to
    the target, fresh input, steps, the final measure, speed-up over the first
    run, and how many times an example was delivered over the run (mean, most)."""
    base = runs[0].reached[0] if runs and runs[0].reached else math.nan
    header = ["configuration", "time to target", metric.fresh, "steps", f"final {metric.short}", "speed-up",
              "deliveries per example (mean, most)"]
    cells = []
    for run in runs:
        if run.reached:
            seconds, fresh, steps, _ = run.reached
            cells.append([run.config.name, f"{seconds:.1f} s", f"{fresh:,}", f"{steps:,}",
                          f"{_final(run):.3f}", f"{base / seconds:.2f}x" if base == base else "-", _repeats(run)])
        else:
            last = run.history[-1] if run.history else (0.0, 0, 0, 0.0)
            cells.append([run.config.name, f"> {last[0]:.0f} s (not reached)", f"{last[1]:,}", f"{last[2]:,}",
                          f"{_final(run):.3f}", "-", _repeats(run)])
    return header, cells


def _repeats(run: Run) -> str:
    """Deliveries per example over the run (the loader's repetition report), or "-" where it has none."""
    repetition = run.stats.get("repetition")
    if not repetition or not repetition["max"]:
        return "-"
    return f"{repetition['mean']:.2f}, {repetition['max']}"


def table(runs: list[Run], target: float, metric: Metric = ACCURACY) -> str:
    """Time to the target, fresh input, steps, the final measure, speed-up over the baseline."""
    header, cells = rows(runs, metric)
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    lower = "" if metric.higher_is_better else ", lower is better"
    lines = [
        f"target: {metric.name} {target:.2f}{metric.unit}{lower} (mean of the last 3 evaluations, every "
        f"{metric.every} steps); speed-up = baseline time / time (higher is better)",
        "",
    ]
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


def plot(runs: list[Run], target: float, path: Path, title: str, metric: Metric = ACCURACY) -> Path:
    """The validation measure against wall time and against fresh input, one line per run; and how many
    examples each run delivered 1, 2, 3, ... times (its loader's repetition report)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (by_time, by_fresh, by_times) = plt.subplots(1, 3, figsize=(17, 4.5), constrained_layout=True)
    for run in runs:
        seconds = [r[0] for r in run.history]
        fresh = [r[1] for r in run.history]
        value = [r[3] for r in run.history]
        style = {"linewidth": 2.2 if run is runs[0] else 1.6, "label": run.config.name}
        by_time.plot(seconds, value, **style)
        by_fresh.plot(fresh, value, **style)
        deliveries = (run.stats.get("repetition") or {}).get("deliveries", [])
        if len(deliveries) > 1:
            by_times.plot(range(1, len(deliveries)), deliveries[1:], marker="o", **style)
    by_times.xaxis.set_major_locator(MaxNLocator(integer=True))  # times are whole
    by_times.set_xlabel("times delivered over the run")
    by_times.set_ylabel("examples")
    by_times.set_title("repetition: examples by times delivered")
    by_times.grid(alpha=0.3)
    # The curves' last stretch, where the target is crossed: accuracy up to 1,
    # a loss from well above the target (its first evaluations are far higher).
    limits = (max(0.0, target - 0.25), 1.0) if metric.higher_is_better else (max(0.0, target - 0.25), target + 0.8)
    for axis, label in ((by_time, "wall time (s)"), (by_fresh, f"{metric.fresh} read")):
        axis.axhline(target, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel(label)
        axis.set_ylabel(metric.name)
        axis.set_ylim(*limits)
        axis.grid(alpha=0.3)
    what = metric.name.split()[-1]  # "accuracy", "loss"
    by_time.set_title(f"{what} against wall time")
    by_fresh.set_title(f"{what} against {metric.fresh}")
    by_fresh.legend(loc="lower right" if metric.higher_is_better else "upper right", fontsize=8)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


class Progress:
    """One status line per run on stderr, redrawn in place on a terminal."""

    def __init__(self, metric: Metric = ACCURACY) -> None:
        self.metric = metric
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, run: Run, max_seconds: float) -> None:
        seconds, fresh, steps, value = run.history[-1]
        width = 24
        done = min(1.0, seconds / max_seconds)
        bar = "#" * int(done * width) + "." * (width - int(done * width))
        line = (f"  {run.config.name:<34} [{bar}] {seconds:5.1f}s  step {steps:5d}  "
                f"fresh {fresh:{self.metric.fresh_width}d}  {self.metric.short} {value:.3f}")
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif seconds - self._last >= 5 or run.reached:
            print(line, file=sys.stderr, flush=True)
            self._last = seconds

    def end(self) -> None:
        self._last = 0.0
        if self.tty:
            print(file=sys.stderr, flush=True)
