"""The `check` use case: load a model and analyse its coverage on a target in one call."""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

import onnx

import surgery.rules  # noqa: F401  (registers the rule suggester used by the report)
from surgery.coverage import CoverageReport, analyze_coverage, check_pins, constant_tensors
from surgery.fold import folded_coverage, waits_for_folding
from surgery.graph import GraphView
from surgery.model import model_label, open_model, refuse_impossible_reshapes
from surgery.qdq import float_model, float_view, is_qdq, quantized_for
from surgery.qoperator import is_qoperator, qoperator_to_qdq
from surgery.shape_repair import can_repair_shapes, repair_shapes
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
        report, qdq, resolved = _analyse(model, tgt, input_shapes, op_target, suggest)
    if suggest and qdq is not None:
        _suggest_on_float_model(report, qdq, resolved, op_target)
    return report


def _suggest_on_float_model(
    report: CoverageReport,
    qdq: onnx.ModelProto,
    target: Target,
    op_target: Mapping[str, str] | None,
) -> None:
    """A quantized model's blockers get the rules that match the float model fix and apply
    rewrite it as (`float_model`: weights as initializers, no Q/DQ). On the float view, whose
    weights are still DequantizeLinear nodes, most rules cannot match: an ORT-quantized ViT
    was suggested transformer-to-4d for 12 blockers where fix frees 303. Placement stays the
    float view's, as compile partitions it."""
    rewritten_model = float_model(qdq)
    still_quantizes = any(n.op_type == "QuantizeLinear" for n in rewritten_model.graph.node)
    if still_quantizes and is_qdq(GraphView(rewritten_model)):
        return  # Q/DQ that float_model cannot undo: its float view is all there is to match
    with gc_paused():  # check_model's analysis, where the float model keeps the QDQ's shapes
        rewritten, _, _ = _analyse(
            rewritten_model, target, None, op_target, True, reuse_static_shapes=True
        )
    rules = {b.name: b.suggested_rules for b in rewritten.blockers}
    for blocker in report.blockers:
        if blocker.name in rules:
            blocker.suggested_rules[:] = rules[blocker.name]


def _analyse(
    model: str | os.PathLike | onnx.ModelProto,
    target: Target | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    op_target: Mapping[str, str] | None,
    suggest: bool,
    *,
    reuse_static_shapes: bool = False,
) -> tuple[CoverageReport, onnx.ModelProto | None, Target]:
    """Open and analyse the model as the compiler will see it (`coverage_as_compiled`). A
    function of its own so the model and its GraphView are freed when it returns, before the
    collector resumes: the collection that follows then only walks the report, not every
    object of the analysis.

    Where shapes wait for folding, the shapes are repaired in place (`repair_shapes`: the
    model is check's own copy) and the model analysed as the fold would leave it; where only
    the fold can tell, the model is folded in place (opened again first if a repair was
    started), and analysed folded. If nothing folds after all, the fold has changed the
    model, and it is opened again for the analysis as given.

    Returns the report, the QDQ model when the input was one (its suggestions come from its
    float model, so none are computed here) and the target. `reuse_static_shapes`: see
    `open_model`."""
    reuse = reuse_static_shapes
    loaded, view, tgt, qdq = _open(model, target, input_shapes, keep_qdq=suggest, reuse=reuse)
    suggest = suggest and qdq is None
    if op_target:
        check_pins(view, op_target)
    constants = constant_tensors(view)
    label = model_label(model)
    if waits_for_folding(loaded, view, tgt, constants, op_target):
        if can_repair_shapes(loaded, view):
            repaired = repair_shapes(loaded, view, constants)
            if repaired is not None:
                refuse_impossible_reshapes(view, label)
                report = analyze_coverage(
                    loaded, tgt, op_target=op_target, view=view, suggest=suggest, constants=repaired
                )
                return report, qdq, tgt
            # half repaired: opened again
            loaded, view, tgt, _ = _open(model, target, input_shapes, keep_qdq=False, reuse=reuse)
        folded = folded_coverage(loaded, view, tgt, op_target=op_target, suggest=suggest)
        if folded is not None:
            refuse_impossible_reshapes(GraphView(loaded), label)
            return folded, qdq, tgt
        loaded, view, tgt, _ = _open(model, target, input_shapes, keep_qdq=False, reuse=reuse)
        constants = constant_tensors(view)
    refuse_impossible_reshapes(view, label)
    report = analyze_coverage(
        loaded, tgt, op_target=op_target, view=view, suggest=suggest, constants=constants
    )
    return report, qdq, tgt


def _open(
    model: str | os.PathLike | onnx.ModelProto,
    target: Target | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    *,
    keep_qdq: bool,
    reuse: bool,
) -> tuple[onnx.ModelProto, GraphView, Target, onnx.ModelProto | None]:
    """The model to analyse (a copy: check's own), its view, the target, and the QDQ model
    when the input is one, or a QOperator model rewritten as one (the analysis is then of its
    float view). Without `keep_qdq` (no suggestions to make from it) the QDQ model is
    rewritten into its float view in place, and what is returned for it only says it was
    one. `reuse`: the model's own static shapes are reused (`open_model`)."""
    loaded, view = open_model(model, input_shapes, reuse_static_shapes=reuse)
    if is_qoperator(view):  # QLinearConv & co. read as the QDQ model they are
        loaded, view = open_model(qoperator_to_qdq(loaded).model, owned=True)
    qdq = None
    if is_qdq(view):  # count the segments of the float model it quantizes, as compile does
        target = target or resolve_target(quantized_for(loaded) or DEFAULT_TARGET)
        qdq = loaded
        loaded, view = open_model(
            float_view(loaded, in_place=not keep_qdq), owned=True, reuse_static_shapes=True
        )
    return loaded, view, target or resolve_target(DEFAULT_TARGET), qdq


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
