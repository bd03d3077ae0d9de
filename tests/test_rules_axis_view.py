"""axis-op-to-4d-view: Split, Slice, ReduceMax and ReduceMean along one run of axes of a
rank-6 tensor (Hiera's q, k, v split and q pooling) run on the [1, outer, n, inner] view."""

from __future__ import annotations

import numpy as np
import onnx

from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from tests.architectures import Builder

RULE = "axis-op-to-4d-view"
SIX = [1, 2, 3, 4, 2, 4]
"""Five non-unit axes: no 4-D layout holds the tensor."""


def _six_d(b: Builder) -> str:
    """A 1×1 Conv on [1, 4, 6, 8], viewed as the rank-6 SIX."""
    y = b.conv("proj", "x", 4, 4, kernel=1, act=None)
    return b.node("Reshape", [y, b.const("six", np.array(SIX))], "six_view")


def _model(b: Builder, outputs: list[str], opset: int = 13) -> onnx.ModelProto:
    return load_model(b.model("axis_view", {"x": [1, 4, 6, 8]}, outputs, opset=opset))


def _max_rank(model: onnx.ModelProto) -> int:
    return max(len(v.type.tensor_type.shape.dim) for v in model.graph.value_info)


def test_a_split_of_a_rank_6_tensor_becomes_slices_of_its_4d_view() -> None:
    b = Builder()
    parts = b.nodes_out(
        "Split", [_six_d(b), b.const("sizes", np.array([1, 2]))], ["p0", "p1"], axis=2
    )
    four_d = [
        b.node("Reshape", [p, b.const(f"{p}_4d", np.array([1, -1, 4, 8]))], f"{p}_r") for p in parts
    ]
    result = apply_rule(_model(b, four_d), RULE)
    assert result.verification.passed and result.verification.mode == "exact"
    assert "Split" not in {n.op_type for n in result.model.graph.node}
    assert _max_rank(result.model) <= 4
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers


def test_a_max_over_one_axis_of_a_rank_6_tensor_becomes_a_max_pool() -> None:
    b = Builder()
    pooled = b.node("ReduceMax", [_six_d(b)], "pooled", axes=[3], keepdims=0)
    out = b.node("Reshape", [pooled, b.const("out4", np.array([1, 6, 2, 4]))], "pooled_4d")
    result = apply_rule(_model(b, [out]), RULE)
    assert result.verification.passed and result.verification.mode == "exact"
    (pool,) = [n for n in result.model.graph.node if n.op_type == "MaxPool"]
    kernel = next(a for a in pool.attribute if a.name == "kernel_shape")
    assert list(kernel.ints) == [4, 1]
    assert _max_rank(result.model) <= 4


def test_a_mean_over_a_run_of_axes_becomes_an_average_pool() -> None:
    b = Builder()
    b.node("ReduceMean", [_six_d(b)], "mean", axes=[2, 3], keepdims=1)
    result = apply_rule(_model(b, ["mean"]), RULE)
    assert result.verification.passed
    assert "AveragePool" in {n.op_type for n in result.model.graph.node}


def test_a_slice_of_one_axis_becomes_a_slice_of_the_view() -> None:
    b = Builder()
    b.slice("middle", _six_d(b), 1, 3, 3)
    result = apply_rule(_model(b, ["middle"]), RULE)
    assert result.verification.passed and result.verification.mode == "exact"
    (out,) = result.model.graph.output
    assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [1, 2, 3, 2, 2, 4]


def test_a_reduction_over_axes_that_are_not_adjacent_is_left_alone() -> None:
    b = Builder()
    b.node("ReduceMax", [_six_d(b)], "scattered", axes=[1, 3], keepdims=1)
    assert find_matches(_model(b, ["scattered"]), RULE) == []
