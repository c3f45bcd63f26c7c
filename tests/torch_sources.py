"""torch datasets for process-worker tests (imported by module name in the
workers, so torch comes along only where a test uses one of these)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


class ShardedByTorch(IterableDataset):
    """Range(n), each worker reading its own shard by torch's get_worker_info(),
    as an IterableDataset written for DataLoader does; every example also says
    what its worker saw: its id, the worker count, the seed, whether the info's
    dataset is the copy being iterated, and a draw from random, NumPy and torch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {
                "id": i,
                "worker": -1 if info is None else info.id,
                "workers": 0 if info is None else info.num_workers,
                "seed": -1 if info is None else info.seed % (1 << 62),
                "own_copy": info is not None and info.dataset is self,  # the worker's copy, as in DataLoader
                "pid": os.getpid(),
                "draws": np.array([random.random(), np.random.random(), torch.rand(()).item()]),
            }


class Sized(torch.utils.data.Dataset):
    """A map-style dataset of ``n`` examples."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Pairs(Sized):
    """``(np.array([i]), i % 3)``: an array and a Python int, the most common shape of a torch example."""

    def __getitem__(self, i: int):
        return np.array([i]), i % 3


class Described(Sized):
    """Dicts of a Python int, a str, a float, a NumPy scalar, a tensor and a range."""

    def __getitem__(self, i: int):
        return {"id": i, "name": f"item-{i}", "weight": i / 2, "np": np.float32(i), "t": torch.tensor([i, -i]),
                "r": range(i % 2, i % 2 + 2)}


class CountingIterable(IterableDataset):
    """An IterableDataset with a ``__len__`` (torch's own tests have one)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class Seeds(torch.utils.data.Dataset):
    """Each example: torch's global seed and the process it was read in."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        return {"id": i, "seed": torch.initial_seed(), "pid": os.getpid()}


def seed_12345(worker_id: int) -> None:
    torch.manual_seed(12345)


class FailsAt(Sized):
    """``range(n)`` whose ``__getitem__(at)`` raises a KeyError."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    def __getitem__(self, i: int):
        if i == self.at:
            raise KeyError(f"no example {i}")
        return i


class Slow(torch.utils.data.Dataset):
    """Every read takes ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import time

        time.sleep(self.delay_s)
        return i


class Locked(Sized):
    """Holds multiprocessing objects (a lock, a value, an event) of the
    forkserver context: they reach worker processes only by inheritance."""

    def __init__(self, n: int) -> None:
        import multiprocessing

        super().__init__(n)
        context = multiprocessing.get_context("forkserver")
        self.lock, self.reads, self.event = context.Lock(), context.Value("i", 0), context.Event()

    def __getitem__(self, i: int):
        with self.lock:
            self.reads.value += 1
        return i
