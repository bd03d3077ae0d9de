"""`check` decides whether shapes wait for folding before placing any node, and then analyses
only the folded model (folded in place). Its report must be the one of the plain path:
analyse the model as given, fold a copy where `shapes_wait_for_folding` says so, analyse
that, and fall back to the first analysis when nothing folds."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import surgery.check
from surgery import examples
from surgery.check import check_model
from surgery.coverage import (
    CoverageReport,
    analyze_coverage,
    attach_suggestions,
    constant_tensors,
)
from surgery.fold import (
    coverage_as_compiled,
    folded_copy,
    shapes_wait_for_folding,
    waits_for_folding,
)
from surgery.model import open_model
from surgery.targets import resolve_target
from tests.conftest import RUN_INPUTS, SHARED_MODELS
from tests.test_check_folding import _view_by_computed_shape
from tests.test_shape_repair import REPAIRED, custom_op_after_flatten, unsorted_flatten

TARGETS = ["mlsoc", "modalix", "rk3588"]
REAL = sorted(p.stem for p in SHARED_MODELS.glob("*.onnx"))


def _nothing_folds() -> onnx.ModelProto:
    """Static input; a custom op leaves its output's rank unknown (a blocker for that reason),
    and the only foldable computation is a custom op ONNX Runtime cannot evaluate: shapes
    wait for folding, but nothing folds."""
    nodes = [
        helper.make_node("Opaque", ["x"], ["u"], domain="custom"),
        helper.make_node("Relu", ["u"], ["r"]),
        helper.make_node("Opaque", ["c"], ["k"], domain="custom"),
        helper.make_node("Add", ["r", "k"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "nothing_folds",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((1, 3, 4, 4), np.float32), "c")],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)]
    )


SYNTHETIC = {
    **examples.EXAMPLES,
    "view_by_computed_shape": _view_by_computed_shape,
    "nothing_folds": _nothing_folds,
    **REPAIRED,
    "custom_op_after_flatten": custom_op_after_flatten,
    "unsorted_flatten": unsorted_flatten,
}


def _source(name: str) -> tuple[onnx.ModelProto | str, dict | None]:
    if name in SYNTHETIC:
        return SYNTHETIC[name](), None
    return str(SHARED_MODELS / f"{name}.onnx"), RUN_INPUTS.get(name)


def _plain_check(source, target: str, shapes) -> CoverageReport:
    """check as it was before the shortcut: analyse, then fold a copy where shapes wait."""
    model, view = open_model(source, shapes)
    tgt = resolve_target(target)
    report = analyze_coverage(model, tgt, view=view, suggest=False)
    compiled = coverage_as_compiled(model, report, tgt, view.names, suggest=True)
    if compiled is report:
        attach_suggestions(model, tgt, report, view)
    return compiled


def _everything(report: CoverageReport) -> tuple:
    """Every field of every placement and segment (`to_dict` leaves some out)."""
    return (
        report.to_dict(),
        [dataclasses.astuple(p) for p in report.placements],
        [dataclasses.astuple(s) for s in report.segments],
    )


def test_the_synthetic_cases_take_each_path():
    """One model folds, one waits but folds nothing: both branches of check are exercised."""
    for build, folds in ((_view_by_computed_shape, True), (_nothing_folds, False)):
        model, view = open_model(build())
        report = analyze_coverage(model, "mlsoc", view=view, suggest=False)
        assert shapes_wait_for_folding(report)
        assert (folded_copy(model, view.names) is not None) is folds


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", [*SYNTHETIC, *REAL])
def test_waits_for_folding_agrees_with_the_analysis(name: str, target: str):
    source, shapes = _source(name)
    model, view = open_model(source, shapes)
    tgt = resolve_target(target)
    expected = shapes_wait_for_folding(analyze_coverage(model, tgt, view=view, suggest=False))
    assert waits_for_folding(model, view, tgt, constant_tensors(view), None) is expected


@pytest.mark.parametrize("name", [*SYNTHETIC, *REAL])
def test_check_reports_what_the_plain_path_reports(name: str):
    source, shapes = _source(name)
    for target in TARGETS:
        expected = _plain_check(source, target, shapes)
        got = check_model(source, target, input_shapes=shapes)
        assert _everything(got) == _everything(expected), (name, target)


def test_check_leaves_the_callers_model_alone():
    model = _view_by_computed_shape()
    before = model.SerializeToString()
    check_model(model, "mlsoc")
    assert model.SerializeToString() == before


def test_check_reads_the_model_once_where_only_the_fold_can_tell(monkeypatch):
    """A custom op rules the shape repair out before it starts: the fold takes the model as
    it was opened, without reading and inferring it a second time."""
    opened = []
    open_model = surgery.check.open_model

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return open_model(*args, **kwargs)

    monkeypatch.setattr(surgery.check, "open_model", counting_open)
    report = check_model(custom_op_after_flatten(), "mlsoc")
    assert len(opened) == 1
    assert not shapes_wait_for_folding(report)  # the folded model's analysis
