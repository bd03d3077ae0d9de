"""onnx.reference kernels replaced where onnx's own fails on real models (float host stages).

`GatherElements` in onnx.reference gathers with `np.choose`, which takes at most 64 choices: a
YOLOv10-style head gathering rows of 8400 anchors raises ValueError. `np.take_along_axis` is
the same operation without the limit.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun


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


FLOAT_OP_OVERRIDES: tuple[type[OpRun], ...] = (GatherElements,)
"""Passed as `new_ops` to every ReferenceEvaluator that runs a float stage."""
