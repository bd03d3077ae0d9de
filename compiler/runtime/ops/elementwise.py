"""Add, Sub and Mul of two quantized tensors with numpy broadcasting.

Add/Sub follow TFLite's integer formulation: both inputs are centred, shifted left by 20 bits
(15 for 16-bit data) for headroom, rescaled to the common scale 2 * max(s_a, s_b) with their
own multipliers, added (or subtracted), and the sum requantized to the output:

  a' = requantize((a - z_a) << L, s_a / (2 max(s_a, s_b)))
  b' = requantize((b - z_b) << L, s_b / (2 max(s_a, s_b)))
  y  = clamp(requantize(a' +- b', 2 max(s_a, s_b) / (2**L s_y)) + z_y)

Mul multiplies the centred inputs and requantizes the product by s_a * s_b / s_y.

Div computes the quotient of the centred inputs in fixed point with 16 fractional bits,
round_half_up((a - z_a) * 2**16 / (b - z_b)) by exact integer division, and requantizes it by
s_a / (s_b * s_y * 2**16). Division by zero saturates towards the sign of the numerator (0 / 0
gives the output zero point).
All requantizations use the executor's mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compiler.intmath import (
    INT32_MAX,
    RequantizationMode,
    divide_round_half_up,
    quantize_multiplier,
    requantize,
)
from compiler.runtime.ops.base import Lowered, OpContext, OutputStage

LEFT_SHIFT_8BIT = 20
LEFT_SHIFT_16BIT = 15
QUOTIENT_BITS = 16


@dataclass(frozen=True, eq=False)
class AddKernel:
    """Integer Add (or Sub) with per-input multipliers (TFLite style)."""

    a_zero_point: int
    b_zero_point: int
    left_shift: int
    a_multiplier: tuple[np.ndarray, np.ndarray]
    b_multiplier: tuple[np.ndarray, np.ndarray]
    subtract: bool
    mode: RequantizationMode
    stage: OutputStage

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        shifted_a = (a.astype(np.int64) - self.a_zero_point) << self.left_shift
        shifted_b = (b.astype(np.int64) - self.b_zero_point) << self.left_shift
        scaled_a = requantize(shifted_a, *self.a_multiplier, self.mode)
        scaled_b = requantize(shifted_b, *self.b_multiplier, self.mode)
        total = scaled_a - scaled_b if self.subtract else scaled_a + scaled_b
        return self.stage(total)


def lower_add(ctx: OpContext) -> Lowered:
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b, b_scale, b_zero_point = ctx.activation_input(1)
    output = ctx.output(0)
    wide = max(a.params.bits, b.params.bits) > 8
    left_shift = LEFT_SHIFT_16BIT if wide else LEFT_SHIFT_8BIT
    twice_max = 2.0 * max(a_scale, b_scale)
    real_output = twice_max / (2.0**left_shift * output.scalar_scale())
    kernel = AddKernel(
        a_zero_point=a_zero_point,
        b_zero_point=b_zero_point,
        left_shift=left_shift,
        a_multiplier=quantize_multiplier(a_scale / twice_max),
        b_multiplier=quantize_multiplier(b_scale / twice_max),
        subtract=ctx.op_type == "Sub",
        mode=ctx.mode,
        stage=OutputStage.build(real_output, output, ctx.mode, ctx.activation),
    )
    return Lowered(kernel, (a.name, b.name))


@dataclass(frozen=True, eq=False)
class MulKernel:
    """Integer Mul: product of centred inputs, requantized by s_a * s_b / s_y."""

    a_zero_point: int
    b_zero_point: int
    stage: OutputStage

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        product = (a.astype(np.int64) - self.a_zero_point) * (
            b.astype(np.int64) - self.b_zero_point
        )
        return self.stage(product)


def lower_mul(ctx: OpContext) -> Lowered:
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b, b_scale, b_zero_point = ctx.activation_input(1)
    output = ctx.output(0)
    real = a_scale * b_scale / output.scalar_scale()
    kernel = MulKernel(
        a_zero_point, b_zero_point, OutputStage.build(real, output, ctx.mode, ctx.activation)
    )
    return Lowered(kernel, (a.name, b.name))


@dataclass(frozen=True, eq=False)
class DivKernel:
    """Integer Div: fixed-point quotient of centred inputs, requantized by s_a / (s_b * s_y)."""

    a_zero_point: int
    b_zero_point: int
    stage: OutputStage

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        numerator = (a.astype(np.int64) - self.a_zero_point) << QUOTIENT_BITS
        denominator = b.astype(np.int64) - self.b_zero_point
        numerator, denominator = np.broadcast_arrays(numerator, denominator)
        sign = np.where(denominator < 0, -1, 1)
        magnitude = np.maximum(np.abs(denominator), 1)
        quotient = sign * divide_round_half_up(numerator * sign, magnitude)
        quotient = np.where(denominator == 0, np.sign(numerator) * INT32_MAX, quotient)
        return self.stage(quotient)


def lower_div(ctx: OpContext) -> Lowered:
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b, b_scale, b_zero_point = ctx.activation_input(1)
    output = ctx.output(0)
    real = a_scale / (b_scale * output.scalar_scale() * 2.0**QUOTIENT_BITS)
    stage = OutputStage.build(real, output, ctx.mode, ctx.activation)
    return Lowered(DivKernel(a_zero_point, b_zero_point, stage), (a.name, b.name))


LOWERINGS = {"Add": lower_add, "Sub": lower_add, "Mul": lower_mul, "Div": lower_div}
