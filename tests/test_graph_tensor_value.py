"""`graph.tensor_value` (the direct decode behind `GraphView.constant_value`) equals
`numpy_helper.to_array`: same dtype, shape, bytes and writeability, for raw and typed-field
storage alike."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.graph import tensor_value

CASES = [
    numpy_helper.from_array(np.float32(3.0).reshape(())),
    numpy_helper.from_array(np.arange(6, dtype=np.int64).reshape(2, 3)),
    numpy_helper.from_array(np.array([True, False])),
    numpy_helper.from_array(np.float16([1, 2])),
    numpy_helper.from_array(np.array([], np.float32)),
    helper.make_tensor("a", TensorProto.FLOAT, [2], [1.0, 2.5]),
    helper.make_tensor("b", TensorProto.INT64, [1], [5]),
    helper.make_tensor("c", TensorProto.INT32, [2, 1], [5, -3]),
    helper.make_tensor("d", TensorProto.DOUBLE, [], [0.1]),
    helper.make_tensor("e", TensorProto.FLOAT, [], [-0.0]),
    helper.make_tensor("f", TensorProto.BOOL, [2], [1, 0]),
    helper.make_tensor("g", TensorProto.FLOAT16, [1], [1.5]),
    helper.make_tensor("h", TensorProto.UINT8, [2], [200, 3]),
    helper.make_tensor("i", TensorProto.UINT8, [], [128]),  # ORT's zero points
    helper.make_tensor("j", TensorProto.INT8, [3], [-128, 0, 127]),
    helper.make_tensor("k", TensorProto.INT16, [2], [-32768, 32767]),
    helper.make_tensor("l", TensorProto.UINT16, [1, 1], [65535]),
]


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.data_type}-{t.name or 'raw'}")
def test_tensor_value_equals_to_array(tensor):
    got, want = tensor_value(tensor), numpy_helper.to_array(tensor)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert got.flags.writeable == want.flags.writeable
