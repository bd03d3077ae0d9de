"""AveragePool with ceil_mode=1 (ResNet-D's shortcut: AvgPool2d(2, 2, ceil_mode=True,
count_include_pad=False)): the partial last window's overhang is padding that never counts, so
the pool is a floor-mode one over grown end padding, on the MLA's POOL with count tables."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.pool import lower_average_pool
from compiler.runtime.qparams import NotLowerable, QuantOperand
from surgery.check import check_model
from tests.lower_support import quantize_on, run_and_compare
from tests.test_emulator_support import qparams
from tests.test_reference_support import quantized_single_op, steps_apart

SEEDS = st.integers(0, 2**32 - 1)


@st.composite
def ceil_cases(draw: st.DrawFn) -> dict:
    """Kernels and strides that leave a partial window on a 7 × 8 input; explicit padding only
    with count_include_pad=0 (the combination the lowering refuses is tested on its own)."""
    kernel = draw(st.tuples(st.integers(2, 3), st.integers(2, 3)))
    count_include_pad = draw(st.sampled_from([0, 1]))
    pads = [0] * 4 if count_include_pad else [draw(st.integers(0, k - 1)) for k in kernel * 2]
    return {
        "kernel_shape": list(kernel),
        "strides": list(draw(st.tuples(st.integers(2, 3), st.integers(2, 3)))),
        "pads": pads,
        "count_include_pad": count_include_pad,
    }


@settings(max_examples=20, deadline=None)
@given(case=ceil_cases(), seed=SEEDS)
def test_a_ceil_mode_average_pool_matches_onnx_runtime_within_one_step(case, seed) -> None:
    rng = np.random.default_rng(seed)
    node = helper.make_node("AveragePool", ["x"], ["y"], ceil_mode=1, **case)
    qdq, feeds = quantized_single_op(node, {"x": (1, 3, 7, 8)}, rng=rng, opset=19)
    assert steps_apart(IntegerExecutor(qdq, strict=True), qdq, feeds)["y"] <= 1


def test_ceil_mode_with_counted_explicit_padding_stays_on_the_host() -> None:
    ctx = OpContext(
        node=helper.make_node(
            "AveragePool",
            ["x"],
            ["y"],
            kernel_shape=[3, 3],
            strides=[2, 2],
            pads=[1, 1, 1, 1],
            ceil_mode=1,
            count_include_pad=1,
        ),
        opset=19,
        mode="sima",
        inputs=(QuantOperand("x", qparams(0.05, 0), None),),
        outputs=(qparams(0.05, 0),),
    )
    with pytest.raises(NotLowerable, match="ceil_mode=1, count_include_pad=1 and padding"):
        lower_average_pool(ctx)


def _resnet_d_shortcut(size: int) -> onnx.ModelProto:
    """Conv → AvgPool(2, 2, ceil_mode, count_include_pad=0) → Conv, plus the strided Conv
    branch it is added to: ResNet-D's downsampling block on a `size` × `size` map."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 8, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 8, 3, 3)).astype(np.float32), "w2"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
            helper.make_node(
                "AveragePool",
                ["a"],
                ["p"],
                kernel_shape=[2, 2],
                strides=[2, 2],
                ceil_mode=1,
                count_include_pad=0,
            ),
            helper.make_node("Conv", ["p", "w1"], ["shortcut"]),
            helper.make_node("Conv", ["a", "w2"], ["main"], strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("Add", ["main", "shortcut"], ["y"]),
        ],
        "resnet_d_shortcut",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("size", [8, 9])
def test_a_resnet_d_shortcut_compiles_to_one_elf_bit_exact(size, tmp_path) -> None:
    """8: the ceiling changes nothing; 9: the last window is partial."""
    model = _resnet_d_shortcut(size)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 1
    qdq = quantize_on(model, "mlsoc")
    result = compile_model(qdq, tmp_path, target="mlsoc", model_name="resnet_d")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(3).normal(0, 1, (1, 3, size, size)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
