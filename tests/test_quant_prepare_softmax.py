"""prepare_model raises opset < 13 models to 13 without splitting a Softmax the float model ran
as one op: ONNX's version converter spells every old Softmax as Flatten → Softmax → Reshape, and
a host Flatten in the middle of an MLA region made the compile produce one `.elf` more than
`surgery check` counted for the float model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from compiler.quantize.prepare import prepare_model
from tests.architectures import Builder


def _softmax_after_conv(height: int, opset: int = 11) -> onnx.ModelProto:
    """Conv → Softmax(axis=1): over the channels only when height = width = 1."""
    b = Builder()
    b.node("Softmax", [b.conv("c", "x", 3, 8, kernel=1, act=None)], "probs", axis=1)
    return b.model("softmax", {"x": [1, 3, height, height]}, ["probs"], opset=opset)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_softmax_over_trailing_unit_axes_stays_one_node_on_its_axis() -> None:
    original = _softmax_after_conv(height=1)
    prepared = prepare_model(original, opset=13).model
    assert _ops(prepared) == ["Conv", "Softmax"]
    softmax = prepared.graph.node[1]
    assert onnx.helper.get_attribute_value(softmax.attribute[0]) == 1
    x = np.random.default_rng(0).normal(size=(1, 3, 1, 1)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(original, x), rtol=1e-6, atol=1e-7)


def test_softmax_over_several_axes_keeps_the_converters_flatten() -> None:
    original = _softmax_after_conv(height=3)
    prepared = prepare_model(original, opset=13).model
    assert "Flatten" in _ops(prepared)
    x = np.random.default_rng(0).normal(size=(1, 3, 3, 3)).astype(np.float32)
    np.testing.assert_allclose(_run(prepared, x), _run(original, x), rtol=1e-6, atol=1e-7)
