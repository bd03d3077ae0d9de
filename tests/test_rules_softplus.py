"""drop-softplus-threshold: torch's Where(x > 20, x, Softplus(x)) is one Softplus, exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches

RULE = "drop-softplus-threshold"


def thresholded_softplus_between_convs(threshold: float) -> onnx.ModelProto:
    """conv → Where(y > t, y, Softplus(y)) → conv, as torch exports F.softplus."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 4, "w1"),
        numpy_helper.from_array(rng.standard_normal((4, 8, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(threshold, np.float32), "threshold"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["y"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Softplus", ["y"], ["soft"], name="softplus"),
        helper.make_node("Greater", ["y", "threshold"], ["big"], name="greater"),
        helper.make_node("Where", ["big", "y", "soft"], ["act"], name="where"),
        helper.make_node("Conv", ["act", "w2"], ["out"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "softplus",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 16, 16])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_thresholded_softplus_splits_the_model_in_two() -> None:
    assert check_model(thresholded_softplus_between_convs(20.0)).mla_segments == 2


def test_it_becomes_one_softplus_and_one_segment_exactly() -> None:
    result = apply_rule(load_model(thresholded_softplus_between_convs(20.0)), RULE)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Softplus") == 1 and "Where" not in ops and "Greater" not in ops
    assert result.verification.passed and result.verification.mode == "exact"
    assert result.coverage_after.mla_segments == 1


@pytest.mark.parametrize("threshold", [10.0, 15.0])
def test_a_threshold_where_softplus_still_differs_from_x_is_left_alone(threshold) -> None:
    """Below 16, softplus(x) and x differ in float32 above the threshold: not exact."""
    assert not find_matches(load_model(thresholded_softplus_between_convs(threshold)), RULE)
