"""compiler.intmath: multipliers, the two requantization modes, rounding, saturation, tables."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler import intmath
from compiler.intmath import (
    INT32_MAX,
    INT32_MIN,
    build_lut,
    divide_round_half_up,
    int_matmul,
    multiplier_to_real,
    quantize_multiplier,
    reciprocal_sqrt,
    requantize,
    round_half_away,
    round_half_even,
    round_half_up,
    rounding_divide_by_pot,
    saturate,
    saturating_rounding_doubling_high_mul,
)

INT32 = st.integers(INT32_MIN, INT32_MAX)
REALS = st.floats(min_value=2.0**-32, max_value=2.0**29, allow_nan=False)
EDGE_INT32 = [
    INT32_MIN,
    INT32_MIN + 1,
    -(2**30),
    -3,
    -2,
    -1,
    0,
    1,
    2,
    3,
    2**30,
    INT32_MAX - 1,
    INT32_MAX,
]


# --- straightforward scalar re-implementations of gemmlowp (C semantics in Python ints) ---------


def _c_divide(a: int, b: int) -> int:
    """C integer division: truncate towards zero."""
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b >= 0) else -quotient


def gemmlowp_srdhm(a: int, b: int) -> int:
    """gemmlowp SaturatingRoundingDoublingHighMul, line by line."""
    overflow = a == b == INT32_MIN
    ab_64 = a * b
    nudge = (1 << 30) if ab_64 >= 0 else (1 - (1 << 30))
    ab_x2_high32 = _c_divide(ab_64 + nudge, 1 << 31)
    return INT32_MAX if overflow else ab_x2_high32


def gemmlowp_rounding_divide_by_pot(x: int, exponent: int) -> int:
    """gemmlowp RoundingDivideByPOT, line by line (>> is arithmetic on int32)."""
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


def tflite_multiply_by_quantized_multiplier(x: int, multiplier: int, left_shift: int) -> int:
    """TFLite MultiplyByQuantizedMultiplier with TFLite's signed (left-positive) shift."""
    left = left_shift if left_shift > 0 else 0
    right = 0 if left_shift > 0 else -left_shift
    shifted = max(INT32_MIN, min(INT32_MAX, x * (1 << left)))
    return gemmlowp_rounding_divide_by_pot(gemmlowp_srdhm(shifted, multiplier), right)


# --- quantize_multiplier -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(real=REALS)
def test_quantize_multiplier_round_trips_within_2_pow_minus_31_relative(real: float) -> None:
    multiplier, shift = quantize_multiplier(real)
    assert 2**30 <= int(multiplier) < 2**31
    assert abs(float(multiplier_to_real(multiplier, shift)) - real) <= real * 2.0**-31


def test_quantize_multiplier_is_vectorised_per_channel() -> None:
    reals = np.array([0.5, 0.001, 3.7, 1e-6])
    multipliers, shifts = quantize_multiplier(reals)
    np.testing.assert_allclose(multiplier_to_real(multipliers, shifts), reals, rtol=2.0**-31)


def test_quantize_multiplier_carries_a_mantissa_that_rounds_up_to_one() -> None:
    multiplier, shift = quantize_multiplier(1.0 - 2.0**-40)
    assert (int(multiplier), int(shift)) == (2**30, -1)


@pytest.mark.parametrize("real", [0.0, 2.0**-40])
def test_quantize_multiplier_represents_negligible_reals_as_zero(real: float) -> None:
    multiplier, shift = quantize_multiplier(real)
    assert (int(multiplier), int(shift)) == (0, 0)


@pytest.mark.parametrize("real", [-0.5, 2.0**31, float("inf"), float("nan")])
def test_quantize_multiplier_rejects_negative_huge_and_non_finite_reals(real: float) -> None:
    with pytest.raises(ValueError):
        quantize_multiplier(real)


# --- tflite mode: gemmlowp primitives ------------------------------------------------------------


@pytest.mark.parametrize("a", EDGE_INT32)
def test_doubling_high_mul_matches_gemmlowp_on_edge_cases(a: int) -> None:
    b_values = EDGE_INT32 + [2**30 + 1, 3 * 2**29]
    ours = saturating_rounding_doubling_high_mul(np.full(len(b_values), a), np.array(b_values))
    assert ours.tolist() == [gemmlowp_srdhm(a, b) for b in b_values]


@settings(deadline=None)
@given(a=INT32, b=INT32)
def test_doubling_high_mul_matches_gemmlowp_on_random_int32(a: int, b: int) -> None:
    assert int(saturating_rounding_doubling_high_mul(a, b)) == gemmlowp_srdhm(a, b)


def test_doubling_high_mul_rounds_ties_towards_positive_infinity() -> None:
    half = 2**30
    assert int(saturating_rounding_doubling_high_mul(1, half)) == 1
    assert int(saturating_rounding_doubling_high_mul(-1, half)) == 0
    assert int(saturating_rounding_doubling_high_mul(-3, half)) == -1
    assert int(saturating_rounding_doubling_high_mul(INT32_MIN, INT32_MIN)) == INT32_MAX


@settings(deadline=None)
@given(x=INT32, exponent=st.integers(0, 31))
def test_rounding_divide_by_pot_matches_gemmlowp(x: int, exponent: int) -> None:
    assert int(rounding_divide_by_pot(x, exponent)) == gemmlowp_rounding_divide_by_pot(x, exponent)


@pytest.mark.parametrize(
    ("x", "exponent", "expected"),
    [(5, 1, 3), (-5, 1, -3), (3, 1, 2), (-3, 1, -2), (6, 2, 2), (-6, 2, -2), (-7, 2, -2)],
)
def test_rounding_divide_by_pot_rounds_ties_away_from_zero(
    x: int, exponent: int, expected: int
) -> None:
    assert int(rounding_divide_by_pot(x, exponent)) == expected


@settings(max_examples=200, deadline=None)
@given(acc=INT32, real=REALS)
def test_tflite_requantize_matches_tflite_multiply_by_quantized_multiplier(
    acc: int, real: float
) -> None:
    multiplier, shift = quantize_multiplier(real)
    expected = tflite_multiply_by_quantized_multiplier(acc, int(multiplier), -int(shift))
    assert int(requantize(acc, multiplier, shift, "tflite")) == expected


# --- sima mode: one rounding, half up ------------------------------------------------------------


@pytest.mark.parametrize(
    ("acc", "expected"), [(3, 2), (-3, -1), (5, 3), (-5, -2), (1, 1), (-1, 0), (4, 2), (-4, -2)]
)
def test_sima_requantize_rounds_ties_half_up(acc: int, expected: int) -> None:
    multiplier, shift = quantize_multiplier(0.5)
    assert int(requantize(acc, multiplier, shift, "sima")) == expected


@settings(max_examples=200, deadline=None)
@given(acc=INT32, real=REALS)
def test_sima_requantize_is_the_exact_rational_rounded_half_up(acc: int, real: float) -> None:
    multiplier, shift = quantize_multiplier(real)
    exact = Fraction(acc * int(multiplier), 2 ** (31 + int(shift)))
    assert int(requantize(acc, multiplier, shift, "sima")) == math.floor(exact + Fraction(1, 2))


def test_tflite_double_rounding_can_differ_from_sima_by_one() -> None:
    multiplier, shift = quantize_multiplier(0.25 + 2.0**-20)
    accs = np.arange(-5000, 5000)
    sima = requantize(accs, multiplier, shift, "sima")
    tflite = requantize(accs, multiplier, shift, "tflite")
    assert np.max(np.abs(sima - tflite)) == 1


@pytest.mark.parametrize("mode", ["sima", "tflite"])
def test_requantize_saturates_the_accumulator_to_int32_first(mode: str) -> None:
    multiplier, shift = quantize_multiplier(2.0**-20)
    big = requantize(np.array([2**40, -(2**40)]), multiplier, shift, mode)
    edge = requantize(np.array([INT32_MAX, INT32_MIN]), multiplier, shift, mode)
    np.testing.assert_array_equal(big, edge)


# --- rounding, saturation and helpers ------------------------------------------------------------


def test_rounding_helpers_differ_only_on_ties() -> None:
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 1.4, -1.6])
    assert round_half_even(x).tolist() == [-2, -2, 0, 0, 2, 2, 1, -2]
    assert round_half_away(x).tolist() == [-3, -2, -1, 1, 2, 3, 1, -2]
    assert round_half_up(x).tolist() == [-2, -1, 0, 1, 2, 3, 1, -2]


def test_divide_round_half_up_matches_floor_of_half_added() -> None:
    assert divide_round_half_up(np.array([5, -5, 7, -7, 6]), 2).tolist() == [3, -2, 4, -3, 3]


def test_saturate_clamps_instead_of_wrapping() -> None:
    assert saturate(np.array([-200, -128, 127, 300]), np.int8).tolist() == [-128, -128, 127, 127]
    assert saturate(np.array([-1, 256]), np.uint8).tolist() == [0, 255]


def test_int_matmul_stays_exact_beyond_the_float64_mantissa() -> None:
    a = np.array([[2**40, 3]], dtype=np.int64)
    b = np.array([[2**20 + 1], [5]], dtype=np.int64)
    assert int(int_matmul(a, b)[0, 0]) == 2**40 * (2**20 + 1) + 15


@settings(max_examples=200, deadline=None)
@given(v=st.integers(1, 2**52))
def test_reciprocal_sqrt_is_accurate_to_one_part_in_10_to_the_8(v: int) -> None:
    y, shift = reciprocal_sqrt(np.array([v]))
    approx = float(y[0]) * 2.0 ** -int(shift[0])
    assert abs(approx * math.sqrt(v) - 1.0) < 1e-8


# --- lookup tables -------------------------------------------------------------------------------


def test_lookup_table_rounds_half_to_even_and_saturates() -> None:
    table = build_lut(lambda x: x, 1.0, 0, np.int8, 2.0, 0, np.int8)
    codes = np.arange(-128, 128)
    np.testing.assert_array_equal(table, np.rint(codes / 2.0))
    saturating = build_lut(lambda x: 10 * x, 1.0, 0, np.int8, 1.0, 0, np.int8)
    assert saturating[0] == -128 and saturating[-1] == 127


def test_lookup_table_maps_nan_to_the_output_zero_point() -> None:
    table = build_lut(np.log, 1.0, 0, np.int8, 0.1, 7, np.int8)
    assert table[0] == 7
    assert table[128] == -128


def test_lookup_table_has_one_entry_per_16_bit_code() -> None:
    assert build_lut(np.tanh, 1e-3, 0, np.int16, 1e-4, 0, np.int16).shape == (65536,)


def test_requantization_modes_are_the_two_documented_ones() -> None:
    assert intmath.REQUANTIZATION_MODES == ("sima", "tflite")
    with pytest.raises(ValueError, match="unknown requantization mode"):
        requantize(1, 1, 0, "nearest")  # type: ignore[arg-type]


@pytest.mark.parametrize("shape, axis", [((2, 3, 4, 5), 1), ((3, 7), 1), ((2, 5, 3), 2)])
def test_per_channel_tables_look_each_position_up_in_its_own_table(shape, axis) -> None:
    rng = np.random.default_rng(0)
    tables = rng.integers(-128, 128, size=(shape[axis], 256)).astype(np.int8)
    q = rng.integers(-128, 128, size=shape).astype(np.int8)
    result = intmath.apply_lut(tables, q, np.int8, axis=axis)
    moved = np.moveaxis(q, axis, 0)
    expected = np.stack(
        [intmath.apply_lut(tables[c], moved[c], np.int8) for c in range(shape[axis])]
    )
    np.testing.assert_array_equal(result, np.moveaxis(expected, 0, axis))


def test_per_channel_tables_must_match_the_axis() -> None:
    with pytest.raises(ValueError, match="3 tables along axis 1"):
        intmath.apply_lut(np.zeros((3, 256), np.int8), np.zeros((1, 4, 2), np.int8), np.int8)


def test_the_normalisation_epsilon_term_is_eps_in_squared_code_units() -> None:
    assert intmath.normalisation_epsilon(1e-5, 64, 0.02) == round(1e-5 * 64**2 / 0.02**2)
    assert intmath.normalisation_epsilon(1e-12, 4, 1.0) == 1  # at least 1: V > 0


@pytest.mark.parametrize("input_scale", [1e-30, 1e-200, 0.0])
def test_an_input_scale_too_fine_for_the_epsilon_term_takes_the_largest_term(
    input_scale: float,
) -> None:
    """A norm of near-zero activations (random-init SAM's neck): eps * N**2 / s**2 is past
    int64 (or infinite); the term is capped, not a cast of inf."""
    term = intmath.normalisation_epsilon(1e-6, 256, input_scale)
    assert term == intmath.EPSILON_TERM_MAX
    x = np.array([[3, -2, 5, 0]], dtype=np.int64)
    z = intmath.normalise(x, (1,), term)
    assert np.all(np.abs(z) <= 4)
