"""channels-last-reduce-to-spatial: a Keras squeeze-excite block as tf2onnx writes it — the
feature map kept channels-last between Transposes, pooled by ReduceMean over axes [1, 2] —
ends up on the MLA, which reduces spatial axes only."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import apply_rule
from surgery.rules.fix import fix_model

C = 8


def _nhwc_squeeze_excite(keepdims: int = 1, op: str = "ReduceMean") -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.4, shape).astype(np.float32), name)

    pooled = "pooled" if keepdims else "pooled_flat"
    nodes = [
        helper.make_node("Conv", ["x", "w_in"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["a"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node(op, ["nhwc", "hw"], [pooled], keepdims=keepdims)
        if op == "ReduceSum"  # axes are an input from opset 13
        else helper.make_node(op, ["nhwc"], [pooled], axes=[1, 2], keepdims=keepdims),
    ]
    if not keepdims:
        nodes.append(helper.make_node("Reshape", ["pooled_flat", "se_shape"], ["pooled"]))
    nodes += [
        helper.make_node("Transpose", ["pooled"], ["se_in"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["se_in", "w_se"], ["se"]),
        helper.make_node("Sigmoid", ["se"], ["gate"]),
        helper.make_node("Transpose", ["gate"], ["gate_nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("Mul", ["nhwc", "gate_nhwc"], ["scaled"]),
        helper.make_node("Transpose", ["scaled"], ["back"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["back", "w_out"], ["y"]),
    ]
    inits = [weight("w_in", C, 3, 3, 3), weight("w_se", C, C, 1, 1), weight("w_out", 4, C, 1, 1)]
    inits.append(numpy_helper.from_array(np.array([1, 1, 1, C], np.int64), "se_shape"))
    inits.append(numpy_helper.from_array(np.array([1, 2], np.int64), "hw"))
    graph = helper.make_graph(
        nodes,
        "nhwc_se",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


@pytest.mark.parametrize(
    ("keepdims", "op"), [(1, "ReduceMean"), (0, "ReduceMean"), (1, "ReduceSum")]
)
def test_a_channels_last_pool_moves_to_the_spatial_axes(keepdims, op) -> None:
    model = _nhwc_squeeze_excite(keepdims, op)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "channels-last-reduce-to-spatial", "mlsoc")
    assert step.verification.passed
    reduce = next(n for n in step.model.graph.node if n.op_type == op)
    axes = next((list(a.ints) for a in reduce.attribute if a.name == "axes"), None)
    if axes is None:
        axes = numpy_helper.to_array(
            next(t for t in step.model.graph.initializer if t.name == reduce.input[1])
        ).tolist()
    assert axes == [2, 3]
    if keepdims:  # keepdims=0 leaves the fixture's own rank-2 Reshape for the lifts
        assert step.coverage_after.mla_segments == 1


def test_fix_takes_the_nhwc_squeeze_excite_block_to_one_segment() -> None:
    result = fix_model(_nhwc_squeeze_excite(), "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    assert "channels-last-reduce-to-spatial" in [step["rule"] for step in result.steps]
