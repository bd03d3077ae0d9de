"""evaluate_constants: the values of computed constants, without folding the model."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from surgery.constant_values import evaluate_constants
from surgery.model import open_model


def _model(nodes: list[onnx.NodeProto], inputs=(), initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "constants",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 5]),
            *inputs,
        ],
        [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
        list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _index(name: str, value) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64))
    )


def test_a_shape_of_a_static_tensor_reads_as_that_shape():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"], start=1),
        _index("i", [0, 2]),
        helper.make_node("Gather", ["s", "i"], ["g"], axis=0),
        helper.make_node("Reshape", ["x", "g"], ["y"], allowzero=0),
    ]
    _, view = open_model(_model(nodes))
    values = evaluate_constants(view, ["g", "s"])
    assert values is not None
    np.testing.assert_array_equal(values["s"], [3, 4, 5])
    np.testing.assert_array_equal(values["g"], [3, 5])


def test_a_value_computed_from_a_graph_input_is_not_a_constant():
    nodes = [
        helper.make_node("Cast", ["n"], ["n64"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["x", "n64"], ["y"]),
    ]
    extra = [helper.make_tensor_value_info("n", TensorProto.INT32, [2])]
    _, view = open_model(_model(nodes, extra))
    assert evaluate_constants(view, ["n64"]) is None


def test_a_random_op_is_not_a_constant():
    nodes = [
        helper.make_node("RandomNormal", [], ["noise"], shape=[1, 3, 4, 5]),
        helper.make_node("Add", ["x", "noise"], ["y"]),
    ]
    _, view = open_model(_model(nodes))
    assert evaluate_constants(view, ["noise"]) is None


def test_more_nodes_than_allowed_leave_the_value_unknown():
    weight = numpy_helper.from_array(np.ones((5,), np.float32), "w")
    nodes, last = [], "w"
    for k in range(6):
        nodes.append(helper.make_node("Neg", [last], [f"n{k}"]))
        last = f"n{k}"
    nodes.append(helper.make_node("Add", ["x", last], ["y"]))
    _, view = open_model(_model(nodes, initializers=[weight]))
    assert evaluate_constants(view, [last], max_nodes=5) is None
    np.testing.assert_array_equal(evaluate_constants(view, [last], max_nodes=6)[last], np.ones(5))
