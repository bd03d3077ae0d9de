"""position-einsum-to-matmul and broadcast-op-to-4d-view: decomposed relative positions
(MViTv2, SAM, ViTDet) — Einsum "byhwc,hkc->byhwk" by a per-row table, and the tables added to
the scores viewed with five non-unit axes — become 4-D ops."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.rank4_views import broadcast_view
from tests.architectures import Builder

HEADS, SIDE, HD = 2, 4, 8


def _queries(b: Builder) -> str:
    """A 1×1 Conv viewed as q [1, heads, side·side, hd], then (1, heads, qh, qw, hd)."""
    q = b.conv("q", "x", 4, HEADS * HD, kernel=1, act=None)
    q = b.node("Reshape", [q, b.const("heads", np.array([1, HEADS, SIDE * SIDE, HD]))], "q_heads")
    grid = np.array([1, HEADS, SIDE, SIDE, HD])
    return b.node("Reshape", [q, b.const("grid", grid)], "r_q")


def _model(b: Builder, out: str) -> onnx.ModelProto:
    return load_model(b.model("relpos", {"x": [1, 4, SIDE * SIDE, 1]}, [out], opset=13))


@pytest.mark.parametrize("equation", ["byhwc,hkc->byhwk", "byhwc,wkc->byhwk", "byhwc,ckh->byhwk"])
def test_a_product_by_a_per_row_table_becomes_one_4d_matmul(equation) -> None:
    b = Builder()
    sizes = {"h": SIDE, "w": SIDE, "k": SIDE, "c": HD}
    table = b.weight("table", *(sizes[a] for a in equation.split(",")[1].split("->")[0]))
    rel = b.node("Einsum", [_queries(b), table], "rel", equation=equation)
    result = apply_rule(_model(b, rel), "position-einsum-to-matmul")
    assert result.verification.passed and result.verification.mode == "exact"
    ops = [n.op_type for n in result.model.graph.node]
    assert "Einsum" not in ops and ops.count("MatMul") == 1


def test_a_product_whose_table_is_computed_at_run_time_is_left_alone() -> None:
    b = Builder()
    q = _queries(b)
    table = b.node(
        "Reshape",
        [b.conv("t", "x", 4, 8, kernel=1, act=None), b.const("t3", np.array([SIDE, SIDE, HD]))],
        "t_table",
    )
    b.node("Einsum", [q, table], "rel", equation="byhwc,hkc->byhwk")
    assert find_matches(_model(b, "rel"), "position-einsum-to-matmul") == []


def test_tables_added_to_six_axis_scores_run_on_4d_views() -> None:
    b = Builder()
    scores = b.conv("s", "x", 4, HEADS * SIDE**2, kernel=1, act=None)
    grid = np.array([1, HEADS, SIDE, SIDE, SIDE, SIDE])
    scores = b.node("Reshape", [scores, b.const("grid6", grid)], "scores6")
    rows = b.conv("r", "x", 4, HEADS * SIDE, kernel=1, act=None)
    rows = b.node(
        "Reshape", [rows, b.const("rows6", np.array([1, HEADS, SIDE, SIDE, SIDE, 1]))], "rel_rows"
    )
    total = b.node("Add", [scores, rows], "biased")
    flat = b.node(
        "Reshape", [total, b.const("flat", np.array([1, HEADS, SIDE**2, SIDE**2]))], "flat_scores"
    )
    result = apply_rule(_model(b, flat), "broadcast-op-to-4d-view")
    assert result.verification.passed and result.verification.mode == "exact"
    ranks = {len(v.type.tensor_type.shape.dim) for v in result.model.graph.value_info}
    assert ranks <= {4} and not result.coverage_after.blockers


def test_broadcast_views_merge_runs_of_axes_broadcast_alike() -> None:
    out = (1, 2, 4, 4, 4, 4)
    views = broadcast_view([out, (1, 2, 4, 4, 4, 1)], out)
    assert views == [[1, 1, 128, 4], [1, 1, 128, 1], [1, 1, 128, 4]]
    alternating = [(1, 4, 1, 4, 1, 4), (1, 1, 4, 1, 4, 1)]
    assert broadcast_view(alternating, (1, 4, 4, 4, 4, 4)) is None  # five runs
