"""How much faster the training step is than its input: ``R`` in the paper's
terms, the bound on what echoing can gain (at most ``min(e, R)`` at echo ``e``).
The input is measured fed alone (no step), the step alone over batches that
input delivered, preloaded where the model runs."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .digits import Augment, PngDigits
from .train import CONFIGS, make_loader, make_trainer

PRELOADED = 16  # batches the step cycles over


def measure(torch: Any, dataset: PngDigits, validation: tuple[np.ndarray, np.ndarray], *, batch_size: int,
            workers: int, seed: int, device: str, worker_type: str, measure_s: float) -> dict[str, float]:
    """The input's and the step's examples/s, and their ratio.

    Args:
        torch: the torch module.
        dataset, validation, batch_size, workers, seed, worker_type: as
            ``train.train`` takes them; the input is no echo's loader.
        device: where the model runs (and the batches are preloaded).
        measure_s: the least time each of the two is measured over.

    Returns:
        ``input_per_s`` (examples/s), ``step_per_s`` (examples/s) and ``r``
        (step over input).
    """
    loader = make_loader(CONFIGS[0], dataset, Augment(seed), batch_size=batch_size, workers=workers, seed=seed,
                         device=device if device != "cpu" else None, worker_type=worker_type)
    try:
        input_per_s, preloaded = input_rate(loader, measure_s)
    finally:
        loader.close()
    step, _ = make_trainer(torch, validation, seed=seed, device=device)
    step_per_s = step_rate(torch, step, preloaded, device, measure_s)
    return {"input_per_s": input_per_s, "step_per_s": step_per_s, "r": step_per_s / input_per_s}


def input_rate(loader: Any, measure_s: float) -> tuple[float, list[dict]]:
    """Examples/s over whole epochs, at least `measure_s` of them, after a first
    one that starts the workers; and copies of up to PRELOADED of that first
    epoch's batches (a batch may view memory the loader reuses).

    Whole epochs, because an epoch's shuffle buffer fills at its start (fewer
    batches come out than examples are read) and drains at its end."""
    preloaded = []
    for batch in loader:
        if len(preloaded) < PRELOADED:
            preloaded.append({key: value.clone() for key, value in batch.items()})
    start, examples = time.perf_counter(), 0
    while time.perf_counter() - start < measure_s:
        examples += sum(len(batch["label"]) for batch in loader)
    return examples / (time.perf_counter() - start), preloaded


def step_rate(torch: Any, step: Any, preloaded: list[dict], device: str, measure_s: float) -> float:
    """Examples/s of `step` alone, cycling over `preloaded` for `measure_s`."""
    for batch in preloaded[:4]:  # a fresh model's first steps (kernels, the allocator)
        step(batch)
    synchronize(torch, device)
    start, steps, examples = time.perf_counter(), 0, 0
    while time.perf_counter() - start < measure_s:
        batch = preloaded[steps % len(preloaded)]
        step(batch)
        steps += 1
        examples += len(batch["label"])
        if steps % 20 == 0:
            synchronize(torch, device)  # so that the clock reads finished steps, not queued ones
    synchronize(torch, device)
    return examples / (time.perf_counter() - start)


def synchronize(torch: Any, device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
