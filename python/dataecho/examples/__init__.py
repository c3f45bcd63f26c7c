"""What an example is: its fields and the casting rule, its structure (a tree
of leaves), ragged and object leaves, one batch leaf of any kind, and the
conversion of examples into the native buffer's columns.
"""

from __future__ import annotations



