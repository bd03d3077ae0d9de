"""onnx.reference kernels replaced where onnx's own fails on real models (float host stages).

`GatherElements` in onnx.reference gathers with `np.choose`, which takes at most 64 choices: a
YOLOv10-style head gathering rows of 8400 anchors raises ValueError. `np.take_along_axis` is
the same operation without the limit.

`GridSample` in onnx.reference implements opset 20 only, whose modes are linear / nearest /
cubic; an opset 16–19 GridSample (RT-DETR's deformable attention, exported at opset 16) says
bilinear / bicubic and raised RuntimeError. The old names are mapped to the new ones, which
compute the same thing, and 2-D samplings run on whole arrays in ONNX Runtime's float32 order
(onnx's per-element Python loop took minutes on RT-DETR's decoder).
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun
from onnx.reference.ops.op_grid_sample import GridSample as _GridSample20


class GatherElements(OpRun):
    """ONNX GatherElements: out[i][j][k] = data[index[i][j][k]][j][k] (along `axis`);
    negative indices count from the end."""

    op_domain = ""

    def _run(
        self, data: np.ndarray, indices: np.ndarray, axis: int | None = None
    ) -> tuple[np.ndarray]:
        axis = 0 if axis is None else int(axis)
        data = np.asarray(data)
        indices = np.asarray(indices, dtype=np.int64)
        indices = np.where(indices < 0, indices + data.shape[axis], indices)
        return (np.take_along_axis(data, indices, axis=axis),)


_OPSET16_MODES = {"bilinear": "linear", "bicubic": "cubic"}
"""GridSample's interpolation modes before opset 20, by their opset 20 names."""


class GridSample(_GridSample20):
    """ONNX GridSample of any opset: the opset 16 mode names (bilinear, bicubic) as well.

    A 2-D sampling (4-D image) in linear or nearest mode with zeros or border padding is
    computed on whole arrays in float32 in the order ONNX Runtime's CPU kernel computes it:
    bit for bit the same as ONNX Runtime 1.32 for nearest and for linear with zeros padding
    and align_corners=0 (RT-DETR's deformable attention), within float rounding otherwise.
    onnx.reference's own kernel loops over every output element in Python (minutes for
    RT-DETR's decoder) and is kept for the other modes and ranks.
    """

    op_domain = ""

    def _run(self, X, grid, mode=None, padding_mode=None, align_corners=None):  # noqa: N803
        mode = _OPSET16_MODES.get(mode or self.mode, mode or self.mode)
        padding_mode = padding_mode or self.padding_mode
        align_corners = bool(align_corners or self.align_corners)
        if (
            np.ndim(X) == 4
            and np.ndim(grid) == 4
            and np.asarray(X).dtype == np.float32
            and mode in ("linear", "nearest")
            and padding_mode in ("zeros", "border")
        ):
            return (_grid_sample_2d(X, grid, mode, padding_mode, align_corners),)
        return super()._run(X, grid, mode, padding_mode, align_corners)


def _grid_sample_2d(
    image: np.ndarray, grid: np.ndarray, mode: str, padding: str, align_corners: bool
) -> np.ndarray:
    """GridSample of [N, C, H, W] at [N, Ho, Wo, 2] (x, y) in [-1, 1] in float32: the four
    corner weights first, then Σ pixel·weight in corner order (ONNX Runtime's CPU kernel)."""
    image = np.asarray(image, np.float32)
    grid = np.asarray(grid, np.float32)
    n, c, h, w = image.shape
    one, half = np.float32(1), np.float32(2)

    def denormalize(v: np.ndarray, length: int) -> np.ndarray:
        if align_corners:
            return (v + one) / half * np.float32(length - 1)
        return ((v + one) * np.float32(length) - one) / half

    x = denormalize(grid[..., 0], w)
    y = denormalize(grid[..., 1], h)
    if padding == "border":
        if align_corners:
            lo_x = lo_y = np.float32(0)
            hi_x, hi_y = np.float32(w - 1), np.float32(h - 1)
        else:
            lo_x = lo_y = np.float32(-0.5)
            hi_x, hi_y = np.float32(w - 0.5), np.float32(h - 0.5)
        outside = (x < lo_x) | (x > hi_x) | (y < lo_y) | (y > hi_y)
        x = np.where(outside, np.clip(x, 0, w - 1), x).astype(np.float32)
        y = np.where(outside, np.clip(y, 0, h - 1), y).astype(np.float32)
    batch = np.arange(n)[:, None, None]

    def pixels(rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """[N, C, Ho, Wo]: the image at integer (row, col), zeros or border outside."""
        inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
        r, q = np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)
        values = image[batch, :, r, q]  # [N, Ho, Wo, C]
        if padding == "zeros":
            values = np.where(inside[..., None], values, np.float32(0))
        return np.moveaxis(values, -1, 1)

    if mode == "nearest":
        return pixels(np.rint(y).astype(np.int64), np.rint(x).astype(np.int64))
    x1, y1 = np.floor(x).astype(np.int64), np.floor(y).astype(np.int64)
    x2, y2 = x1 + 1, y1 + 1
    dx2 = (x2.astype(np.float32) - x)[:, None]
    dx1 = (x - x1.astype(np.float32))[:, None]
    dy2 = (y2.astype(np.float32) - y)[:, None]
    dy1 = (y - y1.astype(np.float32))[:, None]
    p11, p12 = pixels(y1, x1), pixels(y1, x2)
    p21, p22 = pixels(y2, x1), pixels(y2, x2)
    return p11 * (dx2 * dy2) + p12 * (dx1 * dy2) + p21 * (dx2 * dy1) + p22 * (dx1 * dy1)


FLOAT_OP_OVERRIDES: tuple[type[OpRun], ...] = (GatherElements, GridSample)
"""Passed as `new_ops` to every ReferenceEvaluator that runs a float stage."""
