"""Per-op support for lifting to 4-D: what `find` admits and how `Lifter` rewrites each op.

Each op family has an `accept` (read-only, on the shape-inferred model: may this node be
lifted exactly?) and a handler (on the graphsurgeon graph: emit the 4-D op). Keeping both side
by side keeps `find`'s promises and `apply`'s edits in step.

Ops fall in three groups:

- **layout-free** (elementwise, Concat, Split, Slice, Softmax, Layer/RMSNormalization, Reduce*):
  the same op on the 4-D form, with its axis attributes and constant operands re-laid-out;
- **relabels** (Transpose, Identity, Dropout, reshapes that only add or drop unit axes): no op
  at all — the 4-D data is already right, only the layout changes;
- **re-expressed** (Reshape/Flatten/Squeeze/Unsqueeze → one 4-D Reshape, Gather with a constant
  index → Slice, MatMul/Gemm by a constant matrix → 1×1 Conv, 1-D Conv/pooling → 2-D with a
  unit height).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from surgery.graph import FLOAT_TYPES, GraphView, attribute_values, default_opset
from surgery.rules import rank4_layout as L
from surgery.rules.rank4_layout import Layout, Shape
from surgery.rules.rank4_lift import HANDLERS, Lifted, Lifter, relayout_constant, static_dims
from surgery.rules.replace_einsum import plan_product
from surgery.rules.replace_pool import read_pad

MAX_NONUNIT = 4


class NodeInfo:
    """What `find` knows about one node: static shapes, constant operands, attributes."""

    def __init__(self, view: GraphView, idx: int, constants: frozenset[str], opset: int) -> None:
        self.view = view
        self.idx = idx
        self.constants = constants
        self.opset = opset
        self.op = view.op_types[idx]
        self.name = view.names[idx]
        self.inputs = view.node_inputs[idx]
        self.outputs = view.node_outputs[idx]

    @cached_property
    def attrs(self) -> dict[str, Any]:
        return attribute_values(self.view.nodes[self.idx])

    def input(self, k: int) -> str:
        return self.inputs[k] if k < len(self.inputs) else ""

    def shape(self, name: str) -> Shape | None:
        info = self.view.tensor(name)
        return info.shape if info.is_static else None  # static: a tuple of ints already

    def dims(self, name: str) -> Shape:
        """Static shape of a tensor `accept` already checked (ValueError otherwise)."""
        shape = self.shape(name)
        if shape is None:
            raise ValueError(f"tensor {name!r} has no static shape")
        return shape

    def is_const(self, name: str) -> bool:
        return name in self.constants

    def has_value(self, name: str) -> bool:
        """A constant whose value the edit can read (`GraphView.has_value`)."""
        return self.view.has_value(name)

    def value(self, name: str) -> np.ndarray | None:
        return self.view.constant_value(name) if name else None

    @property
    def data_inputs(self) -> list[str]:
        return [t for t in self.inputs if t and t not in self.constants]

    @property
    def used_outputs(self) -> list[str]:
        outs = set(self.view.graph_outputs)
        return [t for t in self.outputs if t and (t in self.view.consumers or t in outs)]

    def liftable(self, name: str) -> bool:
        """Static float tensor of rank ≥ 1 that fits 4-D: at most four non-unit dimensions, or
        the input/output of a Transpose that moves at most four blocks of axes."""
        info = self.view.tensor(name)
        if not info.is_static or not info.shape or info.elem_type not in FLOAT_TYPES:
            return False
        if sum(1 for d in info.shape if d != 1) <= MAX_NONUNIT:
            return True
        view = self.view
        users = view.consumers.get(name, [])
        if len(users) == 1 and _transpose_runs(view, users[0]):
            return True
        producer = view.producer.get(name)
        if producer is None:
            return False
        return _transpose_runs(view, producer) or broadcast_layout(view, producer) is not None

    def ranks(self) -> list[int]:
        return [len(self.shape(t) or ()) for t in [*self.data_inputs, *self.used_outputs]]


def broadcast_layout(view: GraphView, idx: int) -> Layout | None:
    """For a binary elementwise node whose result has more than four non-unit axes, the
    layout of `rank4_layout.broadcast_blocks` that carries it (and its operands) as 4-D."""
    if view.op_types[idx] not in BINARY:
        return None
    shapes = [view.tensor(t) for t in (*view.node_inputs[idx], view.node_outputs[idx][0])]
    if not all(t.is_static for t in shapes):
        return None
    *operands, out = (static_dims(t.shape) for t in shapes)
    if sum(1 for d in out if d != 1) <= MAX_NONUNIT:
        return None
    return L.broadcast_blocks(out, operands)


def _transpose_runs(view: GraphView, idx: int) -> bool:
    """A Transpose whose input moves as at most four blocks of axes (see `transpose_runs`)."""
    if view.op_types[idx] != "Transpose":
        return False
    perm = attribute_values(view.nodes[idx]).get("perm")
    info = view.tensor(view.node_inputs[idx][0])
    if perm is None or not info.is_static:
        return False
    return L.transpose_runs(static_dims(info.shape), perm) is not None


Accept = Callable[[NodeInfo], bool]


@dataclass(frozen=True)
class OpSupport:
    accept: Accept
    emits: str | None
    """The op that runs after lifting ("" when the op disappears, None when unchanged)."""


SUPPORT: dict[str, OpSupport] = {}


def supports(*ops: str, accept: Accept, emits: str | None = None):
    def register(fn):
        for op in ops:
            SUPPORT[op] = OpSupport(accept, emits)
            HANDLERS[op] = fn
        return fn

    return register


def _axis(value: int, rank: int) -> int:
    return value % rank if rank else 0


def _basic(info: NodeInfo, data: list[str] | None = None) -> bool:
    """Data tensors liftable and exactly the listed ones dynamic; other inputs readable constants."""
    data = info.data_inputs if data is None else data
    if not data or not all(info.liftable(t) for t in [*data, *info.used_outputs]):
        return False
    return all(info.has_value(t) for t in info.inputs if t and t not in data)


def _single_output(info: NodeInfo) -> bool:
    return info.used_outputs == [info.outputs[0]]


# ---------------------------------------------------------------------- elementwise

UNARY = (
    "Abs", "Ceil", "Celu", "Clip", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "LeakyRelu", "Log", "Mish", "Neg", "Reciprocal", "Relu", "Round", "Selu",
    "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt", "Tanh", "ThresholdedRelu",
)  # fmt: skip
BINARY = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "PRelu")


def _accept_elementwise(info: NodeInfo) -> bool:
    """Run-time operands of the output's shape, or of its rank and broadcasting against it
    (a per-head gate [1,h,1,H,W] times [1,h,c,H,W]) when every non-unit output axis can have
    a slot of its own, where the broadcast stays a 4-D broadcast."""
    if not _single_output(info) or not _basic(info):
        return False
    out = info.dims(info.outputs[0])
    shapes = [info.dims(t) for t in info.data_inputs]
    if all(s == out for s in shapes):
        return True
    carried = L.spread(out) is not None or broadcast_layout(info.view, info.idx) is not None
    return carried and all(_broadcasts_to(s, out) for s in shapes)


def _broadcasts_to(shape: Shape, out: Shape) -> bool:
    return len(shape) == len(out) and all(d in (1, o) for d, o in zip(shape, out, strict=True))


@supports(*UNARY, *BINARY, accept=_accept_elementwise)
def lift_elementwise(lf: Lifter, node: gs.Node) -> None:
    out = node.outputs[0]
    shape = lf.shape(out)
    dynamic = [lf.value(t) for t in node.inputs if t.name and lf.const(t) is None]
    blocks = None
    if L.spread(shape) is None:  # more than four non-unit axes
        blocks = L.broadcast_blocks(shape, [lf.shape(t) for t in node.inputs if t.name])
    layout = lf.choose(
        dynamic,
        shape,
        lambda c: all(c.broadcasts(x.shape, shape) for x in dynamic),
        extra=[blocks] if blocks is not None else [],
    )
    inputs: list[gs.Tensor] = []
    for k, t in enumerate(node.inputs):
        value = lf.const(t) if t.name else None
        if not t.name:
            inputs.append(t)
        elif value is None:
            inputs.append(lf.convert(lf.value(t), layout).var)
        elif node.op == "Clip":
            inputs.append(t)  # min/max are scalars
        else:
            inputs.append(
                lf.constant(f"{node.name}_in{k}", relayout_constant(value, layout, shape))
            )
    (y,) = lf.emit(node.op, inputs, [layout.shape4(shape)], node.name, out.dtype, **node.attrs)
    lf.set(out, y, layout)


# ---------------------------------------------------------------------- relabels


def _accept_alias(info: NodeInfo) -> bool:
    if not _single_output(info) or not info.liftable(info.input(0)):
        return False
    if info.input(0) in info.constants or not info.liftable(info.outputs[0]):
        return False
    if info.op == "Dropout":
        mode = info.input(2)
        return not mode or (info.has_value(mode) and not bool(np.asarray(info.value(mode)).any()))
    return True


@supports("Identity", "Dropout", "Transpose", accept=_accept_alias, emits="")
def lift_relabel(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    layout = x.layout
    if node.op == "Transpose":
        perm = node.attrs.get("perm") or list(reversed(range(len(x.shape))))
        layout = layout.permuted(perm)
    lf.set(node.outputs[0], x.var, layout)


def _accept_reshape(info: NodeInfo) -> bool:
    src = info.input(0)
    return (
        _single_output(info)
        and bool(src)
        and src not in info.constants
        and info.liftable(src)
        and info.liftable(info.outputs[0])
    )


@supports("Reshape", "Flatten", "Squeeze", "Unsqueeze", accept=_accept_reshape, emits="Reshape")
def lift_reshape(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    out = node.outputs[0]
    dst = lf.shape(out)
    relabeled = L.relabel_reshape(x.layout, x.shape, dst)
    if relabeled is not None:
        lf.set(out, x.var, relabeled)
        return
    x = lf.plain(x)
    layout = lf.layout_for(out, dst)
    target = layout.shape4(dst)
    shape_const = lf.constant(f"{node.name}_shape", np.array(target, np.int64))
    (y,) = lf.emit("Reshape", [x.var, shape_const], [target], node.name, out.dtype)
    lf.set(out, y, layout)


# ---------------------------------------------------------------------- padding


def _accept_pad(info: NodeInfo) -> bool:
    """A Pad with constant amounts (any mode) of a run-time tensor: reflect-padded 1-D convs
    (encodec, HiFi-GAN) pad [N,C,L] on L, which on 4-D is a Pad of W that pad-to-slices can
    then spell with Slices, or the MLA run as it is."""
    src = info.input(0)
    if not src or src in info.constants or not _single_output(info) or not _basic(info, [src]):
        return False
    return (
        read_pad(info.attrs, info.inputs, info.value, info.opset, len(info.dims(src))) is not None
    )


@supports("Pad", accept=_accept_pad)
def lift_pad(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    rank = len(x.shape)
    tensors = {t.name: t for t in node.inputs if t.name}
    read = read_pad(
        node.attrs,
        [t.name for t in node.inputs],
        lambda name: lf.const(tensors[name]),
        lf.opset,
        rank,
    )
    if read is None:
        raise ValueError(f"Pad {node.name} has no constant amounts")
    mode, pads = read
    padded = [a for a in range(rank) if pads[a] or pads[a + rank]]
    if any(x.layout.alone(a, x.shape) is None for a in padded):
        x = lf.separated(x)
    slots = [0] * 8
    for a in padded:
        k = x.layout.slot(a)
        slots[k], slots[k + 4] = pads[a], pads[a + rank]
    out = node.outputs[0]
    shape4 = x.layout.shape4(lf.shape(out))
    if lf.opset < 11:
        attrs = {**node.attrs, "pads": slots}
        inputs = [x.var]
    else:
        attrs = {"mode": mode}
        value = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        amounts = lf.constant(f"{node.name}_pads", np.array(slots, np.int64))
        inputs = [x.var, amounts, *([value] if value is not None else [])]
    (y,) = lf.emit("Pad", inputs, [shape4], node.name, out.dtype, **attrs)
    lf.set(out, y, x.layout)


# ---------------------------------------------------------------------- axis ops


def _accept_concat(info: NodeInfo) -> bool:
    if not _single_output(info) or not _basic(info):
        return False
    out = info.dims(info.outputs[0])
    return out[_axis(info.attrs.get("axis", 0), len(out))] != 1


def _on_its_own(axis: int, shape: Shape, allow_batch: bool = False) -> Callable[[Layout], bool]:
    def ok(layout: Layout) -> bool:
        slot = layout.alone(axis, shape)
        return slot is not None and (allow_batch or slot != 0)

    return ok


def _pick_axis_layout(lf: Lifter, inputs: list[Lifted], shape: Shape, axis: int) -> Layout:
    """A layout where `axis` has a slot of its own, off the batch axis when possible."""
    try:
        return lf.choose(inputs, shape, _on_its_own(axis, shape))
    except ValueError:
        return lf.choose(inputs, shape, _on_its_own(axis, shape, allow_batch=True))


@supports("Concat", accept=_accept_concat)
def lift_concat(lf: Lifter, node: gs.Node) -> None:
    out = node.outputs[0]
    shape = lf.shape(out)
    axis = _axis(node.attrs.get("axis", 0), len(shape))
    dynamic = [lf.value(t) for t in node.inputs if lf.const(t) is None]
    layout = _pick_axis_layout(lf, dynamic, shape, axis)
    inputs = []
    for k, t in enumerate(node.inputs):
        value = lf.const(t)
        if value is None:
            inputs.append(lf.convert(lf.value(t), layout).var)
        else:
            relaid = relayout_constant(value, layout, value.shape)
            inputs.append(lf.constant(f"{node.name}_in{k}", relaid))
    slot = layout.slot(axis)
    (y,) = lf.emit("Concat", inputs, [layout.shape4(shape)], node.name, out.dtype, axis=slot)
    lf.set(out, y, layout)


def _accept_split(info: NodeInfo) -> bool:
    src = info.input(0)
    if not src or src in info.constants or not _basic(info, [src]):
        return False
    shape = info.dims(src)
    return shape[_axis(info.attrs.get("axis", 0), len(shape))] != 1


@supports("Split", accept=_accept_split)
def lift_split(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    axis = _axis(node.attrs.get("axis", 0), len(x.shape))
    layout = _pick_axis_layout(lf, [x], x.shape, axis)
    x = lf.convert(x, layout)
    attrs = {**node.attrs, "axis": layout.slot(axis)}
    shapes = [layout.shape4(lf.shape(t)) for t in node.outputs]
    outs = lf.emit("Split", [x.var, *node.inputs[1:]], shapes, node.name, x.var.dtype, **attrs)
    for t, y in zip(node.outputs, outs, strict=True):
        lf.set(t, y, layout)


def _slice_params(
    rank: int, src: Shape, dst: Shape, values: list[np.ndarray | None]
) -> list[tuple[int, int, int, int]]:
    """(axis, start, end, step) for every axis the slice really changes."""
    starts, ends, axes, steps = values
    if starts is None or ends is None:
        raise ValueError("Slice needs constant starts and ends")
    n = len(starts)
    axes_list = [int(a) % rank for a in (axes if axes is not None else range(n))]
    steps_list = [int(s) for s in (steps if steps is not None else [1] * n)]
    return [
        (a, int(starts[k]), int(ends[k]), steps_list[k])
        for k, a in enumerate(axes_list)
        if not (steps_list[k] == 1 and src[a] == dst[a])
    ]


def _accept_slice(info: NodeInfo) -> bool:
    src = info.input(0)
    if not src or src in info.constants or not _single_output(info) or not _basic(info, [src]):
        return False
    params = [info.input(k) for k in range(1, 5)]
    if any(p and info.value(p) is None for p in params) or not params[0] or not params[1]:
        return False
    a, b = info.dims(src), info.dims(info.outputs[0])
    values = [info.value(p) if p else None for p in params]
    return all(a[x] > 1 for x, *_ in _slice_params(len(a), a, b, values))


@supports("Slice", accept=_accept_slice)
def lift_slice(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    out = node.outputs[0]
    dst = lf.shape(out)
    values = [
        lf.const(node.inputs[k]) if k < len(node.inputs) and node.inputs[k].name else None
        for k in range(1, 5)
    ]
    cuts = _slice_params(len(x.shape), x.shape, dst, values)
    if not cuts:
        lf.set(out, x.var, x.layout)
        return
    if any(x.layout.alone(a, x.shape) is None for a, *_ in cuts):
        x = lf.separated(x)
    y = _emit_slice(lf, x, cuts, dst, node.name, out.dtype)
    lf.set(out, y, x.layout)


def _emit_slice(
    lf: Lifter,
    x: Lifted,
    cuts: list[tuple[int, int, int, int]],
    dst: Shape,
    name: str,
    dtype: Any,
) -> gs.Tensor:
    def const(label: str, column: int, values: list[int] | None = None) -> gs.Constant:
        data = values if values is not None else [c[column] for c in cuts]
        return lf.constant(f"{name}_{label}", np.array(data, np.int64))

    slots = [x.layout.slot(a) for a, *_ in cuts]
    inputs = [
        x.var,
        const("starts", 1),
        const("ends", 2),
        const("axes", 0, slots),
        const("steps", 3),
    ]
    (y,) = lf.emit("Slice", inputs, [x.layout.shape4(dst)], name, dtype)
    return y


def _gather_range(info_value: np.ndarray | None, dim: int) -> tuple[int, int] | None:
    """(start, count) when constant indices pick a contiguous ascending run."""
    if info_value is None or info_value.ndim > 1 or info_value.size == 0:
        return None
    idx = [int(i) % dim for i in np.atleast_1d(info_value)]
    if idx != list(range(idx[0], idx[0] + len(idx))):
        return None
    return idx[0], len(idx)


def _accept_gather(info: NodeInfo) -> bool:
    src, idx = info.input(0), info.input(1)
    if not src or src in info.constants or not _single_output(info) or not _basic(info, [src]):
        return False
    shape = info.dims(src)
    axis = _axis(info.attrs.get("axis", 0), len(shape))
    return shape[axis] > 1 and _gather_range(info.value(idx), shape[axis]) is not None


@supports("Gather", accept=_accept_gather, emits="Slice")
def lift_gather(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    out = node.outputs[0]
    axis = _axis(node.attrs.get("axis", 0), len(x.shape))
    indices = lf.const(node.inputs[1])
    picked = _gather_range(indices, x.shape[axis])
    if indices is None or picked is None:
        raise ValueError("Gather needs constant, contiguous indices")
    start, count = picked
    if x.layout.alone(axis, x.shape) is None:
        x = lf.separated(x)
    kept = list(x.shape)
    kept[axis] = count
    y = _emit_slice(lf, x, [(axis, start, start + count, 1)], tuple(kept), node.name, out.dtype)
    layout = x.layout.without(axis) if indices.ndim == 0 else x.layout
    lf.set(out, y, layout)


def _accept_softmax(info: NodeInfo) -> bool:
    return _single_output(info) and _basic(info)


@supports("Softmax", "LogSoftmax", "Hardmax", accept=_accept_softmax)
def lift_softmax(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    rank = len(x.shape)
    axis = _axis(node.attrs.get("axis", -1 if lf.opset >= 13 else 1), rank)
    if lf.opset >= 13:
        ok = x.layout.alone(axis, x.shape) == 1
        layout = x.layout if ok else L.rows(rank, axis)
    else:
        layout = x.layout if _leads_with(x, axis) else L.coerced(rank, axis)
    x = lf.convert(x, layout)
    out = node.outputs[0]
    attrs = {**node.attrs, "axis": 1}
    (y,) = lf.emit(node.op, [x.var], [layout.shape4(x.shape)], node.name, out.dtype, **attrs)
    lf.set(out, y, layout)


def _leads_with(x: Lifted, axis: int) -> bool:
    """Plain layout whose slot 0 holds exactly the non-unit axes before `axis`."""
    before = {a for a in range(axis) if x.shape[a] != 1}
    return x.layout.is_plain(x.shape) and x.layout.leading(x.shape) == before


def _accept_layernorm(info: NodeInfo) -> bool:
    return _single_output(info) and _basic(info, [info.input(0)])


@supports("LayerNormalization", "RMSNormalization", accept=_accept_layernorm)
def lift_layernorm(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    rank = len(x.shape)
    axis = _axis(node.attrs.get("axis", -1), rank)
    layout = x.layout if _leads_with(x, axis) else L.normalized(rank, axis)
    x = lf.convert(x, layout)
    inner = layout.shape4(x.shape)[1:]
    params = []
    for k, t in enumerate(node.inputs[1:], start=1):
        value = lf.const(t)
        if value is None:
            params.append(t)
            continue
        full = np.broadcast_to(value, x.shape[axis:]).reshape(inner)
        params.append(lf.constant(f"{node.name}_in{k}", full))
    out = node.outputs[0]
    attrs = {**node.attrs, "axis": 1}
    (y,) = lf.emit(
        node.op,
        [x.var, *params],
        [layout.shape4(x.shape)],
        node.name,
        out.dtype,
        **attrs,
    )
    lf.set(out, y, layout)


_REDUCE = (
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSumExp", "ReduceSumSquare",
)  # fmt: skip


def _axes_from_input(op: str, opset: int) -> bool:
    return opset >= 18 or (op == "ReduceSum" and opset >= 13)


def _reduce_axes(op: str, opset: int, attrs: dict, axes_value, rank: int) -> list[int] | None:
    raw = axes_value if _axes_from_input(op, opset) else attrs.get("axes")
    if raw is None or np.asarray(raw).size == 0:
        return None if attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return sorted({int(a) % rank for a in np.atleast_1d(raw)})


def _accept_reduce(info: NodeInfo) -> bool:
    src = info.input(0)
    if not src or src in info.constants or not _single_output(info) or not _basic(info, [src]):
        return False
    shape = info.dims(src)
    axes_in = info.input(1)
    if _axes_from_input(info.op, info.opset) and axes_in and info.value(axes_in) is None:
        return False
    axes = _reduce_axes(info.op, info.opset, info.attrs, info.value(axes_in), len(shape))
    return bool(axes) and any(shape[a] != 1 for a in axes or ())


@supports(*_REDUCE, accept=_accept_reduce)
def lift_reduce(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    rank = len(x.shape)
    axes_value = lf.const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1].name else None
    axes = _reduce_axes(node.op, lf.opset, node.attrs, axes_value, rank) or []
    reduced = [a for a in axes if x.shape[a] != 1]
    if any(x.layout.alone(a, x.shape) is None for a in reduced):
        x = lf.separated(x)
    if any(x.layout.slot(a) < 2 for a in reduced):
        spatial = L.reducing(x.shape, axes)  # the MLA reduces the spatial axes only
        if spatial is not None:
            x = lf.convert(x, spatial)
    slots = sorted({x.layout.slot(a) for a in reduced})
    shape4 = x.layout.shape4(x.shape)
    if slots and min(slots) >= 2:
        slots = sorted({*slots, *(s for s in (2, 3) if shape4[s] == 1)})
    out = node.outputs[0]
    kept = tuple(1 if a in axes else d for a, d in enumerate(x.shape))
    attrs = {k: v for k, v in node.attrs.items() if k not in ("axes", "noop_with_empty_axes")}
    attrs["keepdims"] = 1
    inputs = [x.var]
    if _axes_from_input(node.op, lf.opset):
        inputs.append(lf.constant(f"{node.name}_axes", np.array(slots, np.int64)))
    else:
        attrs["axes"] = slots
    (y,) = lf.emit(node.op, inputs, [x.layout.shape4(kept)], node.name, out.dtype, **attrs)
    layout = x.layout
    if not node.attrs.get("keepdims", 1):
        for a in sorted(axes, reverse=True):
            layout = layout.without(a)
    lf.set(out, y, layout)


# ---------------------------------------------------------------------- linear algebra


def _accept_matmul(info: NodeInfo) -> bool:
    a, b = info.input(0), info.input(1)
    if not _single_output(info) or not a or not b:
        return False
    if a in info.constants:
        return _accept_constant_left(info) or _accept_constant_batch(info)
    sa = info.shape(a)
    if sa is None or len(sa) < 2:
        return False
    if b in info.constants:
        sb = info.shape(b)
        return info.has_value(b) and sb is not None and len(sb) == 2 and _basic(info, [a])
    sb = info.shape(b)
    return _basic(info, [a, b]) and sb is not None and len(sa) == len(sb) and sa[:-2] == sb[:-2]


def _accept_constant_left(info: NodeInfo) -> bool:
    """W · x with a constant matrix W ([M,K], or with leading unit axes up to x's rank) and a
    run-time x [..., K, L]: a 1×1 Conv mixing the channels K → M (YOLO-World's contrastive
    head multiplies text embeddings [1,80,512] by the flattened feature map [1,512,H·W])."""
    a, b = info.input(0), info.input(1)
    sa, sb = info.shape(a), info.shape(b)
    if not info.has_value(a) or sa is None or sb is None or b in info.constants:
        return False
    return 2 <= len(sa) <= len(sb) and all(d == 1 for d in sa[:-2]) and _basic(info, [b])


def _accept_constant_batch(info: NodeInfo) -> bool:
    """A constant batch of matrices times a run-time one of the same batch shape (DETR's first
    decoder layer: its queries are learned constants, so the cross-attention scores are a
    constant [heads, queries, d] times the keys [heads, d, tokens]): one 4-D MatMul."""
    a, b = info.input(0), info.input(1)
    sa, sb = info.shape(a), info.shape(b)
    if not info.has_value(a) or sa is None or sb is None or b in info.constants:
        return False
    return len(sa) == len(sb) >= 3 and sa[:-2] == sb[:-2] and _basic(info, [b])


@supports("MatMul", accept=_accept_matmul)
def lift_matmul(lf: Lifter, node: gs.Node) -> None:
    a, b = node.inputs
    left = lf.const(a)
    if left is not None and all(d == 1 for d in left.shape[:-2]):
        _linear(lf, node, b, left.reshape(left.shape[-2:]), None, axis=-2)
        return
    if left is not None:
        _batched_product(lf, node, lf.value(a), lf.value(b), None)
        return
    weight = lf.const(b)
    if weight is not None:
        _linear(lf, node, a, weight.T, None)
        return
    _batched_product(lf, node, lf.value(a), lf.value(b), None)


def _batched_product(
    lf: Lifter, node: gs.Node, x: Lifted, y: Lifted, out_perm: list[int] | None
) -> None:
    """x · y of two run-time tensors as one 4-D MatMul (batch axes in slots 0–1), its result
    recorded for `node`'s output read through `out_perm` (the Transpose it is stored as)."""
    layout = L.matmul(len(x.shape))
    x, y = lf.convert(x, layout), lf.convert(y, layout)
    product = (*x.shape[:-1], y.shape[-1])
    out = node.outputs[0]
    (z,) = lf.emit("MatMul", [x.var, y.var], [layout.shape4(product)], node.name, out.dtype)
    lf.set(out, z, layout if out_perm is None else layout.permuted(out_perm))


def _accept_einsum(info: NodeInfo) -> bool:
    """A two-operand Einsum that is one batched product of run-time tensors (`plan_product`:
    MaxViT's window attention "bhid,bhjd->bhij" on rank-5 windows × heads)."""
    a, b = info.input(0), info.input(1)
    plan = plan_product(str(info.attrs.get("equation", "")))
    if plan is None or len(info.inputs) != 2 or not _single_output(info):
        return False
    if not _basic(info, [a, b]):
        return False
    sa, sb = (_permuted_shape(info.dims(t), p) for t, p in ((a, plan.lhs_perm), (b, plan.rhs_perm)))
    return len(sa) == len(sb) and sa[:-2] == sb[:-2]


def _permuted_shape(shape: Shape, perm: list[int] | None) -> Shape:
    return shape if perm is None else tuple(shape[p] for p in perm)


@supports("Einsum", accept=_accept_einsum, emits="MatMul")
def lift_einsum(lf: Lifter, node: gs.Node) -> None:
    """The product's operands read through their Transposes (relabels of the 4-D data), one
    MatMul, and its result relabelled into the Einsum's output order."""
    plan = plan_product(str(node.attrs["equation"]))
    if plan is None:
        raise ValueError(f"Einsum {node.name} is not a batched product")
    operands = []
    for tensor, perm in zip(node.inputs, (plan.lhs_perm, plan.rhs_perm), strict=True):
        x = lf.value(tensor)
        if perm is not None:
            x = Lifted(x.var, x.layout.permuted(perm), _permuted_shape(x.shape, perm))
        operands.append(x)
    _batched_product(lf, node, *operands, plan.out_perm)


def _gemm_bias(info_c: np.ndarray | None, m: int, n: int) -> np.ndarray | None | bool:
    """Per-output-channel bias of a Gemm's C, or False when C varies along the rows."""
    if info_c is None:
        return None
    full = np.broadcast_to(info_c, (m, n))
    return full[0] if (full == full[0]).all() else False


def _accept_gemm(info: NodeInfo) -> bool:
    a, b, c = info.input(0), info.input(1), info.input(2)
    if not _single_output(info) or not a or a in info.constants or info.attrs.get("transA", 0):
        return False
    if not _basic(info, [a]) or len(info.shape(a) or ()) != 2 or not info.has_value(b):
        return False
    if not c:
        return True
    m, n = info.dims(info.outputs[0])
    value = info.view.constant_value(c, max_elements=1 << 22)
    return value is not None and _gemm_bias(value, m, n) is not False


@supports("Gemm", accept=_accept_gemm, emits="Conv")
def lift_gemm(lf: Lifter, node: gs.Node) -> None:
    a, b = node.inputs[0], node.inputs[1]
    weight = lf.const(b)
    if weight is None:
        raise ValueError("Gemm needs a constant B")
    weight = weight if node.attrs.get("transB", 0) else weight.T
    weight = weight * np.asarray(node.attrs.get("alpha", 1.0), weight.dtype)
    bias = None
    if len(node.inputs) > 2 and node.inputs[2].name:
        m, n = lf.shape(node.outputs[0])
        row = _gemm_bias(lf.const(node.inputs[2]), m, n)
        bias = np.asarray(row) * np.asarray(node.attrs.get("beta", 1.0), weight.dtype)
    _linear(lf, node, a, weight, bias)


def _linear(
    lf: Lifter,
    node: gs.Node,
    data: gs.Tensor,
    weight: np.ndarray,
    bias: np.ndarray | None,
    axis: int = -1,
) -> None:
    """The channel mix `weight` [M,K] (+ b) of x's `axis` (K → M; the last axis for x · Wᵀ,
    the second last for W · x), as a 1×1 Conv with that axis on the channels."""
    x = lf.value(data)
    rank = len(x.shape)
    axis %= rank
    if x.layout.alone(axis, x.shape) != 1:
        x = lf.convert(x, L.rows(rank, axis))
    out = node.outputs[0]
    shape = lf.shape(out)
    w = lf.constant(f"{node.name}_weight", np.ascontiguousarray(weight)[:, :, None, None])
    inputs = [x.var, w]
    if bias is not None:
        inputs.append(lf.constant(f"{node.name}_bias", bias.astype(weight.dtype).reshape(-1)))
    (y,) = lf.emit(
        "Conv", inputs, [x.layout.shape4(shape)], node.name, out.dtype, kernel_shape=[1, 1]
    )
    lf.set(out, y, x.layout)


# ---------------------------------------------------------------------- 1-D convolution family

_CONV1D = ("Conv", "ConvTranspose")
_POOL1D = ("MaxPool", "AveragePool", "LpPool")
_GLOBAL = ("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
_PER_CHANNEL = ("BatchNormalization", "InstanceNormalization")


def _accept_conv1d(info: NodeInfo) -> bool:
    src = info.input(0)
    if not src or src in info.constants or not _single_output(info):
        return False
    shape = info.shape(src)
    if shape is None or len(shape) != 3 or not _basic(info, [src]):
        return False
    return info.op not in _CONV1D or info.attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID")


_SPATIAL_LISTS = ("kernel_shape", "strides", "dilations", "output_padding")


@supports(*_CONV1D, *_POOL1D, *_GLOBAL, accept=_accept_conv1d)
def lift_conv1d(lf: Lifter, node: gs.Node) -> None:
    x = lf.convert(lf.value(node.inputs[0]), L.ncl(3))
    attrs = dict(node.attrs)
    for key in _SPATIAL_LISTS:
        if key in attrs:
            attrs[key] = [1, *attrs[key]]
    if "pads" in attrs:
        begin, end = attrs["pads"]
        attrs["pads"] = [0, begin, 0, end]
    if "output_shape" in attrs:
        attrs["output_shape"] = [1, *attrs["output_shape"]]
    inputs = [x.var]
    for k, t in enumerate(node.inputs[1:], start=1):
        value = lf.const(t)
        if k == 1 and node.op in _CONV1D and value is not None:
            inputs.append(lf.constant(f"{node.name}_weight", value[:, :, None, :]))
        else:
            inputs.append(t)
    out = node.outputs[0]
    shape = lf.shape(out)
    (y,) = lf.emit(node.op, inputs, [L.ncl(3).shape4(shape)], node.name, out.dtype, **attrs)
    lf.set(out, y, L.ncl(3))


def _accept_per_channel(info: NodeInfo) -> bool:
    src = info.input(0)
    if not src or src in info.constants or not _single_output(info) or not _basic(info, [src]):
        return False
    rank = len(info.shape(src) or ())
    return rank in (2, 3) and (info.op == "BatchNormalization" or rank == 3)


@supports(*_PER_CHANNEL, accept=_accept_per_channel)
def lift_per_channel(lf: Lifter, node: gs.Node) -> None:
    x = lf.value(node.inputs[0])
    rank = len(x.shape)
    x = lf.convert(x, L.ncl(rank))
    out = node.outputs[0]
    shape = lf.shape(out)
    attrs = dict(node.attrs)
    (y,) = lf.emit(
        node.op,
        [x.var, *node.inputs[1:]],
        [L.ncl(rank).shape4(shape)],
        node.name,
        out.dtype,
        **attrs,
    )
    lf.set(out, y, L.ncl(rank))


opset_of = default_opset
