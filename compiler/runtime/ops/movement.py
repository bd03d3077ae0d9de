"""Data movement on integer tensors: exact, with a rescale only when quantizations differ.

Each op moves the integer codes exactly as ONNX moves floats (the functions below mirror the
ONNX operator definitions). When the output QuantizeLinear has the same scale, zero point and
type as the input DequantizeLinear nothing else happens; otherwise every element is rescaled
with `Rescale` (requantize (q - z_in) by s_in / s_out, add z_out, saturate). Concat rescales each
input to the output quantization; Pad fills with the input zero point (real 0) or the constant
value quantized with the input's parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from compiler.intmath import (
    RequantizationMode,
    apply_lut,
    bf16_requantize_table,
    quantize_constant,
)
from compiler.runtime.ops.base import Lowered, OpContext, Rescale
from compiler.runtime.qparams import NotLowerable, QuantOperand, QuantParams

Move = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, eq=False)
class MoveKernel:
    """One input, one output: move the codes, then rescale (identity when params are equal)."""

    move: Move
    rescale: Rescale

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.rescale(self.move(x))


@dataclass(frozen=True, eq=False)
class TabulatedMoveKernel:
    """One input, one output: move the codes, then look each one up in `table` (index = code -
    min of `input_dtype`). Data movement on a narrow-float unit, whose round trip through that
    float format is a per-code function (`compiler.intmath.bf16_requantize_table`)."""

    move: Move
    table: np.ndarray
    input_dtype: np.dtype

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return apply_lut(self.table, self.move(x), self.input_dtype)


def reshape(x: np.ndarray, shape: list[int], allowzero: bool) -> np.ndarray:
    """ONNX Reshape: 0 copies the input dimension (unless allowzero), -1 is inferred."""
    target = [x.shape[i] if s == 0 and not allowzero else s for i, s in enumerate(shape)]
    return x.reshape(target)


def flatten(x: np.ndarray, axis: int) -> np.ndarray:
    axis = axis % x.ndim if x.ndim else 0
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def squeeze(x: np.ndarray, axes: list[int] | None) -> np.ndarray:
    if axes is None:
        return np.squeeze(x)
    return np.squeeze(x, axis=tuple(a % x.ndim for a in axes))


def unsqueeze(x: np.ndarray, axes: list[int]) -> np.ndarray:
    rank = x.ndim + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = np.expand_dims(x, axis)
    return x


def transpose(x: np.ndarray, perm: list[int] | None) -> np.ndarray:
    return np.transpose(x, perm)


def slice_axes(
    x: np.ndarray,
    starts: list[int],
    ends: list[int],
    axes: list[int] | None,
    steps: list[int] | None,
) -> np.ndarray:
    """ONNX Slice: negative indices count from the end, then clamp to the valid range.

    For positive steps starts/ends clamp to [0, dim]; for negative steps to [-1, dim - 1]
    (where -1 means "before the first element").
    """
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= x.ndim
        dim = x.shape[axis]
        low, high = (0, dim) if step > 0 else (-1, dim - 1)
        start = min(max(start + dim if start < 0 else start, low), high)
        end = min(max(end + dim if end < 0 else end, low), high)
        x = np.take(x, np.arange(start, end, step, dtype=np.int64), axis=axis)
    return x


def gather(x: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
    return np.take(x, indices, axis=axis)


def depth_to_space(x: np.ndarray, blocksize: int, mode: str) -> np.ndarray:
    batch, channels, height, width = x.shape
    depth = channels // (blocksize * blocksize)
    if mode == "DCR":
        blocks = x.reshape(batch, blocksize, blocksize, depth, height, width)
        blocks = blocks.transpose(0, 3, 4, 1, 5, 2)
    else:
        blocks = x.reshape(batch, depth, blocksize, blocksize, height, width)
        blocks = blocks.transpose(0, 1, 4, 2, 5, 3)
    return blocks.reshape(batch, depth, height * blocksize, width * blocksize)


def space_to_depth(x: np.ndarray, blocksize: int) -> np.ndarray:
    batch, channels, height, width = x.shape
    blocks = x.reshape(
        batch, channels, height // blocksize, blocksize, width // blocksize, blocksize
    )
    blocks = blocks.transpose(0, 3, 5, 1, 2, 4)
    return blocks.reshape(
        batch, channels * blocksize * blocksize, height // blocksize, width // blocksize
    )


def expand(x: np.ndarray, shape: list[int]) -> np.ndarray:
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(shape))).copy()


def tile(x: np.ndarray, repeats: list[int]) -> np.ndarray:
    return np.tile(x, repeats)


def pad(
    x: np.ndarray, pads: list[int], axes: list[int] | None, mode: str, value: int
) -> np.ndarray:
    """ONNX Pad; negative pads crop."""
    axes = [a % x.ndim for a in axes] if axes is not None else list(range(x.ndim))
    count = len(axes)
    widths = [(0, 0)] * x.ndim
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + count])
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    if mode == "constant":
        x = np.pad(x, grow, mode="constant", constant_values=value)
    else:
        x = np.pad(x, grow, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])
    crop = tuple(slice(-min(b, 0), x.shape[i] + min(e, 0)) for i, (b, e) in enumerate(widths))
    return x[crop]


def _data(ctx: OpContext) -> QuantOperand:
    data = ctx.quant(0)
    data.params.scalar_scale()
    return data


def _move(ctx: OpContext, move: Move) -> Lowered:
    data = _data(ctx)
    return Lowered(
        MoveKernel(move, Rescale.build(data.params, ctx.output(0), ctx.mode)), (data.name,)
    )


def _required(values: list[int] | None, what: str) -> list[int]:
    if values is None:
        raise NotLowerable(f"{what} must be a constant")
    return values


def lower_identity(ctx: OpContext) -> Lowered:
    return _move(ctx, lambda x: x)


def lower_dropout(ctx: OpContext) -> Lowered:
    """Inference-mode Dropout passes its input through (the mask output must be unused, as the
    target profiles require for the MLA)."""
    training = ctx.constant(2) if len(ctx.node.input) > 2 and ctx.node.input[2] else None
    if training is not None and bool(np.asarray(training).reshape(-1)[0]):
        raise NotLowerable("Dropout in training mode is random")
    if len(ctx.node.output) > 1 and ctx.node.output[1]:
        raise NotLowerable("Dropout's mask output has no integer form")
    return lower_identity(ctx)


def lower_reshape(ctx: OpContext) -> Lowered:
    shape = _required(ctx.ints(1, "shape"), "the Reshape shape")
    return _move(ctx, partial(reshape, shape=shape, allowzero=bool(ctx.attr("allowzero", 0))))


def lower_flatten(ctx: OpContext) -> Lowered:
    return _move(ctx, partial(flatten, axis=int(ctx.attr("axis", 1))))


def lower_squeeze(ctx: OpContext) -> Lowered:
    axes = ctx.ints(1) if ctx.opset >= 13 else ctx.attr("axes")
    return _move(ctx, partial(squeeze, axes=axes))


def lower_unsqueeze(ctx: OpContext) -> Lowered:
    axes = ctx.ints(1) if ctx.opset >= 13 else ctx.attr("axes")
    return _move(ctx, partial(unsqueeze, axes=_required(axes, "the Unsqueeze axes")))


def lower_transpose(ctx: OpContext) -> Lowered:
    return _move(ctx, partial(transpose, perm=ctx.attr("perm")))


def lower_slice(ctx: OpContext) -> Lowered:
    if ctx.opset >= 10:
        starts, ends = ctx.ints(1), ctx.ints(2)
        axes, steps = ctx.ints(3), ctx.ints(4)
    else:
        starts, ends = ctx.attr("starts"), ctx.attr("ends")
        axes, steps = ctx.attr("axes"), None
    move = partial(
        slice_axes,
        starts=_required(starts, "Slice starts"),
        ends=_required(ends, "Slice ends"),
        axes=axes,
        steps=steps,
    )
    return _move(ctx, move)


def lower_gather(ctx: OpContext) -> Lowered:
    indices = ctx.input(1)
    if isinstance(indices, QuantOperand) or indices is None:
        raise NotLowerable("Gather indices must be a constant integer tensor")
    return _move(
        ctx, partial(gather, indices=indices.value.astype(np.int64), axis=int(ctx.attr("axis", 0)))
    )


def lower_gather_bf16(ctx: OpContext) -> Lowered:
    """Gather on the bf16 unit (modalix runs Gather in bf16 only): the QDQ model's
    DequantizeLinear -> Cast(bf16) -> Gather -> Cast(bf16) -> QuantizeLinear, i.e. the gathered
    codes mapped through QuantizeLinear(bf16(DequantizeLinear(q)))."""
    indices = ctx.input(1)
    if isinstance(indices, QuantOperand) or indices is None:
        raise NotLowerable("Gather indices must be a constant integer tensor")
    data, scale, zero_point = ctx.activation_input(0)
    if data.params.bits > 16:
        raise NotLowerable("the bf16 unit reads 8- or 16-bit codes")
    output = ctx.output(0)
    table = bf16_requantize_table(
        data.params.dtype,
        zero_point,
        np.float32(scale),
        np.float32(output.scalar_scale()),
        output.scalar_zero_point(),
        output.dtype,
    )
    move = partial(gather, indices=indices.value.astype(np.int64), axis=int(ctx.attr("axis", 0)))
    return Lowered(TabulatedMoveKernel(move, table, np.dtype(data.params.dtype)), (data.name,))


def lower_depth_to_space(ctx: OpContext) -> Lowered:
    move = partial(
        depth_to_space, blocksize=int(ctx.attr("blocksize")), mode=ctx.attr("mode", "DCR")
    )
    return _move(ctx, move)


def lower_space_to_depth(ctx: OpContext) -> Lowered:
    return _move(ctx, partial(space_to_depth, blocksize=int(ctx.attr("blocksize"))))


def lower_expand(ctx: OpContext) -> Lowered:
    return _move(ctx, partial(expand, shape=_required(ctx.ints(1), "the Expand shape")))


def lower_tile(ctx: OpContext) -> Lowered:
    return _move(ctx, partial(tile, repeats=_required(ctx.ints(1), "Tile repeats")))


def lower_pad(ctx: OpContext) -> Lowered:
    data = _data(ctx)
    params = data.params
    if ctx.opset >= 11:
        pads = ctx.ints(1)
        value = ctx.constant(2)
        axes = ctx.ints(3)
    else:
        pads, value, axes = ctx.attr("pads"), ctx.attr("value", 0.0), None
    real_value = 0.0 if value is None else float(np.asarray(value).reshape(-1)[0])
    code = int(
        quantize_constant(
            real_value, params.scalar_scale(), params.scalar_zero_point(), params.dtype
        )
    )
    mode = ctx.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise NotLowerable(f"Pad mode {mode!r}")
    move = partial(pad, pads=_required(pads, "Pad pads"), axes=axes, mode=mode, value=code)
    return _move(ctx, move)


@dataclass(frozen=True, eq=False)
class ConcatKernel:
    """Rescale every input to the output quantization, then concatenate."""

    axis: int
    rescales: tuple[Rescale, ...]

    def __call__(self, *inputs: np.ndarray) -> np.ndarray:
        parts = [rescale(x) for rescale, x in zip(self.rescales, inputs, strict=True)]
        return np.concatenate(parts, axis=self.axis)


def lower_concat(ctx: OpContext) -> Lowered:
    output = ctx.output(0)
    operands = [ctx.quant(i) for i in range(len(ctx.node.input))]
    rescales = tuple(Rescale.build(op.params, output, ctx.mode) for op in operands)
    kernel = ConcatKernel(int(ctx.attr("axis")), rescales)
    return Lowered(kernel, tuple(op.name for op in operands))


@dataclass(frozen=True, eq=False)
class SplitKernel:
    """Split along `axis` into the given sizes, rescaling each part to its own output."""

    axis: int
    sizes: tuple[int, ...] | None
    rescales: tuple[Rescale, ...]

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        count = len(self.rescales)
        sizes = self.sizes
        if sizes is None:
            chunk = -(-x.shape[self.axis] // count)
            sizes = tuple(min(chunk, x.shape[self.axis] - i * chunk) for i in range(count))
        parts = np.split(x, np.cumsum(sizes)[:-1], axis=self.axis)
        return tuple(rescale(part) for rescale, part in zip(self.rescales, parts, strict=True))


def lower_split(ctx: OpContext) -> Lowered:
    data = _data(ctx)
    sizes = ctx.ints(1) if ctx.opset >= 13 else ctx.attr("split")
    rescales = tuple(
        Rescale.build(data.params, ctx.output(i), ctx.mode) for i in range(len(ctx.node.output))
    )
    kernel = SplitKernel(int(ctx.attr("axis", 0)), tuple(sizes) if sizes else None, rescales)
    return Lowered(kernel, (data.name,))


def lower_requantize(
    source: QuantOperand, target: QuantParams, mode: RequantizationMode
) -> Lowered:
    """A DequantizeLinear feeding a QuantizeLinear directly: a pure rescale."""
    return Lowered(Rescale.build(source.params, target, mode), (source.name,))


LOWERINGS = {
    "Identity": lower_identity,
    "Dropout": lower_dropout,
    "Reshape": lower_reshape,
    "Flatten": lower_flatten,
    "Squeeze": lower_squeeze,
    "Unsqueeze": lower_unsqueeze,
    "Transpose": lower_transpose,
    "Slice": lower_slice,
    "Gather": lower_gather,
    "DepthToSpace": lower_depth_to_space,
    "SpaceToDepth": lower_space_to_depth,
    "Expand": lower_expand,
    "Tile": lower_tile,
    "Pad": lower_pad,
    "Concat": lower_concat,
    "Split": lower_split,
}

BF16_LOWERINGS = {"Gather": lower_gather_bf16}
"""Data movement the QDQ model runs in bf16 (Cast pairs to bfloat16 around it)."""
