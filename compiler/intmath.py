"""Integer arithmetic of the quantized model: the single source of truth.

Every piece of integer math that the reference executor (`compiler.runtime`) performs, and that
the MLA emulator must reproduce bit for bit, is defined here: integer type ranges and saturation,
the rounding rules, the fixed-point representation of real multipliers (`quantize_multiplier`),
the two requantization modes ("sima" and "tflite") and the lookup-table builder for nonlinear
functions. docs/integer-semantics.md is the prose version of this module; the two must agree.

All functions are vectorised over numpy arrays and compute in int64 (or, where stated, float64
used as an exact carrier for integers below 2**53). Integer inputs may be any integer dtype;
results are int64 unless the function says otherwise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import ml_dtypes
import numpy as np
import numpy.typing as npt

from compiler.native import kernels as native_kernels

RequantizationMode = Literal["sima", "tflite"]
REQUANTIZATION_MODES: tuple[RequantizationMode, ...] = ("sima", "tflite")

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

MULTIPLIER_BITS = 31
"""M in `quantize_multiplier` is a Q0.31 fixed-point number in [2**30, 2**31)."""

MIN_RIGHT_SHIFT = -30
"""Real multipliers up to 2**30 are representable (a left shift of at most 30)."""

MAX_RIGHT_SHIFT = 31
"""Real multipliers below 2**-32 are represented as zero: |acc * real| < 0.5 for any int32 acc."""

INTEGER_DTYPES: tuple[type[np.integer], ...] = (
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
)

_EXACT_FLOAT64 = 2**53

IntArray = npt.NDArray[np.integer]


# --- integer types -------------------------------------------------------------------------------


def dtype_range(dtype: npt.DTypeLike) -> tuple[int, int]:
    """(min, max) of an integer dtype, as Python ints."""
    return _integer_range(np.dtype(dtype))


@functools.cache
def _integer_range(dtype: np.dtype) -> tuple[int, int]:
    """`dtype_range` of a numpy dtype, remembered (np.iinfo costs microseconds a call)."""
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def saturate(x: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """Clamp integers to the range of `dtype` and cast: overflow saturates, it never wraps."""
    low, high = dtype_range(dtype)
    return np.clip(np.asarray(x, dtype=np.int64), low, high).astype(dtype)


def saturate_int32(x: npt.ArrayLike) -> np.ndarray:
    """Clamp to the int32 range, keeping int64 storage (the accumulator saturation step)."""
    return np.clip(np.asarray(x, dtype=np.int64), INT32_MIN, INT32_MAX)


# --- rounding of real numbers (compile time: tables, multipliers, constants) ---------------------


def round_half_even(x: npt.ArrayLike) -> np.ndarray:
    """Round to nearest, ties to even (IEEE default; ONNX QuantizeLinear). Returns int64."""
    return np.rint(np.asarray(x, dtype=np.float64)).astype(np.int64)


def round_half_away(x: npt.ArrayLike) -> np.ndarray:
    """Round to nearest, ties away from zero (C `round`, TFLite `TfLiteRound`). Returns int64."""
    x = np.asarray(x, dtype=np.float64)
    return (np.sign(x) * np.floor(np.abs(x) + 0.5)).astype(np.int64)


def round_half_up(x: npt.ArrayLike) -> np.ndarray:
    """Round to nearest, ties towards +infinity: floor(x + 0.5). Returns int64."""
    return np.floor(np.asarray(x, dtype=np.float64) + 0.5).astype(np.int64)


# --- rounding of integers (run time) -------------------------------------------------------------


def rounding_right_shift(x: npt.ArrayLike, shift: npt.ArrayLike) -> np.ndarray:
    """x / 2**shift rounded half up (towards +inf), for shift >= 0: (x + 2**(shift-1)) >> shift.

    `>>` is the arithmetic (flooring) shift, so adding half first gives round-half-up for
    negative and positive x alike. shift == 0 returns x unchanged.
    """
    x = np.asarray(x, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.int64)
    if np.any(shift < 0):
        raise ValueError("rounding_right_shift needs a non-negative shift")
    half = np.where(shift > 0, np.left_shift(np.int64(1), np.maximum(shift - 1, 0)), 0)
    return np.right_shift(x + half, shift)


def divide_round_half_up(numerator: npt.ArrayLike, denominator: npt.ArrayLike) -> np.ndarray:
    """numerator / denominator rounded half up, in integers, for a positive denominator."""
    numerator = np.asarray(numerator, dtype=np.int64)
    denominator = np.asarray(denominator, dtype=np.int64)
    if np.any(denominator <= 0):
        raise ValueError("divide_round_half_up needs a positive denominator")
    return np.floor_divide(2 * numerator + denominator, 2 * denominator)


def _divide_truncate(x: np.ndarray, divisor: int) -> np.ndarray:
    """C-style integer division (towards zero), which gemmlowp relies on."""
    quotient = np.abs(x) // divisor
    return np.where(x < 0, -quotient, quotient)


# --- fixed-point multipliers ---------------------------------------------------------------------


class MultiplierRangeError(ValueError):
    """A real multiplier no (M, n) pair holds: a lowering that needs it cannot run on the MLA."""


def quantize_multiplier(real: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Represent a non-negative real multiplier as (M, n) with real ~= M * 2**-31 * 2**-n.

    M is an int32 in [2**30, 2**31) (or 0) and n a right shift in [-30, 31]. This is TFLite's
    `QuantizeMultiplier` with the sign of the shift flipped to mean "right": frexp gives
    real = q * 2**e with q in [0.5, 1), M = round_half_away(q * 2**31) (if that rounds up to
    2**31, halve it and bump e), n = -e. Multipliers too small for any int32 accumulator to reach
    0.5 (n > 31) become (0, 0); multipliers that round to 2**30 or more are rejected.
    The relative representation error is at most 2**-31.
    """
    real = np.asarray(real, dtype=np.float64)
    if not np.all(np.isfinite(real)) or np.any(real < 0):
        raise ValueError("quantize_multiplier needs finite, non-negative real multipliers")
    mantissa, exponent = np.frexp(real)
    multiplier = round_half_away(mantissa * 2.0**MULTIPLIER_BITS)
    carry = multiplier == 2**MULTIPLIER_BITS
    multiplier = np.where(carry, multiplier // 2, multiplier)
    shift = -(exponent.astype(np.int64) + carry)
    too_large = (shift < MIN_RIGHT_SHIFT) & (multiplier != 0)
    if np.any(too_large):
        raise MultiplierRangeError(
            f"a requantization multiplier of {float(np.max(real[too_large])):.3g} is past the "
            f"31-bit fixed point (at most 2**{-MIN_RIGHT_SHIFT}): the output scale is too fine "
            "for the scales it is computed from"
        )
    negligible = (shift > MAX_RIGHT_SHIFT) | (multiplier == 0)
    multiplier = np.where(negligible, 0, multiplier).astype(np.int64)
    shift = np.where(negligible, 0, shift).astype(np.int64)
    return multiplier, shift


def multiplier_to_real(multiplier: npt.ArrayLike, shift: npt.ArrayLike) -> np.ndarray:
    """The real value M * 2**-31 * 2**-n that (M, n) stands for (float64)."""
    multiplier = np.asarray(multiplier, dtype=np.float64)
    shift = np.asarray(shift, dtype=np.float64)
    return multiplier * 2.0 ** (-MULTIPLIER_BITS - shift)


# --- gemmlowp / TFLite primitives ----------------------------------------------------------------


def saturating_rounding_doubling_high_mul(a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
    """gemmlowp `SaturatingRoundingDoublingHighMul`: a * b / 2**31 rounded, ties towards +inf.

    The int64 product gets a nudge of 2**30 (or 1 - 2**30 when negative) and is divided by
    2**31 truncating towards zero. For a positive product a tie rounds up (away from zero); for
    a negative one the nudge is one short of half, so -0.5 becomes 0 and -1.5 becomes -1: ties
    go towards +infinity in both cases (often mis-described as "away from zero"). The one
    overflowing case, a == b == INT32_MIN, saturates to INT32_MAX. a and b must be int32 values.
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    product = a * b
    nudge = np.where(product >= 0, 1 << 30, 1 - (1 << 30))
    high = _divide_truncate(product + nudge, 1 << 31)
    overflow = (a == INT32_MIN) & (b == INT32_MIN)
    return np.where(overflow, INT32_MAX, high)


def rounding_divide_by_pot(x: npt.ArrayLike, exponent: npt.ArrayLike) -> np.ndarray:
    """gemmlowp `RoundingDivideByPOT`: x / 2**exponent, ties away from zero.

    mask = 2**exponent - 1, remainder = x & mask, threshold = mask >> 1 (+1 when x < 0);
    result = (x >> exponent) + (remainder > threshold). exponent in [0, 31].
    """
    x = np.asarray(x, dtype=np.int64)
    exponent = np.asarray(exponent, dtype=np.int64)
    mask = np.left_shift(np.int64(1), exponent) - 1
    remainder = np.bitwise_and(x, mask)
    threshold = np.right_shift(mask, 1) + (x < 0)
    return np.right_shift(x, exponent) + (remainder > threshold)


def multiply_by_quantized_multiplier_tflite(
    x: npt.ArrayLike, multiplier: npt.ArrayLike, shift: npt.ArrayLike
) -> np.ndarray:
    """TFLite `MultiplyByQuantizedMultiplier` with a right shift n (two roundings).

    A negative n is applied first as a left shift of the int32 input (saturated to int32 where
    C++ would overflow), then the doubling high-mul rounds, then RoundingDivideByPOT by max(n, 0)
    rounds again.
    """
    x = np.asarray(x, dtype=np.int64)
    shift = np.asarray(shift, dtype=np.int64)
    left = np.maximum(-shift, 0)
    right = np.maximum(shift, 0)
    shifted = saturate_int32(x * np.left_shift(np.int64(1), left))
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(shifted, multiplier), right)


def multiply_by_quantized_multiplier_sima(
    x: npt.ArrayLike, multiplier: npt.ArrayLike, shift: npt.ArrayLike
) -> np.ndarray:
    """The "sima" requantization: one rounding, (x * M + 2**(30 + n)) >> (31 + n), in int64.

    This is round-half-up (towards +inf) of x * M * 2**-(31 + n). With |x| < 2**31,
    M < 2**31 and n <= 31 nothing overflows int64.
    """
    x = np.asarray(x, dtype=np.int64)
    multiplier = np.asarray(multiplier, dtype=np.int64)
    total_shift = MULTIPLIER_BITS + np.asarray(shift, dtype=np.int64)
    return rounding_right_shift(x * multiplier, total_shift)


def requantize(
    acc: npt.ArrayLike,
    multiplier: npt.ArrayLike,
    shift: npt.ArrayLike,
    mode: RequantizationMode,
) -> np.ndarray:
    """Scale int32 accumulators by the real multiplier (M, n) in the given mode (no zero point).

    The accumulator is first saturated to int32: every requantization in the executor starts
    from an int32 register.
    """
    acc32 = saturate_int32(acc)
    if mode == "sima":
        return multiply_by_quantized_multiplier_sima(acc32, multiplier, shift)
    if mode == "tflite":
        return multiply_by_quantized_multiplier_tflite(acc32, multiplier, shift)
    raise ValueError(
        f"unknown requantization mode {mode!r}; expected one of {REQUANTIZATION_MODES}"
    )


def requantize_clamp(
    acc: npt.ArrayLike,
    multiplier: npt.ArrayLike,
    shift: npt.ArrayLike,
    mode: RequantizationMode,
    zero_point: npt.ArrayLike,
    low: int,
    high: int,
) -> np.ndarray:
    """The output stage of every arithmetic op: clip(requantize(acc) + zero_point, low, high).

    This is the definition (docs/integer-semantics.md, section 5); `FusedOutputStage` computes
    the same values in place, faster.
    """
    scaled = requantize(acc, multiplier, shift, mode) + np.asarray(zero_point, dtype=np.int64)
    return np.clip(scaled, low, high)


_INT64_MAX = 2**63 - 1

ExactTables = tuple[np.ndarray, ...]
"""(lower, upper, scale, offset, total_shift) of a `FusedOutputStage`."""


def laid_out_like(like: np.ndarray, empty: Callable[[tuple[int, ...]], np.ndarray]) -> np.ndarray:
    """An array of like's shape with like's memory order (largest stride outermost): `empty`
    (a function of a shape that returns a C-contiguous array of it) of like's axes in that
    order, transposed back."""
    strides = [abs(stride) for stride in like.strides]
    if all(outer >= inner for outer, inner in zip(strides[:-1], strides[1:], strict=True)):
        return empty(like.shape)
    order = sorted(range(like.ndim), key=lambda axis: -strides[axis])
    array = empty(tuple(like.shape[axis] for axis in order))
    return array.transpose(np.argsort(order))


@dataclass(frozen=True)
class FusedOutputStage:
    """`requantize_clamp(acc + addend, M, n, "sima", zero_point, low, high)` in three passes.

    The definition takes about ten int64 passes per element (saturate, product, rounding half,
    shift, zero point, clamp, each a fresh temporary), and an emulator runs it on every element
    of every feature map. This computes the same codes, written straight into the destination
    array, in three passes (multiply, add, clip-and-store) and a cheap one on the 8- or 16-bit
    result. Why that is the same:

    With S = 31 + n and O = 2**(S - 1) + zero_point * 2**S, the stage is clip(f(sat32(v)),
    low, high) for v = acc + addend and f(v) = floor((v * M + O) / 2**S), the "sima" rounding
    plus the zero point (adding zero_point * 2**S before flooring adds exactly zero_point).
    For M >= 0, f is non-decreasing. Let A be the largest int32 v with f(v) <= low (INT32_MIN
    if none) and B the smallest with f(v) >= high (INT32_MAX if none). Then

    * clip(f(sat32(v)), low, high) == f(clip(v, A, B)) whenever f(A) >= low and f(B) <= high
      (checked per channel): below A, f is at most f(A) == low; above B, at least high; and
      [A, B] lies inside the int32 range, so the clip also saturates;
    * clip(acc + addend, A, B) == clip(acc, A - addend, B - addend) + addend, so the addend
      (a bias, minus an input zero point) moves into the bounds and into the offset below;
    * adding K = -min(dtype) makes every result non-negative (the dtype's unsigned twin then
      holds it), and truncation of a non-negative number is its floor, so

          code + K == trunc(x * M * 2**-S + (addend * M + O + K * 2**S) * 2**-S),
          x = clip(acc, A - addend, B - addend).

    Float path (`exact_float`): the sum above is carried in float64, and the clip comes last,
    on the codes. For x in [A - addend, B - addend], x * M and W = x * M + addend * M + O +
    K * 2**S are integers; when |x * M| <= 2**53 and |W| <= 2**53 (checked per channel from
    the bounds) both are float64 numbers, and scaling by the power of two 2**-S is exact, so
    every float operation rounds an exact value to itself. Outside that interval the float sum
    may round, but rounding to nearest is monotonic: an acc below A - addend gives a sum at
    most that of A - addend, whose truncation is low + K, and one above B - addend a sum at
    least high + K; clipping the sum to [low + K, high + K] then gives the same codes as
    clipping acc first. Int path (where the float path is not provably exact): the same sum
    in int64 on the clipped acc, W >> S, when |x * M| + |addend * M + O + K * 2**S| < 2**63.

    This is the "sima" mode only. `prepare` returns None (callers then use the definition) for
    a shift outside [-30, 31], a negative multiplier, a multiplier above 1 that skips the low
    or high code, or bounds that rule out both paths.
    """

    lower: np.ndarray
    upper: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    total_shift: np.ndarray
    excess: int
    code_dtype: np.dtype
    code_low: float
    code_high: float

    @classmethod
    def prepare(
        cls,
        multiplier: npt.ArrayLike,
        shift: npt.ArrayLike,
        zero_point: int,
        low: int,
        high: int,
        addend: npt.ArrayLike = 0,
        dtype: npt.DTypeLike = np.int64,
    ) -> FusedOutputStage | None:
        """The stage's tables (computed exactly, in Python integers) for results of `dtype`
        in [low, high], or None where neither path is provably identical to the definition."""
        dtype = np.dtype(dtype)
        dtype_low, dtype_high = dtype_range(dtype) if dtype.kind in "iu" else (0, -1)
        if not dtype_low <= low <= high <= dtype_high:
            return None
        tables = np.broadcast_arrays(
            *(np.asarray(t, dtype=np.int64) for t in (multiplier, shift, addend))
        )
        if tables[0].size == 0:
            return None
        shape = tables[0].shape
        m, n, a = (t.reshape(-1).astype(object) for t in tables)
        if np.any(m < 0) or np.any(n < MIN_RIGHT_SHIFT) or np.any(n > MAX_RIGHT_SHIFT):
            return None
        narrow = dtype.itemsize <= 2
        excess = -dtype_low if narrow else 0
        unit = np.power(2, n + MULTIPLIER_BITS)
        offset = unit // 2 + int(zero_point) * unit
        divisor = np.where(m > 0, m, 1)
        lower = -((offset - (low + 1) * unit) // divisor) - 1
        upper = -((offset - high * unit) // divisor)
        lower = np.where(m > 0, np.clip(lower, INT32_MIN, INT32_MAX), 0)
        upper = np.where(m > 0, np.clip(upper, INT32_MIN, INT32_MAX), 0)
        reach_low = (lower * m + offset) // unit
        reach_high = (upper * m + offset) // unit
        if np.any(lower > upper) or np.any(reach_low < low) or np.any(reach_high > high):
            return None
        lower, upper = lower - a, upper - a
        constant = a * m + offset + excess * unit
        product = np.maximum(abs(lower), abs(upper)) * m
        extent = np.maximum(abs(low + excess), abs(high + excess + 1)) * unit
        exact_in_float64 = all(_all_at_most(v, 2**53) for v in (product, constant, extent))
        if narrow and exact_in_float64:
            return cls(
                _float64(lower).reshape(shape),
                _float64(upper).reshape(shape),
                (_float64(m) / _float64(unit)).reshape(shape),
                (_float64(constant) / _float64(unit)).reshape(shape),
                np.zeros(shape, dtype=np.int64),
                excess,
                _code_dtype(dtype),
                float(low + excess),
                float(high + excess),
            )
        if _all_at_most(product + abs(constant), _INT64_MAX):
            return cls(
                lower.astype(np.int64).reshape(shape),
                upper.astype(np.int64).reshape(shape),
                m.astype(np.int64).reshape(shape),
                constant.astype(np.int64).reshape(shape),
                (n + MULTIPLIER_BITS).astype(np.int64).reshape(shape),
                excess,
                _code_dtype(dtype),
                float(low + excess),
                float(high + excess),
            )
        return None

    def __post_init__(self) -> None:
        for table in self.tables():
            table.flags.writeable = False

    @property
    def exact_float(self) -> bool:
        """Whether the stage runs in float64 (else in int64)."""
        return self.scale.dtype == np.float64

    def tables(self) -> ExactTables:
        return (
            self.lower,
            self.upper,
            self.scale,
            self.offset,
            self.total_shift,
        )

    def apply(
        self,
        acc: np.ndarray,
        out: np.ndarray,
        tables: ExactTables | None = None,
        scratch: np.ndarray | None = None,
    ) -> np.ndarray:
        """Write the stage's codes for the integers `acc` (any integer dtype, or integers held
        exactly in a float dtype) into `out`, an array of the `dtype` given to `prepare` and
        of acc's shape; returns out.

        `tables` replaces `tables()` by parts of them that broadcast to acc (a block of the
        whole result). `scratch`, a flat 8-byte-item buffer of at least acc.size elements,
        holds the intermediate values instead of a fresh array.
        """
        if out.shape != acc.shape or out.dtype.itemsize != self.code_dtype.itemsize:
            raise ValueError(f"cannot write a {acc.shape} stage into {out.dtype} {out.shape}")
        tables = self.tables() if tables is None else tables
        if self._compiled(acc, out):
            self._run_compiled(acc, out, tables)
            return out
        x, codes = self._work(out, scratch)
        self._run(acc, x, codes, tables)
        return out

    def bind(
        self, out: np.ndarray, scratch: np.ndarray | None = None
    ) -> Callable[[np.ndarray], None]:
        """`apply` into `out` with these tables and this scratch, its views made once: a
        function of acc (of out's shape) for a caller that applies the stage on every run."""
        if out.dtype.itemsize != self.code_dtype.itemsize:
            raise ValueError(f"cannot write the stage into {out.dtype} {out.shape}")
        tables = self.tables()
        x, codes = self._work(out, scratch)

        def run(acc: np.ndarray) -> None:
            if self._compiled(acc, out):
                self._run_compiled(acc, out, tables)
            else:
                self._run(acc, x, codes, tables)

        return run

    def _compiled(self, acc: np.ndarray, out: np.ndarray) -> bool:
        """Whether the compiled kernel (`compiler.native`) runs this stage: it is built and
        reads acc's dtype and writes out's."""
        return (
            native_kernels is not None
            and acc.dtype in _COMPILED_ACC_DTYPES
            and out.dtype.byteorder != ">"
        )

    def _run_compiled(self, acc: np.ndarray, out: np.ndarray, tables: ExactTables) -> None:
        """`_run`'s passes in one compiled loop over acc, into out's codes: the same
        operations on the same values (float64 or int64, no fused multiply-add), so the same
        codes (tests/test_native_kernels.py)."""
        native_kernels.output_stage(
            acc,
            out.view(self.code_dtype),
            *tables,
            self.exact_float,
            self.code_low,
            self.code_high,
            self.excess,
        )

    def _work(self, out: np.ndarray, scratch: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The intermediate array (in `scratch` if given), laid out in out's memory order (so
        that every pass walks all its operands in one order, also when out is a transposed
        view), and out's codes as `code_dtype`."""
        carrier = np.float64 if self.exact_float else np.int64
        if scratch is None:
            x = laid_out_like(out, lambda shape: np.empty(shape, dtype=carrier))
        else:
            x = laid_out_like(out, lambda shape: scratch[: out.size].view(carrier).reshape(shape))
        return x, out.view(self.code_dtype)

    def _run(self, acc: np.ndarray, x: np.ndarray, codes: np.ndarray, tables: ExactTables) -> None:
        """The stage's passes: acc -> x (the scaled sum) -> codes."""
        lower, upper, scale, offset, total_shift = tables
        if self.exact_float:
            np.multiply(acc, scale, out=x)
            np.add(x, offset, out=x)
            np.clip(x, self.code_low, self.code_high, out=codes, casting="unsafe")
        else:
            np.maximum(acc, lower, out=x, casting="unsafe")
            np.minimum(x, upper, out=x)
            np.multiply(x, scale, out=x)
            np.add(x, offset, out=x)
            np.right_shift(x, total_shift, out=codes, casting="unsafe")
        if self.excess:
            np.bitwise_xor(codes, self.code_dtype.type(self.excess), out=codes)


_COMPILED_ACC_DTYPES = frozenset(
    np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64, np.int16, np.int8)
)
"""Accumulator dtypes the compiled output stage reads."""


def _all_at_most(values: np.ndarray, limit: int) -> bool:
    """Whether every |value| of an object array of Python integers is at most `limit`."""
    return bool(np.all(abs(values) <= limit))


def _float64(values: np.ndarray) -> np.ndarray:
    """An object array of Python integers (each exactly representable) as float64."""
    return values.astype(np.float64)


def _code_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned twin of an 8- or 16-bit integer dtype (which holds code + K); wider
    dtypes hold the codes themselves (K = 0)."""
    if dtype.itemsize <= 2:
        return np.dtype(f"u{dtype.itemsize}")
    return dtype


# --- integer normalisation helpers (Softmax, LayerNorm, InstanceNorm, LRN) -----------------------

RSQRT_ITERATIONS = 5
"""Newton steps of `reciprocal_sqrt`; enough for a Q30 result from the chord initial guess."""


def bit_length(x: npt.ArrayLike) -> np.ndarray:
    """Number of significant bits of non-negative int64 values (0 for 0), computed exactly."""
    x = np.asarray(x, dtype=np.int64)
    if np.any(x < 0):
        raise ValueError("bit_length needs non-negative values")
    return sum((np.right_shift(x, bit) > 0).astype(np.int64) for bit in range(63))


def reciprocal_sqrt(v: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """1 / sqrt(v) for positive int64 v, as (y, shift) with 1 / sqrt(v) ~= y * 2**-shift.

    v is normalised by an even shift 2k to m = v * 2**-2k in [2**28, 2**30) (right shifts
    truncate), read as mu = m * 2**-30 in [0.25, 1). y approximates 1 / sqrt(mu) in Q30 (so
    y in (2**30, 2**31]): it starts on the chord 2 - (4/3)(mu - 1/4), which lies above the
    convex 1/sqrt, and takes RSQRT_ITERATIONS Newton steps y <- y (3 - mu y**2) / 2, each
    product rounded half up back to Q30. No intermediate exceeds 2**63. Then
    1 / sqrt(v) = y * 2**-30 * 2**-(15 + k), i.e. shift = 45 + k.
    """
    v = np.asarray(v, dtype=np.int64)
    if np.any(v <= 0):
        raise ValueError("reciprocal_sqrt needs positive values")
    k = (bit_length(v) - 1 - 28) // 2
    m = np.where(
        k >= 0, np.right_shift(v, np.maximum(2 * k, 0)), np.left_shift(v, np.maximum(-2 * k, 0))
    )
    one = np.int64(1 << 30)
    y = 2 * one - ((m - (one >> 2)) * 4) // 3
    for _ in range(RSQRT_ITERATIONS):
        y_squared = rounding_right_shift(y * y, 30)
        m_y_squared = rounding_right_shift(m * y_squared, 30)
        y = rounding_right_shift(y * (3 * one - m_y_squared), 31)
    return y, 45 + k


NORMALISED_BITS = 16
"""Fractional bits of the normalised value `normalise` returns (Q16)."""


EPSILON_TERM_MAX = 2**60
"""The largest epsilon term: V = N * s2 - s1**2 + term stays below 2**62 for the moments of
8-bit codes over up to 2**20 elements."""


def normalisation_epsilon(epsilon: float, count: int, input_scale: float) -> int:
    """eps as an integer term of V = N * s2 - s1**2 (which is N**2 * variance / s_in**2):
    round_half_up(eps * N**2 / s_in**2) in [1, EPSILON_TERM_MAX]; at least 1 so that V > 0
    for constant data. Computed at build time, so the program and the reference hold the same
    integer. An input scale so fine that eps dwarfs every variance the codes can express (a
    norm of near-zero activations) takes the largest term: the normalised codes are then
    within a few Q16 steps of the exact zero."""
    term = epsilon * count**2 / input_scale / input_scale if input_scale > 0 else math.inf
    if not term < EPSILON_TERM_MAX:
        return EPSILON_TERM_MAX
    return max(1, int(round_half_up(term)))


def normalise(x: npt.ArrayLike, axes: tuple[int, ...], epsilon_term: int) -> np.ndarray:
    """(x - mean) / sqrt(variance + eps) over `axes` of centred codes, in Q16, from exact moments.

    With N elements per group: s1 = sum(x), s2 = sum(x**2), V = N * s2 - s1**2 + epsilon_term,
    (r, k) = reciprocal_sqrt(V), z = round_half_up((N * x - s1) * r / 2**(k - 16)). The one
    definition that LayerNormalization, InstanceNormalization and the LAYERNORM instruction use.
    Bounds: |x| * N < 2**32 keeps every product inside int64.
    """
    x = np.asarray(x, dtype=np.int64)
    count = math.prod(x.shape[a] for a in axes)
    s1 = x.sum(axis=axes, keepdims=True)
    s2 = (x * x).sum(axis=axes, keepdims=True)
    reciprocal, shift = reciprocal_sqrt(count * s2 - s1 * s1 + epsilon_term)
    return rounding_right_shift((count * x - s1) * reciprocal, shift - NORMALISED_BITS)


def channel_window(size: int) -> tuple[int, int]:
    """(channels before, channels after) the centre of an LRN window of `size` channels:
    floor((size - 1) / 2) and ceil((size - 1) / 2), as ONNX defines it."""
    before = (size - 1) // 2
    return before, size - 1 - before


def lrn_accumulator(
    centred: npt.ArrayLike, size: int, index_shift: int, table: npt.ArrayLike
) -> np.ndarray:
    """x * table[i]: the accumulator of integer LRN (channels on axis 1), before its output stage.

    s = the sum of x**2 over the window of `size` channels around each channel (channels
    outside the tensor add nothing), i = round_half_up(s / 2**index_shift), an index past the
    end of `table` reads its last entry. The table holds the factor 1 / (bias + k * s)**beta in
    fixed point, computed at build time; every product is exact in int64.
    """
    x = np.asarray(centred, dtype=np.int64)
    squares = x * x
    before, after = channel_window(size)
    widths = [(0, 0)] * x.ndim
    widths[1] = (before, after)
    padded = np.pad(squares, widths)
    channels = x.shape[1]
    sums = sum(padded[:, k : k + channels] for k in range(size))
    table = np.asarray(table, dtype=np.int64).reshape(-1)
    index = np.minimum(rounding_right_shift(sums, index_shift), table.size - 1)
    return x * table[index]


# --- fp16 normalisation (LayerNormalization, RMSNormalization on the fp16 unit) -----------------

FP16_SUM_LIMIT = 2.0**15
"""Largest value any sum of the fp16 normalisation may reach: the input is scaled by a power of
two (`fp16_input_exponent`) so that no partial sum can overflow fp16 (largest finite 65504)."""

FP16_TINY = np.float16(2.0**-24)
"""Smallest positive fp16 (a subnormal): the least epsilon, so a constant row gives 0, not NaN."""


def fp16_input_exponent(max_abs: float, count: int) -> int:
    """The e of x' = x * 2**-e, chosen at build time: the smallest integer with
    4 * N * (A * 2**-e)**2 <= FP16_SUM_LIMIT and N * A * 2**-e <= FP16_SUM_LIMIT, A the largest
    |x| the input codes can hold. Then |x' - mean| <= 2A' keeps the sum of squared deviations
    (and of x'**2, and of x') finite, while scaling by a power of two loses no bit of x'.
    Normalisation is invariant to it when epsilon is scaled by 2**-2e too."""
    if not max_abs > 0:
        return 0
    exponent = math.ceil(math.log2(max_abs)) - 64
    while True:
        scaled = max_abs * 2.0**-exponent
        if 4.0 * count * scaled * scaled <= FP16_SUM_LIMIT and count * scaled <= FP16_SUM_LIMIT:
            return exponent
        exponent += 1


def fp16_epsilon(epsilon: float, exponent: int) -> np.float16:
    """epsilon * 2**-2e rounded to fp16 (half to even), at least `FP16_TINY`. Build time.

    Past fp16's range (an input whose codes are all far below sqrt(epsilon), as in a randomly
    initialised MobileViT) it is +inf, and the normalisation gives 0: what the true value,
    (x - mean) / sqrt(epsilon) with |x| tiny, rounds to on the output's grid."""
    with np.errstate(over="ignore"):
        scaled = np.float16(np.float64(epsilon) * 2.0 ** (-2 * exponent))
    return max(scaled, FP16_TINY)


def fp16_dequantize(q: npt.ArrayLike, zero_point: int, scale: np.float32) -> np.ndarray:
    """x' = fp16(float32(q - z) * S): the float32 product of the exact centred code and the
    float32 scale S (= s_in * 2**-e, exact), rounded half to even to fp16 (a Cast to float16
    of ONNX DequantizeLinear, scaled by 2**-e)."""
    centred = (np.asarray(q, dtype=np.int64) - int(zero_point)).astype(np.float32)
    return (centred * np.float32(scale)).astype(np.float16)


def fp16_pairwise_sum(values: np.ndarray) -> np.ndarray:
    """Sum of the last axis in fp16, as a fixed binary tree: level by level, an odd count first
    gets a 0 appended, then elements 2i and 2i + 1 are added (each sum rounded half to even).
    The order is part of the definition, so every implementation gives the same bits; a tree's
    rounding error grows with log2(N), not N."""
    v = np.asarray(values, dtype=np.float16)
    while v.shape[-1] > 1:
        if v.shape[-1] % 2:
            v = np.concatenate([v, np.zeros((*v.shape[:-1], 1), np.float16)], axis=-1)
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def fp16_mean(values: np.ndarray) -> np.ndarray:
    """`fp16_pairwise_sum` divided by the count N: the float64 quotient rounded to fp16."""
    count = values.shape[-1]
    total = fp16_pairwise_sum(values).astype(np.float64)
    return (total / count).astype(np.float16)


def fp16_normalise_rows(
    x: np.ndarray,
    gamma: np.ndarray,
    beta: np.ndarray | None,
    epsilon: np.float16,
    *,
    centre: bool,
) -> np.ndarray:
    """Normalise each row (last axis, N elements) of fp16 `x` in fp16, every operation rounded
    half to even, in this order:

      m = fp16_mean(x)                      (LayerNormalization; RMSNormalization: m = 0)
      d = x - m
      v = fp16_mean(d * d)
      r = 1 / sqrt(v + epsilon)             three roundings: add, sqrt, divide
      y = (d * r) * gamma [+ beta]          three (two) roundings

    `gamma`, `beta` are fp16 rows of N (or broadcast to it)."""
    x = np.asarray(x, dtype=np.float16)
    d = x - fp16_mean(x)[..., None] if centre else x
    variance = fp16_mean(d * d)[..., None]
    reciprocal = np.float16(1.0) / np.sqrt(variance + np.float16(epsilon))
    y = (d * reciprocal) * np.asarray(gamma, dtype=np.float16)
    if beta is not None:
        y = y + np.asarray(beta, dtype=np.float16)
    return y


def fp16_quantize(
    y: np.ndarray, scale: np.float32, zero_point: int, low: int, high: int, dtype: npt.DTypeLike
) -> np.ndarray:
    """ONNX QuantizeLinear of the fp16 result: round_half_even(float32(y) / s) + z in float32,
    clamped to [low, high]; +-inf saturates, NaN gives z (real 0)."""
    ratio = np.asarray(y, dtype=np.float32) / np.float32(scale)
    ratio = np.where(np.isnan(ratio), np.float32(0.0), ratio)
    shifted = np.clip(np.rint(ratio), np.float32(low - zero_point), np.float32(high - zero_point))
    return (shifted.astype(np.int64) + int(zero_point)).astype(dtype)


def fp16_normalisation(
    q: npt.ArrayLike,
    axis: int,
    *,
    input_zero_point: int,
    input_scale: np.float32,
    gamma: np.ndarray,
    beta: np.ndarray | None,
    epsilon: np.float16,
    centre: bool,
    output_scale: np.float32,
    output_zero_point: int,
    low: int,
    high: int,
    dtype: npt.DTypeLike,
) -> np.ndarray:
    """Codes in, codes out: `fp16_dequantize`, `fp16_normalise_rows` over the axes from `axis`
    to the end (flattened in C order), `fp16_quantize`. The one definition that the reference
    kernel and the MLA's NORM_FP16 instruction both run. `gamma` / `beta` broadcast against
    the normalised shape."""
    q = np.asarray(q)
    axis %= q.ndim
    normalised = q.shape[axis:]
    count = math.prod(normalised)
    x = fp16_dequantize(q, input_zero_point, input_scale).reshape(-1, count)

    def row(values: np.ndarray | None) -> np.ndarray | None:
        if values is None:
            return None
        return np.broadcast_to(np.asarray(values, dtype=np.float16), normalised).reshape(count)

    y = fp16_normalise_rows(x, row(gamma), row(beta), epsilon, centre=centre)
    codes = fp16_quantize(y, output_scale, output_zero_point, low, high, dtype)
    return codes.reshape(q.shape)


# --- GridSample on the bf16 sampling unit (GRID_SAMPLE_BF16) -------------------------------------

GRID_SAMPLE_MODES = ("nearest", "bilinear")
GRID_PADDING_MODES = ("zeros", "border", "reflection")


def bf16_round(x: npt.ArrayLike) -> np.ndarray:
    """float32 -> the nearest bfloat16, half to even, returned as float32 (it is exactly
    representable): ONNX Cast to bfloat16 and back. ±inf and NaN stay; a value past the largest
    bf16 rounds to ±inf as IEEE conversion does."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def bf16_dequantize(q: npt.ArrayLike, zero_point: int, scale: np.float32) -> np.ndarray:
    """bf16(float32(q - z) * s): ONNX DequantizeLinear (float32 product of the exact centred
    code and the float32 scale) followed by a Cast to bfloat16."""
    centred = (np.asarray(q, dtype=np.int64) - int(zero_point)).astype(np.float32)
    return bf16_round(centred * np.float32(scale))


def bf16_requantize_table(
    input_dtype: npt.DTypeLike,
    input_zero_point: int,
    input_scale: np.float32,
    output_scale: np.float32,
    output_zero_point: int,
    output_dtype: npt.DTypeLike,
) -> np.ndarray:
    """Every input code's output code through a bf16 unit that only moves data:
    QuantizeLinear(bf16(DequantizeLinear(q))), in table order (index = q - dtype min).

    The bf16 round trip can move a code by one even when both sides share their quantization
    (|q - z| > 128 needs more than bf16's 8 significant bits), so it is a table, not a copy.
    """
    codes = lut_input_values(input_dtype)
    real = bf16_dequantize(codes, input_zero_point, input_scale)
    return quantize_linear(real, output_scale, output_zero_point, output_dtype)


def _grid_denormalise(g: np.ndarray, size: int, align_corners: bool) -> np.ndarray:
    """The pixel coordinate of normalised g in [-1, 1], in float32 in this order:
    (g + 1) / 2 * (size - 1) with align_corners, else ((g + 1) * size - 1) / 2."""
    one, two = np.float32(1.0), np.float32(2.0)
    if align_corners:
        return (g + one) / two * np.float32(size - 1)
    return ((g + one) * np.float32(size) - one) / two


def _grid_border(size: int, align_corners: bool) -> tuple[np.float32, np.float32]:
    """The coordinate range that needs no padding: [0, size - 1], or [-0.5, size - 0.5]."""
    if align_corners:
        return np.float32(0.0), np.float32(size - 1)
    return np.float32(-0.5), np.float32(size - 0.5)


def _grid_reflect(x: np.ndarray, low: np.float32, high: np.float32) -> np.ndarray:
    """Reflect x by the near border until it lies in [low, high], float32 (ONNX Runtime's
    GsReflect): d = distance past the border, n = trunc(d / range), r = d - n * range, then
    low + r or high - r by the parity of n. A one-pixel axis (range 0) reflects onto `low`."""
    span = np.float32(high - low)
    if span == 0:
        return np.where((x < low) | (x > high), low, x).astype(np.float32)
    below, above = x < low, x > high
    distance = np.where(below, low - x, x - high).astype(np.float32)
    turns = np.trunc(distance / span)
    rest = distance - turns * span
    even = np.fmod(turns, np.float32(2.0)) == 0
    from_low, from_high = low + rest, high - rest
    reflected = np.where(below, np.where(even, from_low, from_high), x)
    return np.where(above, np.where(even, from_high, from_low), reflected).astype(np.float32)


def _grid_taps(
    values: np.ndarray, xi: np.ndarray, yi: np.ndarray, padding: str, align_corners: bool
) -> np.ndarray:
    """values[n, :, yi, xi] for integer tap coordinates (N, P): zeros outside the image for
    padding "zeros", the clamped pixel for "border", the reflected pixel for "reflection"."""
    batch, channels, height, width = values.shape
    valid = (xi >= 0) & (xi < width) & (yi >= 0) & (yi < height)
    if padding == "reflection":
        xi = _grid_reflect(xi.astype(np.float32), *_grid_border(width, align_corners))
        yi = _grid_reflect(yi.astype(np.float32), *_grid_border(height, align_corners))
        xi, yi = xi.astype(np.int64), yi.astype(np.int64)
    xi, yi = np.clip(xi, 0, width - 1), np.clip(yi, 0, height - 1)
    flat = values.reshape(batch, channels, height * width)
    taps = np.take_along_axis(flat, (yi * width + xi)[:, None, :], axis=2)
    if padding == "zeros":
        taps = np.where(valid[:, None, :], taps, np.float32(0.0))
    return taps


def grid_sample_float32(
    x: np.ndarray, grid: np.ndarray, mode: str, padding: str, align_corners: bool
) -> np.ndarray:
    """GridSample of x (N, C, H, W) at grid (N, Ho, Wo, 2) (x then y, normalised to [-1, 1]),
    every operation in float32 and in ONNX Runtime's CPU kernel's order:

      x, y    = denormalised coordinates (`_grid_denormalise`); nearest: rounded half to even
      if x or y lies outside the no-padding range: border clamps both to the image,
      reflection reflects both (`_grid_reflect`)
      nearest:  the pixel at (y, x) (`_grid_taps`: zeros outside for padding zeros)
      bilinear: x0 = floor(x), x1 = x0 + 1 (y likewise), dx1 = x - x0, dx0 = x1 - x, then
                dy0 * (dx0 * p[y0, x0] + dx1 * p[y0, x1]) + dy1 * (dx0 * p[y1, x0] + dx1 * p[y1, x1])

    Returns float32 (N, C, Ho, Wo)."""
    batch, channels, height, width = x.shape
    out_h, out_w = grid.shape[1:3]
    points = np.asarray(grid, dtype=np.float32).reshape(batch, out_h * out_w, 2)
    px = _grid_denormalise(points[..., 0], width, align_corners)
    py = _grid_denormalise(points[..., 1], height, align_corners)
    if mode == "nearest":
        px, py = np.rint(px), np.rint(py)
    (x_low, x_high), (y_low, y_high) = (
        _grid_border(width, align_corners),
        _grid_border(height, align_corners),
    )
    outside = (px < x_low) | (px > x_high) | (py < y_low) | (py > y_high)
    if padding == "border":
        px = np.where(outside, np.clip(px, 0, width - 1), px).astype(np.float32)
        py = np.where(outside, np.clip(py, 0, height - 1), py).astype(np.float32)
    elif padding == "reflection":
        px = np.where(outside, _grid_reflect(px, x_low, x_high), px)
        py = np.where(outside, _grid_reflect(py, y_low, y_high), py)
    values = np.asarray(x, dtype=np.float32)
    if mode == "nearest":
        result = _grid_taps(
            values, px.astype(np.int64), py.astype(np.int64), padding, align_corners
        )
        return result.reshape(batch, channels, out_h, out_w)
    x0, y0 = np.floor(px), np.floor(py)
    x1, y1 = x0 + np.float32(1.0), y0 + np.float32(1.0)
    dx0, dx1 = (x1 - px)[:, None, :], (px - x0)[:, None, :]
    dy0, dy1 = (y1 - py)[:, None, :], (py - y0)[:, None, :]
    xi0, yi0 = x0.astype(np.int64), y0.astype(np.int64)
    xi1, yi1 = xi0 + 1, yi0 + 1

    def tap(xi: np.ndarray, yi: np.ndarray) -> np.ndarray:
        return _grid_taps(values, xi, yi, padding, align_corners)

    top = dx0 * tap(xi0, yi0) + dx1 * tap(xi1, yi0)
    bottom = dx0 * tap(xi0, yi1) + dx1 * tap(xi1, yi1)
    result = dy0 * top + dy1 * bottom
    return result.astype(np.float32).reshape(batch, channels, out_h, out_w)


def bf16_grid_sample(
    q: npt.ArrayLike,
    grid: npt.ArrayLike,
    *,
    mode: str,
    padding: str,
    align_corners: bool,
    input_zero_point: int,
    input_scale: np.float32,
    grid_zero_point: int,
    grid_scale: np.float32,
    output_scale: np.float32,
    output_zero_point: int,
    low: int,
    high: int,
    dtype: npt.DTypeLike,
) -> np.ndarray:
    """Codes in, codes out: input and grid codes to bf16 (`bf16_dequantize`), the float32
    sampling of `grid_sample_float32`, the result rounded to bf16 (`bf16_round`), then ONNX
    QuantizeLinear clamped to [low, high] (`fp16_quantize`: ±inf saturate, NaN gives z). The one
    definition that the reference kernel and the MLA's GRID_SAMPLE_BF16 instruction both run;
    it is the QDQ model's DequantizeLinear -> Cast(bf16) -> Cast(float) pairs around GridSample,
    the Cast pair after it and its QuantizeLinear."""
    x = bf16_dequantize(q, input_zero_point, input_scale)
    points = bf16_dequantize(grid, grid_zero_point, grid_scale)
    y = bf16_round(grid_sample_float32(x, points, mode, padding, align_corners))
    return fp16_quantize(y, output_scale, output_zero_point, low, high, dtype)


# --- elementwise and index helpers (Add, Sub, Max, Min, ArgMax) ----------------------------------


def rescale_operand(
    centred: npt.ArrayLike,
    left_shift: int,
    multiplier: npt.ArrayLike,
    shift: npt.ArrayLike,
    mode: RequantizationMode,
) -> np.ndarray:
    """requantize(x << left_shift, M, n): one operand of a two-input op at a common fine scale.

    Add, Sub, Max and Min bring both centred operands to the scale 2 * max(s_a, s_b) / 2**L
    with their own multipliers (TFLite's formulation), so that the left shift L keeps the
    rounding far below one output step before they are combined.
    """
    return requantize(np.asarray(centred, dtype=np.int64) << left_shift, multiplier, shift, mode)


def argmax_codes(codes: npt.ArrayLike, axis: int, *, select_last: bool = False) -> np.ndarray:
    """Index (int64, keepdims) of the largest code along `axis`: the first one, or the last one
    with `select_last`. Dequantization with a positive per-tensor scale is increasing, so this
    is ArgMax of the real values; ties are ties of codes."""
    codes = np.asarray(codes)
    axis %= codes.ndim
    if not select_last:
        return np.argmax(codes, axis=axis, keepdims=True).astype(np.int64)
    reversed_index = np.argmax(np.flip(codes, axis=axis), axis=axis, keepdims=True)
    return (codes.shape[axis] - 1 - reversed_index).astype(np.int64)


# --- quantize / dequantize (ONNX QuantizeLinear / DequantizeLinear) ------------------------------


def quantize_linear(
    x: npt.ArrayLike, scale: npt.ArrayLike, zero_point: npt.ArrayLike, dtype: npt.DTypeLike
) -> np.ndarray:
    """ONNX QuantizeLinear: saturate(round_half_even(x / scale) + zero_point), x / scale in float32.

    This is the float-to-integer boundary (graph inputs, the end of float islands), not part of
    the integer program; it follows the ONNX operator exactly so it agrees with ONNX Runtime.
    """
    with np.errstate(over="ignore"):  # a ratio past float32 saturates like any large one
        ratio = np.asarray(x, dtype=np.float32) / np.asarray(scale, dtype=np.float32)
    # Bounded before the cast: int64 of ±inf (an attention mask's finfo.min over a fine scale)
    # is undefined in numpy; every |ratio| ≥ 2**62 saturates the same way.
    ratio = np.clip(np.rint(ratio), -(2.0**62), 2.0**62)
    return saturate(ratio.astype(np.int64) + np.asarray(zero_point, np.int64), dtype)


def quantize_linear_fast(
    x: npt.ArrayLike, scale: npt.ArrayLike, zero_point: npt.ArrayLike, dtype: npt.DTypeLike
) -> np.ndarray:
    """`quantize_linear`, identical results, in four float32 passes instead of int64 ones.

    Where every x / scale is finite and below 2**62 in magnitude (checked; otherwise this is
    `quantize_linear`), round_half_even(x / scale) is an integer-valued float32 that int64
    holds exactly, so saturate(r + zero_point) == clip(r, low - zero_point, high - zero_point)
    + zero_point: the bounds and every clipped value are small integers, exact in float32,
    and the final integer sum fits the dtype, so the cast is exact.
    """
    dtype = np.dtype(dtype)
    zero_point = np.asarray(zero_point, dtype=np.int64)
    with np.errstate(over="ignore"):  # an infinite ratio takes the exact path below
        ratio = np.divide(np.asarray(x, dtype=np.float32), np.asarray(scale, dtype=np.float32))
    ratio = np.asarray(ratio, dtype=np.float32)
    low, high = dtype_range(dtype)
    usable = (
        ratio.size
        and float(ratio.min()) > -(2.0**62)
        and float(ratio.max()) < 2.0**62
        and max(-low, high) <= 2**23
        and _largest_magnitude(zero_point) <= 2**23
        and (
            zero_point.ndim == 0
            or np.broadcast_shapes(ratio.shape, zero_point.shape) == ratio.shape
        )
    )
    if not usable:
        return quantize_linear(x, scale, zero_point, dtype)
    shift = zero_point.astype(np.float32)
    np.rint(ratio, out=ratio)
    np.maximum(ratio, low - shift, out=ratio)  # np.clip, without its Python-level checks
    np.minimum(ratio, high - shift, out=ratio)
    result = np.empty(ratio.shape, dtype=dtype)
    np.add(ratio, shift, out=result, casting="unsafe")
    return result


def _largest_magnitude(values: np.ndarray) -> int:
    """max |value| of int64 values (0 for none); a single value without an array pass."""
    if values.size == 1:
        return abs(int(values.reshape(-1)[0]))
    return int(np.abs(values).max(initial=0))


def dequantize_linear(
    q: npt.ArrayLike, scale: npt.ArrayLike, zero_point: npt.ArrayLike
) -> np.ndarray:
    """ONNX DequantizeLinear: (q - zero_point) * scale in float32."""
    centered = np.asarray(q, dtype=np.int64) - np.asarray(zero_point, dtype=np.int64)
    return (centered.astype(np.float32) * np.asarray(scale, dtype=np.float32)).astype(np.float32)


def quantize_constant(
    x: npt.ArrayLike, scale: float, zero_point: int, dtype: npt.DTypeLike
) -> np.ndarray:
    """Compile-time quantization of a real constant (clip bounds, pad values) in float64."""
    real = np.asarray(x, dtype=np.float64) / float(scale)
    clipped = np.clip(real, -(2.0**62), 2.0**62)
    return saturate(round_half_even(clipped) + int(zero_point), dtype)


# --- exact integer matrix products ---------------------------------------------------------------


def int_matmul(a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
    """Exact integer np.matmul (numpy broadcasting rules), returning int64.

    When every partial sum is provably below 2**53 the product is computed in float64, which
    represents those integers exactly and uses BLAS; otherwise it falls back to int64 matmul.
    The result is identical either way.
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    depth = a.shape[-1] if a.ndim else 1
    bound = int(np.max(np.abs(a), initial=0)) * int(np.max(np.abs(b), initial=0)) * max(depth, 1)
    if bound < _EXACT_FLOAT64:
        return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.int64)
    return np.matmul(a, b)


# --- lookup tables -------------------------------------------------------------------------------


def lut_input_values(dtype: npt.DTypeLike) -> np.ndarray:
    """All values of an 8- or 16-bit integer dtype in table order (index = q - dtype min)."""
    low, high = dtype_range(dtype)
    if high - low + 1 > 2**16:
        raise ValueError(f"lookup tables are for 8- and 16-bit inputs, not {np.dtype(dtype)}")
    return np.arange(low, high + 1, dtype=np.int64)


def build_lut(
    function: Callable[[np.ndarray], np.ndarray],
    input_scale: float,
    input_zero_point: int,
    input_dtype: npt.DTypeLike,
    output_scale: float,
    output_zero_point: int,
    output_dtype: npt.DTypeLike,
) -> np.ndarray:
    """Table of f over every input code: saturate(round_half_even(f((q - z_in) * s_in) / s_out) + z_out).

    f is evaluated in float64 on float64 copies of the (float32) scales. +-inf saturates to the
    type bounds; NaN (e.g. log of a negative number) maps to the output zero point (real 0).
    The table has 256 entries for 8-bit inputs and 65536 for 16-bit inputs, indexed by
    q - min(input dtype).
    """
    codes = lut_input_values(input_dtype)
    real_in = (codes - int(input_zero_point)).astype(np.float64) * float(input_scale)
    with np.errstate(all="ignore"):
        real_out = np.asarray(function(real_in), dtype=np.float64) / float(output_scale)
    real_out = np.where(np.isnan(real_out), 0.0, real_out)
    return quantize_constant(real_out, 1.0, output_zero_point, output_dtype)


def apply_lut(
    table: np.ndarray, q: np.ndarray, input_dtype: npt.DTypeLike, axis: int = 1
) -> np.ndarray:
    """Look every code of q up in a table built by `build_lut` (index = q - dtype min). A 2-D
    table (C, entries) holds one table per position along `axis` of q (a PRelu slope per
    channel)."""
    low, _ = dtype_range(input_dtype)
    index = np.asarray(q, dtype=np.int64) - low
    if table.ndim == 1:
        return table[index]
    channels, entries = table.shape
    if not 0 <= axis < index.ndim or index.shape[axis] != channels:
        raise ValueError(f"{channels} tables along axis {axis} of codes of shape {index.shape}")
    offsets = np.arange(channels, dtype=np.int64) * entries
    trailing = index.ndim - 1 - axis
    return table.reshape(-1)[index + offsets.reshape((channels,) + (1,) * trailing)]
