"""conv-kernel-split: a Conv whose kernel the MLA rejects (rk3588 runs depthwise kernels up to
8×8; EdgeNeXt's last stage uses 9×9) becomes a sum of Convs over tiles of its kernel."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
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


def test_a_kernel_without_padding_cannot_be_split() -> None:
    """Every tile must hold the taps [K−1−p₁, p₀] to keep its pads non-negative: with no
    padding that is the whole kernel."""
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_depthwise((9, 9), (0, 0, 0, 0)), "conv-kernel-split", "rk3588")


def test_a_split_kernel_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    fixed = apply_rule(_depthwise((9, 9), (4, 4, 4, 4)), "conv-kernel-split", "rk3588").model
    qdq = quantize_on(fixed, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="large_kernel")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, H, H)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
