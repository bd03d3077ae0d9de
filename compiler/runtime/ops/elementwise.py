"""Add, Sub and Mul of two quantized tensors with numpy broadcasting.

Add/Sub follow TFLite's integer formulation: both inputs are centred, shifted left by 20 bits
(15 for 16-bit data) for headroom, rescaled to the common scale 2 * max(s_a, s_b) with their
own multipliers, added (or subtracted), and the sum requantized to the output:

  a' = requantize((a - z_a) << L, s_a / (2 max(s_a, s_b)))
  b' = requantize((b - z_b) << L, s_b / (2 max(s_a, s_b)))
  y  = clamp(requantize(a' +- b', 2 max(s_a, s_b) / (2**L s_y)) + z_y)

Max and Min (any number of inputs) take the same path as Add with the extremum in place of the
sum: a' and b' as above, y = clamp(requantize(max(a', b'), 2 max(s_a, s_b) / (2**L s_y)) + z_y).
Both operands are rounded at the common scale with L bits of headroom before they are compared,
so the order of two reals is kept unless they lie within 2**-L of a step, and operands that
share the output's scale and zero point come out unchanged (the codes' own max). More than two
inputs fold left to right, each partial result at the output's quantization: requantizing is
monotone, so max(Q(u), Q(v)) = Q(max(u, v)) and folding adds no error of its own.

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
    rescale_operand,
)
from compiler.runtime.ops.base import Lowered, OpContext, OutputStage, Rescale
from compiler.runtime.ops.movement import lower_requantize
from compiler.runtime.qparams import ConstOperand, NotLowerable, QuantParams

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
        centred_a = a.astype(np.int64) - self.a_zero_point
        centred_b = b.astype(np.int64) - self.b_zero_point
        scaled_a = rescale_operand(centred_a, self.left_shift, *self.a_multiplier, self.mode)
        scaled_b = rescale_operand(centred_b, self.left_shift, *self.b_multiplier, self.mode)
        total = scaled_a - scaled_b if self.subtract else scaled_a + scaled_b
        return self.stage(total)


def _common_scale_kernel(
    a: QuantParams,
    b: QuantParams,
    output: QuantParams,
    ctx: OpContext,
    activation: tuple[float, float] | None = None,
) -> AddKernel:
    """The operand rescales and output stage of Add / Sub / Max / Min of `a` and `b`."""
    a_scale, b_scale = a.scalar_scale(), b.scalar_scale()
    wide = max(a.bits, b.bits) > 8
    left_shift = LEFT_SHIFT_16BIT if wide else LEFT_SHIFT_8BIT
    twice_max = 2.0 * max(a_scale, b_scale)
    real_output = twice_max / (2.0**left_shift * output.scalar_scale())
    return AddKernel(
        a_zero_point=a.scalar_zero_point(),
        b_zero_point=b.scalar_zero_point(),
        left_shift=left_shift,
        a_multiplier=quantize_multiplier(a_scale / twice_max),
        b_multiplier=quantize_multiplier(b_scale / twice_max),
        subtract=ctx.op_type == "Sub",
        mode=ctx.mode,
        stage=OutputStage.build(real_output, output, ctx.mode, activation),
    )


def lower_add(ctx: OpContext) -> Lowered:
    if ctx.op_type == "Sum" and len(ctx.node.input) != 2:
        raise NotLowerable(f"Sum of {len(ctx.node.input)} inputs (two lower as an Add)")
    a, b = ctx.quant(0), ctx.quant(1)
    kernel = _common_scale_kernel(a.params, b.params, ctx.output(0), ctx, ctx.activation)
    return Lowered(kernel, (a.name, b.name))


@dataclass(frozen=True, eq=False)
class ExtremumKernel:
    """Integer Max / Min of n >= 2 inputs: `pairs[0]` combines inputs 0 and 1, `pairs[k]` the
    partial result (at the output's quantization) and input k + 1, each as an Add whose sum is
    replaced by the larger (smaller) operand."""

    maximum: bool
    pairs: tuple[AddKernel, ...]

    def __call__(self, *operands: np.ndarray) -> np.ndarray:
        result = operands[0]
        for pair, operand in zip(self.pairs, operands[1:], strict=True):
            result = self.combine(pair, result, operand)
        return result

    def combine(self, pair: AddKernel, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """One pair: both centred operands at the common scale, then their extremum."""
        centred_a = a.astype(np.int64) - pair.a_zero_point
        centred_b = b.astype(np.int64) - pair.b_zero_point
        scaled_a = rescale_operand(centred_a, pair.left_shift, *pair.a_multiplier, pair.mode)
        scaled_b = rescale_operand(centred_b, pair.left_shift, *pair.b_multiplier, pair.mode)
        extremum = np.maximum if self.maximum else np.minimum
        return pair.stage(extremum(scaled_a, scaled_b))


def lower_extremum(ctx: OpContext) -> Lowered:
    """Max / Min: a single input is a requantization, more fold pairwise (module docstring)."""
    operands = [ctx.activation_input(i)[0] for i in range(len(ctx.node.input))]
    output = ctx.output(0)
    if len(operands) == 1:
        return lower_requantize(operands[0], output, ctx.mode)
    pairs = [_common_scale_kernel(operands[0].params, operands[1].params, output, ctx)]
    pairs += [_common_scale_kernel(output, o.params, output, ctx) for o in operands[2:]]
    kernel = ExtremumKernel(ctx.op_type == "Max", tuple(pairs))
    return Lowered(kernel, tuple(o.name for o in operands))


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


def _scaled_by_constant(ctx: OpContext, data: int, factor: int) -> Lowered | None:
    """x · c or x / c where c (input `factor`) is a positive float scalar the QDQ model left
    unquantized (ONNX Runtime's quantizer keeps a hard-swish's / 6 in float): a rescale of x
    by s_x · c / s_y (or s_x / (c · s_y)), with the fused activation's clamp. None otherwise."""
    operand = ctx.input(factor)
    if not isinstance(operand, ConstOperand) or np.size(operand.value) != 1:
        return None
    value = float(np.asarray(operand.value, np.float64).ravel()[0])
    if not (np.isfinite(value) and value > 0):
        return None
    x, x_scale, x_zero_point = ctx.activation_input(data)
    output = ctx.output(0)
    real = x_scale * (value if ctx.op_type == "Mul" else 1.0 / value) / output.scalar_scale()
    stage = OutputStage.build(real, output, ctx.mode, ctx.activation)
    return Lowered(Rescale(x_zero_point, stage), (x.name,))


def lower_mul(ctx: OpContext) -> Lowered:
    for data, factor in ((0, 1), (1, 0)):
        scaled = _scaled_by_constant(ctx, data, factor)
        if scaled is not None:
            return scaled
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
    scaled = _scaled_by_constant(ctx, 0, 1)
    if scaled is not None:
        return scaled
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b, b_scale, b_zero_point = ctx.activation_input(1)
    output = ctx.output(0)
    real = a_scale / (b_scale * output.scalar_scale() * 2.0**QUOTIENT_BITS)
    stage = OutputStage.build(real, output, ctx.mode, ctx.activation)
    return Lowered(DivKernel(a_zero_point, b_zero_point, stage), (a.name, b.name))


LOWERINGS = {
    "Add": lower_add,
    "Sub": lower_add,
    "Sum": lower_add,
    "Mul": lower_mul,
    "Div": lower_div,
    "Max": lower_extremum,
    "Min": lower_extremum,
}
