"""The exporter patterns that kept torchvision's DeepLabV3 and MNASNet off one rk3588 segment:

- conv-drop-padding-taps: an ASPP branch dilated past its feature map (3×3, dilation 24,
  padding 24 on a 20×20 map) reads the input through its centre tap only; rk3588 rejects the
  padding, the 1×1 Conv it is runs;
- resize-to-supported: the image-pooling branch upsamples a 1×1 map bilinearly by 20 (rk3588:
  integer scales 2–8); from one pixel every mode copies it, so a nearest ×4 then ×5 is exact;
- classifier-to-conv: `x.mean([2, 3])` → Linear, whose rank-2 Gemm rk3588 runs, joins the body
  through an exit reshape at the graph output (a trailing host stage, no segment)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.replace_conv_taps import live_taps
from tests.architectures import Builder

RULE = "conv-drop-padding-taps"


def _attr(model: onnx.ModelProto, node: str, name: str) -> list[int]:
    found = next(n for n in model.graph.node if n.name == node)
    return list(next(a.ints for a in found.attribute if a.name == name))


def _dilated_branch(side: int, kernel: int, dilation: int, pad: int) -> onnx.ModelProto:
    """Conv → a dilated Conv (the ASPP branch) → Conv, on a side×side map."""
    b = Builder()
    x = b.conv("stem", "x", 3, 8, kernel=1)
    w = b.weight("aspp_w", 8, 8, kernel, kernel)
    y = b.node(
        "Conv",
        [x, w, b.weight("aspp_b", 8)],
        "aspp",
        kernel_shape=[kernel, kernel],
        dilations=[dilation] * 2,
        pads=[pad] * 4,
    )
    b.conv("proj", b.node("Relu", [y], "aspp_relu"), 8, 4, kernel=1)
    return load_model(b.model("aspp", {"x": [1, 3, side, side]}, ["proj_relu"]))


def test_live_taps_of_a_dilation_past_the_map_is_the_centre() -> None:
    assert live_taps(size=20, out=20, kernel=3, stride=1, dilation=24, pad=24) == [1]
    assert live_taps(size=20, out=20, kernel=3, stride=1, dilation=12, pad=12) == [0, 1, 2]


def test_aspp_branch_past_the_map_becomes_a_1x1_conv_on_rk3588() -> None:
    model = _dilated_branch(side=20, kernel=3, dilation=24, pad=24)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    result = apply_rule(model, RULE, "rk3588")
    assert result.verification.passed and result.verification.mode == "exact"
    assert _attr(result.model, "aspp", "kernel_shape") == [1, 1]
    assert _attr(result.model, "aspp", "pads") == [0, 0, 0, 0]
    after = check_model(result.model, "rk3588", suggest=False)
    assert after.mla_segments == 1 and not after.blockers


def test_only_the_outer_taps_that_read_padding_are_dropped() -> None:
    """5×5, dilation 10, padding 20 on 16×16: the outer ring reads only padding; the inner 3×3
    keeps dilation 10 with padding 10, which rk3588 runs."""
    result = apply_rule(_dilated_branch(side=16, kernel=5, dilation=10, pad=20), RULE, "rk3588")
    assert result.verification.passed and result.verification.mode == "exact"
    assert _attr(result.model, "aspp", "kernel_shape") == [3, 3]
    assert _attr(result.model, "aspp", "pads") == [10, 10, 10, 10]
    assert _attr(result.model, "aspp", "dilations") == [10, 10]


def test_a_dilated_conv_the_target_runs_is_left_alone() -> None:
    assert find_matches(_dilated_branch(side=20, kernel=3, dilation=24, pad=24), RULE) == []


def _image_pooling(side: int) -> onnx.ModelProto:
    """Conv → pool to side×side → 1×1 Conv → bilinear Resize back to 20×20 → Add → Conv."""
    b = Builder()
    x = b.conv("stem", "x", 3, 8, kernel=1)
    if side == 1:
        pooled = b.node("GlobalAveragePool", [x], "pool")
    else:
        window = 20 // side
        pooled = b.node("MaxPool", [x], "pool", kernel_shape=[window] * 2, strides=[window] * 2)
    p = b.conv("pool_proj", pooled, 8, 8, kernel=1)
    sizes = b.const("sizes", np.array([1, 8, 20, 20], np.int64))
    up = b.node("Resize", [p, "", "", sizes], "upsample", mode="linear")
    b.conv("head", b.node("Add", [x, up], "fused"), 8, 4, kernel=1)
    return load_model(b.model("pooling", {"x": [1, 3, 20, 20]}, ["head_relu"], opset=13))


def test_bilinear_resize_of_one_pixel_becomes_a_nearest_chain_on_rk3588() -> None:
    model = _image_pooling(side=1)
    assert "upsample" in {b.name for b in check_model(model, "rk3588", suggest=False).blockers}
    result = apply_rule(model, "resize-to-supported", "rk3588")
    assert result.verification.passed and result.verification.mode == "exact"
    modes = {
        onnx.helper.get_attribute_value(a)
        for n in result.model.graph.node
        if n.op_type == "Resize"
        for a in n.attribute
        if a.name == "mode"
    }
    assert modes == {b"nearest"}
    after = check_model(result.model, "rk3588", suggest=False)
    assert after.mla_segments == 1 and not after.blockers


def test_bilinear_resize_of_a_real_map_is_left_alone() -> None:
    assert find_matches(_image_pooling(side=2), "resize-to-supported", "rk3588") == []


def _mean_pool_classifier() -> onnx.ModelProto:
    b = Builder()
    x = b.conv("stem", "x", 3, 8, stride=2)
    pooled = b.node("ReduceMean", [x], "pool", axes=[2, 3], keepdims=0)
    b.node("Gemm", [pooled, b.weight("fc_w", 5, 8), b.weight("fc_b", 5)], "logits", transB=1)
    return load_model(b.model("mnas_head", {"x": [1, 3, 8, 8]}, ["logits"]))


def test_mean_pool_classifier_joins_the_body_on_rk3588() -> None:
    model = _mean_pool_classifier()
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    result = apply_rule(model, "classifier-to-conv", "rk3588")
    assert result.verification.passed and result.verification.mode == "exact"
    after = check_model(result.model, "rk3588", suggest=False)
    assert after.mla_segments == 1
    assert [b.op_type for b in after.blockers] == ["Reshape"]  # back to [1, 5]: host, trailing


@pytest.mark.parametrize("target", ["mlsoc", "rk3588"])
def test_mean_pool_classifier_is_claimed_by_the_classifier_rule(target: str) -> None:
    matches = find_matches(_mean_pool_classifier(), "classifier-to-conv", target)
    assert len(matches) == 1 and {"pool", "logits"} <= set(matches[0].nodes)
