"""The `check` use case: load a model and analyse its coverage on a target in one call."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import onnx

from surgery.coverage import CoverageReport, analyze_coverage
from surgery.model import load_model
from surgery.targets import Target, resolve_target


def check_model(
    model: str | os.PathLike | onnx.ModelProto,
    target: str | Target = "mlsoc",
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    op_target: Mapping[str, str] | None = None,
) -> CoverageReport:
    """Which nodes run on the MLA/CVU/APU of `target`, the MLA segments, and the blockers."""
    tgt = resolve_target(target)  # fail fast on a bad target before reading a big model
    loaded = load_model(model, input_shapes)
    return analyze_coverage(loaded, tgt, op_target=op_target)
