"""Sliding-window geometry shared by Conv and the pools: padding, output sizes, windows."""

from __future__ import annotations

import math

import numpy as np

from compiler.runtime.ops.base import OpContext
from compiler.runtime.qparams import NotLowerable


def resolve_pads(
    spatial: tuple[int, ...],
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
    pads: list[int] | None,
    auto_pad: str,
    *,
    ceil_mode: bool = False,
    overhang: bool = False,
) -> tuple[list[int], list[int]]:
    """(begin, end) padding per spatial axis, following the ONNX Conv/Pool rules.

    SAME_UPPER / SAME_LOWER give ceil(size / stride) outputs, with the odd padding element at the
    end (UPPER) or the beginning (LOWER); VALID pads nothing; NOTSET uses `pads`. With ceil_mode
    the end padding grows so the last (partial) window exists, unless that window would start
    in the end padding (the rule PyTorch and ONNX Runtime use). With `overhang` (the pools), a
    window longer than the padded input by less than a stride still gives one output, as onnx's
    shape inference and ONNX Runtime compute it (their integer division truncates the negative
    span to 0), over the part of the window that exists: the end padding grows to hold it.
    """
    rank = len(spatial)
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, extent, stride in zip(spatial, extents, strides, strict=True):
            total = max((math.ceil(size / stride) - 1) * stride + extent - size, 0)
            small, large = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else large)
            end.append(large if auto_pad == "SAME_UPPER" else small)
    elif auto_pad == "VALID":
        begin, end = [0] * rank, [0] * rank
    elif auto_pad in ("NOTSET", ""):
        pads = pads or [0] * (2 * rank)
        begin, end = list(pads[:rank]), list(pads[rank:])
    else:
        raise NotLowerable(f"auto_pad={auto_pad!r}")
    if ceil_mode:
        for axis, (size, extent, stride) in enumerate(zip(spatial, extents, strides, strict=True)):
            span = size + begin[axis] + end[axis] - extent
            count = -(-span // stride) + 1
            if (count - 1) * stride >= size + begin[axis]:
                count -= 1
            end[axis] += max((count - 1) * stride + extent - (size + begin[axis] + end[axis]), 0)
    elif overhang:
        for axis, (size, extent, stride) in enumerate(zip(spatial, extents, strides, strict=True)):
            short = extent - (size + begin[axis] + end[axis])
            if 0 < short < stride:
                end[axis] += short
    return begin, end


def pad_spatial(x: np.ndarray, begin: list[int], end: list[int], value: int) -> np.ndarray:
    """Pad the spatial axes (2 and up) of an N, C, *spatial tensor with a constant."""
    widths = [(0, 0), (0, 0)] + list(zip(begin, end, strict=True))
    return np.pad(x, widths, mode="constant", constant_values=value)


def windows(
    padded: np.ndarray,
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    dilations: tuple[int, ...],
) -> np.ndarray:
    """View of every window: shape (N, C, *out, *kernel), dilation and stride applied."""
    rank = len(kernel)
    extents = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True))
    if any(e > s for e, s in zip(extents, padded.shape[2:], strict=True)):
        raise NotLowerable("the window is larger than the padded input")
    view = np.lib.stride_tricks.sliding_window_view(padded, extents, axis=tuple(range(2, 2 + rank)))
    index = (slice(None), slice(None))
    index += tuple(slice(None, None, s) for s in strides)
    index += tuple(slice(None, None, d) for d in dilations)
    return view[index]


def spatial_attributes(
    ctx: OpContext, rank: int, kernel: tuple[int, ...] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(kernel, strides, dilations) with the ONNX defaults of 1."""
    kernel = tuple(ctx.attr("kernel_shape") or kernel or ())
    if len(kernel) != rank:
        raise NotLowerable("kernel_shape does not match the input rank")
    strides = tuple(ctx.attr("strides") or [1] * rank)
    dilations = tuple(ctx.attr("dilations") or [1] * rank)
    return kernel, strides, dilations
