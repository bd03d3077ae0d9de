"""Conv and ConvTranspose: centred int8 operands, exact integer accumulation, requantization.

acc[m] = sum (x - z_x) * (w[m] - z_w[m]) + bias[m]   (int64, then saturated to int32)
y      = clamp(requantize(acc, s_x * s_w[m] / s_y) + z_y)

Padding is applied to the centred input with 0, i.e. the padded value is the input zero point,
exactly what ONNX Conv on dequantized data does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.intmath import int_matmul
from compiler.runtime.ops.base import Lowered, OpContext, OutputStage, align_bias
from compiler.runtime.ops.geometry import pad_spatial, resolve_pads, spatial_attributes, windows
from compiler.runtime.qparams import ConstOperand, NotLowerable, QuantOperand


def weight_scales(weight: QuantOperand, channels: int, axis: int) -> np.ndarray:
    """Per-output-channel weight scales (float64) from a per-tensor or per-axis weight."""
    params = weight.params
    if params.per_tensor:
        return np.full(channels, params.scalar_scale(), dtype=np.float64)
    ndim = weight.value.ndim if weight.value is not None else 0
    if params.axis is None or params.axis % ndim != axis or params.scale.size != channels:
        raise NotLowerable(f"weights quantized per axis {params.axis}; expected axis {axis}")
    return params.scale.astype(np.float64)


def centred_weight(weight: QuantOperand) -> np.ndarray:
    """w - z_w as int64 (zero point broadcast along the quantization axis)."""
    value = weight.value.astype(np.int64)
    return value - weight.params.along(weight.params.zero_point, value.ndim)


def conv_accumulate(
    x: np.ndarray,
    weight: np.ndarray,
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    begin: list[int],
    end: list[int],
    group: int,
) -> np.ndarray:
    """Grouped N-d convolution of centred int64 data: im2col, then one exact integer matmul."""
    batch, channels = x.shape[:2]
    out_channels, group_channels = weight.shape[:2]
    kernel = weight.shape[2:]
    if channels != group_channels * group or out_channels % group:
        raise NotLowerable("channel counts do not match the group attribute")
    cols = windows(pad_spatial(x, begin, end, 0), kernel, strides, dilations)
    out_shape = cols.shape[2 : 2 + len(kernel)]
    cols = cols.reshape(batch, group, group_channels, *out_shape, *kernel)
    cols = np.moveaxis(cols, 2, 2 + len(kernel))
    depth = group_channels * math.prod(kernel)
    cols = cols.reshape(batch, group, math.prod(out_shape), depth)
    grouped = weight.reshape(group, out_channels // group, depth).transpose(0, 2, 1)
    acc = int_matmul(cols, grouped)
    return acc.transpose(0, 1, 3, 2).reshape(batch, out_channels, *out_shape)


@dataclass(frozen=True, eq=False)
class ConvKernel:
    """Integer Conv with fused bias and activation (the activation lives in `stage`)."""

    weight: np.ndarray
    bias: np.ndarray
    input_zero_point: int
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: list[int] | None
    auto_pad: str
    group: int
    stage: OutputStage

    def __call__(self, x: np.ndarray) -> np.ndarray:
        kernel = self.weight.shape[2:]
        begin, end = resolve_pads(
            x.shape[2:], kernel, self.strides, self.dilations, self.pads, self.auto_pad
        )
        centred = x.astype(np.int64) - self.input_zero_point
        acc = conv_accumulate(
            centred, self.weight, self.strides, self.dilations, begin, end, self.group
        )
        acc += self.bias.reshape(-1, *[1] * len(kernel))
        return self.stage(acc)


def lower_conv(ctx: OpContext) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    weight = ctx.quant(1, constant=True)
    output = ctx.output(0)
    out_channels = weight.value.shape[0]
    rank = weight.value.ndim - 2
    _, strides, dilations = spatial_attributes(ctx, rank, tuple(weight.value.shape[2:]))
    accumulator_scale = x_scale * weight_scales(weight, out_channels, axis=0)
    bias = align_bias(ctx.input(2), accumulator_scale)
    real = (accumulator_scale / output.scalar_scale()).reshape(-1, *[1] * rank)
    kernel = ConvKernel(
        weight=centred_weight(weight),
        bias=np.broadcast_to(np.asarray(bias, dtype=np.int64), (out_channels,)).copy(),
        input_zero_point=x_zero_point,
        strides=strides,
        dilations=dilations,
        pads=ctx.attr("pads"),
        auto_pad=ctx.attr("auto_pad", "NOTSET"),
        group=int(ctx.attr("group", 1)),
        stage=OutputStage.build(real, output, ctx.mode, ctx.activation),
    )
    return Lowered(kernel, (x.name,))


def conv_transpose_accumulate(
    x: np.ndarray,
    weight: np.ndarray,
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    group: int,
    full_shape: tuple[int, ...],
) -> np.ndarray:
    """Transposed convolution of centred int64 data, before cropping the padding.

    Every kernel offset k scatters x @ w[:, :, k] to the output positions k * d + i * s.
    """
    batch, channels = x.shape[:2]
    spatial = x.shape[2:]
    group_out = weight.shape[1]
    group_in = channels // group
    out = np.zeros((batch, group_out * group, *full_shape), dtype=np.int64)
    grouped_x = x.reshape(batch, group, group_in, math.prod(spatial))
    for offset in np.ndindex(*weight.shape[2:]):
        tap = weight[(slice(None), slice(None), *offset)]
        tap = tap.reshape(group, group_in, group_out).transpose(0, 2, 1)
        contribution = int_matmul(tap, grouped_x).reshape(batch, -1, *spatial)
        target = tuple(
            slice(o * d, o * d + s * (n - 1) + 1, s)
            for o, d, s, n in zip(offset, dilations, strides, spatial, strict=True)
        )
        out[(slice(None), slice(None), *target)] += contribution
    return out


@dataclass(frozen=True, eq=False)
class ConvTransposeKernel:
    """Integer ConvTranspose with fused bias and activation."""

    weight: np.ndarray
    bias: np.ndarray
    input_zero_point: int
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: list[int] | None
    auto_pad: str
    output_padding: tuple[int, ...]
    output_shape: tuple[int, ...] | None
    group: int
    stage: OutputStage

    def _geometry(self, spatial: tuple[int, ...]) -> tuple[tuple[int, ...], list[int], list[int]]:
        """Uncropped output size and the (begin, end) crop, per the ONNX ConvTranspose rules."""
        kernel = self.weight.shape[2:]
        full = tuple(
            s * (n - 1) + p + (k - 1) * d + 1
            for s, n, p, k, d in zip(
                self.strides, spatial, self.output_padding, kernel, self.dilations, strict=True
            )
        )
        rank = len(spatial)
        if self.output_shape is not None or self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = self.output_shape or tuple(
                n * s for n, s in zip(spatial, self.strides, strict=True)
            )
            totals = [f - t for f, t in zip(full, target[-rank:], strict=True)]
            if any(t < 0 for t in totals):
                raise NotLowerable("output_shape larger than the transposed convolution")
            upper = self.auto_pad == "SAME_UPPER"
            begin = [t // 2 if upper else t - t // 2 for t in totals]
            end = [t - b for t, b in zip(totals, begin, strict=True)]
        else:
            pads = self.pads or [0] * (2 * rank)
            begin, end = list(pads[:rank]), list(pads[rank:])
        return full, begin, end

    def __call__(self, x: np.ndarray) -> np.ndarray:
        spatial = x.shape[2:]
        full, begin, end = self._geometry(spatial)
        centred = x.astype(np.int64) - self.input_zero_point
        acc = conv_transpose_accumulate(
            centred, self.weight, self.strides, self.dilations, self.group, full
        )
        crop = tuple(slice(b, f - e) for b, e, f in zip(begin, end, full, strict=True))
        acc = acc[(slice(None), slice(None), *crop)]
        acc = acc + self.bias.reshape(-1, *[1] * len(spatial))
        return self.stage(acc)


def conv_transpose_scales(weight: QuantOperand, group: int) -> np.ndarray:
    """Per-output-channel scales of a ConvTranspose weight (C_in, C_out / group, *k).

    Per-axis weights on axis 1 apply to every group; axis 0 is accepted only for depthwise
    weights, where input channel = output channel.
    """
    in_channels, group_out = weight.value.shape[:2]
    params = weight.params
    if params.per_tensor:
        return np.full(group_out * group, params.scalar_scale(), dtype=np.float64)
    axis = (params.axis if params.axis is not None else 1) % weight.value.ndim
    if axis == 1:
        return np.tile(weight_scales(weight, group_out, axis=1), group)
    if axis == 0 and group_out == 1 and in_channels == group:
        return weight_scales(weight, in_channels, axis=0)
    raise NotLowerable(f"ConvTranspose weights quantized per axis {params.axis}")


def lower_conv_transpose(ctx: OpContext) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    weight = ctx.quant(1, constant=True)
    output = ctx.output(0)
    rank = weight.value.ndim - 2
    group = int(ctx.attr("group", 1))
    _, strides, dilations = spatial_attributes(ctx, rank, tuple(weight.value.shape[2:]))
    accumulator_scale = x_scale * conv_transpose_scales(weight, group)
    out_channels = accumulator_scale.size
    bias = align_bias(ctx.input(2), accumulator_scale)
    real = (accumulator_scale / output.scalar_scale()).reshape(-1, *[1] * rank)
    output_shape = ctx.attr("output_shape")
    kernel = ConvTransposeKernel(
        weight=centred_weight(weight),
        bias=np.broadcast_to(np.asarray(bias, dtype=np.int64), (out_channels,)).copy(),
        input_zero_point=x_zero_point,
        strides=strides,
        dilations=dilations,
        pads=ctx.attr("pads"),
        auto_pad=ctx.attr("auto_pad", "NOTSET"),
        output_padding=tuple(ctx.attr("output_padding") or [0] * rank),
        output_shape=tuple(output_shape) if output_shape else None,
        group=group,
        stage=OutputStage.build(real, output, ctx.mode, ctx.activation),
    )
    return Lowered(kernel, (x.name,))


def lower_batch_normalization(ctx: OpContext) -> Lowered:
    """A BatchNormalization the QDQ model keeps (ONNX Runtime's quantizer without pre-processing
    does): per channel y = a·x + b, a = γ/√(σ² + ε), b = β − μ·a, as a depthwise 1×1 Conv. Its
    int8 weight ±127 with per-channel scale |a|/127 is a exactly; b is re-encoded at the
    accumulator's scale s_x·|a|/127 like any float bias (`align_bias`)."""
    if ctx.attr("training_mode", 0):
        raise NotLowerable("a training-mode BatchNormalization")
    rank = ctx.ranks[0] if ctx.ranks else None
    if rank is None or rank < 3:
        raise NotLowerable("BatchNormalization of an input without known spatial axes")
    x, x_scale, x_zero_point = ctx.activation_input(0)
    stats = [ctx.constant(k) for k in range(1, 5)]
    if any(v is None for v in stats):
        raise NotLowerable("BatchNormalization needs constant scale, bias, mean and variance")
    gamma, beta, mean, variance = (np.asarray(v, np.float64).ravel() for v in stats)
    a = gamma / np.sqrt(variance + float(ctx.attr("epsilon", 1e-5)))
    b = beta - mean * a
    channels, spatial = a.size, rank - 2
    weight_scale = np.where(a != 0, np.abs(a) / 127.0, 1.0)
    accumulator_scale = x_scale * weight_scale
    output = ctx.output(0)
    bias = align_bias(ConstOperand("batch_norm_bias", b), accumulator_scale)
    real = (accumulator_scale / output.scalar_scale()).reshape(-1, *[1] * spatial)
    kernel = ConvKernel(
        weight=(np.sign(a) * 127).astype(np.int64).reshape(channels, 1, *[1] * spatial),
        bias=np.broadcast_to(np.asarray(bias, dtype=np.int64), (channels,)).copy(),
        input_zero_point=x_zero_point,
        strides=(1,) * spatial,
        dilations=(1,) * spatial,
        pads=None,
        auto_pad="NOTSET",
        group=channels,
        stage=OutputStage.build(real, output, ctx.mode, ctx.activation),
    )
    return Lowered(kernel, (x.name,))


LOWERINGS = {
    "Conv": lower_conv,
    "ConvTranspose": lower_conv_transpose,
    "BatchNormalization": lower_batch_normalization,
}
