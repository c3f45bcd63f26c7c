"""Echo on the device against echo on the host: what a delivered batch costs
the host, what crosses to the device, and what it does for a training step.

Three parts, in one run:

1. costs (any torch device): images of 3 x 64 x 64 and 3 x 224 x 224 uint8
   (12 KiB and 147 KiB) read by 2 threads, at e = 2 and 4, each without and
   with augmentation (a random crop of a 4-pixel padding and a flip: as
   ``augment``, per example on the loader's threads, for host echo; as
   ``device_augment``, on the whole batch, for echo on the device). Per
   delivered batch: the training process's CPU time (every thread), and per
   delivered example: the bytes copied to the device (the copies, and echo on
   the device's 8 bytes of index per row), over the example's own size. On
   the CPU device the device's work is the host's too: the column "of which
   device" is the CPU time inside what a GPU would take over (copies to the
   device, the device buffer's writes and gathers, ``device_augment``), and
   "host" is the rest. The ratios are device echo over host echo.
2. the step: a small CNN's training step on the crops (on the device, the
   images normalized there), over each loader at e = 2 with augmentation, and
   over one batch preloaded on the device: the step's own time (CUDA events
   around it; on the CPU its wall time) and the loop's (wall time per batch),
   over the preloaded step's.
3. the demo's time to target (``python -m dataecho demo``'s digits, the model
   on the device): echo before augmentation on the host (``augment``, e = 2)
   against echo on the device with the demo's ``DeviceAugment`` (e = 2): steps
   and seconds to the target accuracy, from the same seed.

``--cpu`` runs every part on the CPU device at small sizes (as CI's device
check does, so that what a GPU runs cannot rot); ``--device`` picks the device
(default: CUDA where there is one). ``--budget-s`` bounds the run (below 100 s,
as in the device check, each cost row's epoch has half as many examples); the
JSON is written after every part, so that a run cut short keeps what it found.

Usage:
    python bench/bench_device_echo.py [--device cuda|cpu] [--budget-s 60] [--json PATH]
    python bench/bench_device_echo.py --cpu [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any, Iterator

import numpy as np
import torch

import common
import dataecho
from dataecho.pipeline.stages import device_copy, device_rows

READING = ("per delivered batch: CPU ms of the training process (lower is better); per delivered example: bytes "
           "copied to the device; ratios: device echo over host echo")
PAD = 4


class Images:
    """Example i: ``{"image": one of 16 random C x S x S uint8 images, "label": i % 10}``."""

    def __init__(self, n: int, side: int) -> None:
        self.n = n
        self.pool = np.random.default_rng(0).integers(0, 256, (16, 3, side, side), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"image": self.pool[i % 16], "label": i % 10}


def host_crop_flip(example: dict, rng: np.random.Generator) -> dict:
    """Per example, on the host: a random crop of a 4-pixel padding, and a flip."""
    image = example["image"]
    side = image.shape[-1]
    dy, dx = rng.integers(0, 2 * PAD + 1, 2)
    crop = np.pad(image, ((0, 0), (PAD, PAD), (PAD, PAD)))[:, dy:dy + side, dx:dx + side]
    return {"image": np.ascontiguousarray(crop[:, :, ::-1] if rng.random() < 0.5 else crop), "label": example["label"]}


def device_crop_flip(batch: dict, generator: Any) -> dict:
    """The same, for a whole batch of device tensors, drawn from the loader's device generator: two
    gathers (rows, then columns, the flip folded into the columns' index), no per-example work."""
    images = batch["image"]
    n, channels, side, device = images.shape[0], images.shape[1], images.shape[-1], images.device
    padded = torch.nn.functional.pad(images, (PAD, PAD, PAD, PAD))
    dy, dx = torch.randint(0, 2 * PAD + 1, (2, n, 1), generator=generator, device=device)
    flip = torch.rand(n, 1, generator=generator, device=device) < 0.5
    span = torch.arange(side, device=device)
    rows = (dy + span).view(n, 1, side, 1).expand(n, channels, side, side + 2 * PAD)
    cols = (dx + torch.where(flip, side - 1 - span, span)).view(n, 1, 1, side).expand(n, channels, side, side)
    return {"image": padded.gather(2, rows).gather(3, cols), "label": batch["label"]}


class Meter:
    """Bytes copied to the device, and CPU seconds inside what a GPU would take
    over (copies, the device buffer's writes and gathers, device_augment)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.device_s = 0.0

    @contextlib.contextmanager
    def installed(self) -> Iterator[Meter]:
        patched = []

        def patch(owner: Any, name: str, counts_bytes: Any = None) -> None:
            original = getattr(owner, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if counts_bytes is not None:
                    self.bytes += counts_bytes(*args)
                started = time.thread_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.device_s += time.thread_time() - started
            patched.append((owner, name, original))
            setattr(owner, name, wrapper)

        for backend in (device_copy.CpuBackend, device_copy.CudaBackend):
            patch(backend, "copy", lambda _, tensor, *rest: tensor.numel() * tensor.element_size())
        patch(device_rows.DeviceRows, "write")
        patch(device_rows.DeviceRows, "gather", lambda _, slots: 8 * len(slots))  # the rows' index
        try:
            yield self
        finally:
            for owner, name, original in patched:
                setattr(owner, name, original)

    def timed(self, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args)
            finally:
                self.device_s += time.thread_time() - started
        return call


def make_loader(source: Images, where: str, echo: float, augmented: bool, device: Any, meter: Meter | None,
                batch: int) -> dataecho.EchoLoader:
    common_options = {"batch_size": batch, "echo_factor": echo, "num_workers": 2, "seed": 0, "output": "torch",
                      "device": device, "pin_memory": device.type == "cuda", "drop_last": True}
    if where == "host":
        return dataecho.EchoLoader(source, augment=host_crop_flip if augmented else None, **common_options)
    augment = device_crop_flip if augmented else None
    if augment is not None and meter is not None:
        augment = meter.timed(augment)
    return dataecho.EchoLoader(source, echo_at="device", device_augment=augment, shuffle_buffer=max(4096, 4 * batch),
                               **common_options)


def costs(device: Any, sides: dict[int, int], batch: int) -> list[dict]:
    """Part 1: one row per (side, e, augmented, where), each over a whole epoch (``sides``: side -> examples)."""
    rows = []
    for side, n in sides.items():
        source = Images(n, side)
        for echo in (2.0, 4.0):
            for augmented in (False, True):
                for where in ("host", "device"):
                    meter = Meter()
                    # A whole epoch: what crosses to the device depends on where in the epoch (the
                    # buffer fills first, and drains at the end), so the figures are an epoch's.
                    with meter.installed(), make_loader(source, where, echo, augmented, device, meter, batch) as loader:
                        cpu, batches = time.process_time(), 0
                        for _ in loader:
                            batches += 1
                        _sync(device)
                        cpu = time.process_time() - cpu
                    rows.append({"side": side, "echo": echo, "augmented": augmented, "where": where,
                                 "cpu_ms": 1e3 * cpu / batches, "device_ms": 1e3 * meter.device_s / batches,
                                 "bytes": meter.bytes / (batches * batch), "example": 3 * side * side + 8})
    return rows


def cost_table(rows: list[dict], on_cpu: bool) -> tuple[list[str], list[list[str]]]:
    header = ["image", "e", "augment", "host echo CPU ms/batch", "device echo", "ratio",
              "bytes/example host", "device", "ratio", "device bytes / (example / e)"]
    if on_cpu:
        header[3:5] = ["host echo CPU ms/batch (of which device)", "device echo (of which device)"]
    out = []
    for host, dev in zip(rows[::2], rows[1::2]):
        def ms(r: dict) -> str:
            return f"{r['cpu_ms']:.2f}" + (f" ({r['device_ms']:.2f})" if on_cpu else "")
        share = dev["bytes"] / (dev["example"] / dev["echo"])
        out.append([f"3x{host['side']}x{host['side']}", f"{host['echo']:g}", "yes" if host["augmented"] else "no",
                    ms(host), ms(dev), f"{dev['cpu_ms'] / host['cpu_ms']:.2f}", f"{host['bytes']:.0f}",
                    f"{dev['bytes']:.0f}", f"{dev['bytes'] / host['bytes']:.2f}", f"{share:.2f}"])
    return header, out


def make_model(side: int) -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def step_part(device: Any, side: int, n: int, batch: int, steps: int) -> list[list[str]]:
    """Part 2: the step's time and the loop's, per batch, over each loader and over a preloaded batch."""
    model = make_model(side).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda = device.type == "cuda"

    def step(b: dict) -> None:
        images = b["image"].to(device, non_blocking=True).float().div_(255.0)
        loss = torch.nn.functional.cross_entropy(model(images), b["label"].to(device, non_blocking=True))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def run(batches: Iterator[dict]) -> tuple[float, float]:
        for _ in range(3):
            step(next(batches))
        _sync(device)
        events, step_s, started = [], 0.0, time.perf_counter()
        for _ in range(steps):
            b = next(batches)
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                step(b)
                end.record()
                events.append((begin, end))
            else:
                t = time.perf_counter()
                step(b)
                step_s += time.perf_counter() - t
        _sync(device)
        loop_s = (time.perf_counter() - started) / steps
        if cuda:
            step_s = sum(a.elapsed_time(z) for a, z in events) / 1e3
        return 1e3 * step_s / steps, 1e3 * loop_s

    source = Images(n, side)
    preloaded = {"image": torch.from_numpy(source.pool[:1].repeat(batch, 0)).to(device),
                 "label": torch.zeros(batch, dtype=torch.int64, device=device)}
    run(iter(lambda: preloaded, None))  # warms the model's kernels up first: the baseline is not charged for it
    base_step, base_loop = run(iter(lambda: preloaded, None))
    rows = [["preloaded batch", f"{base_step:.2f}", f"{base_loop:.2f}", "1.00", "1.00"]]
    for where in ("host", "device"):
        with make_loader(source, where, 2.0, True, device, None, batch) as loader:
            step_ms, loop_ms = run(_forever(loader))
        rows.append([f"{where} echo + {'augment' if where == 'host' else 'device_augment'}, e=2", f"{step_ms:.2f}",
                     f"{loop_ms:.2f}", f"{step_ms / base_step:.2f}", f"{loop_ms / base_loop:.2f}"])
    return rows


def demo_part(device: Any, target: float, max_seconds: float) -> list[list[str]]:
    """Part 3: the demo's time to target, host augment against device echo and device augment."""
    from dataecho.demo import digits, train

    files, labels = digits.write_pngs(digits.default_cache())
    train_idx, val_idx = digits.split(labels, 1000, 0)
    dataset = digits.PngDigits(files, labels, train_idx, 0.0)
    images, _ = digits.load()
    validation = (images[val_idx][:, None].astype(np.float32) / 255.0, labels[val_idx])
    rows = []
    for config in (train.CONFIGS[1], train.ON_DEVICE):
        run = train.train(config, dataset, validation, target=target, max_seconds=max_seconds, batch_size=64,
                          workers=4 if device.type == "cuda" else 2, eval_every=20, seed=0, device=str(device),
                          progress=lambda *_: None)
        reached = run.reached
        rows.append([config.name, f"{reached[2]}" if reached else "not reached",
                     f"{reached[0]:.1f}" if reached else f">{run.history[-1][0]:.0f}",
                     f"{run.stats['echo_factor_achieved']:.2f}"])
    return rows


def _forever(loader: dataecho.EchoLoader) -> Iterator[dict]:
    while True:
        yield from loader


def _sync(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="every part on the CPU device, at small sizes")
    parser.add_argument("--device", default=None, help="torch device (default: cuda where there is one)")
    parser.add_argument("--budget-s", type=float, default=60.0, help="the run ends within about this")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    name = "cpu" if args.cpu else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    small = args.cpu or device.type == "cpu"
    torch.set_num_threads(1 if small else torch.get_num_threads())
    budget = args.budget_s
    tables, notes, errors = [], [], []

    cost_rows: list[dict] = []

    def document(final: bool) -> dict[str, Any]:
        unfinished = [] if final else ["incomplete: the run had not ended when this was written"]
        return {"name": "device_echo", "title": "Echo on the device, against echo on the host",
                "command": "python bench/bench_device_echo.py" + (" --cpu" if args.cpu else f" --device {name}"),
                "machine": common.machine(torch=torch.__version__, cuda=torch.version.cuda), "device": str(device),
                "reading": READING, "tables": tables, "targets": _targets(cost_rows, tables, device.type == "cuda"),
                "notes": notes + [f"error: {e}" for e in errors] + unfinished,
                "seconds": round(time.perf_counter() - started, 1)}

    def save(doc: dict[str, Any]) -> None:
        if args.json:  # after every part: a later one that overruns the caller's limit leaves these
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)

    def part(title: str, header: list[str], make: Any) -> None:
        try:
            rows = make()
            tables.append({"title": title, "header": header, "rows": rows})
            print(f"\n{title}")
            common.print_table(header, rows)
        except Exception as exc:  # noqa: BLE001 - a failed part is reported; the others still run
            errors.append(f"{title}: {type(exc).__name__}: {exc}")
            print(f"{title}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        save(document(False))

    # Examples per epoch: half as many where the budget is short (the device check's).
    halved = 1 if budget >= 100 else 2
    sides = {64: 1024} if args.cpu else {64: 16384 // halved, 224: 4096 // halved}
    batch = 64 if args.cpu else 128
    def cost_part() -> list[list[str]]:
        cost_rows.extend(costs(device, sides, batch))
        return cost_table(cost_rows, device.type == "cpu")[1]

    part("costs per delivered batch and example", cost_table([], device.type == "cpu")[0], cost_part)
    steps = 20 if small else 200
    part("the step, ms per batch", ["fed by", "step", "loop", "step / preloaded", "loop / preloaded"],
         lambda: step_part(device, 64 if not args.cpu else 32, 4096 if not small else 1024, batch, steps))
    left = budget - (time.perf_counter() - started)
    import importlib.util

    if importlib.util.find_spec("PIL") is None:
        notes.append("the demo's part left out: it decodes PNGs with Pillow, which is not installed here")
    elif left > 15:
        part("the demo's time to target (0.9)", ["feeding", "steps to target", "seconds", "echo achieved"],
             lambda: demo_part(device, 0.9, max_seconds=max(5.0, left / 2 - 2)))
    else:
        notes.append("the demo's part left out: the budget was spent")
    if device.type == "cpu":
        notes.append("the CPU device: the device's work is the host's too ('of which device'); no GPU's times")
    doc = document(True)
    common.print_document(doc)
    save(doc)
    return 1 if errors else 0


def _targets(rows: list[dict], tables: list[dict], cuda: bool) -> list[dict]:
    """Bytes to the device: at most the example's over e, and 8 B of index per row; with augmentation, less
    host CPU per batch (on a CPU device, less the device's share)."""
    pairs = list(zip(rows[::2], rows[1::2]))
    share = max((d["bytes"] / (d["example"] / d["echo"] + 8) for _, d in pairs), default=None)
    lower = [d["cpu_ms"] - d["device_ms"] < h["cpu_ms"] - h["device_ms"] for h, d in pairs if d["augmented"]]
    out = [{"target": "device echo copies each example once, plus 8 B of index per delivered row",
            "shown": "no rows" if share is None else f"at most {share:.2f} of (example / e + 8 B)",
            "met": None if share is None else share <= 1.01},
           {"target": "with augmentation, device echo's host CPU per batch below host echo's",
            "shown": f"{sum(lower)} of {len(lower)} rows", "met": (all(lower) if lower else None)}]
    step = next((t for t in tables if t["title"].startswith("the step")), None)
    if step is not None and len(step["rows"]) == 3:
        loop = float(step["rows"][2][4])
        out.append({"target": "device echo: the loop at most 3% slower than the step over a preloaded batch",
                    "shown": f"{loop:.2f}x", "met": loop <= 1.03 if cuda else None})
    return out


if __name__ == "__main__":
    sys.exit(main())
