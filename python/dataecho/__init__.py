"""dataecho: data echoing for input-bound training.

A native, lock-free, echo-aware shuffle buffer that repeats examples already in
the pipeline (Choi et al., "Faster Neural Network Training with Data Echoing",
2019) so that the accelerator trains instead of waiting for input.
"""

from __future__ import annotations

from .buffer import ShuffleBuffer
from .errors import BufferClosed
from .examples.jax_trees import to_jax
from .examples.ragged import JaxRagged, Padded, Ragged
from .loader import EchoLoader
from .workers.info import WorkerInfo, get_worker_info

__all__ = ["BufferClosed", "EchoLoader", "JaxRagged", "Padded", "Ragged", "ShuffleBuffer", "WorkerInfo",
           "__version__", "get_worker_info", "to_jax"]
__version__ = "0.1.0"
