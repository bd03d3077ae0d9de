"""last-axis-op-before-reshape: an op along the last axis only, applied to a rank-6 window
partition, moves before the Reshape/Transpose that made it (Twins' locally grouped attention
applies its qkv Linear there)."""

from __future__ import annotations

import numpy as np
import onnx

from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from tests.architectures import Builder

C, SIDE, WS = 8, 4, 2
GRID = [1, SIDE // WS, WS, SIDE // WS, WS, C]
RULE = "last-axis-op-before-reshape"


def _partitioned(b: Builder, perm: tuple[int, ...] = (0, 1, 3, 2, 4, 5)) -> str:
    """Tokens [1, H·W, C] viewed (1, H, W, C), then windows (1, H/ws, W/ws, ws, ws, C)."""
    x = b.node("Reshape", ["x", b.const("hw", np.array([1, SIDE, SIDE, C]))], "hw_view")
    x = b.node("Reshape", [x, b.const("grid", np.array(GRID))], "partition")
    return b.node("Transpose", [x], "partition_t", perm=list(perm))


def _model(b: Builder, out: str) -> onnx.ModelProto:
    return load_model(b.model("hoist", {"x": [1, SIDE * SIDE, C]}, [out]))


def _input_rank(model: onnx.ModelProto, op: str) -> int:
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in model.graph.value_info}
    ranks.update({i.name: len(i.type.tensor_type.shape.dim) for i in model.graph.input})
    (node,) = [n for n in model.graph.node if n.op_type == op]
    return ranks[node.input[0]]


def test_a_linear_on_the_windows_moves_before_the_partition() -> None:
    b = Builder()
    b.linear("qkv", _partitioned(b), C, 3 * C)
    result = apply_rule(_model(b, "qkv_out"), RULE)
    assert result.verification.passed and result.verification.mode == "exact"
    assert _input_rank(result.model, "MatMul") == 4
    assert "qkv_mm" in {b.name for b in result.coverage_before.blockers}


def test_a_slice_of_the_features_moves_before_the_partition() -> None:
    b = Builder()
    b.slice("half", _partitioned(b), 0, C // 2, -1)
    result = apply_rule(_model(b, "half"), RULE)
    assert result.verification.passed and result.verification.mode == "exact"
    assert _input_rank(result.model, "Slice") == 4
    (out,) = result.model.graph.output
    assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [*GRID[:1], 2, 2, 2, 2, 4]


def test_a_layer_norm_over_the_last_axis_moves_and_keeps_its_axis_last() -> None:
    b = Builder()
    scale, bias = b.weight("g", C), b.weight("beta", C)
    b.node("LayerNormalization", [_partitioned(b), scale, bias], "ln", axis=5)
    model = load_model(b.model("hoist", {"x": [1, SIDE * SIDE, C]}, ["ln"], opset=17))
    result = apply_rule(model, RULE)
    assert result.verification.passed
    (ln,) = [n for n in result.model.graph.node if n.op_type == "LayerNormalization"]
    assert onnx.helper.get_attribute_value(ln.attribute[0]) == -1


def test_a_transpose_that_moves_the_last_axis_stops_the_hoist() -> None:
    b = Builder()
    b.linear("qkv", _partitioned(b, perm=(0, 1, 3, 2, 5, 4)), WS, 3 * C)  # mixes the windows
    assert find_matches(_model(b, "qkv_out"), RULE) == []


def test_movement_read_by_another_node_is_left_in_place() -> None:
    b = Builder()
    windows = _partitioned(b)
    y = b.linear("qkv", windows, C, C)
    b.node("Add", [y, windows], "both")
    assert find_matches(_model(b, "both"), RULE) == []


def test_a_constant_that_varies_along_a_leading_axis_is_not_along_the_last_axis() -> None:
    b = Builder()
    b.node("Mul", [_partitioned(b), b.weight("per_window", 1, 2, 1, 1, 1, C)], "scaled")
    assert find_matches(_model(b, "scaled"), RULE) == []


def test_the_rule_matches_the_same_linear_without_the_last_axis_transpose() -> None:
    b = Builder()
    b.linear("qkv", _partitioned(b), C, 3 * C)
    (match,) = find_matches(_model(b, "qkv_out"), RULE)
    assert match.nodes == ["qkv_mm", "partition", "partition_t"]
