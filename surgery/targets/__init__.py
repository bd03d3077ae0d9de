"""Target profiles (op tables as data) and the constraint checks they are written in."""

from surgery.targets.constraints import CHECKS, NodeContext, Reason
from surgery.targets.profile import (
    CONTRIB_OPS,
    PROCESSORS,
    ConstraintEvaluationError,
    OpDecision,
    Target,
    TargetProfile,
    available_targets,
    load_target,
    placeable_domain,
    resolve_target,
)

__all__ = [
    "CHECKS",
    "CONTRIB_OPS",
    "PROCESSORS",
    "ConstraintEvaluationError",
    "NodeContext",
    "OpDecision",
    "Reason",
    "Target",
    "TargetProfile",
    "available_targets",
    "load_target",
    "placeable_domain",
    "resolve_target",
]
