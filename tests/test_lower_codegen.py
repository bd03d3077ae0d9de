"""Code generation, op by op: the emulated MLA program equals the integer reference, bit for bit.

Every integer step of each small QDQ model is compiled as one MLA segment (placement is tested
elsewhere), run in the emulator on the executor's own integer inputs, and compared with the
executor's integer outputs. Compute ops are quantized by ONNX Runtime's quantize_static (an
independent producer); data movement is wrapped in Q/DQ by hand, with and without a rescale.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.lower_support import emulate_all_integer_steps, qdq_op
from tests.test_reference_support import float_model, ort_quantize, random_feeds


def _ort_case(nodes, inputs, outputs, initializers=None, opset=17, positive=False, seed=0):
    rng = np.random.default_rng(seed)
    model = float_model(nodes, inputs, outputs, initializers, opset)
    calibration, tests = random_feeds(model, rng, 8), random_feeds(model, rng, 3)
    if positive:
        calibration, tests = (
            [{k: np.abs(v) + np.float32(0.5) for k, v in f.items()} for f in feeds]
            for feeds in (calibration, tests)
        )
    return ort_quantize(model, calibration), tests


def _weights(rng, *shape):
    return (rng.standard_normal(shape) * 0.3).astype(np.float32)


def _assert_bit_exact(model, feeds, **kwargs) -> None:
    results = emulate_all_integer_steps(model, feeds, **kwargs)
    assert results
    for name, (ours, reference) in results.items():
        assert ours.shape == reference.shape, name
        assert np.array_equal(ours, reference), (
            f"{name}: {int(np.abs(ours.astype(int) - reference.astype(int)).max())} steps apart"
        )


rng = np.random.default_rng(7)
COMPUTE_CASES = {
    "conv_grouped_dilated_strided": (
        [
            helper.make_node(
                "Conv",
                ["x", "w", "b"],
                ["y"],
                group=2,
                strides=[2, 1],
                dilations=[1, 2],
                pads=[1, 2, 0, 1],
            )
        ],
        {"x": (1, 4, 9, 10)},
        ["y"],
        {"w": _weights(rng, 6, 2, 3, 3), "b": _weights(rng, 6)},
    ),
    "conv_depthwise_same_upper": (
        [
            helper.make_node(
                "Conv", ["x", "w"], ["y"], group=4, auto_pad="SAME_UPPER", strides=[2, 2]
            ),
            helper.make_node("Relu", ["y"], ["z"]),
        ],
        {"x": (1, 4, 7, 8)},
        ["z"],
        {"w": _weights(rng, 4, 1, 3, 3)},
    ),
    "conv_1d": (
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1])],
        {"x": (1, 3, 12)},
        ["y"],
        {"w": _weights(rng, 5, 3, 3), "b": _weights(rng, 5)},
    ),
    "conv_transpose": (
        [
            helper.make_node(
                "ConvTranspose",
                ["x", "w", "b"],
                ["y"],
                strides=[2, 2],
                pads=[1, 0, 0, 1],
                output_padding=[1, 0],
            )
        ],
        {"x": (1, 3, 5, 6)},
        ["y"],
        {"w": _weights(rng, 3, 4, 3, 3), "b": _weights(rng, 4)},
    ),
    "matmul_bias": (
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        {"x": (1, 2, 5, 8)},
        ["y"],
        {"w": _weights(rng, 8, 6), "b": _weights(rng, 6)},
    ),
    "gemm_trans_b": (
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
        {"x": (3, 8)},
        ["y"],
        {"w": _weights(rng, 6, 8), "b": _weights(rng, 6)},
    ),
    "matmul_two_activations": (
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        {"a": (1, 2, 4, 5), "b": (1, 2, 5, 3)},
        ["y"],
        None,
    ),
    "add_sub_mul_broadcast": (
        [
            helper.make_node("Add", ["a", "b"], ["s"]),
            helper.make_node("Mul", ["s", "b"], ["m"]),
            helper.make_node("Sub", ["m", "a"], ["y"]),
        ],
        {"a": (1, 3, 4, 5), "b": (1, 3, 1, 5)},
        ["y"],
        None,
    ),
    "add_lower_rank_activation": (
        [helper.make_node("Add", ["a", "b"], ["y"])],
        {"a": (1, 3, 4, 5), "b": (4, 5)},
        ["y"],
        None,
    ),
    "sigmoid_tanh_tables": (
        [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Tanh", ["s"], ["y"])],
        {"x": (1, 3, 4, 5)},
        ["y"],
        None,
    ),
    "max_pool_ceil_mode": (
        [
            helper.make_node(
                "MaxPool",
                ["x"],
                ["y"],
                kernel_shape=[3, 3],
                strides=[2, 2],
                pads=[1, 1, 0, 0],
                ceil_mode=1,
            )
        ],
        {"x": (1, 3, 8, 9)},
        ["y"],
        None,
    ),
    "average_pool_exclude_pad": (
        [
            helper.make_node(
                "AveragePool",
                ["x"],
                ["y"],
                kernel_shape=[3, 3],
                strides=[2, 2],
                pads=[1, 1, 1, 1],
                count_include_pad=0,
            )
        ],
        {"x": (1, 3, 8, 9)},
        ["y"],
        None,
    ),
    "average_pool_include_pad": (
        [
            helper.make_node(
                "AveragePool",
                ["x"],
                ["y"],
                kernel_shape=[2, 3],
                pads=[1, 1, 0, 1],
                count_include_pad=1,
            )
        ],
        {"x": (1, 3, 6, 7)},
        ["y"],
        None,
    ),
    "global_pools": (
        [
            helper.make_node("GlobalAveragePool", ["x"], ["a"]),
            helper.make_node("GlobalMaxPool", ["x"], ["m"]),
        ],
        {"x": (1, 4, 5, 6)},
        ["a", "m"],
        None,
    ),
    "resize_linear": (
        [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")],
        {"x": (1, 3, 4, 5)},
        ["y"],
        {"scales": np.array([1, 1, 2, 1.5], np.float32)},
    ),
    "resize_nearest": (
        [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")],
        {"x": (1, 3, 4, 5)},
        ["y"],
        {"scales": np.array([1, 1, 2, 2], np.float32)},
    ),
    "softmax_channels": (
        [helper.make_node("Softmax", ["x"], ["y"], axis=1)],
        {"x": (1, 6, 3, 4)},
        ["y"],
        None,
    ),
    "concat_split": (
        [
            helper.make_node("Concat", ["a", "b"], ["c"], axis=1),
            helper.make_node("Split", ["c", "sizes"], ["p", "q"], axis=1),
        ],
        {"a": (1, 2, 3, 4), "b": (1, 5, 3, 4)},
        ["p", "q"],
        {"sizes": np.array([3, 4])},
    ),
}


@pytest.mark.parametrize("case", sorted(COMPUTE_CASES))
def test_compute_ops_are_bit_exact(case: str) -> None:
    model, feeds = _ort_case(*COMPUTE_CASES[case])
    _assert_bit_exact(model, feeds)
    _assert_bit_exact(model, feeds, batch=2)


def test_layer_normalization_is_bit_exact() -> None:
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)]
    initializers = {"g": _weights(rng, 8) + 1, "b": _weights(rng, 8)}
    model, feeds = _ort_case(nodes, {"x": (1, 3, 5, 8)}, ["y"], initializers, opset=18)
    _assert_bit_exact(model, feeds)
    _assert_bit_exact(model, feeds, batch=2)


@pytest.mark.parametrize("order", ["WidthFirst", "DepthFirst"])
@pytest.mark.parametrize(
    "strategy", ["BestFit", "GreedyBySize", "GreedyByLifetime", "SlowPeakGrowth"]
)
def test_branching_graph_is_bit_exact_for_every_plan_and_batch(strategy: str, order: str) -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["b"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["r", "w3"], ["c"]),
        helper.make_node("Add", ["b", "c"], ["s"]),
        helper.make_node("MaxPool", ["s"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Concat", ["p", "p"], ["y"], axis=1),
    ]
    initializers = {
        "w1": _weights(rng, 8, 3, 3, 3),
        "w2": _weights(rng, 8, 8, 3, 3),
        "w3": _weights(rng, 8, 8, 1, 1),
    }
    model, feeds = _ort_case(nodes, {"x": (1, 3, 8, 8)}, ["y"], initializers)
    _assert_bit_exact(model, feeds, strategy=strategy, order=order)
    _assert_bit_exact(model, feeds, batch=3, strategy=strategy, order=order)


def _movement(node, shape, **kwargs):
    model = qdq_op(node, shape, **kwargs)
    feeds = random_feeds(model, np.random.default_rng(3), 3)
    return model, feeds


HAND_WRAPPED_CASES = {
    "transpose": (helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 3, 1]), (1, 3, 4, 5), {}),
    "reshape_rescaled": (
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
        (1, 3, 4, 5),
        {"initializers": {"shape": np.array([1, 12, 5], np.int64)}, "out_scale": 0.08},
    ),
    "slice_negative_step": (
        helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"]),
        (1, 3, 6, 7),
        {
            "initializers": {
                "starts": np.array([-1, 1], np.int64),
                "ends": np.array([-100, 6], np.int64),
                "axes": np.array([2, 3], np.int64),
                "steps": np.array([-2, 2], np.int64),
            }
        },
    ),
    "gather_indices": (
        helper.make_node("Gather", ["x", "idx"], ["y"], axis=1),
        (1, 5, 3, 4),
        {"initializers": {"idx": np.array([4, 0, 2, -1], np.int64)}},
    ),
    "gather_scalar": (
        helper.make_node("Gather", ["x", "idx"], ["y"], axis=2),
        (1, 2, 3, 4),
        {"initializers": {"idx": np.array(1, np.int64)}},
    ),
    "depth_to_space_dcr": (
        helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="DCR"),
        (1, 8, 3, 4),
        {},
    ),
    "depth_to_space_crd": (
        helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="CRD"),
        (1, 8, 3, 4),
        {},
    ),
    "space_to_depth": (
        helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2),
        (1, 3, 4, 6),
        {},
    ),
    "expand": (
        helper.make_node("Expand", ["x", "shape"], ["y"]),
        (1, 3, 1, 4),
        {"initializers": {"shape": np.array([2, 3, 5, 4], np.int64)}},
    ),
    "tile": (
        helper.make_node("Tile", ["x", "reps"], ["y"]),
        (1, 2, 3, 4),
        {"initializers": {"reps": np.array([1, 2, 3, 2], np.int64)}, "out_scale": 0.1},
    ),
    "pad_constant_crop": (
        helper.make_node("Pad", ["x", "pads", "value"], ["y"], mode="constant"),
        (1, 3, 5, 6),
        {
            "initializers": {
                "pads": np.array([0, 0, 2, -1, 0, 1, 1, 2], np.int64),
                "value": np.array(0.25, np.float32),
            },
            "out_scale": 0.07,
        },
    ),
    "pad_reflect": (
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect"),
        (1, 2, 5, 6),
        {"initializers": {"pads": np.array([0, 0, 2, 3, 0, 0, 1, 2], np.int64)}},
    ),
    "pad_edge": (
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="edge"),
        (1, 2, 5, 6),
        {"initializers": {"pads": np.array([0, 1, 2, 3, 0, 0, 1, 2], np.int64)}},
    ),
    "pad_wrap": (
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="wrap"),
        (1, 2, 5, 6),
        {"initializers": {"pads": np.array([0, 0, 2, 3, 0, 0, 1, 2], np.int64)}, "opset": 19},
    ),
    "flatten": (
        helper.make_node("Flatten", ["x"], ["y"], axis=2),
        (1, 3, 4, 5),
        {"out_scale": 0.06},
    ),
    "reduce_mean_two_axes": (
        helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=0),
        (1, 3, 4, 5),
        {"initializers": {"axes": np.array([2, 3], np.int64)}, "opset": 18, "out_scale": 0.02},
    ),
    "reduce_sum_channels": (
        helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1),
        (1, 3, 4, 5),
        {"initializers": {"axes": np.array([1], np.int64)}, "out_scale": 0.2},
    ),
    "reduce_max": (
        helper.make_node("ReduceMax", ["x", "axes"], ["y"], keepdims=1),
        (1, 3, 4, 5),
        {"initializers": {"axes": np.array([3], np.int64)}, "opset": 18, "out_scale": 0.04},
    ),
    "reduce_min_all": (
        helper.make_node("ReduceMin", ["x"], ["y"], keepdims=0),
        (1, 3, 4, 5),
        {"opset": 18},
    ),
    "hard_swish_table": (helper.make_node("HardSwish", ["x"], ["y"]), (1, 3, 4, 5), {}),
    "leaky_relu_table": (
        helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.1),
        (1, 3, 4, 5),
        {"out_scale": 0.03},
    ),
    "squeeze_unsqueeze": (
        helper.make_node("Unsqueeze", ["x", "axes"], ["y"]),
        (1, 3, 4, 5),
        {"initializers": {"axes": np.array([2], np.int64)}, "out_scale": 0.03},
    ),
}


@pytest.mark.parametrize("case", sorted(HAND_WRAPPED_CASES))
def test_hand_wrapped_ops_are_bit_exact(case: str) -> None:
    node, shape, kwargs = HAND_WRAPPED_CASES[case]
    model, feeds = _movement(node, shape, **kwargs)
    _assert_bit_exact(model, feeds)
    _assert_bit_exact(model, feeds, batch=2)


def test_softmax_of_an_old_opset_flattens_the_trailing_axes() -> None:
    node = helper.make_node("Softmax", ["x"], ["y"], axis=1)
    model, feeds = _movement(node, (1, 3, 4, 5), out_scale=1 / 256, opset=11)
    _assert_bit_exact(model, feeds)
