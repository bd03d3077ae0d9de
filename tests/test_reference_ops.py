"""Elementwise, pooling, data movement, lookup-table, Softmax and LayerNorm ops against ORT."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper
from onnxruntime.quantization import QuantType

from compiler.runtime import IntegerExecutor
from tests.test_reference_support import ort_run, quantized_single_op, steps_apart

SEEDS = st.integers(0, 2**16)


def _broadcast_pair(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    full = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    other = [d if draw(st.booleans()) else 1 for d in full]
    other = other[draw(st.integers(0, len(other) - 1)) :]
    pair = (tuple(full), tuple(other))
    return pair if draw(st.booleans()) else pair[::-1]


@st.composite
def broadcast_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _broadcast_pair(draw)


@settings(max_examples=25, deadline=None)
@given(
    shapes=broadcast_shapes(),
    op_type=st.sampled_from(["Add", "Sub", "Mul"]),
    activation_type=st.sampled_from([QuantType.QInt8, QuantType.QUInt8]),
    mode=st.sampled_from(["sima", "tflite"]),
    seed=SEEDS,
)
def test_broadcasting_add_sub_mul_match_ort_within_one_step(
    shapes: tuple, op_type: str, activation_type: QuantType, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    node = helper.make_node(op_type, ["a", "b"], ["y"])
    qdq, feeds = quantized_single_op(
        node,
        {"a": shapes[0], "b": shapes[1]},
        rng=rng,
        activation_type=activation_type,
        op_types=[op_type],
    )
    assert steps_apart(IntegerExecutor(qdq, mode, strict=True), qdq, feeds)["y"] <= 1


@pytest.mark.parametrize("mode", ["sima", "tflite"])
def test_div_matches_ort_within_one_step(mode: str) -> None:
    rng = np.random.default_rng(34)
    node = helper.make_node("Div", ["a", "b"], ["y"])
    qdq, feeds = quantized_single_op(
        node, {"a": (3, 4), "b": (1, 4)}, rng=rng, positive=True, op_types=["Div"]
    )
    assert steps_apart(IntegerExecutor(qdq, mode, strict=True), qdq, feeds)["y"] <= 1


def test_add_with_very_different_input_scales_matches_ort() -> None:
    rng = np.random.default_rng(7)
    node = helper.make_node("Add", ["a", "b"], ["y"])
    qdq, _ = quantized_single_op(node, {"a": (2, 8), "b": (2, 8)}, rng=rng)
    feeds = [
        {
            "a": rng.standard_normal((2, 8)).astype(np.float32),
            "b": 0.001 * rng.standard_normal((2, 8)).astype(np.float32),
        }
    ]
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


@st.composite
def pool_cases(draw: st.DrawFn) -> dict:
    kernel = draw(st.tuples(st.integers(1, 3), st.integers(1, 3)))
    pads = [draw(st.integers(0, k - 1)) for k in kernel * 2]
    return {
        "kernel_shape": list(kernel),
        "strides": list(draw(st.tuples(st.integers(1, 3), st.integers(1, 3)))),
        "pads": pads,
    }


@settings(max_examples=15, deadline=None)
@given(case=pool_cases(), ceil_mode=st.sampled_from([0, 1]), seed=SEEDS)
def test_max_pool_is_exact(case: dict, ceil_mode: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    node = helper.make_node("MaxPool", ["x"], ["y"], ceil_mode=ceil_mode, **case)
    qdq, feeds = quantized_single_op(node, {"x": (1, 3, 7, 8)}, rng=rng)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] == 0


@settings(max_examples=15, deadline=None)
@given(case=pool_cases(), count_include_pad=st.sampled_from([0, 1]), seed=SEEDS)
def test_average_pool_matches_ort_within_one_step(
    case: dict, count_include_pad: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    node = helper.make_node(
        "AveragePool", ["x"], ["y"], count_include_pad=count_include_pad, **case
    )
    qdq, feeds = quantized_single_op(node, {"x": (1, 3, 7, 8)}, rng=rng)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


@pytest.mark.parametrize("op_type", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pools_match_ort_within_one_step(op_type: str) -> None:
    rng = np.random.default_rng(8)
    node = helper.make_node(op_type, ["x"], ["y"])
    qdq, feeds = quantized_single_op(node, {"x": (2, 5, 6, 7)}, rng=rng, op_types=[op_type])
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_mean_matches_ort_within_one_step(keepdims: int) -> None:
    rng = np.random.default_rng(9)
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1, 3], keepdims=keepdims)
    qdq, feeds = quantized_single_op(
        node, {"x": (2, 5, 3, 4)}, rng=rng, opset=17, op_types=["ReduceMean"]
    )
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


@pytest.mark.parametrize(
    ("coordinate_mode", "nearest_mode"),
    [
        ("asymmetric", "floor"),
        ("half_pixel", "round_prefer_floor"),
        ("align_corners", "round_prefer_ceil"),
        ("pytorch_half_pixel", "ceil"),
    ],
)
def test_resize_nearest_is_exact(coordinate_mode: str, nearest_mode: str) -> None:
    rng = np.random.default_rng(10)
    node = helper.make_node(
        "Resize",
        ["x", "", "scales"],
        ["y"],
        mode="nearest",
        coordinate_transformation_mode=coordinate_mode,
        nearest_mode=nearest_mode,
    )
    scales = {"scales": np.array([1, 1, 2, 3], dtype=np.float32)}
    qdq, feeds = quantized_single_op(node, {"x": (1, 2, 4, 5)}, scales, rng=rng)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] == 0


@pytest.mark.parametrize("coordinate_mode", ["half_pixel", "align_corners", "asymmetric"])
def test_resize_linear_matches_ort_within_one_step(coordinate_mode: str) -> None:
    rng = np.random.default_rng(11)
    node = helper.make_node(
        "Resize",
        ["x", "", "", "sizes"],
        ["y"],
        mode="linear",
        coordinate_transformation_mode=coordinate_mode,
    )
    sizes = {"sizes": np.array([1, 2, 9, 6], dtype=np.int64)}
    qdq, feeds = quantized_single_op(node, {"x": (1, 2, 4, 5)}, sizes, rng=rng)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


def test_concat_rescales_inputs_with_different_scales_within_one_step() -> None:
    rng = np.random.default_rng(12)
    node = helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=1)
    qdq, _ = quantized_single_op(node, {"a": (1, 2, 3), "b": (1, 4, 3), "c": (1, 1, 3)}, rng=rng)
    feeds = [
        {
            "a": rng.standard_normal((1, 2, 3)).astype(np.float32),
            "b": 5 * rng.standard_normal((1, 4, 3)).astype(np.float32),
            "c": 0.1 * rng.standard_normal((1, 1, 3)).astype(np.float32),
        }
    ]
    executor = IntegerExecutor(qdq, strict=True)
    scales = {name: executor.input_params[name].scalar_scale() for name in "abc"}
    assert len(set(scales.values())) == 3
    assert steps_apart(executor, qdq, feeds)["y"] <= 1


MOVEMENT_CASES = {
    "Reshape": (
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
        {"shape": np.array([0, -1, 2], dtype=np.int64)},
    ),
    "Transpose": (helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1]), {}),
    "Flatten": (helper.make_node("Flatten", ["x"], ["y"], axis=2), {}),
    "Slice": (
        helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"]),
        {
            "starts": np.array([-1, 1], dtype=np.int64),
            "ends": np.array([-100, 100], dtype=np.int64),
            "axes": np.array([2, 3], dtype=np.int64),
            "steps": np.array([-2, 2], dtype=np.int64),
        },
    ),
    "Squeeze": (
        helper.make_node("Squeeze", ["x", "axes"], ["y"]),
        {"axes": np.array([0], dtype=np.int64)},
    ),
    "Unsqueeze": (
        helper.make_node("Unsqueeze", ["x", "axes"], ["y"]),
        {"axes": np.array([-1, 1], dtype=np.int64)},
    ),
    "DepthToSpace": (helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="CRD"), {}),
    "SpaceToDepth": (helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2), {}),
    "Pad": (
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="constant"),
        {"pads": np.array([0, 0, 1, 2, 0, 1, 0, 1], dtype=np.int64)},
    ),
    "PadReflect": (
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect"),
        {"pads": np.array([0, 0, 1, 2, 0, 0, 1, 1], dtype=np.int64)},
    ),
    "Gather": (
        helper.make_node("Gather", ["x", "indices"], ["y"], axis=1),
        {"indices": np.array([3, 0, -1], dtype=np.int64)},
    ),
}


@pytest.mark.parametrize("case", sorted(MOVEMENT_CASES))
def test_data_movement_is_exact(case: str) -> None:
    rng = np.random.default_rng(13)
    node, constants = MOVEMENT_CASES[case]
    qdq, feeds = quantized_single_op(
        node, {"x": (1, 4, 4, 6)}, constants, rng=rng, op_types=[node.op_type]
    )
    executor = IntegerExecutor(qdq, strict=True)
    assert [step.kind for step in executor.steps].count("integer") == 1
    assert steps_apart(executor, qdq, feeds)["y"] == 0


def test_split_into_unequal_parts_is_exact() -> None:
    rng = np.random.default_rng(14)
    node = helper.make_node("Split", ["x", "split"], ["y0", "y1"], axis=1)
    qdq, feeds = quantized_single_op(
        node, {"x": (1, 5, 3)}, {"split": np.array([2, 3], dtype=np.int64)}, rng=rng
    )
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds) == {"y0": 0, "y1": 0}


LUT_OPS = {
    "Sigmoid": {},
    "Tanh": {},
    "Exp": {},
    "Erf": {},
    "HardSigmoid": {"alpha": 0.3, "beta": 0.4},
    "HardSwish": {},
    "LeakyRelu": {"alpha": 0.1},
    "Elu": {"alpha": 0.7},
    "Softplus": {},
    "Reciprocal": {},
    "Sqrt": {},
    "Log": {},
}


@pytest.mark.parametrize("op_type", sorted(LUT_OPS))
@pytest.mark.parametrize("activation_type", [QuantType.QInt8, QuantType.QUInt8])
def test_lookup_table_ops_match_ort_within_one_step(
    op_type: str, activation_type: QuantType
) -> None:
    rng = np.random.default_rng(15)
    node = helper.make_node(op_type, ["x"], ["y"], **LUT_OPS[op_type])
    qdq, feeds = quantized_single_op(
        node,
        {"x": (2, 3, 5)},
        rng=rng,
        positive=op_type in ("Sqrt", "Log", "Reciprocal"),
        activation_type=activation_type,
        op_types=[op_type],
    )
    executor = IntegerExecutor(qdq, strict=True)
    assert executor.summary()[1]["pattern"] == op_type
    assert steps_apart(executor, qdq, feeds)["y"] <= 1


def test_sigmoid_table_has_256_entries_and_matches_the_formula() -> None:
    rng = np.random.default_rng(16)
    node = helper.make_node("Sigmoid", ["x"], ["y"])
    qdq, _ = quantized_single_op(node, {"x": (4, 4)}, rng=rng)
    executor = IntegerExecutor(qdq, strict=True)
    (step,) = [s for s in executor.steps if s.kind == "integer"]
    x_params, y_params = executor.input_params["x"], executor.output_params["y"]
    codes = np.arange(-128, 128)
    real = (codes - x_params.scalar_zero_point()) * x_params.scalar_scale()
    expected = np.clip(
        np.rint(1 / (1 + np.exp(-real)) / y_params.scalar_scale()) + y_params.scalar_zero_point(),
        -128,
        127,
    )
    assert step.kernel.table.shape == (256,)
    np.testing.assert_array_equal(step.kernel.table, expected)


def test_int16_activation_uses_a_65536_entry_table() -> None:
    rng = np.random.default_rng(17)
    node = helper.make_node("Tanh", ["x"], ["y"])
    qdq, feeds = quantized_single_op(
        node, {"x": (4, 4)}, rng=rng, activation_type=QuantType.QInt16, op_types=["Tanh"]
    )
    executor = IntegerExecutor(qdq, strict=True)
    (step,) = [s for s in executor.steps if s.kind == "integer"]
    assert step.kernel.table.shape == (65536,)
    assert steps_apart(executor, qdq, feeds)["y"] <= 1


@pytest.mark.parametrize("mode", ["sima", "tflite"])
def test_softmax_matches_ort_within_two_steps(mode: str) -> None:
    rng = np.random.default_rng(18)
    node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    qdq, feeds = quantized_single_op(node, {"x": (3, 4, 10)}, rng=rng, opset=13)
    feeds = [{"x": 3 * f["x"]} for f in feeds]
    assert steps_apart(IntegerExecutor(qdq, mode, strict=True), qdq, feeds)["y"] <= 2


@pytest.mark.parametrize("mode", ["sima", "tflite"])
def test_layer_normalization_matches_ort_within_two_steps(mode: str) -> None:
    rng = np.random.default_rng(19)
    node = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1)
    params = {
        "gamma": (1 + 0.3 * rng.standard_normal(16)).astype(np.float32),
        "beta": (0.2 * rng.standard_normal(16)).astype(np.float32),
    }
    qdq, feeds = quantized_single_op(node, {"x": (2, 6, 16)}, params, rng=rng)
    executor = IntegerExecutor(qdq, mode, strict=True)
    assert steps_apart(executor, qdq, feeds)["y"] <= 2


def test_layer_normalization_adds_beta_before_the_final_rounding() -> None:
    rng = np.random.default_rng(36)
    node = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1)
    params = {
        "gamma": (1 + 0.3 * rng.standard_normal(32)).astype(np.float32),
        "beta": (0.5 * rng.standard_normal(32)).astype(np.float32),
    }
    qdq, feeds = quantized_single_op(node, {"x": (8, 32)}, params, rng=rng)
    executor = IntegerExecutor(qdq, strict=True)
    ours = executor.run_integer({"x": _codes(feeds[0]["x"], executor.input_params["x"])})["y"]
    theirs = ort_run(qdq, feeds[0])["y"]
    out = executor.output_params["y"]
    theirs = np.rint(theirs / out.scalar_scale()) + out.scalar_zero_point()
    assert np.mean(ours != theirs) < 0.02


def _codes(x: np.ndarray, params) -> np.ndarray:
    low, high = params.bounds
    codes = np.rint(x / params.scalar_scale()) + params.scalar_zero_point()
    return np.clip(codes, low, high).astype(params.dtype)
