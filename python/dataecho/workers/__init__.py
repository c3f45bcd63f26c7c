"""Who reads: the ``Readers`` protocol and its kinds (producer threads, the
caller's own thread with ``num_workers=0``, worker processes and their entry
point), the persistent pool, an epoch's seeds and resources, and
``get_worker_info()``; who augments, in ``augment/``.
"""

from __future__ import annotations
