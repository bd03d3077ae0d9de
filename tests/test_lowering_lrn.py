"""LRN across channels: the integer lowering (`LrnKernel`: a window sum of squares indexing a
table of factors), the LRN instruction and the float op."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from compiler.intmath import lrn_accumulator
from compiler.isa import Lrn, Space
from compiler.quantize import quantize_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.emulator_ops import EmulatorError
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.normalization import (
    LRN_FACTOR_BITS,
    LRN_INDEX_BITS,
    LrnKernel,
    lower_lrn,
    lrn_factors,
)
from compiler.runtime.qparams import NotLowerable, QuantOperand
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import float_model, random_feeds, steps_apart

SEEDS = st.integers(0, 2**32 - 1)


def _lowered(
    input_scale: float, zero_point: int, dtype: str, mode: str = "sima", **attributes
) -> LrnKernel:
    ctx = OpContext(
        node=helper.make_node("LRN", ["x"], ["y"], **attributes),
        opset=13,
        mode=mode,
        inputs=(QuantOperand("x", qparams(input_scale, zero_point, dtype), None),),
        outputs=(qparams(0.02, -3),),
    )
    return lower_lrn(ctx).kernel


def _program(kernel: LrnKernel, x: np.ndarray) -> Codegen:
    """The LRN instruction codegen writes, reading a DRAM input (HWC when 4-D)."""
    build = Codegen()
    layout = "HWC" if x.ndim == 4 else "NCHW"
    build.emit(
        Lrn(
            input=build.input("x", x.shape, x.dtype, Space.DRAM, layout),
            table=build.const(kernel.table, "int32"),
            output=build.output("y", x.shape, "int8", Space.ARENA),
            requant=build.stage(kernel.stage),
            input_zero_point=kernel.input_zero_point,
            size=kernel.size,
            index_shift=kernel.index_shift,
        )
    )
    return build


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=2, max_size=4),
    size=st.integers(1, 7),
    alpha=st.floats(1e-5, 1.0),
    beta=st.floats(0.1, 1.5),
    bias=st.floats(0.5, 4.0),
    dtype=st.sampled_from(["int8", "uint8"]),
    mode=st.sampled_from(["sima", "tflite"]),
    seed=SEEDS,
)
def test_emulator_matches_the_reference(
    shape: list,
    size: int,
    alpha: float,
    beta: float,
    bias: float,
    dtype: str,
    mode: str,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    zero_point = 0 if dtype == "int8" else 128
    attributes = {"size": size, "alpha": alpha, "beta": beta, "bias": bias}
    kernel = _lowered(float(rng.uniform(0.01, 0.5)), zero_point, dtype, mode, **attributes)
    x = random_codes(rng, shape, dtype)
    expected = kernel(x)
    run_single(_program(kernel, x), {"x": x}, expected)


def test_the_accumulator_is_the_window_sum_definition() -> None:
    """A direct loop over ONNX's window (floor before, ceil after, clipped to the tensor)."""
    rng = np.random.default_rng(1)
    x = rng.integers(-128, 128, (2, 6, 3))
    table = np.arange(40, 0, -1)
    for size in (1, 2, 3, 4, 5):
        expected = np.empty_like(x)
        for c in range(6):
            low, high = max(0, c - (size - 1) // 2), min(5, c + size // 2)
            sums = (x[:, low : high + 1] ** 2).sum(axis=1)
            index = np.minimum((sums + 512) >> 10, table.size - 1)
            expected[:, c] = x[:, c] * table[index]
        np.testing.assert_array_equal(lrn_accumulator(x, size, 10, table), expected)


@pytest.mark.parametrize("beta", [0.75, -0.5])
def test_factor_tables_fit_their_bounds(beta: float) -> None:
    """The largest factor (first or, for beta < 0, last) stays below 2**22; at most 2**14 + 1
    entries cover every window sum."""
    largest = 7 * 255**2
    table, index_shift, _ = lrn_factors(7, 1e-3, beta, 1.0, 0.3, largest)
    assert 2 ** (LRN_FACTOR_BITS - 2) <= table.max() < 2**LRN_FACTOR_BITS
    assert table.size <= 2**LRN_INDEX_BITS + 1
    assert (largest + (1 << index_shift) // 2) >> index_shift == table.size - 1


def test_wide_data_and_non_positive_bias_are_not_lowerable() -> None:
    with pytest.raises(NotLowerable, match="8-bit"):
        _lowered(0.05, 0, "int16", size=3)
    with pytest.raises(NotLowerable, match="bias"):
        _lowered(0.05, 0, "int8", size=3, bias=0.0)


def test_the_emulator_rejects_wide_data() -> None:
    rng = np.random.default_rng(2)
    kernel = _lowered(0.05, 0, "int8", size=3)
    x = random_codes(rng, (1, 4, 2, 2), "int16")
    with pytest.raises(EmulatorError, match="8-bit"):
        _program(kernel, x).run({"x": x})


@pytest.mark.parametrize(
    "attributes",
    [
        {"size": 3, "alpha": 0.5, "beta": 0.75, "bias": 1.0},
        {"size": 5, "alpha": 1e-4, "beta": 0.75, "bias": 2.0},
        {"size": 7, "alpha": 2.0, "beta": 1.2, "bias": 0.5},
    ],
)
def test_the_quantized_op_matches_onnx_runtime_within_one_step(attributes: dict) -> None:
    """Our quantizer (mlsoc puts int8 LRN on the MLA) and ONNX Runtime running the QDQ graph
    in float (dequantize, LRN, quantize)."""
    rng = np.random.default_rng(13)
    node = helper.make_node("LRN", ["x"], ["y"], **attributes)
    model = float_model([node], {"x": (2, 8, 5, 5)}, ["y"], opset=13)
    feeds = random_feeds(model, rng, 8, scale=3.0)
    qdq = quantize_model(model, feeds[:6], target="mlsoc").model
    executor = IntegerExecutor(qdq, strict=True)
    assert executor.float_nodes == ()
    assert steps_apart(executor, qdq, feeds[6:])["y"] <= 1
