"""Q/DQ parameters ONNX Runtime would refuse are named before compiling, where the compiler
failed in numpy (a zero scale's multiplier, 17 per-axis scales broadcast over 16 channels)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.errors import InvalidGraphError
from surgery.model import open_model
from surgery.qdq_check import qdq_problem, raise_malformed_qdq


def _qdq(scale, zero_point, axis: int | None = None, x_type=TensorProto.FLOAT) -> onnx.ModelProto:
    """x [1, 4, 2, 2] → QuantizeLinear → DequantizeLinear → y, with the given parameters."""
    inits = [
        numpy_helper.from_array(np.asarray(scale), "s"),
        numpy_helper.from_array(np.asarray(zero_point), "z"),
    ]
    attrs = {} if axis is None else {"axis": axis}
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="quant", **attrs),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dequant", **attrs),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", x_type, [1, 4, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _problem(model: onnx.ModelProto) -> str | None:
    view = open_model(model)[1]
    return qdq_problem(view, view.index_by_name["quant"])


def test_well_formed_parameters_have_no_problem():
    assert _problem(_qdq(np.float32(0.1), np.int8(3))) is None
    per_channel = _qdq(np.full(4, 0.1, np.float32), np.zeros(4, np.int8), axis=1)
    assert _problem(per_channel) is None


def test_a_one_element_scale_beside_a_scalar_zero_point_is_well_formed():
    """What ORT's quantizer writes, and ONNX Runtime runs."""
    assert _problem(_qdq(np.array([0.1], np.float32), np.int8(0))) is None


@pytest.mark.parametrize("scale", [0.0, -0.5, np.nan, np.inf])
def test_a_scale_that_is_not_positive_and_finite_is_named(scale):
    assert "scales must be positive and finite" in _problem(_qdq(np.float32(scale), np.int8(0)))


def test_a_zero_point_of_a_float_type_is_named():
    assert "not an integer type" in _problem(_qdq(np.float32(0.1), np.float32(0)))


def test_a_zero_point_with_another_count_than_the_scale_is_named():
    model = _qdq(np.full(4, 0.1, np.float32), np.zeros(3, np.int8), axis=1)
    assert "has 3 value(s), its scale 4" in _problem(model)


def test_per_axis_scales_that_do_not_match_the_axis_are_named():
    model = _qdq(np.full(5, 0.1, np.float32), np.zeros(5, np.int8), axis=1)
    assert "5 per-axis scales for the 4 elements of axis 1" in _problem(model)


def test_a_per_axis_axis_out_of_range_is_named():
    model = _qdq(np.full(4, 0.1, np.float32), np.zeros(4, np.int8), axis=4)
    assert "axis 4 is out of range for its rank-4 input" in _problem(model)


def test_a_dequantize_of_float_values_is_named():
    model = _qdq(np.float32(0.1), np.int8(0))
    model.graph.node[1].input[0] = "x"  # dequantize the float input itself
    view = open_model(model)[1]
    assert "it dequantizes integer codes" in qdq_problem(view, view.index_by_name["dequant"])


def test_a_scale_of_rank_above_one_is_named():
    """A QuantizeLinear whose inputs were swapped: its scale is the activation."""
    model = _qdq(np.float32(0.1), np.int8(0))
    model.graph.node[0].input[0], model.graph.node[0].input[1] = "s", "x"
    assert "its scale 'x' has rank 4" in _problem(model)


def test_compile_refuses_a_zero_scale_naming_the_node(tmp_path):
    from compiler.compile import compile_model

    with pytest.raises(InvalidGraphError, match=r"node 'quant' \(QuantizeLinear\): its scale"):
        compile_model(_qdq(np.float32(0.0), np.int8(0)), tmp_path)
    assert not list(tmp_path.iterdir())


def test_raise_malformed_qdq_names_the_model():
    view = open_model(_qdq(np.float32(-1.0), np.int8(0)))[1]
    with pytest.raises(InvalidGraphError, match="^qdq.onnx: node 'quant'"):
        raise_malformed_qdq(view, "qdq.onnx")
