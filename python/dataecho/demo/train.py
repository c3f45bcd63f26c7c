"""Training runs: one small CNN per configuration, trained until it reaches the
target validation accuracy (or the time cap), recording accuracy against wall
time and against fresh examples read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

import dataecho

from .digits import Augment, DeviceAugment, PngDigits

SMOOTHING = 3  # evaluations averaged for the target test


@dataclass(frozen=True)
class Config:
    """One way to feed the model.

    Attributes:
        name: as printed.
        echo: the echo factor, or "auto".
        placement: "before" (echo, then augment each repeat), "after" (augment,
            then echo the augmented example), "batch" (echo whole batches,
            augment each delivery) or "device" (echo on the model's device,
            each batch augmented there: DeviceAugment).
    """

    name: str
    echo: float | str
    placement: str


CONFIGS = (
    Config("no echoing (baseline)", 1.0, "before"),
    Config("example echo before augment, e=2", 2.0, "before"),
    Config("example echo before augment, e=4", 4.0, "before"),
    Config("example echo after augment, e=2", 2.0, "after"),
    Config("batch echo, e=2", 2.0, "batch"),
    Config('echo_factor="auto" (max 4)', "auto", "before"),
)
# Echo on the model's device, augmented there (bench/bench_device_echo.py sets it against "before").
ON_DEVICE = Config("example echo on the device, e=2", 2.0, "device")


@dataclass
class Run:
    """What one configuration did. `history` rows: (seconds, fresh, steps, accuracy);
    `stats`: the loader's ``stats()`` once it closed (echo factor achieved, waits)."""

    config: Config
    history: list[tuple[float, int, int, float]] = field(default_factory=list)
    reached: tuple[float, int, int, float] | None = None  # the first row at or over the target
    stats: dict[str, Any] = field(default_factory=dict)


def make_net(torch: Any) -> Any:
    """A small CNN: about 2 ms per training step of 64 digits on one CPU core."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 7 * 7, 10),
    )


def make_loader(config: Config, dataset: PngDigits, augment: Augment, *, batch_size: int, workers: int,
                seed: int, device: Any, worker_type: str = "thread") -> dataecho.EchoLoader:
    """The loader of `config`. `worker_type` "process" reads, decodes and
    augments in worker processes (kept from one epoch to the next), leaving the
    training process's GIL to the step; "thread" (the default) in threads."""
    after = config.placement == "after"
    cuda = device is not None and str(device).startswith("cuda")
    if config.placement == "device":
        return dataecho.EchoLoader(dataset, batch_size=batch_size, echo_factor=config.echo, echo_at="device",
                                   device=device or "cpu", device_augment=DeviceAugment(), shuffle_buffer=1024,
                                   num_workers=workers, seed=seed, max_echo=4.0, output="torch", pin_memory=cuda,
                                   **({"worker_type": "process", "persistent_workers": True}
                                      if worker_type == "process" else {}))
    processes = {"worker_type": "process", "persistent_workers": True} if worker_type == "process" else {}
    return dataecho.EchoLoader(
        dataset,
        batch_size=batch_size,
        echo_factor=config.echo,
        echo_at="batch" if config.placement == "batch" else "example",
        transform=augment if after else None,
        augment=None if after else augment,
        shuffle_buffer=1024 if config.placement != "batch" else 16,
        num_workers=workers,
        seed=seed,
        max_echo=4.0,
        output="torch",
        pin_memory=cuda,
        device=device if cuda else None,
        **processes,
    )


def make_trainer(torch: Any, validation: tuple[np.ndarray, np.ndarray], *, seed: int,
                 device: str) -> tuple[Callable[[dict], None], Callable[[], float]]:
    """A fresh model, from the initial weights `seed` gives, on `device`.

    Returns:
        ``step(batch)``, one Adam step on a batch of the loader's, and
        ``evaluate()``, the model's accuracy on `validation`.
    """
    torch.manual_seed(seed)
    model = make_net(torch).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    val_x = torch.from_numpy(validation[0]).to(device)
    val_y = torch.from_numpy(validation[1]).to(device)

    def step(batch: dict) -> None:
        images, labels = batch["image"].to(device), batch["label"].to(device)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def evaluate() -> float:
        with torch.no_grad():
            return float((model(val_x).argmax(1) == val_y).float().mean())

    return step, evaluate


def train(config: Config, dataset: PngDigits, validation: tuple[np.ndarray, np.ndarray], *, target: float,
          max_seconds: float, batch_size: int, workers: int, eval_every: int, seed: int, device: str,
          progress: Callable[[Run, float], None], worker_type: str = "thread") -> Run:
    """Trains a fresh model from the same initial weights until `target`."""
    import torch

    step, evaluate = make_trainer(torch, validation, seed=seed, device=device)
    loader = make_loader(config, dataset, Augment(seed), batch_size=batch_size, workers=workers, seed=seed,
                         device=device if device != "cpu" else None, worker_type=worker_type)
    return fit(Run(config), loader, step, evaluate, lambda: int(loader.stats()["fresh"]), target=target,
               higher_is_better=True, max_seconds=max_seconds, eval_every=eval_every, progress=progress)


def fit(run: Run, loader: dataecho.EchoLoader, step: Callable[[Any], None], evaluate: Callable[[], float],
        fresh: Callable[[], int], *, target: float, higher_is_better: bool, max_seconds: float, eval_every: int,
        progress: Callable[[Run, float], None]) -> Run:
    """Runs `step` on the loader's batches, epoch after epoch, evaluating every
    `eval_every` steps, until the target is reached or `max_seconds` pass;
    closes the loader.

    Returns:
        `run`, its history rows (seconds, fresh(), steps, evaluate()) and the
        loader's stats.
    """
    start, steps = time.perf_counter(), 0
    try:
        while run.reached is None and not (run.history and run.history[-1][0] > max_seconds):
            for batch in loader:
                step(batch)
                steps += 1
                if steps % eval_every:
                    continue
                value = evaluate()
                row = (time.perf_counter() - start, fresh(), steps, value)
                run.history.append(row)
                progress(run, max_seconds)
                # Reached when the mean of the last three evaluations is: a single
                # noisy evaluation crossing the line says little.
                recent = [r[3] for r in run.history[-SMOOTHING:]]
                mean = sum(recent) / SMOOTHING
                if len(recent) == SMOOTHING and (mean >= target if higher_is_better else mean <= target):
                    run.reached = row
                if run.reached is not None or row[0] > max_seconds:
                    break
    finally:
        loader.close()
    run.stats = loader.stats()
    return run
