"""Who augments, by ``AugmentSpec.kind``: threads of the training process
(dataecho.pipeline.stages.augment) or worker processes
(dataecho.pipeline.stages.augment_processes). Both take the same arguments
(those of AugmentStage); a new kind is a stage class of that signature, and
one line here."""

from __future__ import annotations

from .augment import AugmentSpec, AugmentStage
from .augment_processes import AugmentProcessStage

__all__ = ["AUGMENT_KINDS", "augment_stage"]

AUGMENT_KINDS: dict[str, type[AugmentStage]] = {
    "thread": AugmentStage,
    "process": AugmentProcessStage,
}


def augment_stage(spec: AugmentSpec) -> type[AugmentStage]:
    """The stage class of the kind ``spec`` names."""
    return AUGMENT_KINDS[spec.kind]
