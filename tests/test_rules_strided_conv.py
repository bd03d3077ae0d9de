"""strided-conv-to-space-to-depth: a Conv past the MLA's stride limit (rk3588: 1..7) whose
kernel is a multiple of its stride — audio codecs' downsampling (EnCodec: kernel 16, stride 8
along time) or an overlapping square stem — as a space-to-depth move and a stride-1 Conv."""

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

RULE = "strided-conv-to-space-to-depth"


def _downsampler(
    input_hw: tuple[int, int], kernel: tuple[int, int], strides: tuple[int, int], **attrs
) -> onnx.ModelProto:
    """Conv → the strided Conv under test → 1×1 Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 2, 1, 1)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.normal(0, 0.2, (6, 4, *kernel)).astype(np.float32), "down_w"),
        numpy_helper.from_array(rng.normal(0, 0.5, (6,)).astype(np.float32), "down_b"),
        numpy_helper.from_array(rng.normal(0, 0.5, (5, 6, 1, 1)).astype(np.float32), "w2"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w0"], ["a"]),
            helper.make_node(
                "Conv", ["a", "down_w", "down_b"], ["d"], "down", strides=list(strides), **attrs
            ),
            helper.make_node("Conv", ["d", "w2"], ["y"]),
        ],
        "downsampler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, *input_hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


@pytest.mark.parametrize(
    ("input_hw", "kernel", "strides"),
    [((1, 64), (1, 16), (1, 8)), ((1, 72), (1, 8), (1, 8)), ((32, 32), (16, 16), (8, 8))],
    ids=["time-kernel-2s", "time-kernel-s", "square-kernel-2s"],
)
def test_a_large_stride_conv_runs_on_the_rk3588_mla(input_hw, kernel, strides) -> None:
    model = _downsampler(input_hw, kernel, strides)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    step = apply_rule(model, RULE, "rk3588")
    assert step.verification.passed
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers
    convs = [n for n in step.model.graph.node if n.op_type == "Conv"]
    assert all(a.ints == [1, 1] for n in convs for a in n.attribute if a.name == "strides")


@pytest.mark.parametrize(
    ("input_hw", "kernel", "strides", "attrs"),
    [
        ((1, 60), (1, 16), (1, 8), {}),  # 8 does not divide 60
        ((1, 64), (1, 12), (1, 8), {}),  # kernel not a multiple of the stride
        ((1, 64), (1, 16), (1, 8), {"pads": [0, 4, 0, 4]}),
        ((32, 32), (8, 8), (8, 8), {}),  # a patch conv: patch-conv-to-space-to-depth's
    ],
)
def test_other_strided_convs_are_left_alone(input_hw, kernel, strides, attrs) -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_downsampler(input_hw, kernel, strides, **attrs), RULE, "rk3588")


def test_a_rewritten_time_downsampler_compiles_to_one_elf_bit_exact_on_rk3588(tmp_path) -> None:
    model = apply_rule(_downsampler((1, 64), (1, 16), (1, 8)), RULE, "rk3588").model
    qdq = quantize_on(model, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="downsampler")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(2).normal(0, 1, (1, 2, 1, 64)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
