"""Conv, ConvTranspose, MatMul and Gemm: integer results within one step of ONNX Runtime.

ORT runs the QDQ graph in float (dequantize, float32 op, quantize with round-half-to-even), the
executor in integers with a 31-bit multiplier; they can differ by one step where the real result
lies within float error of a rounding tie.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from onnxruntime.quantization import QuantType

from compiler.runtime import IntegerExecutor
from tests.test_reference_support import (
    float_model,
    ort_quantize,
    quantized_single_op,
    random_feeds,
    steps_apart,
)

TYPE_PAIRS = st.sampled_from(
    [
        (QuantType.QInt8, QuantType.QInt8),
        (QuantType.QUInt8, QuantType.QInt8),
        (QuantType.QUInt8, QuantType.QUInt8),
    ]
)
"""(activation, weight) types ORT's quantizer accepts; uint8 weights have non-zero zero points."""


@st.composite
def conv_cases(draw: st.DrawFn) -> dict:
    group_kind = draw(st.sampled_from(["dense", "depthwise", "grouped"]))
    group = {"dense": 1, "depthwise": 4, "grouped": 2}[group_kind]
    in_channels = 4 if group_kind != "dense" else draw(st.integers(1, 4))
    out_channels = {"dense": draw(st.integers(1, 5)), "depthwise": 4, "grouped": 6}[group_kind]
    kernel = draw(st.tuples(st.integers(1, 3), st.integers(1, 3)))
    return {
        "group": group,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "kernel": kernel,
        "strides": draw(st.tuples(st.integers(1, 3), st.integers(1, 3))),
        "dilations": draw(st.tuples(st.integers(1, 2), st.integers(1, 2))),
        "pads": draw(st.lists(st.integers(0, 2), min_size=4, max_size=4)),
        "size": draw(st.tuples(st.integers(6, 9), st.integers(6, 9))),
        "bias": draw(st.booleans()),
        "relu": draw(st.booleans()),
        "per_channel": draw(st.booleans()),
        "types": draw(TYPE_PAIRS),
        "seed": draw(st.integers(0, 2**16)),
    }


def _conv_model(case: dict, rng: np.random.Generator):
    weight_shape = (case["out_channels"], case["in_channels"] // case["group"], *case["kernel"])
    initializers = {"W": rng.standard_normal(weight_shape).astype(np.float32)}
    inputs = ["x", "W"]
    if case["bias"]:
        initializers["B"] = rng.standard_normal(case["out_channels"]).astype(np.float32)
        inputs.append("B")
    conv = helper.make_node(
        "Conv",
        inputs,
        ["y"],
        group=case["group"],
        strides=list(case["strides"]),
        dilations=list(case["dilations"]),
        pads=case["pads"],
    )
    nodes = [conv]
    output = "y"
    if case["relu"]:
        nodes.append(helper.make_node("Relu", ["y"], ["r"]))
        output = "r"
    return nodes, output, initializers


@settings(max_examples=40, deadline=None)
@given(case=conv_cases(), mode=st.sampled_from(["sima", "tflite"]))
def test_conv_matches_ort_within_one_step(case: dict, mode: str) -> None:
    rng = np.random.default_rng(case["seed"])
    nodes, output, initializers = _conv_model(case, rng)
    model = float_model(
        nodes, {"x": (1, case["in_channels"], *case["size"])}, [output], initializers
    )
    qdq = ort_quantize(
        model,
        random_feeds(model, rng, 8),
        per_channel=case["per_channel"],
        activation_type=case["types"][0],
        weight_type=case["types"][1],
    )
    executor = IntegerExecutor(qdq, mode, strict=True)
    assert steps_apart(executor, qdq, random_feeds(model, rng, 2))[output] <= 1


def test_conv_with_same_upper_auto_pad_matches_ort() -> None:
    rng = np.random.default_rng(1)
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])
    weights = {
        "W": rng.standard_normal((3, 2, 3, 3)).astype(np.float32),
        "B": rng.standard_normal(3).astype(np.float32),
    }
    qdq, feeds = quantized_single_op(node, {"x": (1, 2, 7, 8)}, weights, rng=rng)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


def test_conv_with_int16_activations_matches_ort() -> None:
    rng = np.random.default_rng(33)
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1])
    weights = {
        "W": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "B": rng.standard_normal(4).astype(np.float32),
    }
    qdq, feeds = quantized_single_op(
        node, {"x": (1, 3, 6, 6)}, weights, rng=rng, activation_type=QuantType.QInt16
    )
    executor = IntegerExecutor(qdq, strict=True)
    assert executor.input_params["x"].dtype == np.int16
    assert steps_apart(executor, qdq, feeds)["y"] <= 1


def test_conv_1d_matches_ort() -> None:
    rng = np.random.default_rng(2)
    node = helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1], strides=[2])
    weights = {"W": rng.standard_normal((4, 3, 3)).astype(np.float32)}
    qdq, feeds = quantized_single_op(node, {"x": (2, 3, 11)}, weights, rng=rng)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


@pytest.mark.parametrize(
    "attributes",
    [
        {"strides": [2, 2]},
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
        {"strides": [1, 1], "dilations": [2, 2]},
        {"strides": [2, 2], "group": 2},
    ],
    ids=["stride2", "padded", "dilated", "grouped"],
)
def test_conv_transpose_matches_ort_within_one_step(attributes: dict) -> None:
    rng = np.random.default_rng(3)
    group = attributes.get("group", 1)
    node = helper.make_node("ConvTranspose", ["x", "W", "B"], ["y"], **attributes)
    weights = {
        "W": rng.standard_normal((4, 6 // group, 3, 3)).astype(np.float32),
        "B": rng.standard_normal(6).astype(np.float32),
    }
    # ORT cannot quantize grouped ConvTranspose weights per channel (its bias scale mismatches).
    qdq, feeds = quantized_single_op(
        node, {"x": (1, 4, 5, 5)}, weights, rng=rng, per_channel=group == 1
    )
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


@pytest.mark.parametrize("per_channel", [False, True])
def test_matmul_with_constant_weights_matches_ort(per_channel: bool) -> None:
    rng = np.random.default_rng(4)
    node = helper.make_node("MatMul", ["x", "W"], ["y"])
    weights = {"W": rng.standard_normal((16, 8)).astype(np.float32)}
    qdq, feeds = quantized_single_op(
        node, {"x": (2, 5, 16)}, weights, rng=rng, per_channel=per_channel
    )
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


def test_matmul_of_two_activations_with_broadcast_batch_matches_ort() -> None:
    rng = np.random.default_rng(5)
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    qdq, feeds = quantized_single_op(
        node, {"a": (2, 3, 4, 6), "b": (3, 6, 5)}, rng=rng, activation_type=QuantType.QUInt8
    )
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_with_bias_matches_ort(trans_b: int) -> None:
    rng = np.random.default_rng(6)
    node = helper.make_node("Gemm", ["x", "W", "C"], ["y"], transB=trans_b)
    weight_shape = (7, 10) if trans_b else (10, 7)
    weights = {
        "W": rng.standard_normal(weight_shape).astype(np.float32),
        "C": rng.standard_normal(7).astype(np.float32),
    }
    qdq, feeds = quantized_single_op(node, {"x": (3, 10)}, weights, rng=rng)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1
