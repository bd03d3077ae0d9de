"""ONNX Runtime's QOperator quantization (QLinearConv, QGemm, QLinearAdd, ...) read as QDQ
(`surgery.qoperator`): the rewrite computes what the integer ops compute (ONNX Runtime on
both, within one output quantization step), check counts the segments of the float model,
compile keeps the model's scales and runs bit-exact, fix rewrites the float model."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.quantize import QuantizationError, quantize_model
from compiler.runtime.compare import compare_with_reference
from compiler.runtime.pipeline import run_archive
from surgery.check import check_model
from surgery.graph import GraphView
from surgery.qdq import REWRITTEN_AS_FLOAT_NOTE, float_model, is_quantized
from surgery.qoperator import QOPERATOR_OPS, is_qoperator, qoperator_to_qdq
from surgery.rules.fix import fix_model

INT8, UINT8 = TensorProto.INT8, TensorProto.UINT8
X_SCALE, Y_SCALE = 0.02, 0.03


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime without graph optimisations: its fusions would turn the QDQ form back
    into the integer ops and hide what the rewrite computes."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options)
    return session.run(None, feed)


def _image(shape: tuple[int, ...], seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def _zero(elem_type: int, value: int) -> np.ndarray:
    return np.array(value, np.int8 if elem_type == INT8 else np.uint8)


def _single_op_model(
    node: onnx.NodeProto,
    in_shape: list[int],
    out_shape: list[int],
    elem_type: int = INT8,
    extra: list[onnx.TensorProto] = (),
    extra_inputs: list[onnx.ValueInfoProto] = (),
    nodes_after: list[onnx.NodeProto] = (),
    output_quantization: tuple[str, str] = ("ys", "yz"),
) -> onnx.ModelProto:
    """float x → QuantizeLinear → `node` (reads xq, xs, xz, ys, yz) → `nodes_after` →
    DequantizeLinear (at `output_quantization`) of yq → y."""
    zero = 3 if elem_type == INT8 else 131
    inits = [
        numpy_helper.from_array(np.array(X_SCALE, np.float32), "xs"),
        numpy_helper.from_array(_zero(elem_type, zero), "xz"),
        numpy_helper.from_array(np.array(Y_SCALE, np.float32), "ys"),
        numpy_helper.from_array(_zero(elem_type, zero - 8), "yz"),
        *extra,
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="quantize"),
        node,
        *nodes_after,
        helper.make_node(
            "DequantizeLinear", ["yq", *output_quantization], ["y"], name="dequantize"
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "single_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape), *extra_inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


def _contrib(op_type: str, inputs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op_type, inputs, ["yq"], name="op", domain="com.microsoft", **attrs)


def _weights(shape: tuple[int, ...], elem_type: int, channels: int | None) -> list:
    """Quantized weight `w` with scale `ws` and zero point `wz` (per channel if given)."""
    rng = np.random.default_rng(0)
    dtype = np.int8 if elem_type == INT8 else np.uint8
    low, high = (-60, 60) if elem_type == INT8 else (70, 190)
    size = () if channels is None else (channels,)
    zero = 0 if elem_type == INT8 else 128
    return [
        numpy_helper.from_array(rng.integers(low, high, shape).astype(dtype), "w"),
        numpy_helper.from_array(rng.uniform(0.004, 0.01, size).astype(np.float32), "ws"),
        numpy_helper.from_array(np.full(size, zero, dtype), "wz"),
    ]


def _bias(size: int) -> onnx.TensorProto:
    return numpy_helper.from_array(
        np.random.default_rng(2).integers(-300, 300, size).astype(np.int32), "b"
    )


SHAPE = [1, 4, 6, 6]
SINGLE_OPS = {
    "conv_per_channel_bias": lambda t: _single_op_model(
        helper.make_node(
            "QLinearConv",
            ["xq", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
            ["yq"],
            name="op",
            pads=[1, 1, 1, 1],
        ),
        SHAPE,
        [1, 8, 6, 6],
        t,
        [*_weights((8, 4, 3, 3), t, 8), _bias(8)],
    ),
    "matmul_per_column": lambda t: _single_op_model(
        helper.make_node(
            "QLinearMatMul", ["xq", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["yq"], name="op"
        ),
        [1, 5, 6],
        [1, 5, 7],
        t,
        _weights((6, 7), t, 7),
    ),
    "gemm_alpha_transposed_bias": lambda t: _single_op_model(
        _contrib(
            "QGemm",
            ["xq", "xs", "xz", "w", "ws", "wz", "b", "ys", "yz"],
            alpha=0.5,
            transB=1,
        ),
        [3, 6],
        [3, 5],
        t,
        [*_weights((5, 6), t, 5), _bias(5)],
    ),
    "add": lambda t: _single_op_model(
        _contrib("QLinearAdd", ["xq", "xs", "xz", "xq", "xs", "xz", "ys", "yz"]), SHAPE, SHAPE, t
    ),
    "sigmoid": lambda t: _single_op_model(
        _contrib("QLinearSigmoid", ["xq", "xs", "xz", "ys", "yz"]), SHAPE, SHAPE, t
    ),
    "leaky_relu": lambda t: _single_op_model(
        _contrib("QLinearLeakyRelu", ["xq", "xs", "xz", "ys", "yz"], alpha=0.1), SHAPE, SHAPE, t
    ),
    "softmax": lambda t: _single_op_model(
        _contrib("QLinearSoftmax", ["xq", "xs", "xz", "ys", "yz"], axis=-1, opset=17),
        SHAPE,
        SHAPE,
        t,
    ),
    "global_average_pool": lambda t: _single_op_model(
        _contrib("QLinearGlobalAveragePool", ["xq", "xs", "xz", "ys", "yz"], channels_last=0),
        SHAPE,
        [1, 4, 1, 1],
        t,
    ),
    "average_pool": lambda t: _single_op_model(
        _contrib(
            "QLinearAveragePool",
            ["xq", "xs", "xz", "ys", "yz"],
            kernel_shape=[2, 2],
            strides=[2, 2],
        ),
        SHAPE,
        [1, 4, 3, 3],
        t,
    ),
    "concat_of_two_scales": lambda t: _single_op_model(
        _contrib("QLinearConcat", ["ys", "yz", "xq", "xs", "xz", "xq", "ys", "xz"], axis=1),
        SHAPE,
        [1, 8, 6, 6],
        t,
    ),
}


@pytest.mark.parametrize("elem_type", [INT8, UINT8], ids=["int8", "uint8"])
@pytest.mark.parametrize("case", sorted(SINGLE_OPS))
def test_each_qlinear_op_computes_what_the_integer_op_computes(case, elem_type) -> None:
    model = SINGLE_OPS[case](elem_type)
    conversion = qoperator_to_qdq(model)
    onnx.checker.check_model(conversion.model)
    assert conversion.converted == 1 and not conversion.left
    assert QOPERATOR_OPS.isdisjoint(n.op_type for n in conversion.model.graph.node)
    x = model.graph.input[0].type.tensor_type.shape.dim
    feed = {"x": _image(tuple(d.dim_value for d in x)) * 2 - 0.5}
    (expected,), (got,) = _run(model, feed), _run(conversion.model, feed)
    assert got.shape == expected.shape
    assert np.max(np.abs(got - expected)) <= Y_SCALE * 1.001  # one output step at most


@pytest.mark.parametrize("opset", [17, 18])
def test_reduce_mean_takes_its_axes_as_the_opset_wants(opset) -> None:
    """ONNX Runtime has no CPU kernel for QLinearReduceMean: its form is checked by shape."""
    node = _contrib("QLinearReduceMean", ["xq", "xs", "xz", "ys", "yz"], axes=[2, 3], keepdims=1)
    model = _single_op_model(node, SHAPE, [1, 4, 1, 1])
    model.opset_import[0].version = opset
    converted = qoperator_to_qdq(model).model
    mean = next(n for n in converted.graph.node if n.op_type == "ReduceMean")
    axes = {a.name: helper.get_attribute_value(a) for a in mean.attribute}.get("axes")
    if opset >= 18:
        axes = next(
            numpy_helper.to_array(t).tolist()
            for t in converted.graph.initializer
            if t.name == mean.input[1]
        )
    assert axes == [2, 3]
    feed = {"x": _image(tuple(SHAPE))}
    (got,) = _run(converted, feed)
    expected = np.round(feed["x"].mean(axis=(2, 3), keepdims=True) / Y_SCALE) * Y_SCALE
    np.testing.assert_allclose(got, expected, atol=Y_SCALE * 1.001)


def test_an_output_without_zero_point_gets_one_of_its_input_type() -> None:
    """Q without a zero point writes uint8: an int8 op's output needs an explicit int8 zero."""
    node = _contrib("QLinearSigmoid", ["xq", "xs", "xz", "ys", ""])
    converted = qoperator_to_qdq(
        _single_op_model(node, SHAPE, SHAPE, INT8, output_quantization=("ys", ""))
    ).model
    quantize = next(n for n in converted.graph.node if n.output[0] == "yq")
    zero = next(t for t in converted.graph.initializer if t.name == quantize.input[2])
    assert zero.data_type == INT8 and numpy_helper.to_array(zero) == 0


def test_a_channels_last_op_is_left_with_the_reason() -> None:
    model = _single_op_model(
        _contrib("QLinearGlobalAveragePool", ["xq", "xs", "xz", "ys", "yz"], channels_last=1),
        [1, 6, 6, 4],
        [1, 1, 1, 4],
    )
    conversion = qoperator_to_qdq(model)
    assert conversion.converted == 0
    assert conversion.left == [
        "op: QLinearGlobalAveragePool: channels-last layout (NHWC), which "
        "the float op has no form of"
    ]
    blocker = next(b for b in check_model(model).blockers if b.name == "op")
    assert blocker.reasons[0].code == "qoperator_quantization"


def test_a_run_time_scale_is_left_as_it_is() -> None:
    scale_input = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    model = _single_op_model(
        _contrib("QLinearSigmoid", ["xq", "s", "xz", "ys", "yz"]),
        SHAPE,
        SHAPE,
        extra_inputs=[scale_input],
    )
    conversion = qoperator_to_qdq(model)
    assert conversion.converted == 0
    assert "'s' is computed at run time" in conversion.left[0]


def test_a_per_channel_model_of_opset_12_is_converted_to_opset_13() -> None:
    model = SINGLE_OPS["conv_per_channel_bias"](INT8)
    model.opset_import[0].version = 12
    converted = qoperator_to_qdq(model).model
    assert next(o.version for o in converted.opset_import if o.domain == "") == 13
    feed = {"x": _image(tuple(SHAPE))}
    (expected,), (got,) = _run(model, feed), _run(converted, feed)
    assert np.max(np.abs(got - expected)) <= Y_SCALE * 1.001


def test_an_ir3_model_with_vector_scales_loads_after_the_rewrite() -> None:
    """The 1-element scale and zero point give way to scalars and go: at IR version 3 ONNX
    Runtime refuses an initializer nothing reads (ORT's quantizer keeps a model's IR)."""
    model = _single_op_model(
        _contrib("QLinearSigmoid", ["xq", "xv", "xzv", "ys", "yz"]), SHAPE, SHAPE
    )
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([X_SCALE], np.float32), "xv"),
            numpy_helper.from_array(np.array([3], np.int8), "xzv"),
        ]
    )
    model.ir_version, model.opset_import[0].version = 3, 11
    converted = qoperator_to_qdq(model).model
    assert not {"xv", "xzv"} & {t.name for t in converted.graph.initializer}
    feed = {"x": _image(tuple(SHAPE))}
    (expected,), (got,) = _run(model, feed), _run(converted, feed)
    assert np.max(np.abs(got - expected)) <= Y_SCALE * 1.001
    (real,) = _run(float_model(model), feed)  # its activation Q/DQ gone, and their scales
    np.testing.assert_allclose(real, 1 / (1 + np.exp(-feed["x"])), atol=1e-6)


def test_data_movement_on_a_quantized_tensor_is_wrapped_exactly() -> None:
    """MaxPool and Reshape on the int8 tensor become DQ → op → Q at its own scale."""
    pool = helper.make_node(
        "MaxPool", ["xq"], ["pq"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
    )
    reshape = helper.make_node("Reshape", ["pq", "shape"], ["yq"], name="reshape")
    shape = numpy_helper.from_array(np.array([1, 36]), "shape")
    model = _single_op_model(
        pool, SHAPE, [1, 36], extra=[shape], nodes_after=[reshape], output_quantization=("xs", "xz")
    )
    conversion = qoperator_to_qdq(model)
    ops = [n.op_type for n in conversion.model.graph.node]
    assert ops == [
        "QuantizeLinear",
        "DequantizeLinear",
        "MaxPool",
        "QuantizeLinear",
        "DequantizeLinear",
        "Reshape",
        "QuantizeLinear",
        "DequantizeLinear",
    ]
    feed = {"x": _image(tuple(SHAPE))}
    np.testing.assert_array_equal(_run(model, feed)[0], _run(conversion.model, feed)[0])


def test_a_model_without_qlinear_ops_is_not_qoperator(plain_cnn) -> None:
    assert not is_qoperator(GraphView(plain_cnn))
    assert qoperator_to_qdq(plain_cnn).converted == 0


# A small CNN quantized by ONNX Runtime's own quantizer, in both formats.


class _Images(CalibrationDataReader):
    def __init__(self) -> None:
        self.frames = iter([{"image": _image((1, 3, 16, 16), seed)} for seed in range(4)])

    def get_next(self):
        return next(self.frames, None)


def _float_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.normal(size=shape) * 0.3).astype(np.float32), name)

    inits = [
        weight("k1", (8, 3, 3, 3)),
        weight("b1", (8,)),
        weight("k2", (8, 8, 3, 3)),
        weight("k3", (8, 8, 1, 1)),
        weight("fc", (10, 16)),
        weight("fc_b", (10,)),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "k1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node(
            "MaxPool", ["r1"], ["p1"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("Conv", ["p1", "k2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["s2"], name="sigmoid"),
        helper.make_node("Mul", ["c2", "s2"], ["silu"], name="silu"),
        helper.make_node("Add", ["silu", "p1"], ["res"], name="residual"),
        helper.make_node("Conv", ["res", "k3"], ["c3"], name="conv3"),
        helper.make_node("Concat", ["c3", "res"], ["cat"], name="concat", axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc", "fc_b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def ort_quantized(tmp_path_factory) -> dict[str, onnx.ModelProto]:
    folder = tmp_path_factory.mktemp("ort_quantized")
    onnx.save(_float_cnn(), folder / "float.onnx")
    models = {}
    # uint8 per tensor: ONNX Runtime's uint8 x int8 per-channel QLinearConv saturates on x86
    # (37 steps off the exact integer result on this model; the QDQ form computes it exactly)
    for name, fmt, activations, per_channel in [
        ("qoperator_int8", QuantFormat.QOperator, QuantType.QInt8, True),
        ("qoperator_uint8", QuantFormat.QOperator, QuantType.QUInt8, False),
        ("qdq_int8", QuantFormat.QDQ, QuantType.QInt8, True),
    ]:
        quantize_static(
            folder / "float.onnx",
            folder / f"{name}.onnx",
            _Images(),
            quant_format=fmt,
            activation_type=activations,
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
        )
        models[name] = onnx.load(folder / f"{name}.onnx")
    return models


def test_ort_qoperator_model_has_no_qlinear_op_left(ort_quantized) -> None:
    model = ort_quantized["qoperator_int8"]
    assert {"QLinearConv", "QLinearAdd", "QGemm"} <= {n.op_type for n in model.graph.node}
    conversion = qoperator_to_qdq(model)
    assert not conversion.left
    assert QOPERATOR_OPS.isdisjoint(n.op_type for n in conversion.model.graph.node)
    assert "rewrote" in conversion.note() and str(conversion.converted) in conversion.note()


@pytest.mark.parametrize("name", ["qoperator_int8", "qoperator_uint8"])
def test_ort_qoperator_model_rewritten_matches_onnx_runtime(ort_quantized, name) -> None:
    model = ort_quantized[name]
    feed = {"image": _image((1, 3, 16, 16), seed=9)}
    (expected,), (got,) = _run(model, feed), _run(qoperator_to_qdq(model).model, feed)
    logits_scale = next(
        numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "logits_scale"
    )
    assert np.max(np.abs(got - expected)) <= float(logits_scale) * 2.001


def test_check_sees_a_qoperator_model_as_ort_qdq_model(ort_quantized) -> None:
    """The same segments and placements as the QDQ model of the same calibration."""
    qoperator = check_model(ort_quantized["qoperator_int8"])
    qdq = check_model(ort_quantized["qdq_int8"])
    assert qoperator.mla_segments == qdq.mla_segments == 1
    assert Counter(p.processor for p in qoperator.placements) == Counter(
        p.processor for p in qdq.placements
    )
    assert sorted(b.op_type for b in qoperator.blockers) == sorted(b.op_type for b in qdq.blockers)
    assert all(r.code != "custom_op" for b in qoperator.blockers for r in b.reasons)


def test_fix_rewrites_the_float_model_of_a_qoperator_model(ort_quantized) -> None:
    model = ort_quantized["qoperator_int8"]
    assert is_quantized(GraphView(model))
    result = fix_model(model)
    ops = {n.op_type for n in result.model.graph.node}
    assert ops.isdisjoint({"QuantizeLinear", "DequantizeLinear", *QOPERATOR_OPS})
    assert REWRITTEN_AS_FLOAT_NOTE in result.notes
    assert result.coverage_after.mla_segments == 1


def test_float_model_of_a_qoperator_model_is_the_one_of_its_qdq_twin(ort_quantized) -> None:
    """The same dequantized weights and no activation quantization, as from ORT's QDQ model."""
    feed = {"image": _image((1, 3, 16, 16), seed=5)}
    (from_qoperator,) = _run(float_model(ort_quantized["qoperator_int8"]), feed)
    (from_qdq,) = _run(float_model(ort_quantized["qdq_int8"]), feed)
    np.testing.assert_allclose(from_qoperator, from_qdq, atol=1e-5)


def test_quantize_refuses_a_qoperator_model_and_says_compile_takes_it(ort_quantized) -> None:
    with pytest.raises(QuantizationError, match="already quantized.*QLinearConv") as error:
        quantize_model(ort_quantized["qoperator_int8"], [])
    assert "surgery compile" in error.value.hint


def test_qoperator_model_compiles_to_one_elf_bit_exact(ort_quantized, tmp_path) -> None:
    model = ort_quantized["qoperator_int8"]
    result = compile_model(model, tmp_path, model_name="cnn")
    assert len(result.elf_files) == 1
    assert any("QOperator" in note for note in result.notes)
    archive = read_archive(result.archive)
    feed = {"image": _image((1, 3, 16, 16), seed=3)}
    outputs, stats = run_archive(archive, feed, keep_tensors=True)
    comparison = compare_with_reference(archive.manifest, model, feed, outputs, stats.tensors)
    assert comparison.mla_bit_exact
    (onnx_runtime,) = _run(model, feed)
    logits_scale = next(
        numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "logits_scale"
    )
    assert np.max(np.abs(outputs["logits"] - onnx_runtime)) <= 4 * float(logits_scale)
