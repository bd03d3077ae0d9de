"""conv-kernel-split: a Conv whose kernel the MLA rejects (rk3588 runs depthwise kernels up to
8×8; EdgeNeXt's last stage uses 9×9; wav2vec 2.0's positional convolution has 128 taps padded
by 64) becomes a sum of Convs over tiles of its kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.replace_conv import even_tiles
from tests.lower_support import quantize_on, run_and_compare

C, H = 8, 10


def _depthwise(kernel, pads, group: int = C, strides=(1, 1), dilations=(1, 1)) -> onnx.ModelProto:
    """1×1 Conv → depthwise (or grouped) Conv with `kernel` and a bias → 1×1 Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (C, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(
            rng.normal(0, 0.3, (C, C // group, *kernel)).astype(np.float32), "wk"
        ),
        numpy_helper.from_array(rng.normal(0, 0.3, C).astype(np.float32), "bk"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, C, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node(
            "Conv",
            ["a", "wk", "bk"],
            ["b"],
            group=group,
            kernel_shape=list(kernel),
            pads=list(pads),
            strides=list(strides),
            dilations=list(dilations),
        ),
        helper.make_node("Conv", ["b", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "large_kernel",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def _tile_kernels(model: onnx.ModelProto) -> list[list[int]]:
    return [
        list(helper.get_attribute_value(a))
        for n in model.graph.node[1:-1]
        if n.op_type == "Conv"
        for a in n.attribute
        if a.name == "kernel_shape"
    ]


@pytest.mark.parametrize(
    ("kernel", "pads", "strides", "dilations", "tiles"),
    [
        ((9, 9), (4, 4, 4, 4), (1, 1), (1, 1), [[5, 5]] * 4),  # EdgeNeXt's "same" 9×9
        ((9, 9), (4, 4, 4, 4), (2, 2), (1, 1), [[5, 5]] * 4),  # strided
        ((11, 11), (5, 3, 5, 7), (1, 1), (1, 1), [[6, 4], [6, 8], [6, 4], [6, 8]]),
        ((9, 3), (8, 1, 8, 1), (1, 1), (2, 1), [[5, 3], [5, 3]]),  # dilated, split on H only
    ],
)
def test_a_depthwise_kernel_over_the_limit_becomes_a_sum_of_tiles(
    kernel, pads, strides, dilations, tiles
) -> None:
    model = _depthwise(kernel, pads, strides=strides, dilations=dilations)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    step = apply_rule(model, "conv-kernel-split", "rk3588")
    assert step.verification.passed
    assert _tile_kernels(step.model) == tiles
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_the_bias_is_added_once() -> None:
    step = apply_rule(_depthwise((9, 9), (4, 4, 4, 4)), "conv-kernel-split", "rk3588")
    convs = [n for n in step.model.graph.node[1:-1] if n.op_type == "Conv"]
    assert [len(n.input) for n in convs] == [3, 2, 2, 2]


def test_kernels_the_mla_runs_are_left_alone() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_depthwise((7, 7), (3, 3, 3, 3)), "conv-kernel-split", "rk3588")
    with pytest.raises(RuleNotApplicableError):  # mlsoc has no depthwise kernel limit
        apply_rule(_depthwise((9, 9), (4, 4, 4, 4)), "conv-kernel-split", "mlsoc")


def test_a_kernel_without_padding_is_split_into_cropped_tiles() -> None:
    """Shifting pads cannot split it (every shifted tile holds the taps [K−1−p₁, p₀]: with no
    padding, the whole kernel); each tile convolves its own crop of the input instead."""
    step = apply_rule(_depthwise((9, 9), (0, 0, 0, 0)), "conv-kernel-split", "rk3588")
    assert step.verification.passed
    ops = [n.op_type for n in step.model.graph.node]
    assert "Pad" not in ops and ops.count("Slice") == 4
    assert _tile_kernels(step.model) == [[4, 4], [4, 5], [5, 4], [5, 5]]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def _positional_conv(taps: int, group: int, channels: int = 32, frames: int = 49):
    """wav2vec 2.0's positional convolution on [1, channels, 1, frames]: a grouped 1×taps
    kernel padded by taps/2 on both sides (the exporter's 4-D form of its Conv1d)."""
    rng = np.random.default_rng(3)
    weight = rng.normal(0, 0.1, (channels, channels // group, 1, taps)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node(
                "Conv",
                ["a", "wk", "bk"],
                ["b"],
                group=group,
                kernel_shape=[1, taps],
                pads=[0, taps // 2, 0, taps // 2],
            ),
            helper.make_node("Conv", ["b", "w2"], ["y"]),
        ],
        "positional_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, frames])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(
                rng.normal(0, 0.3, (channels, 4, 1, 1)).astype(np.float32), "w1"
            ),
            numpy_helper.from_array(weight, "wk"),
            numpy_helper.from_array(rng.normal(0, 0.3, channels).astype(np.float32), "bk"),
            numpy_helper.from_array(
                rng.normal(0, 0.3, (4, channels, 1, 1)).astype(np.float32), "w2"
            ),
        ],
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


@pytest.mark.parametrize(("taps", "group", "tiles"), [(32, 4, 2), (128, 16, 5)])
def test_pads_past_the_limit_are_one_pad_before_cropped_tiles(taps, group, tiles) -> None:
    """rk3588 pads at most 15 and runs kernels up to 31 wide."""
    model = _positional_conv(taps, group)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    step = apply_rule(model, "conv-kernel-split", "rk3588")
    assert step.verification.passed
    ops = [n.op_type for n in step.model.graph.node]
    assert ops.count("Pad") == 1 and ops.count("Conv") == tiles + 2
    assert all(k[1] <= 31 for k in _tile_kernels(step.model))
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_cropped_tiles_compile_to_one_elf_bit_exact(tmp_path) -> None:
    fixed = apply_rule(_positional_conv(32, 4), "conv-kernel-split", "rk3588").model
    qdq = quantize_on(fixed, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="positional_conv")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(6).normal(0, 1, (1, 4, 1, 49)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact


def test_even_tiles_cut_taps_into_runs_that_differ_by_at_most_one() -> None:
    assert even_tiles(128, 5) == [(0, 25), (26, 50), (51, 76), (77, 101), (102, 127)]
    assert even_tiles(9, 1) == [(0, 8)]


def test_a_split_kernel_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    fixed = apply_rule(_depthwise((9, 9), (4, 4, 4, 4)), "conv-kernel-split", "rk3588").model
    qdq = quantize_on(fixed, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="large_kernel")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, H, H)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
