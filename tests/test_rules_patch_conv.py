"""patch-conv-to-space-to-depth: a patchify Conv (kernel = stride) past the MLA's stride limit
(rk3588: 1..7; SegFormer's 8×8 sequence reduction, ViT's 16×16 patch embedding) as
SpaceToDepth and a 1×1 Conv."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.replace_patch_conv import space_to_depth_weight
from tests.lower_support import quantize_on, run_and_compare


def _conv_patch_conv(block: int = 8, size: int = 32, **patch_attrs) -> onnx.ModelProto:
    """Conv → patch Conv (kernel = stride = `block` unless overridden) → Conv."""
    rng = np.random.default_rng(0)
    kernel = patch_attrs.pop("kernel", block)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32), "w0"),
        numpy_helper.from_array(
            rng.normal(0, 0.2, (6, 4, kernel, kernel)).astype(np.float32), "patch_w"
        ),
        numpy_helper.from_array(rng.normal(0, 0.5, (6,)).astype(np.float32), "patch_b"),
        numpy_helper.from_array(rng.normal(0, 0.5, (5, 6, 1, 1)).astype(np.float32), "w2"),
    ]
    attrs = {"strides": [block, block], **patch_attrs}
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
            helper.make_node("Conv", ["a", "patch_w", "patch_b"], ["p"], "patch", **attrs),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_patch_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def test_the_reordered_kernel_reads_space_to_depth_channels() -> None:
    """Same sums as the patch kernel: conv(x, W) at one patch == W' · SpaceToDepth(x)."""
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(3, 2, 4, 4))
    patch = rng.normal(size=(2, 4, 4))
    moved = patch.transpose(1, 2, 0).reshape(-1)  # channel (i·b + j)·C + c
    expected = np.einsum("mcij,cij->m", weight, patch)
    np.testing.assert_allclose(space_to_depth_weight(weight)[:, :, 0, 0] @ moved, expected)


def test_a_stride_8_patch_conv_runs_on_the_rk3588_mla() -> None:
    model = _conv_patch_conv(8)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    step = apply_rule(model, "patch-conv-to-space-to-depth", "rk3588")
    assert step.verification.passed
    assert [n.op_type for n in step.model.graph.node] == ["Conv", "SpaceToDepth", "Conv", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel": 9},  # overlapping windows
        {"pads": [1, 1, 1, 1]},
        {"dilations": [2, 2], "kernel": 4},
    ],
)
def test_only_a_plain_patch_conv_is_matched(attrs) -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_patch_conv(8, **attrs), "patch-conv-to-space-to-depth", "rk3588")


def test_a_map_the_stride_does_not_divide_is_not_matched() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_patch_conv(8, size=36), "patch-conv-to-space-to-depth", "rk3588")


def test_a_rewritten_patch_conv_compiles_to_one_elf_bit_exact_on_rk3588(tmp_path) -> None:
    model = apply_rule(_conv_patch_conv(8), "patch-conv-to-space-to-depth", "rk3588").model
    qdq = quantize_on(model, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="patch")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(2).normal(0, 1, (1, 3, 32, 32)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
