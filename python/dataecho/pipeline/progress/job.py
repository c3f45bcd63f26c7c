"""A loader's part of a data-parallel job, as each epoch starts: the rank and
world size ``torch.distributed`` reports where none were given (so that a
loader built before ``init_process_group`` shards from its first epoch on),
and the gloo process group on which ``echo_factor="auto"`` keeps the ranks in
lockstep (dataecho.pipeline.stages.lockstep)."""

from __future__ import annotations

from typing import Any

from ...reading.sharding import current_shard, warn_if_ungrouped
from ..plan import Plan, Planner

__all__ = ["Job"]


class Job:
    """Follows the job a loader runs in; holds its lockstep process group."""

    def __init__(self) -> None:
        self._group: Any = None

    def follow(self, planner: Planner, starting: bool = True) -> Planner:
        """``planner``'s loader on the part of the job ``torch.distributed``
        reports now; ``planner`` itself where ``rank``/``world_size`` were given,
        or nothing changed. ``starting``: an epoch starts, and is warned (once)
        where the environment says the job is distributed but no process group exists."""
        if planner.shard_given:
            return planner
        shard = current_shard()
        if starting:
            warn_if_ungrouped(shard)
        if shard == planner.shard:
            return planner
        self._group = None
        return planner.on_shard(shard)

    def group(self, planned: Plan) -> Any:
        """The gloo process group of ``planned``'s lockstep stage, made at its
        first epoch on every rank at once (making one is a collective); None
        where no lockstep is planned."""
        if planned.lockstep is None:
            return None
        if self._group is None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group
