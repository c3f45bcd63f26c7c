"""torch tensors, with torch imported on first use: zero-copy conversion,
dtypes NumPy lacks, jagged nested tensors and page-locked memory.

``import dataecho`` never imports torch; these modules import it when called.
"""

from __future__ import annotations



