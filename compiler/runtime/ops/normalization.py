"""LayerNormalization and InstanceNormalization in integers: exact moments, fixed-point rsqrt,
gamma and beta folded into per-element (or per-channel) multipliers and offsets.

Over the normalised axes (N elements per group), with x = q - z_in:

  s1 = sum(x), s2 = sum(x**2)                       int64
  d  = N * x - s1                                   N * (x - mean), exact
  V  = N * s2 - s1**2 + E                           N**2 * (variance + eps / s_in**2)
       E = max(1, round_half_up(eps * N**2 / s_in**2))
  (y, shift) = reciprocal_sqrt(V)                   1 / sqrt(V) ~= y * 2**-shift (intmath)
  z  = (d * y) >> (shift - 16), rounded half up     the normalised value in Q16
  f  = requantize(sign(g) * z, |g| * 2**(8 - 16) / s_out)      output units in Q8
  out = clamp(requantize(f + round_half_even(b * 2**8 / s_out), 2**-8) + z_out)

(`compiler.intmath.normalise` is that definition up to z.) LayerNormalization normalises the
axes from `axis` to the end, gamma and beta having (or broadcasting to) their shape;
InstanceNormalization normalises the spatial axes 2... of each (n, c), with one gamma and beta
per channel: the same computation with axis = 2 and per-channel parameters.

LRN (local response normalisation across channels) divides each value by
(bias + alpha / size * s)**beta, s the sum of squares over a window of `size` channels. With
x = q - z_in and S the integer sum of x**2 over the window (s = s_in**2 * S):

  i  = round_half_up(S / 2**h)                     h chosen so that i <= 2**LRN_INDEX_BITS
  F  = table[i] = round_half_even(2**Q * (bias + alpha / size * s_in**2 * i * 2**h)**-beta)
  out = clamp(requantize(x * F, s_in / (s_out * 2**Q)) + z_out)

(`compiler.intmath.lrn_accumulator` is x * F.) Q puts the largest factor just below
2**LRN_FACTOR_BITS, so x * F stays inside int32 for 8-bit x; rounding S changes the factor by
a relative error of about beta * alpha / size * s_in**2 * 2**(h-1) / bias at most.

gamma (g) and beta (b) are constants whatever their encoding in the model (int8 + DQ, int32 +
DQ or float): they are read as reals at build time and become one (M, n) multiplier and one
integer offset per normalised element (per channel). The product is first requantized to output
units with 8 extra fractional bits so that beta is added before the final rounding; the result
is within one or two output steps of the float op, and deterministic.

LayerNormalization and RMSNormalization that a target runs in fp16 (the QDQ model wraps them in
Cast pairs to float16; RMSNormalization also when it sits between a DequantizeLinear and a
QuantizeLinear, having no integer form) use the MLA's fp16 normalisation unit instead
(`Fp16NormKernel`): 8-bit codes in, every operation in IEEE fp16 in a fixed order
(`compiler.intmath.fp16_normalisation`), codes out. The input is dequantized at a scale
multiplied by 2**-e (`compiler.intmath.fp16_input_exponent`) so that no fp16 sum can overflow,
with epsilon scaled by 2**-2e to match; normalisation does not change under such scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.intmath import (
    NORMALISED_BITS,
    RequantizationMode,
    bit_length,
    dtype_range,
    fp16_epsilon,
    fp16_input_exponent,
    fp16_normalisation,
    lrn_accumulator,
    normalisation_epsilon,
    normalise,
    quantize_multiplier,
    requantize,
    round_half_even,
    rounding_right_shift,
)
from compiler.runtime.ops.base import Lowered, OpContext, OutputStage
from compiler.runtime.qparams import NotLowerable

OUTPUT_FRACTION_BITS = 8
LRN_INDEX_BITS = 14
"""LRN factor tables have at most 2**14 + 1 entries (64 KiB of int32)."""
LRN_FACTOR_BITS = 22
"""The largest LRN factor is below 2**22, so x * F fits int32 for |x| <= 2**9."""


@dataclass(frozen=True, eq=False)
class LayerNormKernel:
    """Integer normalisation over the axes from `axis` to the end; gamma/beta folded into
    multipliers and offsets that broadcast against the normalised shape or, `per_channel`
    (InstanceNormalization), hold one value per channel (axis 1)."""

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
    per_channel: bool = False

    def axes(self, ndim: int) -> tuple[int, ...]:
        return tuple(range(self.axis % ndim, ndim))

    def parameters(self, ndim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(sign, multiplier, shift, offset), shaped to broadcast against a rank-`ndim` input:
        per-channel values become (C, 1, ..., 1)."""
        values = (self.sign, self.multiplier, self.shift, self.offset)
        arrays = tuple(np.asarray(v, dtype=np.int64) for v in values)
        if not self.per_channel:
            return arrays
        shape = (-1,) + (1,) * (ndim - 2)
        return tuple(a.reshape(shape) for a in arrays)

    def __call__(self, q: np.ndarray) -> np.ndarray:
        axes = self.axes(q.ndim)
        count = math.prod(q.shape[a] for a in axes)
        epsilon = normalisation_epsilon(self.epsilon, count, self.input_scale)
        normalised = normalise(q.astype(np.int64) - self.input_zero_point, axes, epsilon)
        sign, multiplier, shift, offset = self.parameters(q.ndim)
        fine = requantize(sign * normalised, multiplier, shift, self.mode)
        unit, unit_shift = quantize_multiplier(2.0**-OUTPUT_FRACTION_BITS)
        scaled = requantize(fine + offset, unit, unit_shift, self.mode) + self.zero_point
        return np.clip(scaled, self.low, self.high).astype(self.dtype)


def _normalisation_kernel(
    ctx: OpContext, gamma: np.ndarray, beta: np.ndarray | None, axis: int, *, per_channel: bool
) -> Lowered:
    """The kernel of either normalisation, with gamma and beta as reals."""
    x, x_scale, x_zero_point = ctx.activation_input(0)
    gamma = np.asarray(gamma, dtype=np.float64)
    beta = np.zeros_like(gamma) if beta is None else np.asarray(beta, dtype=np.float64)
    output = ctx.output(0)
    out_scale = output.scalar_scale()
    fraction = OUTPUT_FRACTION_BITS - NORMALISED_BITS
    multiplier, shift = quantize_multiplier(np.abs(gamma) * 2.0**fraction / out_scale)
    low, high = output.bounds
    kernel = LayerNormKernel(
        axis=axis,
        epsilon=float(ctx.attr("epsilon", 1e-5)),
        input_scale=x_scale,
        input_zero_point=x_zero_point,
        sign=np.sign(gamma).astype(np.int64),
        multiplier=multiplier,
        shift=shift,
        offset=round_half_even(beta * 2.0**OUTPUT_FRACTION_BITS / out_scale),
        zero_point=output.scalar_zero_point(),
        low=low,
        high=high,
        dtype=output.dtype,
        mode=ctx.mode,
        per_channel=per_channel,
    )
    return Lowered(kernel, (x.name,))


def lower_layer_normalization(ctx: OpContext) -> Lowered:
    if any(name for name in ctx.node.output[1:]):
        raise NotLowerable("LayerNormalization with Mean / InvStdDev outputs")
    gamma = ctx.constant(1)
    if gamma is None:
        raise NotLowerable("LayerNormalization scale must be a constant")
    axis = int(ctx.attr("axis", -1))
    return _normalisation_kernel(ctx, gamma, layer_norm_bias(ctx, gamma), axis, per_channel=False)


def layer_norm_bias(ctx: OpContext, gamma: np.ndarray) -> np.ndarray:
    """LayerNormalization's B: zeros when the node has none (torch's `bias=False`, as
    PoolFormerV2 and CAFormer export it); a B computed at run time is not lowerable (reading
    it as absent would drop it)."""
    if len(ctx.node.input) < 3 or not ctx.node.input[2]:
        return np.zeros_like(np.asarray(gamma))
    beta = ctx.constant(2)
    if beta is None:
        raise NotLowerable("LayerNormalization B must be a constant")
    return beta


def lower_instance_normalization(ctx: OpContext) -> Lowered:
    """InstanceNormalization(x, scale (C,), B (C,)): LayerNorm over axes 2... per channel."""
    gamma, beta = ctx.constant(1), ctx.constant(2)
    if gamma is None or beta is None:
        raise NotLowerable("InstanceNormalization scale and B must be constants")
    gamma = np.asarray(gamma).reshape(-1)
    beta = np.broadcast_to(np.asarray(beta).reshape(-1), gamma.shape)
    return _normalisation_kernel(ctx, gamma, beta, 2, per_channel=True)


@dataclass(frozen=True, eq=False)
class LrnKernel:
    """Integer LRN: x times a tabulated factor of the rounded window sum of squares."""

    size: int
    index_shift: int
    table: np.ndarray
    input_zero_point: int
    stage: OutputStage

    def __call__(self, q: np.ndarray) -> np.ndarray:
        centred = q.astype(np.int64) - self.input_zero_point
        return self.stage(lrn_accumulator(centred, self.size, self.index_shift, self.table))


def lrn_factors(
    size: int, alpha: float, beta: float, bias: float, input_scale: float, largest: int
) -> tuple[np.ndarray, int, int]:
    """(table, index_shift, Q) for window sums of squares up to `largest` (module docstring)."""
    index_shift = max(0, int(bit_length(largest)) - LRN_INDEX_BITS)
    entries = int(rounding_right_shift(largest, index_shift)) + 1
    sums = np.arange(entries, dtype=np.float64) * 2.0**index_shift
    factors = (bias + alpha / size * input_scale**2 * sums) ** -beta
    fraction = LRN_FACTOR_BITS - 1 - math.floor(math.log2(factors.max()))
    table = round_half_even(factors * 2.0**fraction).astype(np.int64)
    return table, index_shift, fraction


def lower_lrn(ctx: OpContext) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    if x.params.bits > 8:
        raise NotLowerable("integer LRN takes 8-bit data")
    size = int(ctx.attr("size", 0))
    bias = float(ctx.attr("bias", 1.0))
    if size < 1 or not bias > 0:
        raise NotLowerable(f"LRN with size {size} and bias {bias}")
    low, high = x.params.bounds
    largest = size * max(x_zero_point - low, high - x_zero_point) ** 2
    alpha, beta = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75))
    table, index_shift, fraction = lrn_factors(size, alpha, beta, bias, x_scale, largest)
    output = ctx.output(0)
    real = x_scale / (output.scalar_scale() * 2.0**fraction)
    stage = OutputStage.build(real, output, ctx.mode)
    return Lowered(LrnKernel(size, index_shift, table, x_zero_point, stage), (x.name,))


@dataclass(frozen=True, eq=False)
class Fp16NormKernel:
    """LayerNormalization (`centre`) or RMSNormalization over the axes from `axis` on, in fp16.

    `input_scale` and `epsilon` are the model's; `scaled` turns them into the unit's float32
    scale and fp16 epsilon for a given element count. `gamma` / `beta` are fp16 and broadcast
    against the normalised shape; the output is quantized by ONNX QuantizeLinear rules.
    """

    centre: bool
    axis: int
    epsilon: float
    input_scale: float
    input_zero_point: int
    input_dtype: np.dtype
    gamma: np.ndarray
    beta: np.ndarray | None
    output_scale: np.float32
    zero_point: int
    low: int
    high: int
    dtype: np.dtype

    def scaled(self, count: int) -> tuple[np.float32, np.float16]:
        """(float32 input scale s_in * 2**-e, fp16 epsilon * 2**-2e) for rows of `count`
        elements: e keeps every fp16 sum finite (`compiler.intmath.fp16_input_exponent`)."""
        low, high = dtype_range(self.input_dtype)
        largest = max(self.input_zero_point - low, high - self.input_zero_point)
        exponent = fp16_input_exponent(largest * self.input_scale, count)
        scale = np.float32(np.float64(np.float32(self.input_scale)) * 2.0**-exponent)
        return scale, fp16_epsilon(self.epsilon, exponent)

    def __call__(self, q: np.ndarray) -> np.ndarray:
        axis = self.axis % q.ndim
        scale, epsilon = self.scaled(math.prod(q.shape[axis:]))
        return fp16_normalisation(
            q,
            axis,
            input_zero_point=self.input_zero_point,
            input_scale=scale,
            gamma=self.gamma,
            beta=self.beta,
            epsilon=epsilon,
            centre=self.centre,
            output_scale=self.output_scale,
            output_zero_point=self.zero_point,
            low=self.low,
            high=self.high,
            dtype=self.dtype,
        )


def lower_fp16_normalization(ctx: OpContext) -> Lowered:
    """LayerNormalization(x, scale, B) or RMSNormalization(x, scale) on the fp16 unit."""
    if any(name for name in ctx.node.output[1:]):
        raise NotLowerable(f"{ctx.op_type} with Mean / InvStdDev outputs")
    x, x_scale, x_zero_point = ctx.activation_input(0)
    if x.params.bits > 8:
        raise NotLowerable("the fp16 normalisation unit reads 8-bit codes")
    gamma = ctx.constant(1)
    if gamma is None:
        raise NotLowerable(f"{ctx.op_type} scale must be a constant")
    centre = ctx.op_type == "LayerNormalization"
    beta = layer_norm_bias(ctx, gamma) if centre else None
    output = ctx.output(0)
    low, high = output.bounds
    kernel = Fp16NormKernel(
        centre=centre,
        axis=int(ctx.attr("axis", -1)),
        epsilon=float(ctx.attr("epsilon", 1e-5)),
        input_scale=x_scale,
        input_zero_point=x_zero_point,
        input_dtype=np.dtype(x.params.dtype),
        gamma=np.asarray(gamma, dtype=np.float16),
        beta=None if beta is None else np.asarray(beta, dtype=np.float16),
        output_scale=np.float32(output.scalar_scale()),
        zero_point=output.scalar_zero_point(),
        low=low,
        high=high,
        dtype=np.dtype(output.dtype),
    )
    return Lowered(kernel, (x.name,))


LOWERINGS = {
    "LayerNormalization": lower_layer_normalization,
    "InstanceNormalization": lower_instance_normalization,
    "LRN": lower_lrn,
    "RMSNormalization": lower_fp16_normalization,
}

FP16_LOWERINGS = {
    "LayerNormalization": lower_fp16_normalization,
    "RMSNormalization": lower_fp16_normalization,
}
"""Lowerings of the ops the QDQ model runs in fp16 (Cast pairs to float16 around them)."""
