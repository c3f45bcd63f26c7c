"""Random generators keyed by delivery number, for ``augment(example, rng=...)``:
its output is then a function of (seed, epoch, rank, delivery) alone, whichever
thread runs it, and can be recomputed on resume."""

from __future__ import annotations

import numpy as np

__all__ = ['DeliveryRng']

class DeliveryRng:
    """``numpy.random.Generator``s keyed by delivery number: Philox with a key
    from (seed, epoch, rank) and the delivery number in its counter, so that
    every delivery has its own stream (2**64 blocks long). One per thread: the
    generator handed out for a delivery is valid until the next ``at`` call."""

    def __init__(self, seed: int, epoch: int, rank: int) -> None:
        self._key = np.random.SeedSequence([seed, epoch, rank, 0x6175676D]).generate_state(2, dtype=np.uint64)
        self._bits = np.random.Philox(key=self._key)
        self._empty = np.zeros(4, dtype=np.uint64)

    def at(self, delivery: int) -> np.random.Generator:
        self._bits.state = {
            "bit_generator": "Philox",
            "state": {"counter": np.array((0, delivery, 0, 0), dtype=np.uint64), "key": self._key},
            "buffer": self._empty, "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
        }
        return np.random.Generator(self._bits)
