"""ReduceMean, ReduceSum, ReduceMax, ReduceMin and ArgMax over constant axes.

Mean and Sum add the centred codes in int64 and requantize by s_in / (s_out * count) (count = 1
for Sum); Max and Min reduce the raw codes and rescale, which is exact. ArgMax compares the raw
codes (dequantization with a positive per-tensor scale is increasing, so the largest code is
the largest real) and returns int64 indices, an unquantized output as in the float model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.intmath import argmax_codes
from compiler.runtime.ops.base import Lowered, OpContext, Rescale
from compiler.runtime.ops.pool import AverageStage, average_stage
from compiler.runtime.qparams import NotLowerable

_AXES_INPUT_SINCE = {"ReduceSum": 13}
"""Opset from which `axes` is an input rather than an attribute (18 for the other reductions)."""


@dataclass(frozen=True)
class Reduction:
    """Which axes a Reduce* node reduces, resolved against the input rank at run time."""

    axes: tuple[int, ...]
    keepdims: bool
    noop_with_empty_axes: bool

    @classmethod
    def from_context(cls, ctx: OpContext) -> Reduction:
        if ctx.opset >= _AXES_INPUT_SINCE.get(ctx.op_type, 18):
            axes = ctx.ints(1)
        else:
            axes = ctx.attr("axes")
        return cls(
            tuple(axes or ()),
            bool(ctx.attr("keepdims", 1)),
            bool(ctx.attr("noop_with_empty_axes", 0)),
        )

    def resolve(self, ndim: int) -> tuple[int, ...]:
        """Sorted non-negative axes; () means no reduction (noop_with_empty_axes)."""
        if not self.axes:
            return () if self.noop_with_empty_axes else tuple(range(ndim))
        return tuple(sorted(a % ndim for a in self.axes))


@dataclass(frozen=True, eq=False)
class ReduceSumKernel:
    """Sum (or mean when `average`) of centred codes, then one requantization."""

    reduction: Reduction
    input_zero_point: int
    average: bool
    stage: AverageStage

    def __call__(self, x: np.ndarray) -> np.ndarray:
        axes = self.reduction.resolve(x.ndim)
        centred = x.astype(np.int64) - self.input_zero_point
        total = centred.sum(axis=axes, keepdims=self.reduction.keepdims) if axes else centred
        count = math.prod(x.shape[a] for a in axes) if self.average else 1
        return self.stage(total, count)


def lower_reduce_sum(ctx: OpContext) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    kernel = ReduceSumKernel(
        Reduction.from_context(ctx),
        x_zero_point,
        ctx.op_type == "ReduceMean",
        average_stage(ctx, x_scale),
    )
    return Lowered(kernel, (x.name,))


@dataclass(frozen=True, eq=False)
class ReduceExtremumKernel:
    """Integer max or min, then rescale."""

    reduction: Reduction
    maximum: bool
    rescale: Rescale

    def __call__(self, x: np.ndarray) -> np.ndarray:
        axes = self.reduction.resolve(x.ndim)
        if not axes:
            return self.rescale(x)
        reduce = np.max if self.maximum else np.min
        return self.rescale(reduce(x, axis=axes, keepdims=self.reduction.keepdims))


def lower_reduce_extremum(ctx: OpContext) -> Lowered:
    x, _, _ = ctx.activation_input(0)
    kernel = ReduceExtremumKernel(
        Reduction.from_context(ctx),
        ctx.op_type == "ReduceMax",
        Rescale.build(x.params, ctx.output(0), ctx.mode),
    )
    return Lowered(kernel, (x.name,))


@dataclass(frozen=True, eq=False)
class ArgMaxKernel:
    """Index of the first (or, `select_last`, the last) largest code along `axis`, int64."""

    axis: int
    keepdims: bool
    select_last: bool

    def __call__(self, x: np.ndarray) -> np.ndarray:
        indices = argmax_codes(x, self.axis, select_last=self.select_last)
        return indices if self.keepdims else np.squeeze(indices, axis=self.axis % x.ndim)


def lower_argmax(ctx: OpContext) -> Lowered:
    x, scale, _ = ctx.activation_input(0)
    if not scale > 0:
        raise NotLowerable(f"ArgMax of codes needs a positive input scale, not {scale}")
    kernel = ArgMaxKernel(
        int(ctx.attr("axis", 0)),
        bool(ctx.attr("keepdims", 1)),
        bool(ctx.attr("select_last_index", 0)),
    )
    return Lowered(kernel, (x.name,))


LOWERINGS = {
    "ArgMax": lower_argmax,
    "ReduceMean": lower_reduce_sum,
    "ReduceSum": lower_reduce_sum,
    "ReduceMax": lower_reduce_extremum,
    "ReduceMin": lower_reduce_extremum,
}
