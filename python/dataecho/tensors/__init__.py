"""torch tensors and JAX arrays, each library imported on first use:
zero-copy conversion, dtypes NumPy lacks, jagged nested tensors, page-locked
memory, and NumPy arrays handed to JAX (jax_arrays.py).

``import dataecho`` never imports torch or jax; these modules import them when called.
"""

from __future__ import annotations



