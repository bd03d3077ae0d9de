"""The `check` use case: load a model and analyse its coverage on a target in one call."""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import onnx

import surgery.rules  # noqa: F401  (registers the rule suggester used by the report)
from surgery.coverage import CoverageReport, analyze_coverage, attach_suggestions
from surgery.fold import coverage_as_compiled
from surgery.model import open_model
from surgery.qdq import float_view, is_qdq, quantized_for
from surgery.targets import Target, resolve_target

DEFAULT_TARGET = "mlsoc"
"""The target when none is given and the model records none."""


def check_model(
    model: str | os.PathLike | onnx.ModelProto,
    target: str | Target | None = None,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    op_target: Mapping[str, str] | None = None,
    suggest: bool = True,
) -> CoverageReport:
    """Which nodes run on the MLA/CVU/APU of `target`, the MLA segments, and the blockers.

    `suggest` also asks every rewrite rule which blockers it removes (`suggested_rules`).
    `target=None` means the target a quantized model was quantized for, else mlsoc.
    """
    # Fail fast on a bad target before reading a big model.
    tgt = resolve_target(target) if target is not None else None
    with gc_paused():
        return _analyse(model, tgt, input_shapes, op_target, suggest)


def _analyse(
    model: str | os.PathLike | onnx.ModelProto,
    target: Target | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    op_target: Mapping[str, str] | None,
    suggest: bool,
) -> CoverageReport:
    """Open and analyse the model. A function of its own so the model and its GraphView are
    freed when it returns, before the collector resumes: the collection that follows then
    only walks the report, not every object of the analysis."""
    loaded, view = open_model(model, input_shapes)
    if is_qdq(view):  # count the segments of the float model it quantizes, as compile does
        target = target or resolve_target(quantized_for(loaded) or DEFAULT_TARGET)
        loaded, view = open_model(float_view(loaded))
    target = target or resolve_target(DEFAULT_TARGET)
    report = analyze_coverage(loaded, target, op_target=op_target, view=view, suggest=False)
    compiled = coverage_as_compiled(
        loaded, report, target, view.names, op_target=op_target, suggest=suggest
    )
    if compiled is report and suggest:
        attach_suggestions(loaded, target, report, view)
    return compiled


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
