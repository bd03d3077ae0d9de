"""The `check` use case: load a model and analyse its coverage on a target in one call."""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import onnx

import surgery.rules  # noqa: F401  (registers the rule suggester used by the report)
from surgery.coverage import CoverageReport, analyze_coverage
from surgery.model import open_model
from surgery.qdq import float_view, is_qdq
from surgery.targets import Target, resolve_target


def check_model(
    model: str | os.PathLike | onnx.ModelProto,
    target: str | Target = "mlsoc",
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    op_target: Mapping[str, str] | None = None,
    suggest: bool = True,
) -> CoverageReport:
    """Which nodes run on the MLA/CVU/APU of `target`, the MLA segments, and the blockers.

    `suggest` also asks every rewrite rule which blockers it removes (`suggested_rules`).
    """
    tgt = resolve_target(target)  # fail fast on a bad target before reading a big model
    with gc_paused():
        return _analyse(model, tgt, input_shapes, op_target, suggest)


def _analyse(
    model: str | os.PathLike | onnx.ModelProto,
    target: Target,
    input_shapes: Mapping[str, Sequence[int]] | None,
    op_target: Mapping[str, str] | None,
    suggest: bool,
) -> CoverageReport:
    """Open and analyse the model. A function of its own so the model and its GraphView are
    freed when it returns, before the collector resumes: the collection that follows then
    only walks the report, not every object of the analysis."""
    loaded, view = open_model(model, input_shapes)
    if is_qdq(view):  # count the segments of the float model it quantizes, as compile does
        loaded, view = open_model(float_view(loaded))
    return analyze_coverage(loaded, target, op_target=op_target, view=view, suggest=suggest)


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector during a short, allocation-heavy analysis.

    Analysis allocates many small objects and no reference cycles; a full collection triggered
    halfway through (traversing every protobuf wrapper) would cost more than the analysis.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
