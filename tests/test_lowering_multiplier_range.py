"""A requantization multiplier past the 31-bit fixed point (an output scale far finer than its
inputs', as calibration gives an untrained network whose activations shrink to ~1e-24) makes
that node a host step with the reason; neither the reference executor nor compile crashes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.intmath import MultiplierRangeError, quantize_multiplier
from compiler.runtime import IntegerExecutor


def test_quantize_multiplier_names_the_multiplier_it_cannot_hold() -> None:
    with pytest.raises(MultiplierRangeError, match=r"8\.06e\+20 is past the 31-bit fixed point"):
        quantize_multiplier(np.array([0.5, 8.06e20]))


def _conv_layernorm(out_scale: float) -> onnx.ModelProto:
    """Q → DQ → Conv → Q → DQ → LayerNorm → Q(out_scale) → DQ: a LayerNorm whose output
    scale is `out_scale` while its normalised values are of order 1."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "x_s"),
        numpy_helper.from_array(np.array(0, np.int8), "x_z"),
        numpy_helper.from_array(rng.integers(-90, 90, (4, 4, 1, 1)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.array(0.01, np.float32), "w_s"),
        numpy_helper.from_array(np.array(0, np.int8), "w_z"),
        numpy_helper.from_array(np.array(0.04, np.float32), "c_s"),
        numpy_helper.from_array(np.array(0, np.int8), "c_z"),
        numpy_helper.from_array(np.ones(4, np.float32), "gamma"),
        numpy_helper.from_array(np.array(out_scale, np.float32), "y_s"),
        numpy_helper.from_array(np.array(0, np.int8), "y_z"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_d"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]),
        helper.make_node("Conv", ["x_d", "w"], ["c"], "conv"),
        helper.make_node("QuantizeLinear", ["c", "c_s", "c_z"], ["c_q"]),
        helper.make_node("DequantizeLinear", ["c_q", "c_s", "c_z"], ["c_d"]),
        helper.make_node("LayerNormalization", ["c_d", "gamma"], ["n"], "norm", axis=1),
        helper.make_node("QuantizeLinear", ["n", "y_s", "y_z"], ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_s", "y_z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_layernorm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_an_unrepresentable_multiplier_leaves_the_node_to_the_host_with_the_reason() -> None:
    executor = IntegerExecutor(_conv_layernorm(1e-24))
    reasons = dict(executor.float_nodes)
    assert "31-bit fixed point" in reasons["norm"]
    assert "conv" in [step.name for step in executor.steps]


def test_compile_runs_the_node_on_a_host_stage_and_says_why(tmp_path) -> None:
    result = compile_model(_conv_layernorm(1e-24), tmp_path, target="mlsoc", model_name="ln")
    assert result.archive.exists()
    assert any("31-bit fixed point" in note for note in result.notes), result.notes
