"""Picklable sources and transforms for process-worker tests (worker processes
import them by module name)."""

from __future__ import annotations

import os
import time

import numpy as np

import dataecho


class Indexed:
    """n examples {"id": i, "x": 8 bytes derived from i}; optionally slow or failing."""

    def __init__(self, n, delay_s=0.0, fail_at=None):
        self.n, self.delay_s, self.fail_at = n, delay_s, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"record {i} is corrupt")
        if self.delay_s:
            time.sleep(self.delay_s)
        return {"id": i, "x": np.arange(8, dtype=np.uint8) + np.uint8(i % 200)}


class Sharded:
    """An iterable that reads only its worker's shard of range(n)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = dataecho.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"id": i, "worker": -1 if info is None else info.id}


def with_pid(example):
    """A transform that returns a Python number and a torch tensor too."""
    import torch

    return {**example, "pid": os.getpid(), "t": torch.tensor([example["id"]], dtype=torch.int64)}


def suicide_at_500(example):
    if example["id"] == 500:
        os.kill(os.getpid(), 9)
    return example
