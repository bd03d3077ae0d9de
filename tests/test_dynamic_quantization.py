"""ONNX Runtime's dynamic quantization undone (`float_model`): MatMulInteger / ConvInteger of a
DynamicQuantizeLinear'd activation, DynamicQuantizeLSTM, and the quantized bias older ORT
versions add, each become the float op with the dequantized weight."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from surgery.graph import GraphView
from surgery.qdq import REWRITTEN_AS_FLOAT_NOTE, float_model, is_quantized
from surgery.rules.fix import fix_model
from surgery.verify import make_inputs, run_model

DYNAMIC_OPS = {
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "ConvInteger",
    "DynamicQuantizeLSTM",
    "DynamicQuantizeMatMul",
}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _float_linear_and_conv() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(32, 64)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(size=64).astype(np.float32), "B"),
        numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "K"),
    ]
    nodes = [
        helper.make_node("Conv", ["img", "K"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "B"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "linear_and_conv",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 32]),
            helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 3, 8, 8]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 64]),
            helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 8, 8, 8]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _float_lstm() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    hidden, features = 8, 4
    inits = [
        numpy_helper.from_array(rng.normal(size=(1, 4 * hidden, features)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.normal(size=(1, 4 * hidden, hidden)).astype(np.float32), "R"),
        numpy_helper.from_array(rng.normal(size=(1, 8 * hidden)).astype(np.float32), "B"),
    ]
    node = helper.make_node("LSTM", ["x", "W", "R", "B"], ["y"], name="lstm", hidden_size=hidden)
    graph = helper.make_graph(
        [node],
        "lstm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 1, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 1, 1, hidden])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _dynamically_quantized(model: onnx.ModelProto, tmp_path, per_channel: bool) -> onnx.ModelProto:
    onnx.save(model, tmp_path / "float.onnx")
    quantize_dynamic(
        tmp_path / "float.onnx",
        tmp_path / "dynamic.onnx",
        weight_type=QuantType.QInt8,
        per_channel=per_channel,
    )
    return onnx.load(tmp_path / "dynamic.onnx")


@pytest.mark.parametrize("per_channel", [False, True])
def test_matmul_and_conv_become_float_ops_with_dequantized_weights(tmp_path, per_channel):
    dynamic = _dynamically_quantized(_float_linear_and_conv(), tmp_path, per_channel)
    assert {n.op_type for n in dynamic.graph.node} & DYNAMIC_OPS  # ORT did quantize it
    undone = float_model(dynamic)
    onnx.checker.check_model(undone, full_check=True)
    assert sorted(n.op_type for n in undone.graph.node) == ["Add", "Conv", "MatMul"]


@pytest.mark.parametrize("per_channel", [False, True])
def test_undone_model_computes_the_float_model_up_to_weight_rounding(tmp_path, per_channel):
    original = _float_linear_and_conv()
    undone = float_model(_dynamically_quantized(original, tmp_path, per_channel))
    feed = make_inputs(original, seed=0)
    expected, got = run_model(original, feed), run_model(undone, feed)
    for name in ("y", "c"):
        assert _cosine(expected[name], got[name]) > 0.9999, name


@pytest.mark.parametrize("per_channel", [False, True])
def test_dynamic_lstm_becomes_an_lstm_with_its_float_weights(tmp_path, per_channel):
    original = _float_lstm()
    dynamic = _dynamically_quantized(original, tmp_path, per_channel)
    assert "DynamicQuantizeLSTM" in {n.op_type for n in dynamic.graph.node}
    undone = float_model(dynamic)
    assert [n.op_type for n in undone.graph.node] == ["LSTM"]
    feed = make_inputs(original, seed=0)
    assert _cosine(run_model(original, feed)["y"], run_model(undone, feed)["y"]) > 0.999


def _old_ort_conv_with_quantized_bias() -> onnx.ModelProto:
    """A ConvInteger whose bias is quantized at run time, as older ORT versions wrote it:
    Add(conv_int32, Reshape(Cast(Floor(Div(bias, x_scale · w_scale))))) → Cast → Mul."""
    rng = np.random.default_rng(2)
    inits = [
        numpy_helper.from_array(rng.integers(-100, 100, (4, 3, 3, 3)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.array(0, np.int8), "w_zero"),
        numpy_helper.from_array(np.array(0.02, np.float32), "w_scale"),
        numpy_helper.from_array(rng.normal(size=4).astype(np.float32), "bias"),
        numpy_helper.from_array(np.array([1, 4, 1, 1], np.int64), "bias_shape"),
    ]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zero"]),
        helper.make_node("Mul", ["x_scale", "w_scale"], ["bias_scale"]),
        helper.make_node("Div", ["bias", "bias_scale"], ["bias_div"]),
        helper.make_node("Floor", ["bias_div"], ["bias_floor"]),
        helper.make_node("Cast", ["bias_floor"], ["bias_int"], to=TensorProto.INT32),
        helper.make_node("Reshape", ["bias_int", "bias_shape"], ["bias_4d"]),
        helper.make_node(
            "ConvInteger", ["x_q", "w_q", "x_zero", "w_zero"], ["acc"], name="conv", pads=[1] * 4
        ),
        helper.make_node("Add", ["acc", "bias_4d"], ["acc_biased"]),
        helper.make_node("Cast", ["acc_biased"], ["acc_float"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x_scale", "w_scale"], ["out_scale"]),
        helper.make_node("Mul", ["acc_float", "out_scale"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "old_ort_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_run_time_quantized_bias_becomes_the_convs_float_bias():
    dynamic = _old_ort_conv_with_quantized_bias()
    undone = float_model(dynamic)
    assert [n.op_type for n in undone.graph.node] == ["Conv"]
    assert list(undone.graph.node[0].input)[2] == "bias"
    feed = make_inputs(dynamic, seed=0)
    assert _cosine(run_model(dynamic, feed)["y"], run_model(undone, feed)["y"]) > 0.999


def test_a_dynamically_quantized_model_counts_as_quantized(tmp_path):
    dynamic = _dynamically_quantized(_float_linear_and_conv(), tmp_path, per_channel=False)
    assert is_quantized(GraphView(dynamic))
    assert not is_quantized(GraphView(_float_linear_and_conv()))


def test_fix_of_a_dynamically_quantized_model_returns_the_float_model_and_says_so(tmp_path):
    dynamic = _dynamically_quantized(_float_linear_and_conv(), tmp_path, per_channel=True)
    result = fix_model(dynamic, "mlsoc")
    assert not {n.op_type for n in result.model.graph.node} & DYNAMIC_OPS
    assert result.notes[0] == REWRITTEN_AS_FLOAT_NOTE


def test_a_quantized_embedding_becomes_a_gather_of_the_float_table(tmp_path):
    rng = np.random.default_rng(3)
    table = numpy_helper.from_array(rng.normal(size=(50, 16)).astype(np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], name="embed")],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
        [table],
    )
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(original, tmp_path / "float.onnx")
    quantize_dynamic(
        tmp_path / "float.onnx", tmp_path / "dynamic.onnx", op_types_to_quantize=["Gather"]
    )
    dynamic = onnx.load(tmp_path / "dynamic.onnx")
    assert "DequantizeLinear" in {n.op_type for n in dynamic.graph.node}
    undone = float_model(dynamic)
    assert [n.op_type for n in undone.graph.node] == ["Gather"]
    feed = make_inputs(original, seed=0)
    np.testing.assert_allclose(
        run_model(undone, feed)["y"], run_model(dynamic, feed)["y"], rtol=1e-6, atol=1e-6
    )


def test_a_fused_dynamic_matmul_becomes_a_matmul_and_its_bias():
    """com.microsoft.DynamicQuantizeMatMul, which ORT's optimiser fuses the pattern into."""
    rng = np.random.default_rng(4)
    # |w| <= 64: ONNX Runtime's AVX2 uint8 x int8 kernel adds product pairs in int16, which
    # saturates past that (on CPUs without VNNI), and the test compares with its result
    inits = [
        numpy_helper.from_array(rng.integers(-64, 65, (16, 8)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.full(8, 0.01, np.float32), "w_scale"),
        numpy_helper.from_array(np.zeros(8, np.int8), "w_zero"),
        numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "bias"),
    ]
    node = helper.make_node(
        "DynamicQuantizeMatMul",
        ["x", "w_q", "w_scale", "w_zero", "bias"],
        ["y"],
        name="fused",
        domain="com.microsoft",
    )
    graph = helper.make_graph(
        [node],
        "fused",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
        inits,
    )
    dynamic = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    undone = float_model(dynamic)
    assert [n.op_type for n in undone.graph.node] == ["MatMul", "Add"]
    feed = make_inputs(dynamic, seed=0)
    assert _cosine(run_model(dynamic, feed)["y"], run_model(undone, feed)["y"]) > 0.999
