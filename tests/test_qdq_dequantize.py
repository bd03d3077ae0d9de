"""`dequantized_weight` computes a weight's DequantizeLinear bit for bit as ONNX Runtime does,
and leaves to ONNX Runtime what it does not cover."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.graph import GraphView
from surgery.qdq import dequantized_weight

RNG = np.random.default_rng(7)


def _dequantize_model(x, scale, zero=None, **attrs) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(x, "x"), numpy_helper.from_array(scale, "s")]
    ins = ["x", "s"]
    if zero is not None:
        inits.append(numpy_helper.from_array(zero, "z"))
        ins.append("z")
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ins, ["y"], **attrs)],
        "dq",
        [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _ort_value(model: onnx.ModelProto) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {})[0]


def _codes(dtype, shape) -> np.ndarray:
    info = np.iinfo(dtype)  # the whole range: int32 codes above 2**24 round to float
    return RNG.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)


def _scales(n) -> np.ndarray:
    return (RNG.random(n) * 0.05 + 1e-4).astype(np.float32)


CASES = {
    "int8 per tensor": (_codes(np.int8, (16, 8, 3, 3)), _scales(1).reshape(()), None, {}),
    "uint8 per tensor, zero point": (
        _codes(np.uint8, (64, 32)),
        _scales(1).reshape(()),
        np.array(131, np.uint8),
        {},
    ),
    "int8 per channel, axis 0": (
        _codes(np.int8, (16, 8, 3, 3)),
        _scales(16),
        np.zeros(16, np.int8),
        {"axis": 0},
    ),
    "uint8 per column, axis -1": (
        _codes(np.uint8, (64, 32)),
        _scales(32),
        _codes(np.uint8, (32,)),
        {"axis": -1},
    ),
    "int32 bias": (_codes(np.int32, (64,)), _scales(64), None, {"axis": 0}),
    "int16 per tensor as [1]": (_codes(np.int16, (40, 40)), _scales(1), None, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_dequantized_weight_equals_onnx_runtime_bit_for_bit(case: str):
    x, scale, zero, attrs = CASES[case]
    model = _dequantize_model(x, scale, zero, **attrs)
    got = dequantized_weight(GraphView(model), 0)
    assert got is not None and got.dtype == np.float32
    assert got.tobytes() == _ort_value(model).tobytes()


def test_blocked_quantization_is_left_to_onnx_runtime():
    x = _codes(np.int8, (8, 64))
    model = _dequantize_model(x, _scales(8 * 2).reshape(8, 2), None, axis=1, block_size=32)
    assert dequantized_weight(GraphView(model), 0) is None


def test_a_computed_input_is_left_to_onnx_runtime():
    model = _dequantize_model(_codes(np.int8, (4, 4)), _scales(1).reshape(()))
    model.graph.initializer.pop()  # the scale comes from a node now
    scale = numpy_helper.from_array(np.array(0.5, np.float32))
    model.graph.node.insert(0, helper.make_node("Constant", [], ["s"], value=scale))
    assert dequantized_weight(GraphView(model), 1) is None
