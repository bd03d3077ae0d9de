"""A BatchNormalization with no conv before it (MobileNetV4's attention blocks normalise the
residual stream) is prepared as x · scale + shift — and as x · scale alone when the shift is
zero: an Add of a zero constant would quantize it with a scale unrelated to the activation
(MobileNetV4-hybrid with initialised weights split into 5 .elf for check's 1)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.quantize.prepare import prepare_model


def _residual_batchnorm(shift: float) -> onnx.ModelProto:
    """Conv → Add(residual) → BatchNormalization (beta = shift, mean 0) → Conv."""
    rng = np.random.default_rng(0)
    c = 4
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (c, c, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (c, c, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), "gamma"),
        numpy_helper.from_array(np.full(c, shift, np.float32), "beta"),
        numpy_helper.from_array(np.zeros(c, np.float32), "mean"),
        numpy_helper.from_array(np.ones(c, np.float32), "var"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Add", ["a", "x"], ["res"]),
            helper.make_node(
                "BatchNormalization", ["res", "gamma", "beta", "mean", "var"], ["bn"], name="bn"
            ),
            helper.make_node("Conv", ["bn", "w2"], ["y"]),
        ],
        "residual_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize(("shift", "ops"), [(0.0, ["Mul"]), (0.25, ["Mul", "Add"])])
def test_a_batchnorm_after_an_add_becomes_a_scale_and_a_shift_only_if_nonzero(shift, ops) -> None:
    prepared = prepare_model(_residual_batchnorm(shift)).model
    assert "BatchNormalization" not in [n.op_type for n in prepared.graph.node]
    assert [n.op_type for n in prepared.graph.node if n.name.startswith("bn")] == ops


def test_the_prepared_model_computes_the_batchnorm() -> None:
    model = _residual_batchnorm(0.0)
    x = np.random.default_rng(1).normal(size=(1, 4, 4, 4)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    prepared = prepare_model(model).model
    got = ort.InferenceSession(prepared.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
