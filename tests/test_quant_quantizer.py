"""quantize_model end to end on small nets: QDQ structure, schemes, accuracy, options, errors."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from compiler.defines import (
    HistogramEntropyMethod,
    MinMaxMethod,
    bfloat16_scheme,
    default_quantization,
    int16_quantization,
    quantization_scheme,
)
from compiler.quantize import METADATA_KEY, CalibrationDataError, QuantizationError, quantize_model
from compiler.quantize.equalize import equalize
from compiler.quantize.prepare import prepare_model
from surgery.coverage import analyze_coverage
from tests.test_quant_nets import conv_net, random_samples, run, sqnr_db, two_conv_net


def nodes_of(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op]


def producer(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto | None:
    return next((n for n in model.graph.node if tensor in n.output), None)


def init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def weight_dq(model: onnx.ModelProto, node_name: str, index: int = 1) -> onnx.NodeProto:
    node = next(n for n in model.graph.node if n.name == node_name)
    dq = producer(model, node.input[index])
    assert dq is not None and dq.op_type == "DequantizeLinear", (
        f"{node_name} input {index} is not dequantized"
    )
    return dq


def attr(node: onnx.NodeProto, name: str, default=None):
    return next(
        (onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name), default
    )


@pytest.fixture(scope="module")
def default_result():
    return quantize_model(conv_net(), random_samples(16), default_quantization)


def test_qdq_model_passes_checker_runs_and_is_close_to_float(default_result) -> None:
    q = default_result.model
    onnx.checker.check_model(q, full_check=True)
    float_model = conv_net()
    scores = [sqnr_db(run(float_model, f), run(q, f)) for f in random_samples(6, seed=9)]
    assert min(scores) > 25.0, scores
    assert nodes_of(q, "QuantizeLinear") and nodes_of(q, "DequantizeLinear")


def test_per_channel_symmetric_weights_and_int32_bias(default_result) -> None:
    q = default_result.model
    for conv in ("conv1", "conv2", "conv3"):
        dq = weight_dq(q, conv)
        assert attr(dq, "axis") == 0
        values = init(q, dq.input[0])
        assert values.dtype == np.int8 and values.min() >= -127
        scale = init(q, dq.input[1])
        assert scale.ndim == 1 and scale.size == values.shape[0]
        assert not init(q, dq.input[2]).any()  # zero points are 0: symmetric
        bias_dq = weight_dq(q, conv, 2)
        assert init(q, bias_dq.input[0]).dtype == np.int32
        in_scale = _input_scale(q, conv)
        np.testing.assert_allclose(
            init(q, bias_dq.input[1]),
            (in_scale * scale.astype(np.float64)).astype(np.float32),
            rtol=1e-6,
        )


def _input_scale(model: onnx.ModelProto, node_name: str) -> float:
    node = next(n for n in model.graph.node if n.name == node_name)
    dq = producer(model, node.input[0])
    assert dq is not None and dq.op_type == "DequantizeLinear"
    return float(init(model, dq.input[1]))


def test_per_tensor_weights() -> None:
    params = default_quantization.with_weight_quantization(
        quantization_scheme(asymmetric=False, per_channel=False)
    )
    q = quantize_model(conv_net(), random_samples(4), params).model
    dq = weight_dq(q, "conv2")
    assert attr(dq, "axis") is None
    assert init(q, dq.input[1]).ndim == 0
    assert init(q, weight_dq(q, "conv2", 2).input[1]).ndim == 0


def test_activations_are_asymmetric_int8_per_tensor(default_result) -> None:
    q = default_result.model
    for node in nodes_of(q, "QuantizeLinear"):
        assert init(q, node.input[1]).ndim == 0
        assert init(q, node.input[2]).dtype == np.int8
    record = json.loads(next(p.value for p in q.metadata_props if p.key == METADATA_KEY))
    assert record["tensors"]["x"]["zero_point"] == -128  # x ≥ 0: asymmetric, signed storage
    assert record["activation_scheme"] == "int8 asymmetric per-tensor"


def test_int16_activations_use_opset_21() -> None:
    q = quantize_model(conv_net(), random_samples(4), int16_quantization).model
    opset = next(o.version for o in q.opset_import if o.domain in ("", "ai.onnx"))
    assert opset >= 21
    zps = [init(q, n.input[2]) for n in nodes_of(q, "QuantizeLinear")]
    assert zps and all(z.dtype == np.int16 for z in zps)
    assert init(q, weight_dq(q, "conv1").input[0]).dtype == np.int8
    onnx.checker.check_model(q)
    float_model = conv_net()
    feed = random_samples(1, seed=5)[0]
    assert sqnr_db(run(float_model, feed), run(q, feed)) > 30.0


def test_no_qdq_between_conv_and_relu(default_result) -> None:
    q = default_result.model
    relu = next(n for n in q.graph.node if n.name == "relu1")
    conv = producer(q, relu.input[0])
    assert conv is not None and conv.op_type == "Conv"
    assert default_result.report["fused"] == {"c1": "relu1", "c2": "relu2"}


def test_maxpool_shares_its_input_scale(default_result) -> None:
    tensors = default_result.report["tensors"]
    assert tensors["p"]["shared_with"] == "a3"


def test_constant_node_weights_are_quantized_per_channel_as_weights() -> None:
    model = conv_net(constant_weights=True)
    assert not model.graph.initializer
    result = quantize_model(model, random_samples(8), default_quantization)
    q = result.model
    for conv in ("conv1", "conv2", "conv3"):
        dq = weight_dq(q, conv)
        assert attr(dq, "axis") == 0 and init(q, dq.input[0]).dtype == np.int8
    assert not nodes_of(q, "Constant")
    scores = [sqnr_db(run(model, f), run(q, f)) for f in random_samples(4, seed=9)]
    assert min(scores) > 25.0


def test_generator_data_and_progress() -> None:
    calls: list[tuple[int, int | None]] = []

    def samples():
        yield from random_samples(5)

    quantize_model(
        conv_net(), samples(), default_quantization, progress=lambda d, t: calls.append((d, t))
    )
    assert calls == [(i, None) for i in range(1, 6)]
    calls.clear()
    quantize_model(
        conv_net(),
        random_samples(3),
        MinMaxMethod() and default_quantization,
        progress=lambda d, t: calls.append((d, t)),
    )
    assert calls[-1] == (3, 3)


def test_every_calibration_method_runs() -> None:
    for method in ("min_max", "moving_average", "mse", "entropy", "percentile"):
        q = quantize_model(
            conv_net(), random_samples(6), default_quantization.with_calibration(method)
        )
        assert q.report["calibration"]["method"]["method"]
        feed = random_samples(1, seed=7)[0]
        assert sqnr_db(run(conv_net(), feed), run(q.model, feed)) > 20.0, method


def test_unquantized_nodes_stay_float_and_are_pinned_off_the_mla() -> None:
    result = quantize_model(
        conv_net(), random_samples(4), default_quantization.with_unquantized_nodes("conv3")
    )
    q = result.model
    conv3 = next(n for n in q.graph.node if n.name == "conv3")
    assert producer(q, conv3.input[1]) is None and init(q, conv3.input[1]).dtype == np.float32
    assert init(q, conv3.input[2]).dtype == np.float32
    # conv3 itself does not quantize its output (no rename to a pre-quantization tensor); the
    # Q/DQ on c3 exists only on the way into the quantized Add that reads it
    assert list(conv3.output) == ["c3"]
    readers = [n for n in q.graph.node if "c3" in n.input]
    assert [n.op_type for n in readers] == ["QuantizeLinear"]
    assert result.report["unquantized_nodes"] == {"conv3": "listed in unquantized_nodes"}
    pins = json.loads(next(p.value for p in q.metadata_props if p.key == "surgery.op_target"))
    assert pins["conv3"] in ("CVU", "APU")
    placement = analyze_coverage(q, "mlsoc", suggest=False).by_name("conv3")
    assert placement is not None and placement.processor != "MLA"


def test_custom_per_node_config() -> None:
    custom = {
        "conv2": {
            "weight_quantization_scheme": quantization_scheme(False, False),
            "activation_quantization_scheme": quantization_scheme(True, False, 16),
        }
    }
    result = quantize_model(
        conv_net(), random_samples(4), default_quantization.with_custom_quantization_configs(custom)
    )
    q = result.model
    assert attr(weight_dq(q, "conv2"), "axis") is None
    assert attr(weight_dq(q, "conv1"), "axis") == 0
    assert result.report["tensors"]["r2"]["dtype"] == "int16"
    assert result.report["tensors"]["r1"]["dtype"] == "int8"


def test_unknown_node_names_are_errors() -> None:
    with pytest.raises(QuantizationError, match="unquantized_nodes"):
        quantize_model(
            conv_net(), random_samples(2), default_quantization.with_unquantized_nodes("nope")
        )
    with pytest.raises(QuantizationError, match="custom_quantization_configs"):
        quantize_model(
            conv_net(),
            random_samples(2),
            default_quantization.with_custom_quantization_configs({"nope": {}}),
        )


def test_bfloat16_needs_a_target_with_bf16() -> None:
    bf16 = default_quantization.with_activation_quantization(
        bfloat16_scheme()
    ).with_weight_quantization(bfloat16_scheme())
    with pytest.raises(ValueError, match="bf16"):
        quantize_model(conv_net(), random_samples(2), bf16, target="mlsoc")
    q = quantize_model(conv_net(), random_samples(2), bf16, target="modalix").model
    assert not nodes_of(q, "QuantizeLinear")
    assert any(attr(n, "to") == onnx.TensorProto.BFLOAT16 for n in nodes_of(q, "Cast"))
    feed = random_samples(1, seed=3)[0]
    assert sqnr_db(run(conv_net(), feed), run(q, feed)) > 35.0


def test_metadata_records_the_decisions(default_result) -> None:
    record = json.loads(
        next(p.value for p in default_result.model.metadata_props if p.key == METADATA_KEY)
    )
    assert record["target"] == "mlsoc"
    assert record["requantization_mode"] == "sima"
    assert record["calibration"] == {
        "method": {"method": "histogram_mse", "num_bins": 2048},
        "samples": 16,
    }
    assert {"min", "max", "scale", "zero_point"} <= set(record["tensors"]["r1"])
    assert record["weights"]["w1"]["axis"] == 0
    assert record["quantized_nodes"] == 8
    assert record == default_result.report


def test_calibration_data_errors() -> None:
    with pytest.raises(CalibrationDataError, match="no samples"):
        quantize_model(conv_net(), [], default_quantization)
    with pytest.raises(CalibrationDataError, match="shape"):
        quantize_model(
            conv_net(), [{"x": np.zeros((1, 3, 8, 8), np.float32)}], default_quantization
        )
    with pytest.raises(CalibrationDataError, match="'x'"):
        quantize_model(
            conv_net(), [{"image": np.zeros((1, 3, 16, 16), np.float32)}], default_quantization
        )
    with pytest.raises(QuantizationError, match="second pass"):
        quantize_model(
            conv_net(), iter(random_samples(2)), default_quantization.with_bias_correction()
        )


def test_already_quantized_models_are_rejected_with_what_to_do(default_result) -> None:
    with pytest.raises(QuantizationError, match="already quantized") as refused:
        quantize_model(default_result.model, random_samples(1), default_quantization)
    assert "float model" in refused.value.hint and "surgery compile" in refused.value.hint


# --------------------------------------------------------------------------- CLE and bias correction


@pytest.mark.parametrize(
    ("activation", "depthwise"),
    [("Relu", False), (None, False), ("Relu", True), ("LeakyRelu", True)],
)
def test_cross_layer_equalization_preserves_float_and_balances_ranges(
    activation, depthwise
) -> None:
    model = two_conv_net(activation=activation, depthwise=depthwise)
    prepared = prepare_model(model).model
    before = {t.name: numpy_helper.to_array(t).copy() for t in prepared.graph.initializer}
    report = equalize(prepared, {"conv1", "conv2"})
    assert [p["first"] for p in report.pairs] == ["conv1"]
    feeds = random_samples(3, seed=4)
    for feed in feeds:
        ref, test = run(model, feed), run(prepared, feed)
        np.testing.assert_allclose(
            test, ref, atol=1e-4 * max(1.0, float(np.abs(ref).max())), rtol=1e-4
        )
    w1 = numpy_helper.to_array(next(t for t in prepared.graph.initializer if t.name == "w1"))
    w2 = numpy_helper.to_array(next(t for t in prepared.graph.initializer if t.name == "w2"))
    r1 = np.abs(w1).reshape(w1.shape[0], -1).max(axis=1)
    r2 = (
        np.abs(w2).reshape(w2.shape[0], -1).max(axis=1)
        if depthwise
        else np.abs(w2).max(axis=(0, 2, 3))
    )
    np.testing.assert_allclose(r1, r2, rtol=1e-4)
    spread_before = np.abs(before["w1"]).reshape(6, -1).max(axis=1)
    assert r1.max() / r1.min() < spread_before.max() / spread_before.min()


def test_cross_layer_equalization_skips_relu6() -> None:
    model = two_conv_net(activation=None)
    clip = onnx.helper.make_node("Clip", ["c1", "lo", "hi"], ["a1"], name="act")
    model.graph.node.insert(1, clip)
    model.graph.node[2].input[0] = "a1"
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
            numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
        ]
    )
    prepared = prepare_model(model).model
    report = equalize(prepared, {"conv1", "conv2"})
    assert not report.pairs and report.skipped and "upper bound" in report.skipped[0]["reason"]


def test_cross_layer_equalization_in_the_quantizer_helps_per_tensor_weights() -> None:
    model = two_conv_net(activation="Relu", depthwise=True)
    per_tensor = default_quantization.with_weight_quantization(quantization_scheme(False, False))
    data, test = random_samples(8), random_samples(4, seed=11)
    plain = quantize_model(model, data, per_tensor)
    equalized = quantize_model(model, data, per_tensor.with_channel_equalization())
    assert equalized.report["equalization"]["pairs"]

    def score(result) -> float:
        return float(np.mean([sqnr_db(run(model, f), run(result.model, f)) for f in test]))

    assert score(equalized) > score(plain) + 3.0


def test_bias_correction_reduces_the_mean_output_error() -> None:
    model = two_conv_net(activation="Relu", depthwise=False)
    params = default_quantization.with_weight_quantization(
        quantization_scheme(False, False)
    ).with_calibration(MinMaxMethod())
    data = random_samples(12)
    plain = quantize_model(model, data, params)
    corrected = quantize_model(model, data, params.with_bias_correction())
    assert set(corrected.report["bias_correction"]) == {"conv1", "conv2"}

    def mean_error(result) -> float:
        diffs = [run(model, f) - run(result.model, f) for f in data]
        return float(np.abs(np.mean(diffs, axis=(0, 1, 3, 4))).mean())

    assert mean_error(corrected) < 0.5 * mean_error(plain)


def test_entropy_method_on_the_net(default_result) -> None:
    q = quantize_model(
        conv_net(),
        random_samples(8),
        default_quantization.with_calibration(HistogramEntropyMethod()),
    )
    assert q.report["tensors"]["r1"]["method"] == "histogram_entropy"


# --------------------------------------------------------------------------- MatMul / Gemm, RKNN dtypes, memory


def matmul_gemm_net() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    h = onnx.helper
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        h.make_node("Relu", ["m"], ["r"], name="relu"),
        h.make_node("Reshape", ["r", "s"], ["f"], name="flat"),
        h.make_node("Gemm", ["f", "g", "gb"], ["y"], name="gemm", transB=1),
    ]
    inits = [
        numpy_helper.from_array(rng.normal(size=(8, 5)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1, 20], np.int64), "s"),
        numpy_helper.from_array(rng.normal(size=(3, 20)).astype(np.float32), "g"),
        numpy_helper.from_array(rng.normal(size=(3,)).astype(np.float32), "gb"),
    ]
    graph = h.make_graph(
        nodes,
        "mm",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 4, 8])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3])],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_matmul_and_gemm_weights_are_per_output_channel() -> None:
    data = random_samples(6, shape=(1, 1, 4, 8))
    q = quantize_model(matmul_gemm_net(), data, default_quantization, target="rk3588").model
    assert attr(weight_dq(q, "mm"), "axis") == 1  # (K, N): output channels on the last axis
    assert attr(weight_dq(q, "gemm"), "axis") == 0  # transB=1: (N, K)
    assert init(q, weight_dq(q, "gemm", 2).input[0]).dtype == np.int32
    mlsoc = quantize_model(matmul_gemm_net(), data, default_quantization, target="mlsoc").model
    gemm = next(n for n in mlsoc.graph.node if n.name == "gemm")
    assert (
        producer(mlsoc, gemm.input[1]) is None
    )  # rank-2 Gemm is not on the mlsoc MLA: stays float


def test_rknn_w4a16_groupwise_int4_weights() -> None:
    from compiler.quantize import RknnConfig

    config = RknnConfig(
        target_platform="rk3576", quantized_dtype="w4a16", quantized_method="group32"
    )
    data = random_samples(4, shape=(1, 1, 4, 8))
    result = quantize_model(matmul_gemm_net(), data, config, target=config.target)
    q = result.model
    dq = weight_dq(q, "mm")
    assert attr(dq, "block_size") == 32 and attr(dq, "axis") == 0
    stored = next(t for t in q.graph.initializer if t.name == dq.input[0])
    assert stored.data_type == onnx.TensorProto.INT4
    assert any(attr(n, "to") == onnx.TensorProto.FLOAT16 for n in nodes_of(q, "Cast"))
    onnx.checker.check_model(q)
    feed = random_samples(1, seed=8, shape=(1, 1, 4, 8))[0]
    assert sqnr_db(run(matmul_gemm_net(), feed), run(q, feed)) > 15.0


def test_rknn_dynamic_fixed_point_uses_power_of_two_scales() -> None:
    from compiler.quantize import RknnConfig

    params = RknnConfig(
        target_platform="rv1106", quantized_dtype="w16a16i_dfp"
    ).to_quantization_params()
    result = quantize_model(conv_net(), random_samples(4), params)
    for entry in result.report["tensors"].values():
        if "scale" in entry:
            assert np.log2(entry["scale"]) == pytest.approx(round(np.log2(entry["scale"])))
    scale = init(result.model, weight_dq(result.model, "conv1").input[1])
    np.testing.assert_array_equal(np.log2(scale), np.round(np.log2(scale)))


def test_calibration_memory_does_not_grow_with_the_number_of_samples() -> None:
    import tracemalloc

    def peak(n: int) -> int:
        def samples():
            rng = np.random.default_rng(0)
            for _ in range(n):
                yield {"x": rng.random((1, 3, 16, 16), dtype=np.float32)}

        tracemalloc.start()
        quantize_model(conv_net(), samples(), default_quantization)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    few, many = peak(4), peak(64)
    assert many < few * 1.2 + 64 * 1024, (few, many)


def hardswish_net() -> onnx.ModelProto:
    """conv → x·clip(x + 3, 0, 6) / 6 (HardSwish as exporters write it) → conv."""
    model = two_conv_net(activation=None)
    h = onnx.helper
    hs = [
        h.make_node("Add", ["c1", "three"], ["t"], name="hs_add"),
        h.make_node("Clip", ["t", "zero", "six"], ["cl"], name="hs_clip"),
        h.make_node("Mul", ["c1", "cl"], ["m"], name="hs_mul"),
        h.make_node("Div", ["m", "six"], ["a1"], name="hs_div"),
    ]
    for k, node in enumerate(hs):
        model.graph.node.insert(1 + k, node)
    model.graph.node[-1].input[0] = "a1"
    model.graph.initializer.extend(
        numpy_helper.from_array(np.array(v, np.float32), n)
        for n, v in (("three", 3.0), ("zero", 0.0), ("six", 6.0))
    )
    onnx.checker.check_model(model)
    return model


def test_elementwise_groups_are_opt_in_and_leave_no_qdq_inside() -> None:
    model = hardswish_net()
    data = random_samples(8)
    grouped = quantize_model(model, data, default_quantization, elementwise_groups=True)
    plain = quantize_model(model, data, default_quantization)
    assert grouped.report["elementwise_groups"] == [
        {
            "source": "c1",
            "kind": "lut",
            "nodes": ["hs_add", "hs_clip", "hs_mul", "hs_div"],
            "outputs": ["a1"],
        }
    ]
    assert not plain.report["elementwise_groups"]
    inside = {"t", "cl", "m"}
    assert not inside & set(grouped.report["tensors"])
    assert inside <= set(plain.report["tensors"])
    feed = random_samples(1, seed=6)[0]
    assert sqnr_db(run(model, feed), run(grouped.model, feed)) > 25.0


def test_silu_is_one_table_by_default() -> None:
    model = two_conv_net(activation=None)
    h = onnx.helper
    model.graph.node.insert(1, h.make_node("Sigmoid", ["c1"], ["s"], name="gate"))
    model.graph.node.insert(2, h.make_node("Mul", ["c1", "s"], ["a1"], name="silu"))
    model.graph.node[-1].input[0] = "a1"
    result = quantize_model(model, random_samples(4), default_quantization)
    assert [g["nodes"] for g in result.report["elementwise_groups"]] == [["gate", "silu"]]
    assert "s" not in result.report["tensors"] and "a1" in result.report["tensors"]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threaded_calibration_gives_the_ranges_of_a_sequential_pass(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observers fed by worker threads while ORT computes the next sample, and outputs fetched in
    groups, end in exactly the state of feeding every tensor of every sample in order."""
    import compiler.quantize.calibrate as calibrate_module
    from compiler.quantize.calibrate import calibrate, float_session

    monkeypatch.setattr(calibrate_module, "OBSERVER_THREADS", threads)
    from compiler.quantize.observers import HistogramObserver
    from compiler.quantize.samples import SamplePasses

    model = prepare_model(conv_net(), opset=13).model
    data = [s["x"] * (k + 1) for k, s in enumerate(random_samples(5))]
    tensors = [n.output[0] for n in model.graph.node] + ["x"]
    threaded = {t: [HistogramObserver()] for t in tensors}
    stats = calibrate(model, threaded, SamplePasses(data), max_output_bytes=4 * 16 * 16 * 16)
    assert stats.runs_per_sample > 1
    session = float_session(model, tensors[:-1])
    sequential = {t: HistogramObserver() for t in tensors}
    for x in data:
        values = dict(zip(tensors[:-1], session.run(tensors[:-1], {"x": x}), strict=True))
        values["x"] = x
        for t in tensors:
            sequential[t].update(values[t])
    for t in tensors:
        got, want = threaded[t][0], sequential[t]
        assert (got.width, got.origin, got.min, got.max) == (
            want.width,
            want.origin,
            want.min,
            want.max,
        )
        np.testing.assert_array_equal(got.counts, want.counts)


def test_observer_shares_give_every_tensor_to_one_worker_largest_first() -> None:
    from compiler.quantize.calibrate import _shares

    sizes = {"a": 100, "b": 60, "c": 50, "d": 10}
    runs = [(["a", "b"], [np.zeros(100), np.zeros(60)]), (["c", "d"], [np.zeros(50), np.zeros(10)])]
    names = [[n for share_names, _ in share for n in share_names] for share in _shares(runs, 2)]
    assert sorted(n for share in names for n in share) == ["a", "b", "c", "d"]
    assert sorted(sum(sizes[n] for n in share) for share in names) == [110, 110]
    assert len(_shares(runs, 8)) == 4  # no empty shares
