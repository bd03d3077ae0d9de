"""LayerNormalization in integers: exact moments, fixed-point rsqrt, per-channel gamma and beta.

Over the normalised axes (from `axis` to the end, N elements), with x = q - z_in:

  s1 = sum(x), s2 = sum(x**2)                       int64
  d  = N * x - s1                                   N * (x - mean), exact
  V  = N * s2 - s1**2 + E                           N**2 * (variance + eps / s_in**2)
       E = max(1, round_half_up(eps * N**2 / s_in**2))
  (y, shift) = reciprocal_sqrt(V)                   1 / sqrt(V) ~= y * 2**-shift (intmath)
  z  = (d * y) >> (shift - 16), rounded half up     the normalised value in Q16
  f  = requantize(sign(g) * z, |g| * 2**(8 - 16) / s_out)      output units in Q8
  out = clamp(requantize(f + round_half_even(b * 2**8 / s_out), 2**-8) + z_out)

gamma (g) and beta (b) are constants whatever their encoding in the model (int8 + DQ, int32 +
DQ or float): they are read as reals at build time and become one (M, n) multiplier and one
integer offset per normalised element. The product is first requantized to output units with 8
extra fractional bits so that beta is added before the final rounding; the result is within one
or two output steps of float LayerNormalization, and deterministic.
Bounds: |x| * N < 2**32 keeps every product inside int64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.intmath import (
    RequantizationMode,
    quantize_multiplier,
    reciprocal_sqrt,
    requantize,
    round_half_even,
    round_half_up,
    rounding_right_shift,
)
from compiler.runtime.ops.base import Lowered, OpContext
from compiler.runtime.qparams import NotLowerable

NORMALISED_BITS = 16
OUTPUT_FRACTION_BITS = 8


@dataclass(frozen=True, eq=False)
class LayerNormKernel:
    """Integer LayerNormalization; gamma/beta folded into per-element multipliers and offsets."""

    axis: int
    epsilon: float
    input_scale: float
    input_zero_point: int
    sign: np.ndarray
    multiplier: np.ndarray
    shift: np.ndarray
    offset: np.ndarray
    zero_point: int
    low: int
    high: int
    dtype: np.dtype
    mode: RequantizationMode

    def __call__(self, q: np.ndarray) -> np.ndarray:
        axes = tuple(range(self.axis % q.ndim, q.ndim))
        count = math.prod(q.shape[a] for a in axes)
        x = q.astype(np.int64) - self.input_zero_point
        s1 = x.sum(axis=axes, keepdims=True)
        s2 = (x * x).sum(axis=axes, keepdims=True)
        epsilon = max(1, int(round_half_up(self.epsilon * count**2 / self.input_scale**2)))
        variance = count * s2 - s1 * s1 + epsilon
        reciprocal, shift = reciprocal_sqrt(variance)
        normalised = rounding_right_shift((count * x - s1) * reciprocal, shift - NORMALISED_BITS)
        fine = requantize(self.sign * normalised, self.multiplier, self.shift, self.mode)
        unit, unit_shift = quantize_multiplier(2.0**-OUTPUT_FRACTION_BITS)
        scaled = requantize(fine + self.offset, unit, unit_shift, self.mode) + self.zero_point
        return np.clip(scaled, self.low, self.high).astype(self.dtype)


def lower_layer_normalization(ctx: OpContext) -> Lowered:
    if any(name for name in ctx.node.output[1:]):
        raise NotLowerable("LayerNormalization with Mean / InvStdDev outputs")
    x, x_scale, x_zero_point = ctx.activation_input(0)
    gamma = ctx.constant(1)
    if gamma is None:
        raise NotLowerable("LayerNormalization scale must be a constant")
    beta = ctx.constant(2)
    beta = np.zeros_like(gamma) if beta is None else np.asarray(beta, dtype=np.float64)
    output = ctx.output(0)
    out_scale, out_zero_point = output.scalar_scale(), output.scalar_zero_point()
    gamma = np.asarray(gamma, dtype=np.float64)
    fraction = OUTPUT_FRACTION_BITS - NORMALISED_BITS
    multiplier, shift = quantize_multiplier(np.abs(gamma) * 2.0**fraction / out_scale)
    low, high = output.bounds
    kernel = LayerNormKernel(
        axis=int(ctx.attr("axis", -1)),
        epsilon=float(ctx.attr("epsilon", 1e-5)),
        input_scale=x_scale,
        input_zero_point=x_zero_point,
        sign=np.sign(gamma).astype(np.int64),
        multiplier=multiplier,
        shift=shift,
        offset=round_half_even(beta * 2.0**OUTPUT_FRACTION_BITS / out_scale),
        zero_point=out_zero_point,
        low=low,
        high=high,
        dtype=output.dtype,
        mode=ctx.mode,
    )
    return Lowered(kernel, (x.name,))


LOWERINGS = {"LayerNormalization": lower_layer_normalization}
