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
