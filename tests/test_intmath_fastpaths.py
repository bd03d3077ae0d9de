"""compiler.intmath.FusedOutputStage computes exactly `requantize_clamp`, the definition.

The fused stage folds the int32 saturation, the bias, the rounding half and the zero point into
per-channel bounds and one offset, and carries the sum in float64 or int64 (its docstring has the
argument). These tests pin it to the definition on extreme accumulators (beyond int32, up to
2**53), on the accumulators where the rounding flips (just below, at and above every threshold
of the output codes, which include the exact ties of a power-of-two multiplier), on every output
dtype and clamp range, and on float32 / float64 / integer accumulator carriers.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from compiler.intmath import (
    INT32_MAX,
    INT32_MIN,
    MAX_RIGHT_SHIFT,
    MIN_RIGHT_SHIFT,
    FusedOutputStage,
    dtype_range,
    quantize_linear,
    quantize_linear_fast,
    quantize_multiplier,
    requantize_clamp,
)

OUT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64]
EXTREMES = [0, 1, -1, INT32_MAX, INT32_MIN, INT32_MAX + 1, INT32_MIN - 1, 2**40, -(2**40)]


@st.composite
def stages(draw: st.DrawFn) -> dict:
    """(M, n) per channel (from real multipliers, or raw, incl. the power of two 2**30 whose
    products have exact ties), a zero point, a clamp range inside an output dtype, a bias."""
    channels = draw(st.integers(1, 3))
    if draw(st.booleans()):
        exponent = draw(st.integers(-40, 3))
        reals = [draw(st.floats(0.5, 1.0)) * 2.0**exponent for _ in range(channels)]
        multiplier, shift = quantize_multiplier(reals)
    else:
        multiplier = np.array(
            [draw(st.sampled_from([0, 2**30, 2**31 - 1]) | st.integers(2**30, 2**31 - 1))]
            * channels
        )
        shift = np.array(
            [draw(st.integers(MIN_RIGHT_SHIFT, MAX_RIGHT_SHIFT)) for _ in range(channels)]
        )
    dtype = np.dtype(draw(st.sampled_from(OUT_DTYPES)))
    dtype_low, dtype_high = dtype_range(dtype)
    dtype_low, dtype_high = max(dtype_low, -(2**40)), min(dtype_high, 2**40)
    low = draw(st.sampled_from([dtype_low]) | st.integers(dtype_low, dtype_high))
    high = draw(st.sampled_from([dtype_high]) | st.integers(low, dtype_high))
    zero_point = draw(st.integers(max(dtype_low, -(2**15)), min(dtype_high, 2**15)))
    bias = [draw(st.sampled_from([0]) | st.integers(-(2**31), 2**31)) for _ in range(channels)]
    return {
        "multiplier": np.asarray(multiplier, dtype=np.int64).reshape(-1, 1),
        "shift": np.asarray(shift, dtype=np.int64).reshape(-1, 1),
        "zero_point": zero_point,
        "low": low,
        "high": high,
        "addend": np.asarray(bias, dtype=np.int64).reshape(-1, 1),
        "dtype": dtype,
    }


def _thresholds(case: dict, count: int) -> list[int]:
    """Accumulators where the stage's output code changes: for codes q near the zero point
    and the clamp bounds, acc + addend = ceil((q * 2**S - O) / M) - 1, +0 and +1."""
    values = []
    for m, n, a in zip(
        case["multiplier"].ravel(), case["shift"].ravel(), case["addend"].ravel(), strict=True
    ):
        m, unit = int(m), 2 ** (31 + int(n))
        if m == 0:
            continue
        offset = unit // 2 + case["zero_point"] * unit
        codes = {case["low"], case["low"] + 1, case["high"], case["high"] + 1, case["zero_point"]}
        for q in sorted(codes)[:count]:
            edge = -((offset - q * unit) // m)
            values += [edge - 1 - int(a), edge - int(a), edge + 1 - int(a)]
    return values


def _check(case: dict, acc: np.ndarray) -> None:
    stage = FusedOutputStage.prepare(
        case["multiplier"],
        case["shift"],
        case["zero_point"],
        case["low"],
        case["high"],
        case["addend"],
        case["dtype"],
    )
    assume(stage is not None)
    exact = np.asarray(acc, dtype=np.int64) + case["addend"]
    expected = requantize_clamp(
        exact,
        case["multiplier"],
        case["shift"],
        "sima",
        case["zero_point"],
        case["low"],
        case["high"],
    )
    out = np.empty(acc.shape, dtype=case["dtype"])
    stage.apply(acc, out)
    np.testing.assert_array_equal(out.astype(np.int64), expected)
    # Channel-last operands (transposed in memory) with a scratch buffer: the intermediate
    # then follows out's memory order.
    transposed = np.empty_like(out, order="F")
    scratch = np.empty(acc.size, dtype=np.int64)
    stage.apply(np.asfortranarray(acc), transposed, scratch=scratch)
    np.testing.assert_array_equal(transposed, out)


@settings(max_examples=400, deadline=None)
@given(case=stages(), carrier=st.sampled_from(["int64", "float64", "float32"]), data=st.data())
def test_fused_stage_equals_the_definition_at_every_threshold(
    case: dict, carrier: str, data: st.DataObject
) -> None:
    values = _thresholds(case, 5) + EXTREMES
    values += data.draw(st.lists(st.integers(-(2**33), 2**33), min_size=1, max_size=8))
    limit = {"int64": 2**53, "float64": 2**53, "float32": 2**24}[carrier]
    values = [v for v in values if abs(v) <= limit]
    acc = np.array(values, dtype=np.int64).reshape(1, -1)
    acc = np.broadcast_to(acc, (case["multiplier"].shape[0], acc.shape[1]))
    _check(case, np.ascontiguousarray(acc).astype(carrier))


@settings(max_examples=150, deadline=None)
@given(case=stages(), codes=st.lists(st.integers(-128, 127), min_size=1, max_size=16))
def test_fused_stage_equals_the_definition_on_narrow_integer_accumulators(
    case: dict, codes: list[int]
) -> None:
    acc = np.tile(np.array(codes, dtype=np.int8), (case["multiplier"].shape[0], 1))
    _check(case, acc)


def test_fused_stage_takes_the_float_path_for_typical_conv_stages() -> None:
    """An int8 output of a per-channel CONV stage runs in float64; a multiplier below 2**-16
    needs the int64 path."""
    multiplier, shift = quantize_multiplier([0.0021, 0.0007, 0.013])
    addend = np.array([[1234], [-99], [0]])
    typical = FusedOutputStage.prepare(
        multiplier.reshape(-1, 1), shift.reshape(-1, 1), -3, -3, 127, addend, np.int8
    )
    assert typical is not None and typical.exact_float
    small = FusedOutputStage.prepare(*quantize_multiplier([2.0**-20]), 5, -128, 127, 0, np.int8)
    assert small is not None and not small.exact_float


@pytest.mark.parametrize(
    ("multiplier", "shift", "mode_ok"),
    [(-(2**30), 5, False), (2**30, MAX_RIGHT_SHIFT + 1, False), (2**30, 5, True)],
)
def test_fused_stage_refuses_tables_outside_its_proof(
    multiplier: int, shift: int, mode_ok: bool
) -> None:
    stage = FusedOutputStage.prepare(multiplier, shift, 0, -128, 127, 0, np.int8)
    assert (stage is not None) == mode_ok


def test_fused_stage_tables_are_read_only() -> None:
    stage = FusedOutputStage.prepare(*quantize_multiplier([0.01]), 0, -128, 127, 0, np.int8)
    assert stage is not None
    for table in stage.tables():
        assert not table.flags.writeable


def test_fused_stage_leaves_float64_where_its_sums_could_round() -> None:
    """int16 codes with S = 31 + 8 span 2**16 * 2**39 > 2**53: the sum would not be exact in
    float64, so the int64 path runs (and agrees with the definition on the extremes)."""
    multiplier, shift = quantize_multiplier([2.0**-8 * 0.77])
    stage = FusedOutputStage.prepare(multiplier, shift, 0, -(2**15), 2**15 - 1, 0, np.int16)
    assert stage is not None and not stage.exact_float
    acc = np.array(EXTREMES + [2**25 + 1, -(2**25) - 3], dtype=np.int64)
    out = stage.apply(acc, np.empty(acc.shape, dtype=np.int16))
    expected = requantize_clamp(acc, multiplier, shift, "sima", 0, -(2**15), 2**15 - 1)
    np.testing.assert_array_equal(out, expected)


SPECIAL_FLOATS = [0.0, -0.0, 0.5, -0.5, 1.5, -2.5, 127.5, -128.5, 1e30, -1e30, np.inf, -np.inf]


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(
        st.sampled_from(SPECIAL_FLOATS) | st.floats(-1e6, 1e6, width=32), min_size=1, max_size=24
    ),
    scale=st.sampled_from([1.0, 0.5, 0.0039215689, 3.0]) | st.floats(2.0**-20, 1024.0, width=32),
    zero_point=st.integers(-128, 255),
    dtype=st.sampled_from([np.int8, np.uint8, np.int16, np.uint16, np.int32]),
    with_nan=st.booleans(),
)
def test_fast_quantize_linear_equals_the_definition(
    values: list[float], scale: float, zero_point: int, dtype: type, with_nan: bool
) -> None:
    low, high = dtype_range(dtype)
    zero_point = min(max(zero_point, low), high)
    x = np.array(values + ([np.nan] if with_nan else []), dtype=np.float32)
    expected = quantize_linear(x, np.float32(scale), zero_point, dtype)
    result = quantize_linear_fast(x, np.float32(scale), zero_point, dtype)
    assert result.dtype == expected.dtype
    np.testing.assert_array_equal(result, expected)


def test_fast_quantize_linear_broadcasts_per_axis_parameters() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(0, 50, size=(2, 3, 4, 5)).astype(np.float32)
    scale = np.array([0.5, 0.25, 2.0], dtype=np.float32).reshape(1, 3, 1, 1)
    zero_point = np.array([-3, 0, 7]).reshape(1, 3, 1, 1)
    np.testing.assert_array_equal(
        quantize_linear_fast(x, scale, zero_point, np.int8),
        quantize_linear(x, scale, zero_point, np.int8),
    )
