"""Exact integer products on floating-point BLAS: the accumulators at the limits, bit for bit.

The emulator carries CONV / CONV_TRANSPOSE / MATMUL operands in float32 when every partial sum is
provably at most 2**24, in float64 up to 2**53, and in int64 beyond (`_exact_dtype`; the proof is
in emulator_ops.py). These tests read the raw accumulators (an identity output stage into int32:
M = 2**30, n = -1 gives (acc * 2**30 + 2**29) >> 30 = acc) for extreme operands (codes of 255 or
-128 / 127, weights of -128 / 127, the largest depth each dtype allows and beyond), compare them
with an int64 computation written out here, and check each case is one a plain float32 product
gets wrong, so the dtype choice is what keeps it exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from compiler.intmath import INT32_MAX, INT32_MIN
from compiler.isa import Conv, ConvTranspose, MatMul, Requant, Space
from compiler.runtime import emulator_ops
from compiler.runtime.emulator_ops import FLOAT32_EXACT, FLOAT64_EXACT
from tests.test_emulator_support import Codegen

IDENTITY = Requant(2**30, -1, 0, INT32_MIN, INT32_MAX, "sima")
"""acc -> acc for every int32 accumulator."""

FLOAT32_DEPTH = FLOAT32_EXACT // (255 * 128)
"""514: the deepest sum of 255 x -128 products whose partial sums all fit float32 exactly."""


def _extreme(rng: np.random.Generator, shape: tuple[int, ...], low: int, high: int) -> np.ndarray:
    """Mostly `low`, some `high`: sums near the bound that are not multiples of large powers of
    two (a constant operand would give sums float32 happens to represent)."""
    return np.where(rng.random(shape) < 0.9, low, high)


def _float32_is_wrong(x: np.ndarray, w: np.ndarray, exact: np.ndarray) -> bool:
    """Whether a float32 product of the same operands (x @ w) misses the exact sums."""
    approximate = np.matmul(x.astype(np.float32), w.astype(np.float32)).astype(np.int64)
    return bool(np.any(approximate != exact))


def _conv_reference(x: np.ndarray, weight: np.ndarray, group: int) -> np.ndarray:
    """Valid (unpadded, unit stride) grouped convolution of centred int64 values, tap by tap."""
    batch, channels, height, width = x.shape
    out_channels, group_channels, kh, kw = weight.shape
    group_out = out_channels // group
    ho, wo = height - kh + 1, width - kw + 1
    acc = np.zeros((batch, out_channels, ho, wo), dtype=np.int64)
    for m in range(out_channels):
        g = m // group_out
        for i in range(kh):
            for j in range(kw):
                patch = x[:, g * group_channels : (g + 1) * group_channels, i : i + ho, j : j + wo]
                acc[:, m] += np.einsum("nchw,c->nhw", patch, weight[m, :, i, j])
    return acc


def _run_conv(codes: np.ndarray, zero_point: int, weight: np.ndarray, group: int) -> np.ndarray:
    build = Codegen()
    out_channels, _, kh, kw = weight.shape
    shape = (codes.shape[0], out_channels, codes.shape[2] - kh + 1, codes.shape[3] - kw + 1)
    build.emit(
        Conv(
            input=build.input("x", codes.shape, codes.dtype, Space.ARENA),
            weight=build.const(weight, "int8"),
            bias=None,
            output=build.output("acc", shape, "int32"),
            requant=IDENTITY,
            input_zero_point=zero_point,
            group=group,
        )
    )
    return build.run({"x": codes})["acc"]


@pytest.mark.parametrize(
    ("channels", "kernel", "depth_dtype"),
    [
        (FLOAT32_DEPTH, (1, 1), np.float32),
        (FLOAT32_DEPTH + 1, (1, 1), np.float64),
        (57, (3, 3), np.float32),  # 513 taps
        (58, (3, 3), np.float64),  # 522 taps
        (512, (3, 3), np.float64),  # 4608 taps, a deep real-network layer
    ],
)
def test_dense_conv_accumulators_are_exact_at_the_float32_limit(
    channels: int, kernel: tuple[int, int], depth_dtype: type
) -> None:
    """uint8 codes of 255 (zero point 0) times int8 weights of -128: |sum| up to 255 * 128 * K."""
    rng = np.random.default_rng(channels)
    codes = _extreme(rng, (1, channels, kernel[0] + 1, kernel[1] + 2), 255, 254).astype(np.uint8)
    weight = _extreme(rng, (3, channels, *kernel), -128, -127)
    mass = int(np.abs(weight).sum(axis=(1, 2, 3)).max())
    assert emulator_ops._exact_dtype(emulator_ops._largest_value(codes, 0, mass)) is depth_dtype
    expected = _conv_reference(codes.astype(np.int64), weight, group=1)
    np.testing.assert_array_equal(_run_conv(codes, 0, weight, group=1), expected)
    if depth_dtype is not np.float32:
        cols = np.lib.stride_tricks.sliding_window_view(codes[0], kernel, axis=(1, 2))
        cols = cols.transpose(1, 2, 0, 3, 4).reshape(-1, channels * kernel[0] * kernel[1])
        flat = expected[0].reshape(3, -1).T
        assert _float32_is_wrong(cols, weight.reshape(3, -1).T, flat)


@pytest.mark.parametrize("zero_point", [-128, 127])
def test_int8_extremes_over_a_deep_sum(zero_point: int) -> None:
    """int8 codes of -128 / 127 centred by an extreme zero point (|x - z| = 255 or 0), 720 deep."""
    rng = np.random.default_rng(zero_point + 1000)
    far = 127 if zero_point == -128 else -128
    codes = _extreme(rng, (1, 720, 2, 3), far, -far - 1).astype(np.int8)
    weight = _extreme(rng, (4, 720, 1, 1), -128, 127)
    centred = codes.astype(np.int64) - zero_point
    expected = _conv_reference(centred, weight, group=1)
    assert np.abs(expected).max() > FLOAT32_EXACT
    np.testing.assert_array_equal(_run_conv(codes, zero_point, weight, group=1), expected)
    columns = centred[0].reshape(720, -1).T
    assert _float32_is_wrong(columns, weight.reshape(4, -1).T, expected[0].reshape(4, -1).T)


@pytest.mark.parametrize("scalar_taps", [False, True])
@pytest.mark.parametrize(("taps", "depth_dtype"), [(514, np.float32), (516, np.float64)])
def test_depthwise_tap_sums_are_exact_at_the_float32_limit(
    taps: int, depth_dtype: type, scalar_taps: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The depthwise path multiplies per-channel weights by tap columns (or sums shifted slices
    times scalar weights), with the same bound."""
    monkeypatch.setattr(emulator_ops, "SCALAR_TAP_OUTPUTS", 0 if scalar_taps else 10**9)
    rng = np.random.default_rng(taps)
    kernel = (2, taps // 2)
    codes = _extreme(rng, (1, 3, 3, kernel[1] + 1), 255, 254).astype(np.uint8)
    weight = _extreme(rng, (3, 1, *kernel), -128, -127)
    mass = int(np.abs(weight).sum(axis=(1, 2, 3)).max())
    assert emulator_ops._exact_dtype(emulator_ops._largest_value(codes, 0, mass)) is depth_dtype
    expected = _conv_reference(codes.astype(np.int64), weight, group=3)
    np.testing.assert_array_equal(_run_conv(codes, 0, weight, group=3), expected)


@pytest.mark.parametrize("depth", [FLOAT32_DEPTH, FLOAT32_DEPTH + 1, 3000])
def test_matmul_accumulators_are_exact(depth: int) -> None:
    rng = np.random.default_rng(depth)
    a = _extreme(rng, (2, 3, depth), 255, 254).astype(np.uint8)
    b = _extreme(rng, (depth, 5), -128, -127)
    expected = np.einsum("bik,kj->bij", a.astype(np.int64), b)
    build = Codegen()
    build.emit(
        MatMul(
            a=build.input("a", a.shape, "uint8", Space.ARENA),
            b=build.const(b, "int16"),
            bias=None,
            output=build.output("acc", expected.shape, "int32"),
            requant=IDENTITY,
        )
    )
    np.testing.assert_array_equal(build.run({"a": a})["acc"], expected)
    if depth > FLOAT32_DEPTH:
        assert _float32_is_wrong(a.reshape(-1, depth), b, expected.reshape(-1, 5))


def test_conv_transpose_scatter_sums_are_exact_beyond_float32() -> None:
    """Overlapping taps (stride 1, 2x2 kernel) add up to 4 products of depth 200 per output."""
    rng = np.random.default_rng(7)
    channels, group_out, height, width = 200, 3, 3, 4
    codes = _extreme(rng, (1, channels, height, width), 255, 254).astype(np.uint8)
    weight = _extreme(rng, (channels, group_out, 2, 2), -128, -127)
    x = codes.astype(np.int64)
    expected = np.zeros((1, group_out, height + 1, width + 1), dtype=np.int64)
    for i in range(2):
        for j in range(2):
            expected[:, :, i : i + height, j : j + width] += np.einsum(
                "nchw,cm->nmhw", x, weight[:, :, i, j]
            )
    assert np.abs(expected).max() > FLOAT32_EXACT
    build = Codegen()
    build.emit(
        ConvTranspose(
            input=build.input("x", codes.shape, "uint8", Space.ARENA),
            weight=build.const(weight, "int8"),
            bias=None,
            output=build.output("acc", expected.shape, "int32"),
            requant=IDENTITY,
        )
    )
    np.testing.assert_array_equal(build.run({"x": codes})["acc"], expected)


def test_sums_beyond_float64_use_int64() -> None:
    """int32 operands whose products pass 2**53: exact in int64, and the stage saturates."""
    a = np.full((1, 4), 2**30, dtype=np.int32)
    b = np.array([[2**23 + 1], [2**23], [-1], [1]], dtype=np.int64)
    mass = int(np.abs(b).sum())
    assert emulator_ops._exact_dtype(emulator_ops._largest_value(a, 0, mass)) is np.int64
    exact = int(a[0].astype(np.int64) @ b[:, 0])
    assert exact > FLOAT64_EXACT
    build = Codegen()
    build.emit(
        MatMul(
            a=build.input("a", a.shape, "int32", Space.ARENA),
            b=build.const(b, "int32"),
            bias=None,
            output=build.output("y", (1, 1), "int32"),
            requant=IDENTITY,
        )
    )
    assert build.run({"a": a})["y"][0, 0] == INT32_MAX


def test_the_dtype_choice_follows_the_bound() -> None:
    choose = emulator_ops._exact_dtype
    assert choose(FLOAT32_EXACT) is np.float32
    assert choose(FLOAT32_EXACT + 1) is np.float64
    assert choose(FLOAT64_EXACT) is np.float64
    assert choose(FLOAT64_EXACT + 1) is np.int64
    codes = np.array([-128, 5, 127], dtype=np.int8)
    # centred by 127: |x - z| <= 255; 255 * mass, and never less than a code or the zero point
    assert emulator_ops._largest_value(codes, 127, 10) == 2550
    assert emulator_ops._largest_value(codes, 127, 0) == 255
    assert emulator_ops._largest_value(np.array([2**30], np.int32), 2**30, 1) == 2**30
    # Every code of the dtype bounds the codes when that picks float32 (no pass over them);
    # otherwise the codes' own range does.
    assert emulator_ops._largest_value(np.zeros(3, np.int8), 0, 10) == 1280
    assert emulator_ops._largest_value(np.array([-3, 4], np.int16), 0, 1000) == 4000
