"""An epoch's pipeline: the planner, the chain of stages and the epoch that
iterates it, checkpoints; the stages themselves in ``stages/``, and what
serves the loader across epochs (resume, replay, the job, stats) in
``progress/``.
"""

from __future__ import annotations
