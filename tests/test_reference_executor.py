"""The executor on whole graphs: patterns, fusion, float islands, the integer API and errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType

from compiler.runtime import (
    ExecutionError,
    IntegerExecutor,
    QdqModelError,
    UnsupportedQuantizedOpError,
)
from tests.test_reference_support import (
    float_model,
    ort_quantize,
    ort_run,
    random_feeds,
    steps_apart,
)


class QdqBuilder:
    """Hand-written QDQ graphs, in the conventions of the project's own quantizer."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, np.ndarray] = {}
        self.inputs: dict[str, tuple[int, ...]] = {}
        self.outputs: list[str] = []

    def constant(self, name: str, value: np.ndarray) -> str:
        self.initializers[name] = value
        return name

    def quantize(self, x: str, scale: float, zero_point: int, dtype=np.int8) -> str:
        scale_name = self.constant(f"{x}_s", np.array(scale, dtype=np.float32))
        zero_name = self.constant(f"{x}_z", np.array(zero_point, dtype=dtype))
        self.nodes.append(
            helper.make_node("QuantizeLinear", [x, scale_name, zero_name], [f"{x}_q"])
        )
        return f"{x}_q"

    def dequantize(self, q: str, scale, zero_point, axis: int | None = None) -> str:
        scale = np.asarray(scale, dtype=np.float32)
        zero_point = np.asarray(zero_point)
        scale_name = self.constant(f"{q}_dqs", scale)
        zero_name = self.constant(f"{q}_dqz", zero_point)
        attributes = {} if axis is None else {"axis": axis}
        self.nodes.append(
            helper.make_node(
                "DequantizeLinear", [q, scale_name, zero_name], [f"{q}_f"], **attributes
            )
        )
        return f"{q}_f"

    def activation(self, x: str, scale: float, zero_point: int, dtype=np.int8) -> str:
        """Q -> DQ on an activation; returns the float view."""
        return self.dequantize(
            self.quantize(x, scale, zero_point, dtype), scale, np.array(zero_point, dtype)
        )

    def node(self, op_type: str, inputs: list[str], output: str, **attributes) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], **attributes))
        return output

    def build(self, outputs: list[str], opset: int = 17) -> onnx.ModelProto:
        return float_model(self.nodes, self.inputs, outputs, self.initializers, opset)


def _small_cnn(rng: np.random.Generator) -> onnx.ModelProto:
    """conv-relu-maxpool-conv-add-globalaveragepool, with a residual add."""
    initializers = {
        "W1": (0.4 * rng.standard_normal((8, 3, 3, 3))).astype(np.float32),
        "B1": (0.1 * rng.standard_normal(8)).astype(np.float32),
        "W2": (0.3 * rng.standard_normal((8, 8, 3, 3))).astype(np.float32),
        "B2": (0.1 * rng.standard_normal(8)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node(
            "MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Conv", ["p1", "W2", "B2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p1"], ["a"], name="add"),
        helper.make_node("GlobalAveragePool", ["a"], ["y"], name="gap"),
    ]
    return float_model(nodes, {"x": (1, 3, 16, 16)}, ["y"], initializers)


@pytest.mark.parametrize("mode", ["sima", "tflite"])
@pytest.mark.parametrize("activation_type", [QuantType.QInt8, QuantType.QUInt8])
@pytest.mark.parametrize("per_channel", [True, False])
def test_small_cnn_quantized_by_ort_agrees_within_one_step(
    mode: str, activation_type: QuantType, per_channel: bool
) -> None:
    rng = np.random.default_rng(20)
    model = _small_cnn(rng)
    qdq = ort_quantize(
        model,
        random_feeds(model, rng, 16),
        per_channel=per_channel,
        activation_type=activation_type,
    )
    executor = IntegerExecutor(qdq, mode, strict=True)
    assert [s.kind for s in executor.steps].count("float") == 0
    assert steps_apart(executor, qdq, random_feeds(model, rng, 8))["y"] <= 1


def test_float_island_between_quantized_convs_runs_in_float() -> None:
    rng = np.random.default_rng(21)
    initializers = {
        "W1": rng.standard_normal((4, 2, 3, 3)).astype(np.float32),
        "W2": rng.standard_normal((4, 4, 1, 1)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Sin", ["c1"], ["s"]),
        helper.make_node("Conv", ["s", "W2"], ["y"]),
    ]
    model = float_model(nodes, {"x": (1, 2, 6, 6)}, ["y"], initializers)
    qdq = ort_quantize(model, random_feeds(model, rng, 8), op_types=["Conv"])
    executor = IntegerExecutor(qdq)
    assert [name for name, _ in executor.float_nodes] == ["s"]
    kinds = [s.kind for s in executor.steps]
    assert kinds == [
        "quantize",
        "integer",
        "dequantize",
        "float",
        "quantize",
        "integer",
        "dequantize",
    ]
    assert steps_apart(executor, qdq, random_feeds(model, rng, 3))["y"] <= 1


def test_node_excluded_from_quantization_runs_as_a_float_island() -> None:
    rng = np.random.default_rng(22)
    model = _small_cnn(rng)
    qdq = ort_quantize(model, random_feeds(model, rng, 8), nodes_to_exclude=["conv2"])
    executor = IntegerExecutor(qdq, strict=True)
    assert "conv2" in {name for name, _ in executor.float_nodes}
    assert steps_apart(executor, qdq, random_feeds(model, rng, 3))["y"] <= 1


def test_run_integer_returns_the_codes_that_run_dequantizes() -> None:
    rng = np.random.default_rng(23)
    model = _small_cnn(rng)
    qdq = ort_quantize(model, random_feeds(model, rng, 8))
    executor = IntegerExecutor(qdq)
    feed = random_feeds(model, rng, 1)[0]
    x_params, y_params = executor.input_params["x"], executor.output_params["y"]
    codes = np.clip(
        np.rint(feed["x"] / x_params.scalar_scale()) + x_params.scalar_zero_point(), -128, 127
    ).astype(np.int8)
    integer = executor.run_integer({"x": codes})["y"]
    assert integer.dtype == np.int8
    dequantized = (integer.astype(np.float32) - y_params.scalar_zero_point()) * y_params.scale
    np.testing.assert_array_equal(dequantized, executor.run(feed)["y"])


def test_keep_intermediates_exposes_every_integer_tensor_with_its_params() -> None:
    rng = np.random.default_rng(24)
    model = _small_cnn(rng)
    qdq = ort_quantize(model, random_feeds(model, rng, 8))
    executor = IntegerExecutor(qdq, keep_intermediates=True)
    executor.run(random_feeds(model, rng, 1)[0])
    assert executor.tensor_params
    for name, params in executor.tensor_params.items():
        assert executor.intermediates[name].dtype == params.dtype


def test_intermediates_are_not_kept_by_default() -> None:
    rng = np.random.default_rng(24)
    model = _small_cnn(rng)
    executor = IntegerExecutor(ort_quantize(model, random_feeds(model, rng, 4)))
    executor.run(random_feeds(model, rng, 1)[0])
    assert executor.intermediates == {}


def _conv_bias_activation(activation: str, rng: np.random.Generator) -> onnx.ModelProto:
    """DQ(x), DQ(int8 per-channel w), DQ(int32 bias) -> Conv -> activation -> Q -> DQ."""
    b = QdqBuilder()
    b.inputs["x"] = (1, 3, 6, 6)
    x_scale, w_scale = 0.02, np.array([0.01, 0.02, 0.015, 0.03], dtype=np.float32)
    x = b.activation("x", x_scale, 3)
    w = b.constant("w", rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8))
    bias = b.constant("bias", rng.integers(-2000, 2000, 4).astype(np.int32))
    conv = b.node(
        "Conv",
        [
            x,
            b.dequantize(w, w_scale, np.zeros(4, np.int8), axis=0),
            b.dequantize(bias, x_scale * w_scale, np.zeros(4, np.int32), axis=0),
        ],
        "conv",
        pads=[1, 1, 1, 1],
    )
    if activation == "Relu":
        act = b.node("Relu", [conv], "act")
    else:
        low = b.constant("low", np.array(0.0, np.float32))
        high = b.constant("high", np.array(1.5, np.float32))
        act = b.node("Clip", [conv, low, high], "act")
    y = b.activation(act, 0.05, -10)
    return b.build([y])


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_conv_bias_and_activation_before_quantize_fuse_into_one_integer_step(
    activation: str,
) -> None:
    rng = np.random.default_rng(25)
    qdq = _conv_bias_activation(activation, rng)
    executor = IntegerExecutor(qdq, strict=True)
    (step,) = [s for s in executor.steps if s.kind == "integer"]
    assert step.pattern == f"Conv+{activation}"
    feeds = random_feeds(qdq, rng, 3)
    assert steps_apart(executor, qdq, feeds)["act_q_f"] <= 1


def test_fused_clip_clamps_at_the_quantized_bounds() -> None:
    rng = np.random.default_rng(26)
    qdq = _conv_bias_activation("Clip", rng)
    executor = IntegerExecutor(qdq)
    out = executor.run_integer({"x": rng.integers(-128, 128, (1, 3, 6, 6)).astype(np.int8)})
    codes = out["act_q_f"]
    assert codes.min() >= -10
    assert codes.max() <= -10 + 30
    assert codes.max() == 20


def test_silu_written_as_mul_of_sigmoid_is_one_lookup_table() -> None:
    rng = np.random.default_rng(27)
    b = QdqBuilder()
    b.inputs["x"] = (2, 16)
    x = b.activation("x", 0.04, 0)
    gate = b.node("Sigmoid", [x], "gate")
    y = b.activation(b.node("Mul", [x, gate], "silu"), 0.02, -100)
    qdq = b.build([y])
    executor = IntegerExecutor(qdq, strict=True)
    (step,) = [s for s in executor.steps if s.kind == "integer"]
    assert step.pattern == "Mul(x, Sigmoid(x))"
    assert step.kernel.table.shape == (256,)
    assert steps_apart(executor, qdq, random_feeds(qdq, rng, 3))[y] <= 1


def test_matmul_followed_by_a_constant_add_fuses_the_bias() -> None:
    rng = np.random.default_rng(28)
    b = QdqBuilder()
    b.inputs["x"] = (3, 8)
    x_scale, w_scale = 0.03, 0.01
    x = b.activation("x", x_scale, 5)
    w = b.dequantize(
        b.constant("w", rng.integers(-127, 128, (8, 4)).astype(np.int8)), w_scale, np.int8(0)
    )
    bias = b.dequantize(
        b.constant("bias", rng.integers(-500, 500, 4).astype(np.int32)),
        x_scale * w_scale,
        np.int32(0),
    )
    added = b.node("Add", [b.node("MatMul", [x, w], "mm"), bias], "biased")
    y = b.activation(b.node("Relu", [added], "relu"), 0.02, -128)
    qdq = b.build([y])
    executor = IntegerExecutor(qdq, strict=True)
    (step,) = [s for s in executor.steps if s.kind == "integer"]
    assert step.pattern == "MatMul+Add+Relu"
    assert steps_apart(executor, qdq, random_feeds(qdq, rng, 3))[y] <= 1


@pytest.mark.parametrize(("scale", "zero_point"), [(0.02, 3), (0.05, -7)])
def test_dequantize_then_quantize_is_an_integer_requantization(
    scale: float, zero_point: int
) -> None:
    rng = np.random.default_rng(29)
    b = QdqBuilder()
    b.inputs["x"] = (4, 5)
    y = b.activation(b.activation("x", 0.02, 3), scale, zero_point)
    qdq = b.build([y])
    executor = IntegerExecutor(qdq, strict=True)
    assert [s.pattern for s in executor.steps if s.kind == "integer"] == ["Requantize"]
    assert steps_apart(executor, qdq, random_feeds(qdq, rng, 3))[y] <= 1


def test_strict_mode_rejects_a_quantized_op_without_integer_form() -> None:
    b = QdqBuilder()
    b.inputs["x"] = (2, 3)
    y = b.activation(b.node("Sin", [b.activation("x", 0.02, 0)], "sin"), 0.01, 0)
    with pytest.raises(UnsupportedQuantizedOpError, match="Sin"):
        IntegerExecutor(b.build([y]), strict=True)


def test_quantized_op_without_integer_form_runs_in_float_by_default() -> None:
    rng = np.random.default_rng(30)
    b = QdqBuilder()
    b.inputs["x"] = (2, 3)
    y = b.activation(b.node("Sin", [b.activation("x", 0.02, 0)], "sin"), 0.01, 0)
    qdq = b.build([y])
    executor = IntegerExecutor(qdq)
    assert [name for name, _ in executor.float_nodes] == ["sin"]
    assert steps_apart(executor, qdq, random_feeds(qdq, rng, 2))[y] == 0


def test_int32_accumulator_saturates_before_requantization() -> None:
    depth = 140_000
    b = QdqBuilder()
    b.inputs["x"] = (1, depth)
    x = b.activation("x", 1.0, 0)
    w = b.dequantize(b.constant("w", np.full((depth, 1), 127, np.int8)), 1.0, np.int8(0))
    y = b.activation(b.node("MatMul", [x, w], "mm"), 2.0**17, 0, dtype=np.int16)
    executor = IntegerExecutor(b.build([y]), strict=True)
    codes = executor.run_integer({"x": np.full((1, depth), 127, np.int8)})[y]
    assert depth * 127 * 127 > 2**31
    assert int(codes.reshape(())) == round((2**31 - 1) / 2**17)


def test_blocked_int4_weights_fall_back_to_float() -> None:
    rng = np.random.default_rng(31)
    b = QdqBuilder()
    b.inputs["x"] = (2, 8)
    x = b.activation("x", 0.05, 0)
    weights = numpy_helper.from_array(rng.integers(-8, 8, (8, 4)).astype(np.int8), "w4")
    weights.data_type = TensorProto.INT4
    b.nodes.append(
        helper.make_node("DequantizeLinear", ["w4", "w4_s"], ["w4_f"], axis=0, block_size=4)
    )
    b.constant("w4_s", np.full((2, 4), 0.1, np.float32))
    y = b.activation(b.node("MatMul", [x, "w4_f"], "mm"), 0.1, 0)
    model = b.build([y], opset=21)
    model.graph.initializer.append(
        helper.make_tensor("w4", TensorProto.INT4, (8, 4), rng.integers(-8, 8, 32).tolist())
    )
    executor = IntegerExecutor(model)
    assert {name for name, _ in executor.float_nodes} >= {"mm"}
    feeds = random_feeds(model, rng, 2)
    assert steps_apart(executor, model, feeds)[y] <= 1


def test_unknown_requantization_mode_is_rejected() -> None:
    b = QdqBuilder()
    b.inputs["x"] = (2,)
    y = b.activation("x", 0.1, 0)
    with pytest.raises(ValueError, match="requantization_mode"):
        IntegerExecutor(b.build([y]), "round-robin")  # type: ignore[arg-type]


def test_missing_input_is_a_clear_error() -> None:
    b = QdqBuilder()
    b.inputs["x"] = (2,)
    executor = IntegerExecutor(b.build([b.activation("x", 0.1, 0)]))
    with pytest.raises(ExecutionError, match="missing input 'x'"):
        executor.run({})


def test_run_integer_rejects_codes_outside_the_input_type() -> None:
    b = QdqBuilder()
    b.inputs["x"] = (2,)
    executor = IntegerExecutor(b.build([b.activation("x", 0.1, 0)]))
    with pytest.raises(ExecutionError, match="outside int8"):
        executor.run_integer({"x": np.array([0, 300], dtype=np.int16)})


def test_input_quantization_rounds_like_onnx_quantize_linear() -> None:
    b = QdqBuilder()
    b.inputs["x"] = (3,)
    y = b.activation("x", 0.1, 0)
    qdq = b.build([y])
    feed = {"x": np.array([0.05, 0.15, -0.25], dtype=np.float32)}
    np.testing.assert_array_equal(IntegerExecutor(qdq).run(feed)[y], ort_run(qdq, feed)[y])


def test_division_by_zero_saturates_towards_the_sign_of_the_numerator() -> None:
    b = QdqBuilder()
    b.inputs["a"] = (3,)
    b.inputs["d"] = (3,)
    quotient = b.node("Div", [b.activation("a", 0.1, 0), b.activation("d", 0.1, 5)], "div")
    y = b.activation(quotient, 0.5, 0)
    executor = IntegerExecutor(b.build([y]), strict=True)
    codes = executor.run_integer(
        {"a": np.array([7, -7, 0], np.int8), "d": np.array([5, 5, 5], np.int8)}
    )[y]
    assert codes.tolist() == [127, -128, 0]


def test_model_from_the_project_quantizer_runs_fully_integer() -> None:
    quantizer = pytest.importorskip("compiler.quantize.quantizer")
    rng = np.random.default_rng(35)
    model = _small_cnn(rng)
    qdq = quantizer.quantize_model(model, random_feeds(model, rng, 4)).model
    executor = IntegerExecutor(qdq, strict=True)
    assert executor.float_nodes == ()
    assert "Conv+Relu" in {s.pattern for s in executor.steps}
    assert steps_apart(executor, qdq, random_feeds(model, rng, 3))["y"] <= 1


def test_cyclic_graph_is_a_clear_error() -> None:
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
    ]
    with pytest.raises(QdqModelError, match="cycle"):
        IntegerExecutor(float_model(nodes, {"x": (2,)}, ["b"]))
