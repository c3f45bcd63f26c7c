"""Smoke test of an installed wheel: the native buffer and the loader, NumPy only.

Run from outside the repository so that the installed package is the one imported:
.ci/check-wheel runs it in a fresh virtual environment per CPython, and cibuildwheel
as its test-command.
"""

import platform

import numpy as np

import dataecho

with dataecho.ShuffleBuffer({"x": ((4,), "float32"), "y": ((), "int64")}, capacity=64, batch_size=8, echo_factor=2) as buf:
    buf.put_many({"x": np.ones((20, 4), np.float32), "y": np.arange(20)})
ids = sorted(np.concatenate([b["y"] for b in buf]).tolist())
assert ids == sorted(list(range(20)) * 2), ids
images = [np.full(8192, i, np.uint8) for i in range(16)]  # large enough to be held by reference
with dataecho.ShuffleBuffer(((8192,), "uint8"), capacity=32, batch_size=4, seed=0) as held:
    for image in images:
        held.put(image)
assert sorted(int(b[0]) for batch in held for b in batch) == list(range(16)) and held.held == 0
loader = dataecho.EchoLoader(range(100), batch_size=10, echo_factor=2, seed=0)
assert sum(len(b) for b in loader) == 200
print(f"smoke test ok: dataecho {dataecho.__version__} on {platform.python_implementation()} "
      f"{platform.python_version()}, NumPy {np.__version__}, from {dataecho.__file__}")
