"""Who reads: producer threads, the caller's own thread (``num_workers=0``),
worker processes and their entry point, the persistent pool, and
``get_worker_info()``.
"""

from __future__ import annotations



