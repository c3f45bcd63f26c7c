"""An epoch's pipeline: the stage protocol, the chain of stages and the epoch
that iterates it, the stages themselves, checkpoints and counters.
"""

from __future__ import annotations



