"""The configuration of a stand-in for a loader (dataecho.pipeline.progress.replay):
the same epochs of positions, over a source whose examples are their own
dataset indices, read natively in the caller's thread."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

__all__ = ["stand_in"]


def stand_in(config: Any, augment: Callable[..., Any]) -> Any:
    """``config`` (a replayable ``LoaderConfig``) over a stand-in source whose
    examples are their own dataset indices, read in the caller's thread, with
    ``augment`` (a pass-through that takes ``rng``) in place of the user's:
    its epochs deliver the same positions in the same batches as ``config``'s
    (deterministic reading does not depend on who reads), in a fraction of the
    time; nothing of the user's (dataset, transform, collate, device) runs."""
    return dataclasses.replace(
        config, dataset=np.arange(len(config.dataset), dtype=np.int64), transform=None, collate_fn=None,
        augment=augment if config.augment is not None else None, augment_workers="thread", pin_memory=False,
        timeout=None, worker_init_fn=None, persistent_workers=False, worker_type="thread", workers=0,
        auto_workers=False, output="numpy", device=None, ragged=None, ragged_bytes=None, padding=None,
        jax_device=None, batched=True)
