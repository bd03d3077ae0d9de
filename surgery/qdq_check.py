"""QuantizeLinear / DequantizeLinear nodes checked against what ONNX Runtime accepts: a scale
that is positive and finite, a zero point of an integer type and of the scale's shape, one
per-axis scale per element of the quantized axis, a DequantizeLinear of integer codes.

Shapes of one element count as a scalar (ORT's quantizer writes a [1] scale beside a scalar
zero point, which ONNX Runtime runs). The compiler turns every scale into an integer multiplier and every per-axis scale into a
broadcast: a zero or NaN scale, or 17 scales for 16 channels, failed there in numpy. Checked
once when compiling, so the error names the node and what is wrong with it.
"""

from __future__ import annotations

import numpy as np

from surgery.errors import InvalidGraphError
from surgery.graph import FLOAT_TYPES, GraphView

_QUANTIZE, _DEQUANTIZE = "QuantizeLinear", "DequantizeLinear"
_MAX_SCALES = 2**20
"""Scales are read up to this many values (one per channel of even the widest layers)."""


def raise_malformed_qdq(view: GraphView, label: str = "model") -> None:
    """InvalidGraphError for the first QuantizeLinear or DequantizeLinear whose parameters
    ONNX Runtime would refuse (scales computed at run time are not judged here)."""
    for op in (_QUANTIZE, _DEQUANTIZE):
        for idx in view.nodes_by_op.get(op, ()):
            if view.domains[idx] not in ("", "ai.onnx"):
                continue
            problem = qdq_problem(view, idx)
            if problem:
                raise InvalidGraphError(
                    f"{label}: node {view.names[idx]!r} ({op}): {problem}",
                    hint="ONNX Runtime cannot run it either: quantize the model again",
                )


def qdq_problem(view: GraphView, idx: int) -> str | None:
    """What is wrong with one Q/DQ node's parameters, or None."""
    ins = view.node_inputs[idx]
    if len(ins) < 2 or not ins[1]:
        return None  # the schema's input count is checked on load
    x = view.tensor(ins[0]) if ins[0] else None
    codes_in = view.op_types[idx] == _DEQUANTIZE
    if x is not None and x.elem_type:
        if codes_in and x.elem_type in FLOAT_TYPES:
            return f"its input {x.name!r} is {x.dtype}: it dequantizes integer codes"
        if not codes_in and x.elem_type not in FLOAT_TYPES:
            return f"its input {x.name!r} is {x.dtype}: it quantizes floating-point values"
    declared = view.tensor(ins[1])
    if declared.rank is not None and declared.rank > 1 and not _attr(view, idx, "block_size"):
        return (
            f"its scale {ins[1]!r} has rank {declared.rank}: a scale is a scalar or a 1-D "
            "tensor (one per element of the quantized axis)"
        )
    scale = view.constant_value(ins[1], _MAX_SCALES)
    if scale is None:
        return None
    if scale.dtype.kind != "f":
        return f"its scale {ins[1]!r} is {scale.dtype}, not floating-point"
    bad = scale[~(np.isfinite(scale) & (scale > 0))]
    if bad.size:
        return f"its scale {ins[1]!r} holds {bad.flat[0]}: scales must be positive and finite"
    zero_point = view.constant_value(ins[2], _MAX_SCALES) if len(ins) > 2 and ins[2] else None
    if zero_point is not None:
        if zero_point.dtype.kind not in "iu":
            return f"its zero point {ins[2]!r} is {zero_point.dtype}, not an integer type"
        if zero_point.size != scale.size:  # [] against [1] is what ORT's quantizer writes
            return (
                f"its zero point {ins[2]!r} has {zero_point.size} value(s), its scale "
                f"{scale.size}: they must match"
            )
    if scale.size > 1 and scale.ndim == 1 and not _attr(view, idx, "block_size"):
        return _per_axis_problem(view, idx, x, scale.size)
    return None


def _per_axis_problem(view: GraphView, idx: int, x, scales: int) -> str | None:
    if x is None or x.rank is None:
        return None
    axis = _attr(view, idx, "axis")
    axis = 1 if axis is None else axis
    if not -x.rank <= axis < x.rank:
        return f"axis {axis} is out of range for its rank-{x.rank} input {x.name!r}"
    size = x.shape[axis]
    if isinstance(size, int) and size != scales:
        return (
            f"it has {scales} per-axis scales for the {size} elements of axis {axis} of {x.name!r}"
        )
    return None


def _attr(view: GraphView, idx: int, name: str) -> int | None:
    for a in view.nodes[idx].attribute:
        if a.name == name:
            return a.i
    return None
