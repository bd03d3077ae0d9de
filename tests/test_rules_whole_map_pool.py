"""whole-map-pool-to-global: Hugging Face EfficientNet's AvgPool2d(hidden_dim, ceil_mode=True)
over a 7×7 map is a global average pool (and the same for a MaxPool)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule


def _conv_pool_conv(op: str, kernel: int, **attrs) -> onnx.ModelProto:
    """Conv → pool with a square `kernel` and stride over its [1, 8, 7, 7] map → 1×1 Conv."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
            helper.make_node(
                op, ["a"], ["p"], kernel_shape=[kernel, kernel], strides=[kernel, kernel], **attrs
            ),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_pool_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 7, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w1"),
            numpy_helper.from_array(rng.normal(0, 0.5, (4, 8, 1, 1)).astype(np.float32), "w2"),
        ],
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_an_average_pool_wider_than_its_map_becomes_a_global_average(count_include_pad):
    model = _conv_pool_conv("AveragePool", 2560, ceil_mode=1, count_include_pad=count_include_pad)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "whole-map-pool-to-global", "mlsoc")
    assert step.verification.passed
    assert [n.op_type for n in step.model.graph.node] == ["Conv", "GlobalAveragePool", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_max_pool_wider_than_its_map_becomes_a_global_max():
    step = apply_rule(_conv_pool_conv("MaxPool", 200, ceil_mode=1), "whole-map-pool-to-global")
    assert step.verification.passed
    assert "GlobalMaxPool" in [n.op_type for n in step.model.graph.node]


def test_a_padded_pool_is_left_alone():
    """Padding enters the divisor of an AveragePool that counts it: not a plain global mean."""
    model = _conv_pool_conv("AveragePool", 160, ceil_mode=1, pads=[0, 0, 1, 1])
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "whole-map-pool-to-global", "mlsoc")
