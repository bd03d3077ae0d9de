"""GridSample on the MLA's bf16 sampling unit (the GRID_SAMPLE_BF16 instruction).

Modalix runs GridSample on its MLA in bf16 only, so the quantizer wraps it in Cast pairs to
bfloat16 (DequantizeLinear -> Cast(bf16) -> Cast(float) on the image and the grid, Cast(bf16)
-> Cast(float) -> QuantizeLinear after it). The unit reads the integer codes of both, rounds them
to bf16 exactly as those Casts do, samples in float32 in ONNX Runtime's order and rounds the
result to bf16 before quantizing it (`compiler.intmath.bf16_grid_sample`, the one definition the
emulator also runs). A GridSample read straight from DequantizeLinear nodes (no Casts) runs on
the same unit, as RMSNormalization runs on the fp16 one: there is no integer form.

Supported: 4-D input, mode bilinear / linear and nearest, padding_mode zeros, border and
reflection, align_corners 0 / 1. Bicubic stays on the host (NotLowerable).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compiler.intmath import GRID_PADDING_MODES, bf16_grid_sample
from compiler.runtime.ops.base import Lowered, OpContext
from compiler.runtime.qparams import NotLowerable

_MODE_NAMES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest"}
"""ONNX mode names (opset 16: bilinear / bicubic, opset 20: linear / cubic) -> the unit's."""


@dataclass(frozen=True, eq=False)
class GridSampleKernel:
    """y = quantize(bf16(sample(bf16(dequantize(x)), bf16(dequantize(grid))))), see
    `compiler.intmath.bf16_grid_sample`; scales are the float32 values of the model."""

    mode: str
    padding: str
    align_corners: bool
    input_zero_point: int
    input_scale: np.float32
    grid_zero_point: int
    grid_scale: np.float32
    output_scale: np.float32
    zero_point: int
    low: int
    high: int
    dtype: np.dtype

    def __call__(self, x: np.ndarray, grid: np.ndarray) -> np.ndarray:
        if np.ndim(x) != 4 or np.ndim(grid) != 4 or np.shape(grid)[-1] != 2:
            raise ValueError(
                f"GridSample on the bf16 unit takes a 4-D image and an (N, H, W, 2) grid, not "
                f"{np.shape(x)} and {np.shape(grid)}"
            )
        return bf16_grid_sample(
            x,
            grid,
            mode=self.mode,
            padding=self.padding,
            align_corners=self.align_corners,
            input_zero_point=self.input_zero_point,
            input_scale=self.input_scale,
            grid_zero_point=self.grid_zero_point,
            grid_scale=self.grid_scale,
            output_scale=self.output_scale,
            output_zero_point=self.zero_point,
            low=self.low,
            high=self.high,
            dtype=self.dtype,
        )


def _sampling(ctx: OpContext) -> tuple[str, str, bool]:
    """(mode, padding, align_corners), or NotLowerable for what the unit does not do."""
    mode = str(ctx.attr("mode", "bilinear" if ctx.opset < 20 else "linear"))
    if mode not in _MODE_NAMES:
        raise NotLowerable(f"GridSample mode {mode!r}: the MLA samples nearest or bilinear only")
    padding = str(ctx.attr("padding_mode", "zeros"))
    if padding not in GRID_PADDING_MODES:
        raise NotLowerable(f"GridSample padding_mode {padding!r}")
    return _MODE_NAMES[mode], padding, bool(ctx.attr("align_corners", 0))


def lower_grid_sample(ctx: OpContext) -> Lowered:
    """GridSample(X, grid) with both inputs integer codes behind DequantizeLinear nodes (read
    through their bf16 Casts when the quantizer wrote them)."""
    mode, padding, align_corners = _sampling(ctx)
    x, x_scale, x_zero_point = ctx.activation_input(0)
    grid, grid_scale, grid_zero_point = ctx.activation_input(1)
    if max(x.params.bits, grid.params.bits) > 16:
        raise NotLowerable("the bf16 sampling unit reads 8- or 16-bit codes")
    output = ctx.output(0)
    low, high = output.bounds
    kernel = GridSampleKernel(
        mode=mode,
        padding=padding,
        align_corners=align_corners,
        input_zero_point=x_zero_point,
        input_scale=np.float32(x_scale),
        grid_zero_point=grid_zero_point,
        grid_scale=np.float32(grid_scale),
        output_scale=np.float32(output.scalar_scale()),
        zero_point=output.scalar_zero_point(),
        low=low,
        high=high,
        dtype=np.dtype(output.dtype),
    )
    return Lowered(kernel, (x.name, grid.name))


LOWERINGS = {"GridSample": lower_grid_sample}

BF16_LOWERINGS = {"GridSample": lower_grid_sample}
"""Lowerings of the ops the QDQ model runs in bf16 (Cast pairs to bfloat16 around them)."""
