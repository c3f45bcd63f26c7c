"""The loader's cost to a GPU training step.

A training step on the GPU (ResNet-18 forward and backward on 224x224 images
under bf16 autocast, then SGD) runs over batches preloaded on the GPU, and over
each loader feeding it, in one run. Every loader reads the same per-example
dataset: ``__getitem__`` decodes a 256x256 JPEG from an in-memory pool (Pillow;
zlib where Pillow is missing), and a random 224x224 crop and flip in NumPy
follows (``EchoLoader``: as ``augment``, in its worker processes, anew on every
repeat; ``DataLoader``: in its workers, after the decode). Images stay uint8
until the GPU, where the step normalizes them.

Two times per batch, as in ``bench_step.py``:

- the step's own: the GPU time of its kernels, between CUDA events recorded
  around it (no synchronization in the loop, as in a loop that reads its loss
  now and then). It is what a loader takes from the step itself.
- the loop's: wall time per batch over the timed steps, synchronized at both
  ends: the step and any wait for the batch, what training runs at.

Beside them: how long the GPU stood idle between steps per batch (waiting for
the batch and its copy: ``DataLoader``'s ``.to()`` runs on the training stream),
the training process's CPU per batch (all its threads, not its workers), the
cores busy on the whole machine (every process, from /proc/stat), and the
input's own rate: batches per second the loader delivers with no step, over the
step's rate (below 1: the input cannot keep up, and the loop must wait).

Contestants, each timed right after the same step over preloaded batches (the
slowdown is the median over rounds of these neighbours' ratio; the contestants'
order alternates from round to round):

- ``EchoLoader(worker_type="process", num_workers=8, augment=..., echo_factor=2,
  pin_memory=True, device="cuda", output="torch")``: half the decodes, the crop
  and flip in worker processes, batches copied on a side stream one ahead;
- ``torch.utils.data.DataLoader(num_workers=8, pin_memory=True)``, then
  ``.to("cuda", non_blocking=True)``.

Both keep their workers (``persistent_workers=True``) and drop the last short
batch; an epoch is longer than a timing. ``--budget-s`` bounds the whole run:
the steps per timing are sized from it, and rounds that no longer fit are left
out. Targets: with ``EchoLoader`` the step at most 3% slower than over
preloaded batches, and, where its input alone keeps up with the step, the loop
at most 3% slower too.

``--cpu`` runs the same code on the CPU at small sizes (a small CNN on 32x32
crops, 2 workers, no pinned memory and no device), so that every part runs; its
times are no GPU's, and its targets are not judged.

torch is imported where it is used: worker processes import this module to
unpickle the dataset, and need only NumPy and Pillow.

Usage:
    python bench/bench_gpu_step.py [--budget-s 120] [--batch 256] [--workers 8] [--side 256] [--json PATH]
    python bench/bench_gpu_step.py --cpu [--json PATH]

``--side`` sizes the decoding (a smaller JPEG decodes faster) where the input
cannot keep up with the step; ``--sync`` synchronizes after every step, as a
loop that reads its loss every step does.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import gc
import io
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import common
import numpy as np

import dataecho

STARTED = time.perf_counter()
NAME, TITLE = "gpu_step", "The loader's cost to a GPU step"
COMMAND = "python bench/bench_gpu_step.py"
PRELOADED = "preloaded"
STEP_TARGET = 0.03  # the step, and the loop where the input keeps up: at most 3% slower than preloaded


@dataclass(frozen=True)
class Sizes:
    """What one run measures at: the GPU's sizes, or the CPU's for ``--cpu``."""

    batch: int
    side: int  # the decoded image's side
    crop: int  # the step's input side
    classes: int
    workers: int
    budget_s: float
    rounds: int
    warmup: int  # batches before a timing: the loader's start, cuDNN's choice of kernels
    min_steps: int
    max_steps: int
    alone: int  # batches timed with no step, after as many again are taken (what was prefetched)
    pool: int  # distinct JPEGs in memory
    timeout_s: float  # a loader's wait for one batch before the contestant fails
    start_s: float  # a loader's start, warm-up and close, guessed until one is measured


GPU = Sizes(batch=256, side=256, crop=224, classes=1000, workers=8, budget_s=120.0, rounds=3, warmup=15,
            min_steps=30, max_steps=300, alone=40, pool=64, timeout_s=45.0, start_s=6.0)
CPU = Sizes(batch=32, side=40, crop=32, classes=10, workers=2, budget_s=20.0, rounds=2, warmup=4,
            min_steps=8, max_steps=60, alone=8, pool=16, timeout_s=15.0, start_s=2.5)


# The dataset: decoding in __getitem__, the crop and flip after it.

def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


def _picture(rng: np.random.Generator, side: int) -> np.ndarray:
    """A smooth picture with noise, uint8 (side, side, 3): it compresses and
    decodes as a photo does, where pure noise would not."""
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    waves = [np.sin(2 * np.pi * (f * x + g * y) + p) for f, g, p in rng.uniform(0.5, 4.0, (3, 3))]
    picture = 127.5 + 90.0 * np.stack(waves, axis=-1) + rng.normal(0.0, 12.0, (side, side, 3))
    return np.clip(picture, 0, 255).astype(np.uint8)


def _encode(picture: np.ndarray, codec: str, quality: int) -> bytes:
    if codec == "zlib":
        return zlib.compress(picture.tobytes(), 1)
    out = io.BytesIO()
    _pillow().fromarray(picture).save(out, format="JPEG", quality=quality)
    return out.getvalue()


class Images:
    """Map-style: example i is ``{"image": uint8 (side, side, 3), "label": int}``,
    decoded by ``__getitem__`` from the (i % pool)-th image held encoded in memory.

    Args:
        n: number of examples.
        side: the decoded image's side.
        classes: labels are ``i % classes``.
        pool: distinct images held.
        quality: JPEG quality.
    """

    def __init__(self, n: int, side: int, classes: int, pool: int = 64, quality: int = 90) -> None:
        rng = np.random.default_rng(0)
        self.n, self.side, self.classes = n, side, classes
        self.codec = "jpeg" if _pillow() is not None else "zlib"
        self.pool = [_encode(_picture(rng, side), self.codec, quality) for _ in range(pool)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        data = self.pool[i % len(self.pool)]
        if self.codec == "zlib":
            image = np.frombuffer(zlib.decompress(data), np.uint8).reshape(self.side, self.side, 3)
        else:
            image = np.asarray(_pillow().open(io.BytesIO(data)).convert("RGB"))
        return {"image": image, "label": i % self.classes}


class RandomCropFlip:
    """``augment(example, rng)``: a random ``crop`` x ``crop`` window of the image,
    flipped left to right half of the time, as a new contiguous array."""

    def __init__(self, crop: int) -> None:
        self.crop = crop

    def __call__(self, example: dict, rng: np.random.Generator) -> dict:
        image, crop = example["image"], self.crop
        top, left = rng.integers(0, image.shape[0] - crop + 1), rng.integers(0, image.shape[1] - crop + 1)
        window = image[top:top + crop, left:left + crop]
        if rng.random() < 0.5:
            window = window[:, ::-1]
        return {"image": np.ascontiguousarray(window), "label": example["label"]}


class Augmented:
    """DataLoader's dataset: ``images[i]`` then ``augment``, in its workers."""

    def __init__(self, images: Images, augment: RandomCropFlip) -> None:
        self.images, self.augment = images, augment
        self._rng, self._pid = None, None

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        if self._pid != os.getpid():  # one generator per worker, not one that fork copies into each
            self._rng, self._pid = np.random.default_rng([0, os.getpid()]), os.getpid()
        return self.augment(self.images[i], self._rng)


# The step.

def build_model(kind: str, cuda: bool, classes: int) -> tuple[Any, str]:
    """(model, what it is): ResNet-18 from torchvision, else from timm, else a
    small CNN; the small CNN alone for ``kind="small"``, or on the CPU with ``"auto"``."""
    if kind == "resnet18" or (kind == "auto" and cuda):
        failures = []
        try:
            import torchvision
            model = torchvision.models.resnet18(num_classes=classes)
            return model, f"ResNet-18 (torchvision {torchvision.__version__})"
        except Exception as exc:  # a torchvision that does not load raises more than ImportError
            failures.append(f"torchvision: {type(exc).__name__}: {exc}")
        try:
            import timm
            model = timm.create_model("resnet18", pretrained=False, num_classes=classes)
            return model, f"ResNet-18 (timm {timm.__version__})"
        except Exception as exc:
            failures.append(f"timm: {type(exc).__name__}: {exc}")
        why = "; ".join(failures)
        return small_cnn(64, classes), f"a small CNN (4 convolutions, 64-512 channels): no ResNet-18 ({why})"
    return small_cnn(8, classes), "a small CNN (4 convolutions, 8-64 channels)"


def small_cnn(width: int, classes: int) -> Any:
    """Four 3x3 convolutions of stride 2 with batch norm, then a linear classifier."""
    from torch import nn

    layers, channels = [], 3
    for stage in range(4):
        out = width << stage
        layers += [nn.Conv2d(channels, out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out),
                   nn.ReLU(inplace=True)]
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


class Step:
    """One training step on uint8 NHWC images: normalized on the device
    (channels-last from there on), forward and backward (bf16 autocast where the
    device has it), SGD. Queues the work and returns; nothing waits for the device."""

    def __init__(self, model: Any, device: Any, bf16: bool) -> None:
        import torch

        self.device, self.bf16 = device, bf16
        self.model = model.to(device, memory_format=torch.channels_last).train()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device=device).mul(255).view(1, 3, 1, 1)
        self.std = torch.tensor([0.229, 0.224, 0.225], device=device).mul(255).view(1, 3, 1, 1)
        self.loss = None

    def __call__(self, images: Any, labels: Any) -> None:
        import torch
        import torch.nn.functional as F

        # NHWC memory is channels-last already; whatever a loader's strides, every contestant's kernels are the same.
        x = images.permute(0, 3, 1, 2).float().contiguous(memory_format=torch.channels_last)
        x = x.sub_(self.mean).div_(self.std)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = F.cross_entropy(self.model(x), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.loss = loss.detach()


class CudaClock:
    """Marks are CUDA events on the current stream: the times between them are the GPU's."""

    def mark(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()


class HostClock:
    """Marks are ``perf_counter()`` readings: on the CPU the step runs as it is called."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def synchronize(self) -> None:
        pass


# Timing.

@dataclass
class Plan:
    """How each timing runs."""

    steps: int
    min_steps: int
    warmup: int
    alone: int
    cap_s: float  # a timing stops after this long, once it has min_steps
    sync: bool  # synchronize after every step (as a loop that reads its loss every step)


@dataclass
class Run:
    """One timing: per batch, the step's own time (median), the loop's (wall time,
    all batches), the clock's time between a step's end and the next one's start
    (mean), the training process's CPU and the host's time taking a batch (mean);
    for a loader, its time to the first batch and its rate with no step."""

    step_s: float
    loop_s: float
    waited_s: float
    cpu_s: float
    take_s: float
    steps: int
    cores: float | None = None  # the machine's busy CPU time over the wall time: cores in use, all processes
    first_s: float | None = None
    input_rate: float | None = None
    stats: str = ""  # EchoLoader's own account, from stats()


def timed(batches: Iterator[Any], to_device: Callable, step: Step, clock: Any, plan: Plan) -> Run:
    """Times ``plan.steps`` steps over ``batches`` after ``plan.warmup`` untimed ones."""
    for _ in range(plan.warmup):
        step(*to_device(next(batches)))
    clock.synchronize()
    marks, takes = [], []
    wall, cpu, busy = time.perf_counter(), time.process_time(), machine_busy_s()
    stop = wall + plan.cap_s
    while len(marks) < plan.steps and (len(marks) < plan.min_steps or time.perf_counter() < stop):
        taking = time.perf_counter()
        images, labels = to_device(next(batches))
        takes.append(time.perf_counter() - taking)
        start = clock.mark()
        step(images, labels)
        marks.append((start, clock.mark()))
        if plan.sync:
            clock.synchronize()
    clock.synchronize()
    wall, cpu, busy_after = time.perf_counter() - wall, time.process_time() - cpu, machine_busy_s()
    steps = [clock.seconds(start, end) for start, end in marks]
    gaps = [clock.seconds(end, start) for (_, end), (start, _) in zip(marks, marks[1:])]
    n = len(marks)
    cores = (busy_after - busy) / wall if busy is not None and busy_after is not None else None
    return Run(statistics.median(steps), wall / n, sum(gaps) / max(1, len(gaps)), cpu / n, sum(takes) / n, n, cores)


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy (every process, every core),
    from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(t) for t in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def input_rate(batches: Iterator[Any], to_device: Callable, clock: Any, count: int) -> float:
    """Batches per second that ``batches`` deliver (copies to the device included)
    with no step, after ``count`` taken first: what was prefetched during the steps."""
    for _ in range(count):
        to_device(next(batches))
    clock.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        to_device(next(batches))
    clock.synchronize()
    return count / (time.perf_counter() - start)


def endless(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


@dataclass
class Contestant:
    name: str
    setup: str  # its configuration, for the setup table
    make: Callable[[], Any]  # a new loader
    to_device: Callable[[Any], tuple]  # a batch as (images, labels) where the step runs


def run_loader(contestant: Contestant, step: Step, clock: Any, plan: Plan) -> Run:
    """A timing over a new loader, its time to the first batch and its rate with
    no step; the loader is closed after, its processes gone before the next timing."""
    started = time.perf_counter()
    loader = contestant.make()
    batches = endless(loader)
    try:
        step(*contestant.to_device(next(batches)))
        first_s = time.perf_counter() - started
        run = timed(batches, contestant.to_device, step, clock, plan)
        run.first_s = first_s
        run.input_rate = input_rate(batches, contestant.to_device, clock, plan.alone)
        if isinstance(loader, dataecho.EchoLoader):
            run.stats = stats_line(loader)
        return run
    finally:
        common.stop_contestant(batches, loader)
        del loader, batches
        gc.collect()  # DataLoader's persistent workers end as its iterator is collected


def stats_line(loader: dataecho.EchoLoader) -> str:
    """The loader's own account of its life so far (its start included)."""
    try:
        stats = loader.stats()
        return (f"echo factor achieved {stats['echo_factor_achieved']:.2f}, the loop waited "
                f"{stats['consumer_wait_fraction']:.1%} of its time, {stats['upstream_examples_per_s']:,.0f} fresh "
                f"examples/s (over its life, its start included)")
    except Exception as exc:  # an account, not a measurement: its absence fails nothing
        return f"stats() unavailable ({type(exc).__name__}: {exc})"


def contestants(images: Images, sizes: Sizes, args: argparse.Namespace, cuda: bool) -> list[Contestant]:
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    augment = RandomCropFlip(sizes.crop)
    echo_args = dict(batch_size=sizes.batch, shuffle=True, num_workers=sizes.workers, pin_memory=cuda,
                     drop_last=True, timeout=sizes.timeout_s, persistent_workers=True, echo_factor=args.echo,
                     augment=augment, worker_type="process", output="torch", device="cuda" if cuda else None, seed=0)
    torch_args = dict(batch_size=sizes.batch, shuffle=True, num_workers=sizes.workers, pin_memory=cuda,
                      drop_last=True, timeout=sizes.timeout_s, persistent_workers=True)

    def on_device(batch: dict) -> tuple:
        images, labels = batch["image"], batch["label"]
        if images.device != device:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        return images, (labels if labels.dtype == torch.int64 else labels.long())

    def shown(kwargs: dict) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k not in ("augment", "batch_size", "seed"))

    copy = ', then .to("cuda", non_blocking=True)' if cuda else ""
    return [
        Contestant(f"EchoLoader, {sizes.workers} worker processes, echo {args.echo:g}",
                   f"EchoLoader({shown(echo_args)}, augment=crop and flip)",
                   lambda: dataecho.EchoLoader(images, **echo_args), on_device),
        Contestant(f"DataLoader(num_workers={sizes.workers})", f"DataLoader({shown(torch_args)}), decode then crop "
                                                                 f"and flip in its workers{copy}",
                   lambda: torch.utils.data.DataLoader(Augmented(images, augment), **torch_args), on_device),
    ]


# One run: preparing, timing in rounds, the report.

@dataclass
class Results:
    """What the run has measured so far: the report is made from it at any point."""

    sizes: Sizes
    cuda: bool
    device: str
    machine: dict[str, Any]
    setup: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the contestants, EchoLoader first
    runs: dict[str, list[tuple[int, Run, Run]]] = field(default_factory=dict)  # name -> (round, preloaded, run)
    errors: dict[str, str] = field(default_factory=dict)
    pair_s: dict[str, float] = field(default_factory=dict)  # name -> seconds its last round took
    calibration: Run | None = None  # the preloaded step, before the rounds
    failed: bool = False

    def fail(self, part: str, exc: BaseException) -> None:
        traceback.print_exc()
        self.failed = True
        self.errors[part] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        self.notes.append(f"{part} failed: {self.errors[part]}")


def preload(images: Images, augment: RandomCropFlip, batch: int, count: int, device: Any):
    """``count`` batches made as the loaders make them, on ``device``, and the mean
    time per example of the decode and of the crop and flip (in this process)."""
    import torch

    rng, out, decode_s, augment_s = np.random.default_rng(1), [], 0.0, 0.0
    augment(images[0], rng)  # the decoder's first call loads it: not a decode's cost
    for b in range(count):
        examples = []
        for i in range(b * batch, (b + 1) * batch):
            start = time.perf_counter()
            example = images[i]
            decoded = time.perf_counter()
            examples.append(augment(example, rng))
            decode_s, augment_s = decode_s + decoded - start, augment_s + time.perf_counter() - decoded
        pictures = torch.from_numpy(np.stack([e["image"] for e in examples])).to(device)
        out.append((pictures, torch.tensor([e["label"] for e in examples], dtype=torch.int64, device=device)))
    return out, decode_s / (count * batch), augment_s / (count * batch)


def plan_run(sizes: Sizes, args: argparse.Namespace, loop_s: float, left_s: float, n: int) -> tuple[Plan, int]:
    """Steps per timing and rounds that fit ``left_s``: each round times the
    preloaded step before each of ``n`` loaders, which also start, warm up, run
    alone and close."""
    overhead_s = sizes.start_s + (2 * sizes.warmup + 2 * sizes.alone) * loop_s
    rounds, steps = sizes.rounds, sizes.min_steps
    while rounds >= 1:
        steps = int((left_s / rounds / n - overhead_s) / (2 * loop_s))
        if steps >= sizes.min_steps or rounds == 1:
            break
        rounds -= 1
    steps = args.steps or max(sizes.min_steps, min(sizes.max_steps, steps))
    return Plan(steps=steps, min_steps=min(steps, sizes.min_steps), warmup=sizes.warmup, alone=sizes.alone,
                cap_s=3.0 * steps * loop_s + 1.0, sync=args.sync), max(1, rounds)


def measure(res: Results, entrants: list[Contestant], preloaded: Callable[[], Run], step: Step, clock: Any,
            plan: Plan, rounds: int, deadline: float, save: Callable[[], None]) -> None:
    """Rounds of (preloaded, loader) pairs, the loaders' order alternating; a pair
    that would end past ``deadline`` is not started."""
    guess_s = res.sizes.start_s + (2 * plan.steps + 2 * plan.warmup + 2 * plan.alone) * res.calibration.loop_s
    for r in range(rounds):
        for c in entrants if r % 2 == 0 else entrants[::-1]:
            if c.name in res.errors:
                continue
            if time.perf_counter() + res.pair_s.get(c.name, guess_s) > deadline:
                res.notes.append(f"The budget (--budget-s {res.sizes.budget_s:g}) ended the run before round {r + 1} "
                                 f"of {rounds} of {c.name}.")
                return
            began = time.perf_counter()
            base = preloaded()
            progress(r, rounds, PRELOADED, base)
            try:
                run = run_loader(c, step, clock, plan)
            except Exception as exc:  # the contestant is reported, and the run goes on
                print(f"{_elapsed()}round {r + 1}/{rounds}, {c.name}: FAILED", flush=True)
                res.fail(c.name, exc)
                save()
                continue
            res.runs[c.name].append((r + 1, base, run))
            res.pair_s[c.name] = time.perf_counter() - began
            progress(r, rounds, c.name, run, base)
            save()


def progress(r: int, rounds: int, name: str, run: Run, base: Run | None = None) -> None:
    line = f"{_elapsed()}round {r + 1}/{rounds}, {name}: step {_ms(run.step_s)}"
    if base is not None:
        line += f" ({run.step_s / base.step_s:.3f}x)"
    line += f", loop {_ms(run.loop_s)}"
    if base is not None:
        line += (f" ({run.loop_s / base.loop_s:.3f}x), waited {_ms(run.waited_s)} a batch, first batch after "
                 f"{run.first_s:.1f} s, input alone {run.input_rate:.1f} batches/s")
    print(line + f" ({run.steps} steps)", flush=True)


def _elapsed() -> str:
    return f"[{time.perf_counter() - STARTED:5.1f} s] "


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _median(values: Any) -> float:
    return statistics.median(list(values))


def summary_table(res: Results) -> dict[str, Any]:
    """Per contestant: medians over its rounds, and its ratios over the preloaded step timed just before."""
    header = ["contestant", "step", "step / preloaded", "loop", "loop / preloaded", "waited a batch", "CPU a batch",
              "cores busy", "input alone"]
    bases = [base for name in res.names for _, base, _ in res.runs.get(name, [])]
    rows = [[PRELOADED, _ms(_median(b.step_s for b in bases)), "1.000x", _ms(_median(b.loop_s for b in bases)),
             "1.000x", *_usage(bases), "-"]] if bases else []
    for name in res.names:
        runs = res.runs.get(name, [])
        if not runs:
            rows.append([name, f"failed: {res.errors[name]}" if name in res.errors else "not run"] + ["-"] * 7)
            continue
        timed_runs = [run for _, _, run in runs]
        rate = _median(run.input_rate for run in timed_runs)
        keeps_up = _median(run.input_rate * base.loop_s for _, base, run in runs)
        rows.append([name, _ms(_median(r.step_s for r in timed_runs)),
                     f"{_median(run.step_s / base.step_s for _, base, run in runs):.3f}x",
                     _ms(_median(r.loop_s for r in timed_runs)),
                     f"{_median(run.loop_s / base.loop_s for _, base, run in runs):.3f}x", *_usage(timed_runs),
                     f"{rate:.1f} batches/s ({keeps_up:.2f}x the step)"])
    return {"title": "Per batch: the step's own time and the loop's (medians over rounds)", "header": header,
            "rows": rows}


def _usage(runs: list[Run]) -> list[str]:
    """The waited, CPU and cores-busy cells of ``runs``: medians."""
    waited, loop = _median(r.waited_s for r in runs), _median(r.loop_s for r in runs)
    cores = [r.cores for r in runs if r.cores is not None]
    return [f"{_ms(waited)} ({waited / loop:.1%})", _ms(_median(r.cpu_s for r in runs)),
            f"{_median(cores):.1f} of {os.cpu_count()}" if cores else "-"]


def rounds_table(res: Results) -> dict[str, Any]:
    header = ["round", "contestant", "first batch", "steps", "preloaded step", "step", "ratio", "preloaded loop",
              "loop", "ratio", "waited a batch", "taking a batch"]
    rows = []
    for name in res.names:
        for r, base, run in res.runs.get(name, []):
            rows.append([str(r), name, f"{run.first_s:.2f} s", str(run.steps), _ms(base.step_s), _ms(run.step_s),
                         f"{run.step_s / base.step_s:.3f}x", _ms(base.loop_s), _ms(run.loop_s),
                         f"{run.loop_s / base.loop_s:.3f}x", _ms(run.waited_s), _ms(run.take_s)])
    rows.sort(key=lambda row: int(row[0]))
    return {"title": "Each round: a contestant and the preloaded step timed just before it", "header": header,
            "rows": rows}


def targets(res: Results) -> list[dict[str, Any]]:
    """The step, and the loop where the input keeps up: EchoLoader at most 3% slower
    than preloaded. Judged on a GPU only."""
    name = res.names[0] if res.names else "EchoLoader"
    runs = res.runs.get(name, [])
    step_target = f"{name}: the step at most {STEP_TARGET:.0%} slower than over preloaded batches"
    loop_target = (f"{name}: the loop not waiting where the input keeps up (at most {STEP_TARGET:.0%} slower than "
                   f"over preloaded batches)")
    if not runs:
        why = f"not measured ({res.errors.get(name, 'no round ran')})"
        return [{"target": step_target, "shown": why, "met": None}, {"target": loop_target, "shown": why, "met": None}]
    step_slow = _median(run.step_s / base.step_s for _, base, run in runs) - 1
    loop_slow = _median(run.loop_s / base.loop_s for _, base, run in runs) - 1
    keeps_up = _median(run.input_rate * base.loop_s for _, base, run in runs)
    timed_runs = [run for _, _, run in runs]
    waited, loop = _median(r.waited_s for r in timed_runs), _median(r.loop_s for r in timed_runs)
    where = f"median of {_count(len(runs), 'round')}"
    step_shown = f"{step_slow:+.1%} ({where})"
    loop_shown = (f"loop {loop_slow:+.1%} ({where}); waited {_ms(waited)} a batch ({waited / loop:.1%} of the loop); "
                  f"input alone {keeps_up:.2f}x the step's rate")
    if not res.cuda:
        step_shown, loop_shown = step_shown + "; CPU: not judged", loop_shown + "; CPU: not judged"
    elif keeps_up < 1.0:
        loop_shown += ": the input alone does not keep up, not judged"
    return [{"target": step_target, "shown": step_shown, "met": step_slow <= STEP_TARGET if res.cuda else None},
            {"target": loop_target, "shown": loop_shown,
             "met": loop_slow <= STEP_TARGET if res.cuda and keeps_up >= 1.0 else None}]


def reading(res: Results) -> str:
    clock = "GPU time between CUDA events" if res.cuda else "wall time"
    idle = ("the GPU's time between steps (idle, or copying the batch on the training stream, as DataLoader's "
            ".to() does)" if res.cuda else "the loop's time between steps")
    return (f"per batch, lower is better: the step's own time ({clock}, median) and the loop's (wall time per "
            f"batch); x: over the preloaded step timed just before, the median over rounds; waited: {idle}; CPU: "
            f"the training process's, all its threads; cores busy: the whole machine's, every process; input alone: "
            f"batches/s with no step, over the step's rate (below 1x the input cannot keep up)")


def report(res: Results) -> dict[str, Any]:
    """The run as the benchmarks' JSON structure (every cell a string)."""
    tables = [summary_table(res), rounds_table(res)]
    if res.setup:
        tables.append({"title": "Setup", "header": ["part", "what"], "rows": res.setup})
    return {"name": NAME, "title": TITLE, "command": COMMAND, "machine": res.machine, "device": res.device,
            "reading": reading(res), "tables": tables, "targets": targets(res), "notes": list(res.notes),
            "seconds": round(time.perf_counter() - STARTED, 1)}


def write_json(path: str | None, rep: dict[str, Any]) -> bool:
    if not path:
        return True
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(rep, f, indent=2)
        os.replace(path + ".tmp", path)  # a run stopped mid-write leaves the previous JSON whole
        return True
    except OSError as exc:
        print(f"could not write {path}: {exc}", file=sys.stderr, flush=True)
        return False


def prepare(res: Results, sizes: Sizes, args: argparse.Namespace, cuda: bool):
    """The step, its clock, the preloaded timing (a function of a plan), the
    contestants, and the setup rows and notes that say what they are."""
    import torch

    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cudnn.benchmark = True  # the batches' shape never changes
    else:
        torch.set_num_threads(1)  # the other core for the workers, as in bench_step.py
    images = Images(sizes.batch * 1024, sizes.side, sizes.classes, sizes.pool)
    model, model_name = build_model(args.model, cuda, sizes.classes)
    bf16 = cuda and torch.cuda.is_bf16_supported()
    step = Step(model, device, bf16)
    batches, decode_s, augment_s = preload(images, RandomCropFlip(sizes.crop), sizes.batch, 4, device)
    clock = CudaClock() if cuda else HostClock()
    cycle = itertools.cycle(batches)
    entrants = contestants(images, sizes, args, cuda)
    res.names, res.runs = [c.name for c in entrants], {c.name: [] for c in entrants}
    kib = sum(map(len, images.pool)) / len(images.pool) / 1024
    res.setup += [
        ["step", f"{model_name}; batch {sizes.batch} of {sizes.crop}x{sizes.crop}x3 uint8, normalized on the "
                 f"{device.type}, channels-last; {'bf16 autocast' if bf16 else 'float32'}; cross-entropy over "
                 f"{sizes.classes} classes; SGD with momentum"],
        ["input", f"{images.codec} {sizes.side}x{sizes.side} ({len(images.pool)} images of {kib:.1f} KiB) decoded "
                  f"per example: {decode_s * 1e6:.0f} us; a random {sizes.crop}x{sizes.crop} crop and flip: "
                  f"{augment_s * 1e6:.0f} us (in this process)"],
    ] + [[c.name, c.setup] for c in entrants]
    res.notes += shm_note()
    print(f"{_elapsed()}setup: {model_name}; batch {sizes.batch}; {images.codec} {sizes.side} -> {sizes.crop}; decode "
          f"{decode_s * 1e6:.0f} us, crop and flip {augment_s * 1e6:.0f} us per example", flush=True)
    preloaded = functools.partial(timed, cycle, lambda batch: batch, step, clock)
    return step, clock, preloaded, entrants, (decode_s, augment_s)


def shm_note() -> list[str]:
    """Worker processes hand batches over in /dev/shm: a small one fails them."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return []
    free, size = stat.f_bavail * stat.f_frsize / 2**30, stat.f_blocks * stat.f_frsize / 2**30
    return [f"/dev/shm: {free:.1f} GiB free of {size:.1f} GiB."]


def capacity_note(sizes: Sizes, args: argparse.Namespace, costs: tuple[float, float], loop_s: float) -> str:
    """What the input needs of the cores at the preloaded step's rate, from the costs in this process."""
    rate, (decode_s, augment_s) = sizes.batch / loop_s, costs
    echo_need = rate * (decode_s / args.echo + augment_s)
    return (f"At the preloaded step's rate ({rate:,.0f} examples/s) decoding, cropping and flipping every delivered "
            f"example takes {rate * (decode_s + augment_s):.1f} cores (DataLoader's {sizes.workers} workers); at echo "
            f"{args.echo:g}, decoding each example once for {args.echo:g} deliveries, {echo_need:.1f} cores "
            f"(EchoLoader's {sizes.workers} reading and {sizes.workers} augmenting processes): from the costs in this "
            f"process, before handing batches over.")


def run_all(res: Results, sizes: Sizes, args: argparse.Namespace, cuda: bool, save: Callable[[], None]) -> None:
    step, clock, preloaded, entrants, costs = prepare(res, sizes, args, cuda)
    deadline = STARTED + sizes.budget_s - (3.0 if cuda else 1.5)  # the report and the exit after
    calibration = Plan(steps=sizes.min_steps, min_steps=sizes.min_steps, warmup=2 * sizes.warmup, alone=0,
                       cap_s=float("inf"), sync=args.sync)
    res.calibration = preloaded(calibration)
    plan, rounds = plan_run(sizes, args, res.calibration.loop_s, deadline - time.perf_counter(), len(entrants))
    res.notes.append(capacity_note(sizes, args, costs, res.calibration.loop_s))
    timing = (f"{plan.steps} steps per timing after {plan.warmup} untimed; {_count(rounds, 'round')}; input alone: "
              f"{plan.alone} batches after {plan.alone} untaken")
    res.setup.append(["timing", timing + ("; synchronized after every step" if plan.sync else "")])
    print(f"{_elapsed()}calibration: preloaded step {_ms(res.calibration.step_s)}, loop {_ms(res.calibration.loop_s)}; "
          f"{plan.steps} steps per timing, {_count(rounds, 'round')}", flush=True)
    save()
    measure(res, entrants, lambda: preloaded(plan), step, clock, plan, rounds, deadline, save)
    res.notes.append(f"The step's last loss: {float(step.loss):.3f} (a guess at random: ln {sizes.classes} = "
                     f"{math.log(sizes.classes):.3f}).")


def device_notes(args: argparse.Namespace, cuda: bool) -> list[str]:
    if cuda:
        return ["CPU a batch: the training loop's thread may spin while it waits for the GPU (CUDA's default), so "
                "each row counts up to the loop's wall time for it; what a loader adds beyond the preloaded row is "
                "its own threads' in the training process."]
    notes = ["On the CPU the times are no GPU's: the run checks that every part works; no target is judged."]
    if not args.cpu:
        notes.insert(0, "CUDA is not available: the run is the CPU's, at --cpu sizes.")
    return notes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU at small sizes, every part run, no target judged")
    parser.add_argument("--budget-s", type=float,
                        help=f"seconds for the whole run (default {GPU.budget_s:g}; --cpu: {CPU.budget_s:g})")
    parser.add_argument("--batch", type=int, help=f"examples per batch (default {GPU.batch}; --cpu: {CPU.batch})")
    parser.add_argument("--workers", type=int,
                        help=f"each loader's num_workers (default {GPU.workers}; --cpu: {CPU.workers})")
    parser.add_argument("--side", type=int, help=f"the decoded images' side (default {GPU.side}; --cpu: {CPU.side})")
    parser.add_argument("--crop", type=int, help=f"the crop's side, the step's input (default {GPU.crop}; --cpu: "
                                                 f"{CPU.crop})")
    parser.add_argument("--rounds", type=int, help=f"rounds at most (default {GPU.rounds}; --cpu: {CPU.rounds})")
    parser.add_argument("--steps", type=int, help="timed steps per timing (default: sized from the budget)")
    parser.add_argument("--echo", type=float, default=2.0, help="EchoLoader's echo_factor (2)")
    parser.add_argument("--model", choices=("auto", "resnet18", "small"), default="auto",
                        help="auto: ResNet-18 on a GPU, the small CNN on the CPU")
    parser.add_argument("--sync", action="store_true", help="synchronize after every step, as a loop that reads "
                                                            "its loss every step")
    parser.add_argument("--json", help="also write the results here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    import torch

    cuda = not args.cpu and torch.cuda.is_available()
    given = {"batch": args.batch, "workers": args.workers, "budget_s": args.budget_s, "rounds": args.rounds,
             "side": args.side, "crop": args.crop}
    sizes = dataclasses.replace(GPU if cuda else CPU, **{k: v for k, v in given.items() if v is not None})
    if sizes.crop > sizes.side:
        sys.exit(f"--crop {sizes.crop}: at most the images' side ({sizes.side})")
    # The last resort against a hang: every thread's stack, then exit 1; the JSON saved after each round stays.
    faulthandler.dump_traceback_later(sizes.budget_s + 30, exit=True)
    device = torch.cuda.get_device_name(0) if cuda else "cpu (--cpu)" if torch.cuda.is_available() else "cpu (no CUDA)"
    res = Results(sizes, cuda, device, common.machine(torch=torch.__version__, cuda=torch.version.cuda))
    res.notes += device_notes(args, cuda)
    try:
        run_all(res, sizes, args, cuda, lambda: write_json(args.json, report(res)))
    except Exception as exc:  # reported; the tables keep what was measured
        res.fail("the run", exc)
    missing = [name for name in res.names if not res.runs.get(name) and name not in res.errors]
    if missing:
        res.failed = True
        res.notes.append(f"Not measured within the budget: {', '.join(missing)}.")
    last = [runs[-1][2].stats for runs in res.runs.values() if runs and runs[-1][2].stats]
    res.notes += [f"{res.names[0]}, stats() after its last timing: {last[0]}."] if last else []
    rep = report(res)
    common.print_document(rep)
    written = write_json(args.json, rep)
    faulthandler.cancel_dump_traceback_later()
    return 0 if written and not res.failed else 1


if __name__ == "__main__":
    sys.exit(main())
