"""Rules skip a node whose declared output does not fit it (not 4-D) instead of failing on it:
check names the blockers, and warns of no rule. Attributes ONNX's inference finds invalid (a
perm that is no permutation, pads of the wrong length) are refused on load
(test_invalid_nodes.py)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model


def _model(nodes, inputs, output_shape=None, initializers=()):
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
        initializer=list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _rule_warnings(model, caplog) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="surgery.rules.suggest"):
        check_model(model)
    return [r.getMessage() for r in caplog.records if r.name == "surgery.rules.suggest"]


def _conv(pads: list[int], output_shape=None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    weight = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=pads, strides=[32, 32])
    return _model([conv], [x], output_shape, [weight])


def test_a_blocked_conv_whose_declared_output_is_not_4d_is_skipped(caplog):
    assert _rule_warnings(_conv(pads=[1, 1, 1, 1], output_shape=[4]), caplog) == []
