"""CumSum: exact prefix sums of centred codes as a MATMUL with a constant 0/1 matrix
(`prefix_matrix`), the summed axis moved last by strided views, then one requantization."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from compiler.isa import MatMul, Space
from compiler.quantize import quantize_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.matmul import CumSumKernel, lower_cumsum, prefix_matrix
from compiler.runtime.qparams import ConstOperand, NotLowerable, QuantOperand
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import float_model, random_feeds, steps_apart

SEEDS = st.integers(0, 2**32 - 1)


def _onnx_cumsum(x: np.ndarray, axis: int, exclusive: bool, reverse: bool) -> np.ndarray:
    """CumSum as ONNX defines it, on integers."""
    x = np.flip(x, axis) if reverse else x
    total = np.cumsum(x, axis=axis)
    if exclusive:
        total = total - x
    return np.flip(total, axis) if reverse else total


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_the_prefix_matrix_computes_cumsum(exclusive: bool, reverse: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(-255, 256, (3, 9))
    matrix = prefix_matrix(9, exclusive=exclusive, reverse=reverse)
    np.testing.assert_array_equal(x @ matrix, _onnx_cumsum(x, 1, exclusive, reverse))


def _lowered(axis: int, mode: str = "sima", **attributes) -> CumSumKernel:
    ctx = OpContext(
        node=helper.make_node("CumSum", ["x", "axis"], ["y"], **attributes),
        opset=14,
        mode=mode,
        inputs=(
            QuantOperand("x", qparams(0.05, -4), None),
            ConstOperand("axis", np.array(axis, np.int64)),
        ),
        outputs=(qparams(0.4, 3),),
    )
    return lower_cumsum(ctx).kernel


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=2, max_size=4),
    data=st.data(),
    exclusive=st.booleans(),
    reverse=st.booleans(),
    mode=st.sampled_from(["sima", "tflite"]),
    seed=SEEDS,
)
def test_emulator_matches_the_reference(
    shape: list, data: st.DataObject, exclusive: bool, reverse: bool, mode: str, seed: int
) -> None:
    """The MATMUL codegen writes: input and output seen with the summed axis last."""
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    kernel = _lowered(axis, mode, exclusive=int(exclusive), reverse=int(reverse))
    x = random_codes(rng, shape, "int8")
    expected = kernel(x)
    centred = x.astype(np.int64) + 4
    rounded = np.rint(_onnx_cumsum(centred, axis, exclusive, reverse) * 0.125) + 3
    assert np.max(np.abs(expected - np.clip(rounded, -128, 127))) <= 1
    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.DRAM, "HWC" if x.ndim == 4 else "NCHW")
    target = build.output("y", x.shape, "int8", Space.ARENA)
    last = axis % x.ndim
    perm = [a for a in range(x.ndim) if a != last] + [last]
    matrix = prefix_matrix(x.shape[last], exclusive=exclusive, reverse=reverse)
    build.emit(
        MatMul(
            a=source.transpose(perm),
            b=build.const(matrix, "int8"),
            output=target.transpose(perm),
            requant=build.stage(kernel.stage),
            a_zero_point=kernel.input_zero_point,
        )
    )
    run_single(build, {"x": x}, expected)


def test_a_computed_axis_is_not_lowerable() -> None:
    ctx = OpContext(
        node=helper.make_node("CumSum", ["x", "axis"], ["y"]),
        opset=14,
        mode="sima",
        inputs=(QuantOperand("x", qparams(0.05, 0), None), None),
        outputs=(qparams(0.4, 3),),
    )
    with pytest.raises(NotLowerable, match="axis"):
        lower_cumsum(ctx)


@pytest.mark.parametrize(("axis", "exclusive"), [(3, 0), (1, 1)])
def test_the_quantized_op_matches_onnx_runtime_within_one_step(axis: int, exclusive: int) -> None:
    """Our quantizer and ONNX Runtime running the QDQ graph in float."""
    rng = np.random.default_rng(17)
    node = helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive)
    axis_value = {"axis": np.array(axis, np.int64)}
    model = float_model([node], {"x": (1, 6, 5, 7)}, ["y"], axis_value, opset=14)
    feeds = random_feeds(model, rng, 8)
    qdq = quantize_model(model, feeds[:6], target="mlsoc").model
    executor = IntegerExecutor(qdq, strict=True)
    assert executor.float_nodes == ()
    assert steps_apart(executor, qdq, feeds[6:])["y"] <= 1
