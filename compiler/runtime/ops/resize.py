"""Resize, nearest and (N-)linear, on integer tensors.

Output coordinates map to input coordinates with the ONNX coordinate_transformation_mode,
computed in float64 from the float32 scales. Nearest picks one input code per output (with the
ONNX nearest_mode), so it is exact data movement plus an optional rescale.

Linear interpolation is integer. Per resized axis, the input coordinate x is clamped to
[0, size - 1]; x0 = floor(x), x1 = min(x0 + 1, size - 1) and the weight of x1 is the fraction
in fixed point with 10 fractional bits, w1 = floor((x - x0) * 1024 + 0.5) (round half up),
w0 = 1024 - w1. The axes are interpolated one after the other on the centred codes (q - z_in)
in int64 with no intermediate rounding, so the result carries 10 fractional bits per resized
axis and a single requantization by s_in / (s_out * 2**(10 * axes)) rounds it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compiler.runtime.ops.base import Lowered, OpContext, OutputStage, Rescale
from compiler.runtime.qparams import NotLowerable

WEIGHT_BITS = 10
WEIGHT_ONE = 1 << WEIGHT_BITS

_COORDINATE_MODES = (
    "half_pixel",
    "half_pixel_symmetric",
    "pytorch_half_pixel",
    "align_corners",
    "asymmetric",
    "tf_half_pixel_for_nearest",
)
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def input_coordinates(out_size: int, in_size: int, scale: float, mode: str) -> np.ndarray:
    """Input coordinate (float64) of every output index along one axis (ONNX Resize)."""
    x = np.arange(out_size, dtype=np.float64)
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = out_size / (scale * in_size)
        offset = in_size / 2.0 * (1.0 - adjustment)
        return offset + (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_size > 1 else np.zeros_like(x)
    if mode == "align_corners":
        return x * (in_size - 1) / (out_size - 1) if out_size > 1 else np.zeros_like(x)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_half_pixel_for_nearest":
        return (x + 0.5) / scale
    raise NotLowerable(f"coordinate_transformation_mode={mode!r}")


def nearest_indices(coordinates: np.ndarray, in_size: int, mode: str) -> np.ndarray:
    """Round input coordinates to indices with the ONNX nearest_mode, clamped to the input."""
    if mode == "round_prefer_floor":
        index = np.ceil(coordinates - 0.5)
    elif mode == "round_prefer_ceil":
        index = np.floor(coordinates + 0.5)
    elif mode == "floor":
        index = np.floor(coordinates)
    else:
        index = np.ceil(coordinates)
    return np.clip(index, 0, in_size - 1).astype(np.int64)


def linear_taps(coordinates: np.ndarray, in_size: int) -> tuple[np.ndarray, ...]:
    """(x0, x1, w0, w1) per output index: neighbours and 10-bit fixed-point weights."""
    clamped = np.clip(coordinates, 0.0, in_size - 1)
    x0 = np.floor(clamped).astype(np.int64)
    x1 = np.minimum(x0 + 1, in_size - 1)
    w1 = np.floor((clamped - x0) * WEIGHT_ONE + 0.5).astype(np.int64)
    return x0, x1, WEIGHT_ONE - w1, w1


@dataclass(frozen=True, eq=False)
class ResizeKernel:
    """Integer Resize; `scales`/`sizes` are the constant Resize inputs (one of them set)."""

    mode: str
    coordinate_mode: str
    nearest_mode: str
    scales: tuple[float, ...] | None
    sizes: tuple[int, ...] | None
    axes: tuple[int, ...] | None
    input_zero_point: int
    rescale: Rescale
    linear_stages: dict[int, OutputStage]

    def _geometry(self, shape: tuple[int, ...]) -> list[tuple[int, int, int, float]]:
        """(axis, in size, out size, scale) of every axis that changes size."""
        axes = [a % len(shape) for a in self.axes] if self.axes else list(range(len(shape)))
        resized = []
        for i, axis in enumerate(axes):
            in_size = shape[axis]
            if self.sizes is not None:
                out_size = self.sizes[i]
                scale = out_size / in_size
            else:
                scale = self.scales[i]
                out_size = int(np.floor(in_size * scale))
            if out_size != in_size or scale != 1.0:
                resized.append((axis, in_size, out_size, scale))
        return resized

    def __call__(self, x: np.ndarray) -> np.ndarray:
        resized = self._geometry(x.shape)
        if self.mode == "nearest":
            for axis, in_size, out_size, scale in resized:
                coordinates = input_coordinates(out_size, in_size, scale, self.coordinate_mode)
                x = np.take(x, nearest_indices(coordinates, in_size, self.nearest_mode), axis=axis)
            return self.rescale(x)
        acc = x.astype(np.int64) - self.input_zero_point
        for axis, in_size, out_size, scale in resized:
            coordinates = input_coordinates(out_size, in_size, scale, self.coordinate_mode)
            x0, x1, w0, w1 = linear_taps(coordinates, in_size)
            shape = [1] * acc.ndim
            shape[axis] = out_size
            acc = np.take(acc, x0, axis=axis) * w0.reshape(shape) + np.take(
                acc, x1, axis=axis
            ) * w1.reshape(shape)
        if len(resized) not in self.linear_stages:
            raise NotLowerable(
                f"linear Resize over {len(resized)} axes overflows the int32 accumulator"
            )
        return self.linear_stages[len(resized)](acc)


def lower_resize(ctx: OpContext) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    output = ctx.output(0)
    mode = ctx.attr("mode", "nearest")
    coordinate_mode = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if ctx.opset < 11:
        coordinate_mode = "asymmetric"
    nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear"):
        raise NotLowerable(f"Resize mode {mode!r}")
    if coordinate_mode not in _COORDINATE_MODES or nearest_mode not in _NEAREST_MODES:
        raise NotLowerable(f"Resize with {coordinate_mode} / {nearest_mode}")
    if ctx.attr("antialias", 0) or ctx.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        raise NotLowerable("Resize with antialias or a keep_aspect_ratio_policy")
    scales_index, sizes_index = (1, None) if ctx.opset < 11 else (2, 3)
    scales = ctx.constant(scales_index)
    sizes = ctx.ints(sizes_index) if sizes_index is not None else None
    if (scales is None or scales.size == 0) and not sizes:
        raise NotLowerable("Resize needs constant scales or sizes")
    bits = max(x.params.bits, output.bits)
    linear_stages = {}
    if mode == "linear":
        max_axes = (31 - bits) // WEIGHT_BITS
        for count in range(max_axes + 1):
            real = x_scale / (output.scalar_scale() * 2.0 ** (WEIGHT_BITS * count))
            linear_stages[count] = OutputStage.build(real, output, ctx.mode)
    kernel = ResizeKernel(
        mode=mode,
        coordinate_mode=coordinate_mode,
        nearest_mode=nearest_mode,
        scales=tuple(float(s) for s in scales.reshape(-1)) if not sizes else None,
        sizes=tuple(sizes) if sizes else None,
        axes=tuple(ctx.attr("axes")) if ctx.attr("axes") else None,
        input_zero_point=x_zero_point,
        rescale=Rescale.build(x.params, output, ctx.mode),
        linear_stages=linear_stages,
    )
    return Lowered(kernel, (x.name,))


LOWERINGS = {"Resize": lower_resize}
