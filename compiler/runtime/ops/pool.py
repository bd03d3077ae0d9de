"""MaxPool, AveragePool and their global forms.

MaxPool takes the integer maximum of each window (padding holds the type minimum, so it never
wins) and rescales only if the output quantization differs; max commutes with the increasing
affine map, so this is exact.

AveragePool sums the centred codes (q - z_in) of each window in int64 and requantizes by
s_in / (s_out * count): the division by the window size is folded into the multiplier, one
(M, n) per distinct count. count is the kernel size when count_include_pad=1, otherwise the
number of input (non-padding) elements under the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.intmath import RequantizationMode, quantize_multiplier, requantize_clamp
from compiler.runtime.ops.base import Lowered, OpContext, Rescale
from compiler.runtime.ops.geometry import pad_spatial, resolve_pads, spatial_attributes, windows
from compiler.runtime.qparams import NotLowerable


@dataclass(frozen=True, eq=False)
class MaxPoolKernel:
    """Integer MaxPool (any rank, dilations, ceil_mode)."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: list[int] | None
    auto_pad: str
    ceil_mode: bool
    pad_value: int
    rescale: Rescale

    def __call__(self, x: np.ndarray) -> np.ndarray:
        begin, end = resolve_pads(
            x.shape[2:],
            self.kernel,
            self.strides,
            self.dilations,
            self.pads,
            self.auto_pad,
            ceil_mode=self.ceil_mode,
            overhang=True,
        )
        padded = pad_spatial(x, begin, end, self.pad_value)
        view = windows(padded, self.kernel, self.strides, self.dilations)
        pooled = view.max(axis=tuple(range(-len(self.kernel), 0)))
        return self.rescale(pooled)


def lower_max_pool(ctx: OpContext) -> Lowered:
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        raise NotLowerable("MaxPool with an Indices output")
    x, _, _ = ctx.activation_input(0)
    kernel = tuple(ctx.attr("kernel_shape") or ())
    kernel, strides, dilations = spatial_attributes(ctx, len(kernel))
    pool = MaxPoolKernel(
        kernel=kernel,
        strides=strides,
        dilations=dilations,
        pads=ctx.attr("pads"),
        auto_pad=ctx.attr("auto_pad", "NOTSET"),
        ceil_mode=bool(ctx.attr("ceil_mode", 0)),
        pad_value=x.params.bounds[0],
        rescale=Rescale.build(x.params, ctx.output(0), ctx.mode),
    )
    return Lowered(pool, (x.name,))


@dataclass(frozen=True, eq=False)
class AverageStage:
    """sum -> requantize by s_in / (s_out * count) -> + z_out -> saturate."""

    input_scale: float
    output_scale: float
    zero_point: int
    low: int
    high: int
    dtype: np.dtype
    mode: RequantizationMode

    def __call__(self, total: np.ndarray, count: np.ndarray | int) -> np.ndarray:
        real = self.input_scale / (self.output_scale * np.asarray(count, dtype=np.float64))
        multiplier, shift = quantize_multiplier(real)
        return requantize_clamp(
            total, multiplier, shift, self.mode, self.zero_point, self.low, self.high
        ).astype(self.dtype)


def average_stage(ctx: OpContext, input_scale: float) -> AverageStage:
    output = ctx.output(0)
    low, high = output.bounds
    return AverageStage(
        input_scale,
        output.scalar_scale(),
        output.scalar_zero_point(),
        low,
        high,
        output.dtype,
        ctx.mode,
    )


@dataclass(frozen=True, eq=False)
class AveragePoolKernel:
    """Integer AveragePool: window sums of centred codes, one multiplier per window count."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads: list[int] | None
    auto_pad: str
    count_include_pad: bool
    input_zero_point: int
    stage: AverageStage
    ceil_mode: bool = False

    def resolved_pads(self, spatial: tuple[int, ...]) -> tuple[list[int], list[int], bool]:
        """(begin, end, count_include_pad) of the equivalent floor-mode pool on `spatial`.

        ceil_mode adds end padding for the last, partial window; that overhang never counts
        towards the divisor. With no explicit padding (the only kind `lower_average_pool`
        accepts with ceil_mode and count_include_pad=1) every counted element is an input
        element, so the pool is the count_include_pad=0 one over the grown padding."""
        geometry = (spatial, self.kernel, self.strides, self.dilations, self.pads, self.auto_pad)
        begin, end = resolve_pads(*geometry, overhang=True)  # counted as padding, as ORT does
        if not self.ceil_mode:
            return begin, end, self.count_include_pad
        grown = resolve_pads(*geometry, ceil_mode=True)[1]
        if grown == end:
            return begin, end, self.count_include_pad
        return begin, grown, False

    def __call__(self, x: np.ndarray) -> np.ndarray:
        spatial = x.shape[2:]
        begin, end, count_include_pad = self.resolved_pads(spatial)
        axes = tuple(range(-len(self.kernel), 0))
        centred = x.astype(np.int64) - self.input_zero_point
        total = windows(
            pad_spatial(centred, begin, end, 0), self.kernel, self.strides, self.dilations
        )
        total = total.sum(axis=axes)
        if count_include_pad:
            count = np.int64(math.prod(self.kernel))
        else:
            inside = pad_spatial(np.ones((1, 1, *spatial), dtype=np.int64), begin, end, 0)
            count = windows(inside, self.kernel, self.strides, self.dilations).sum(axis=axes)
        return self.stage(total, count)


def lower_average_pool(ctx: OpContext) -> Lowered:
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    count_include_pad = bool(ctx.attr("count_include_pad", 0))
    explicit = any(ctx.attr("pads") or ()) or ctx.attr("auto_pad", "NOTSET") not in ("NOTSET", "")
    if ceil_mode and count_include_pad and explicit:
        raise NotLowerable(
            "AveragePool with ceil_mode=1, count_include_pad=1 and padding: a partial window "
            "counts its padding but not its overhang, which the POOL count tables cannot tell apart"
        )
    x, x_scale, x_zero_point = ctx.activation_input(0)
    kernel = tuple(ctx.attr("kernel_shape") or ())
    kernel, strides, dilations = spatial_attributes(ctx, len(kernel))
    pool = AveragePoolKernel(
        kernel=kernel,
        strides=strides,
        dilations=dilations,
        pads=ctx.attr("pads"),
        auto_pad=ctx.attr("auto_pad", "NOTSET"),
        count_include_pad=count_include_pad,
        input_zero_point=x_zero_point,
        stage=average_stage(ctx, x_scale),
        ceil_mode=ceil_mode,
    )
    return Lowered(pool, (x.name,))


@dataclass(frozen=True, eq=False)
class GlobalAveragePoolKernel:
    """Sum of centred codes over all spatial positions, requantized by s_in / (s_out * H * W)."""

    input_zero_point: int
    stage: AverageStage

    def __call__(self, x: np.ndarray) -> np.ndarray:
        axes = tuple(range(2, x.ndim))
        total = (x.astype(np.int64) - self.input_zero_point).sum(axis=axes, keepdims=True)
        return self.stage(total, math.prod(x.shape[2:]))


def lower_global_average_pool(ctx: OpContext) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    return Lowered(GlobalAveragePoolKernel(x_zero_point, average_stage(ctx, x_scale)), (x.name,))


@dataclass(frozen=True, eq=False)
class GlobalMaxPoolKernel:
    """Integer maximum over all spatial positions."""

    rescale: Rescale

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.rescale(x.max(axis=tuple(range(2, x.ndim)), keepdims=True))


def lower_global_max_pool(ctx: OpContext) -> Lowered:
    x, _, _ = ctx.activation_input(0)
    return Lowered(GlobalMaxPoolKernel(Rescale.build(x.params, ctx.output(0), ctx.mode)), (x.name,))


LOWERINGS = {
    "MaxPool": lower_max_pool,
    "AveragePool": lower_average_pool,
    "GlobalAveragePool": lower_global_average_pool,
    "GlobalMaxPool": lower_global_max_pool,
}
