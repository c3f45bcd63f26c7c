"""dataecho: data echoing for input-bound training.

A native, lock-free, echo-aware shuffle buffer that repeats examples already in
the pipeline (Choi et al., "Faster Neural Network Training with Data Echoing",
2019) so that the accelerator trains instead of waiting for input.

``dataecho.grain`` (echo as a Grain transformation) and ``dataecho.nodes`` (as
a torchdata node) are imported when first named: ``import dataecho`` imports
neither library.
"""

from __future__ import annotations

import importlib
from typing import Any

from .buffer import ShuffleBuffer
from .errors import BufferClosed
from .examples.jax_trees import to_jax
from .examples.ragged import JaxRagged, Padded, Ragged
from .loader import EchoLoader
from .workers.info import WorkerInfo, get_worker_info

__all__ = ["BufferClosed", "EchoLoader", "JaxRagged", "Padded", "Ragged", "ShuffleBuffer", "WorkerInfo",
           "__version__", "get_worker_info", "to_jax"]
__version__ = "0.1.0"

_INTEGRATIONS = ("grain", "nodes", "transformers")


def __getattr__(name: str) -> Any:
    # dataecho.grain, dataecho.nodes and dataecho.transformers import their library: only when asked for.
    if name in _INTEGRATIONS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
