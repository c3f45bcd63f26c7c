"""How a source is read: one epoch's view of it, the reading order and its
shard per rank, and the readers of each kind of source (a dataset read by
index, arrays, Arrow tables, Ray Data, iterables), in chunks.
"""

from __future__ import annotations



