"""Declarative operator constraints: one small function per check, looked up by name.

A target profile lists, per op and processor, constraints such as
`{check: rank, ranks: [4]}`. Each check returns None when the node satisfies it, or a `Reason`
with a machine code and a short sentence a user can act on. The function's docstring is the
rule as documented (`surgery targets mlsoc --op Resize` prints it with the parameters filled in),
so the text a user reads and the code that decides are one thing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from surgery.graph import (
    FLOAT_TYPES,
    GraphView,
    TensorInfo,
    attribute_value,
    dtype_name,
    shape_text,
)


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a node cannot run on a processor."""

    code: str
    message: str
    processor: str = "MLA"

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message, "processor": self.processor}


@dataclass(slots=True)
class NodeContext:
    """Everything a constraint may look at for one node."""

    view: GraphView
    index: int
    constants: set[str] | frozenset[str]
    processor: str = "MLA"
    _attrs: dict[str, Any] | None = None
    _attr_protos: dict[str, onnx.AttributeProto] | None = None
    _data_inputs: list[TensorInfo] | None = None
    _outputs: list[TensorInfo] | None = None
    _data_tensors: list[tuple[str, TensorInfo]] | None = None

    @property
    def node(self) -> onnx.NodeProto:
        return self.view.nodes[self.index]

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.view.node_inputs[self.index]

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.view.node_outputs[self.index]

    def input(self, k: int) -> TensorInfo | None:
        ins = self.view.node_inputs[self.index]
        if k >= len(ins) or not ins[k]:
            return None
        return self.view.tensor(ins[k])

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def input_is_constant(self, k: int) -> bool:
        ins = self.view.node_inputs[self.index]
        return k < len(ins) and bool(ins[k]) and ins[k] in self.constants

    def input_value(self, k: int) -> np.ndarray | None:
        ins = self.view.node_inputs[self.index]
        if k >= len(ins) or not ins[k]:
            return None
        return self.view.constant_value(ins[k])

    def data_inputs(self) -> list[TensorInfo]:
        if self._data_inputs is None:
            tensor, constants = self.view.tensor, self.constants
            self._data_inputs = [
                tensor(n) for n in self.view.node_inputs[self.index] if n and n not in constants
            ]
        return self._data_inputs

    def outputs(self) -> list[TensorInfo]:
        if self._outputs is None:
            tensor = self.view.tensor
            self._outputs = [tensor(n) for n in self.view.node_outputs[self.index] if n]
        return self._outputs

    def rank(self) -> int | None:
        """Rank of the first data input (the tensor the op works on)."""
        ins = self.data_inputs()
        if ins:
            return ins[0].rank
        first = self.input(0)
        return first.rank if first is not None else None

    def attr(self, name: str, default: Any = None) -> Any:
        """One attribute as a Python value; only the attributes asked for are converted."""
        if self._attrs is not None and name in self._attrs:
            return self._attrs[name]
        if self._attr_protos is None:
            self._attr_protos = {a.name: a for a in self.node.attribute}
        proto = self._attr_protos.get(name)
        if proto is None:
            return default
        value = attribute_value(proto)
        if self._attrs is None:
            self._attrs = {}
        self._attrs[name] = value
        return value


Check = Callable[[NodeContext, dict[str, Any]], Reason | None]
CHECKS: dict[str, Check] = {}
REQUIRED_PARAMS: dict[str, frozenset[str]] = {}


def check(name: str, *required: str) -> Callable[[Check], Check]:
    """Register a constraint function under the name profiles use, with its required params."""

    def register(fn: Check) -> Check:
        CHECKS[name] = fn
        REQUIRED_PARAMS[name] = frozenset(required)
        return fn

    return register


def describe(name: str, params: dict[str, Any]) -> str:
    """The documented rule of a constraint with its parameters filled in."""
    doc = (CHECKS[name].__doc__ or name).strip().splitlines()[0]
    values = {k: _fmt(v) for k, v in params.items()}
    try:
        return doc.format(**values)
    except (KeyError, IndexError):
        return doc


def _fmt(v: Any) -> str:
    if isinstance(v, list | tuple):
        return ", ".join(str(x) for x in v)
    return str(v)


def _ranks_text(ranks: list[int]) -> str:
    return " or ".join(f"{r}-D" for r in ranks)


def _selected_tensors(ctx: NodeContext, which: str) -> list[tuple[str, TensorInfo]]:
    if which == "outputs":
        return [("output", t) for t in ctx.outputs()]
    if which == "inputs":
        return [("input", t) for t in ctx.data_inputs()]
    if ctx._data_tensors is None:
        ctx._data_tensors = [("input", t) for t in ctx.data_inputs()] + [
            ("output", t) for t in ctx.outputs()
        ]
    return ctx._data_tensors


@check("rank", "ranks")
def check_rank(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Data tensors must be {ranks}-D."""
    ranks = p["ranks"]
    for role, t in _selected_tensors(ctx, p.get("tensors", "data")):
        if t.rank is None:
            return Reason(
                "rank_unknown",
                f"{role} {t.name!r} has unknown rank; the {ctx.processor} needs "
                f"{_ranks_text(ranks)} tensors",
                ctx.processor,
            )
        if t.rank not in ranks:
            return Reason(
                "rank",
                f"{role} {t.name!r} is rank {t.rank}; the {ctx.processor} needs "
                f"{_ranks_text(ranks)} tensors",
                ctx.processor,
            )
    return None


@check("dtype", "dtypes")
def check_dtype(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Data tensors must be one of: {dtypes}."""
    allowed = set(p["dtypes"])
    for role, t in _selected_tensors(ctx, p.get("tensors", "data")):
        if t.elem_type and t.dtype not in allowed:
            return Reason(
                "dtype",
                f"{role} {t.name!r} is {t.dtype}; the {ctx.processor} takes "
                f"{', '.join(sorted(allowed))}",
                ctx.processor,
            )
    return None


@check("static_shape")
def check_static_shape(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Data tensors must have static shapes (fix dynamic inputs with --input-shape)."""
    for role, t in _selected_tensors(ctx, p.get("tensors", "data")):
        if t.shape is not None and not t.is_static:
            return Reason(
                "dynamic_shape",
                f"{role} {t.name!r} has dynamic shape {shape_text(t.shape)}; the {ctx.processor} "
                "needs static shapes (use --input-shape)",
                ctx.processor,
            )
    return None


@check("attr_in", "attr", "values")
def check_attr_in(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Attribute {attr} must be one of: {values}."""
    value = ctx.attr(p["attr"], p.get("default"))
    if value is None:
        return None
    if (
        p.get("unless_zero_pads")
        and not any(ctx.attr("pads", []))
        and ctx.attr("auto_pad", "NOTSET") in ("NOTSET", "VALID")
    ):
        return None
    if value not in p["values"]:
        return Reason(
            "attribute",
            f"attribute {p['attr']}={value} is not supported on the {ctx.processor} (allowed: {_fmt(p['values'])})",
            ctx.processor,
        )
    return None


@check("attr_range", "attr")
def check_attr_range(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Every value of attribute {attr} must lie in {min}..{max}."""
    value = ctx.attr(p["attr"], p.get("default"))
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    lo, hi = p.get("min", -math.inf), p.get("max", math.inf)
    bad = [v for v in values if not lo <= v <= hi]
    if bad:
        return Reason(
            "attribute",
            f"attribute {p['attr']}={value} is outside {p.get('min', '')}..{p.get('max', '')} on the {ctx.processor}",
            ctx.processor,
        )
    return None


@check("kernel_max", "max")
def check_kernel_max(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Kernel sizes must be at most {max} (global pooling is exempt)."""
    kernel = ctx.attr("kernel_shape")
    if kernel is None:
        w = ctx.input(1)
        kernel = list(w.shape[2:]) if w is not None and w.shape is not None else []
    bad = [k for k in kernel if isinstance(k, int) and k > p["max"]]
    if bad:
        return Reason(
            "kernel",
            f"kernel {list(kernel)} exceeds {p['max']} on the {ctx.processor}",
            ctx.processor,
        )
    return None


@check("window_fits")
def check_window_fits(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Every pooling window must lie within the padded input (ceil_mode pads the last one)."""
    kernel = ctx.attr("kernel_shape")
    x = ctx.input(0)
    if not kernel or x is None or x.shape is None or len(x.shape) != len(kernel) + 2:
        return None
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if ctx.attr("ceil_mode", 0) or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        return None  # padded until every window fits
    rank = len(kernel)
    pads = [0] * 2 * rank if auto_pad == "VALID" else ctx.attr("pads") or [0] * 2 * rank
    dilations = ctx.attr("dilations") or [1] * rank
    if len(pads) != 2 * rank or len(dilations) != rank:
        return None  # malformed: the model's problem, not this constraint's
    for axis, size in enumerate(x.shape[2:]):
        extent = (kernel[axis] - 1) * dilations[axis] + 1
        padded = size + pads[axis] + pads[axis + rank] if isinstance(size, int) else None
        if padded is not None and extent > padded:
            # ONNX Runtime takes the part of the window that exists; the MLA whole windows only
            return Reason(
                "window",
                f"its window of {extent} is wider than input {x.name!r} padded along axis "
                f"{axis + 2} ({padded}); the {ctx.processor} computes whole windows only",
                ctx.processor,
            )
    return None


@check("depthwise_kernel_max", "max")
def check_depthwise_kernel_max(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Depthwise convolution kernels must be at most {max}."""
    group = ctx.attr("group", 1)
    x = ctx.input(0)
    channels = x.shape[1] if x is not None and x.shape is not None and len(x.shape) > 1 else None
    if group > 1 and group == channels:
        w = ctx.input(1)
        kernel = ctx.attr("kernel_shape") or (
            list(w.shape[2:]) if w is not None and w.shape else []
        )
        if any(isinstance(k, int) and k > p["max"] for k in kernel):
            return Reason(
                "kernel",
                f"depthwise kernel {list(kernel)} exceeds {p['max']} on the {ctx.processor}",
                ctx.processor,
            )
    return None


@check("const_input", "index")
def check_const_input(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Input {index} must be a constant."""
    k = p["index"]
    if k < len(ctx.input_names) and ctx.input_names[k] and not ctx.input_is_constant(k):
        return Reason(
            "non_constant_input",
            f"input {k} ({ctx.input_names[k]!r}) must be a constant on the {ctx.processor}",
            ctx.processor,
        )
    return None


@check("single_data_input")
def check_single_data_input(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Only the first input may be a computed tensor; the others must be constants."""
    dynamic = [n for k, n in enumerate(ctx.input_names) if k > 0 and n and n not in ctx.constants]
    if dynamic:
        return Reason(
            "non_constant_input",
            f"input {dynamic[0]!r} is computed at run time; the {ctx.processor} needs it constant (try fold-constants)",
            ctx.processor,
        )
    return None


@check("input_rank", "index", "max")
def check_input_rank(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Input {index} must have rank at most {max}."""
    t = ctx.input(p["index"])
    if t is not None and t.rank is not None and t.rank > p["max"]:
        return Reason(
            "rank",
            f"input {p['index']} ({t.name!r}) is rank {t.rank}; at most {p['max']} allowed on the {ctx.processor}",
            ctx.processor,
        )
    return None


@check("vector_input", "index")
def check_vector_input(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Input {index} must be a vector: at most one dimension larger than 1."""
    t = ctx.input(p["index"])
    if t is not None and t.shape is not None and sum(1 for d in t.shape if d != 1) > 1:
        return Reason(
            "shape",
            f"input {p['index']} ({t.name!r}) has shape {shape_text(t.shape)}; the {ctx.processor} needs a 1-D vector",
            ctx.processor,
        )
    return None


def _normalise_axes(ctx: NodeContext, p: dict[str, Any]) -> list[int] | None:
    """The axes a node works on, from an attribute or a constant input; None if unknown."""
    rank = ctx.rank()
    if "input" in p and len(ctx.input_names) > p["input"] and ctx.input_names[p["input"]]:
        value = ctx.input_value(p["input"])
        if value is None:
            return None
        axes = [int(a) for a in np.atleast_1d(value)]
    else:
        raw = ctx.attr(p.get("attr", "axis"), p.get("default"))
        if raw is None:
            if p.get("all_if_missing") and rank is not None:
                return list(range(rank))
            return None
        axes = [int(a) for a in (raw if isinstance(raw, list) else [raw])]
    if not axes and p.get("all_if_missing") and rank is not None:
        return list(range(rank))
    if rank is None:
        return axes if all(a >= 0 for a in axes) else None
    return [a % rank for a in axes]


def _axis_kind(axis: int, rank: int | None) -> set[str]:
    kinds = {str(axis)}
    if axis == 0:
        kinds.add("batch")
    if axis == 1:
        kinds.add("channel")
    if axis >= 2:
        kinds.add("spatial")
    if rank is not None and axis == rank - 1:
        kinds.add("last")
    return kinds


@check("axis")
def check_axis(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """The operation axis must be {allowed} and must not be {forbidden}."""
    axes = _normalise_axes(ctx, p)
    if axes is None:
        return Reason(
            "axis_unknown",
            f"the axis is not a constant; the {ctx.processor} needs a known axis",
            ctx.processor,
        )
    rank = ctx.rank()
    allowed = {str(a) for a in p.get("allowed", [])}
    forbidden = {str(a) for a in p.get("forbidden", [])}
    for a in axes:
        kinds = _axis_kind(a, rank)
        if forbidden & kinds:
            return Reason(
                "axis",
                f"works along axis {a} ({', '.join(sorted(forbidden & kinds))}); the {ctx.processor} does not allow the {_fmt(p['forbidden'])} axis",
                ctx.processor,
            )
        if allowed and not allowed & kinds:
            return Reason(
                "axis",
                f"works along axis {a}; the {ctx.processor} needs the {_fmt(p['allowed'])} axis",
                ctx.processor,
            )
    return None


@check("reduce_axes", "max_size")
def check_reduce_axes(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Reductions must be over spatial axes; reduced extent below {max_size} unless all spatial axes are reduced."""
    op = ctx.node.op_type
    axes_from_input = (op == "ReduceSum" and _opset_ge(ctx, 13)) or (
        op in _AXES_AS_INPUT and _opset_ge(ctx, 18)
    )
    axes = _normalise_axes(
        ctx,
        {"attr": "axes", "input": 1, "all_if_missing": True}
        if axes_from_input
        else {"attr": "axes", "all_if_missing": True},
    )
    if axes is None:
        return Reason(
            "axis_unknown",
            f"reduction axes are not constant; the {ctx.processor} needs known axes",
            ctx.processor,
        )
    rank = ctx.rank()
    if rank is None:
        return Reason("rank_unknown", "input rank is unknown", ctx.processor)
    if any(a < 2 for a in axes):
        return Reason(
            "axis",
            f"reduces over axes {axes}; the {ctx.processor} reduces spatial axes only",
            ctx.processor,
        )
    x = ctx.input(0)
    if set(axes) != set(range(2, rank)) and x is not None and x.shape is not None:
        extent = 1
        for a in axes:
            d = x.shape[a]
            extent *= d if isinstance(d, int) else 1
        if extent >= p["max_size"]:
            return Reason(
                "shape",
                f"reduces {extent} elements over axes {axes}; the {ctx.processor} needs < {p['max_size']} unless all spatial axes are reduced",
                ctx.processor,
            )
    return None


_AXES_AS_INPUT = {
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceSumSquare",
}


def _opset_ge(ctx: NodeContext, version: int) -> bool:
    for o in ctx.view.model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version >= version
    return False


@check("perm_keeps", "axes")
def check_perm_keeps(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Transpose must keep axes {axes} in place (the batch axis cannot move)."""
    perm = ctx.attr("perm")
    rank = ctx.rank()
    if perm is None:
        perm = list(reversed(range(rank))) if rank is not None else None
    if perm is None:
        return None
    moved = [a for a in p["axes"] if a < len(perm) and perm[a] != a]
    if moved:
        return Reason(
            "axis",
            f"perm {perm} moves axis {moved[0]}; the {ctx.processor} keeps the batch axis in place",
            ctx.processor,
        )
    return None


@check("scalar_in", "index", "values")
def check_scalar_in(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Input {index} must be a constant scalar in {{{values}}}."""
    value = ctx.input_value(p["index"])
    if value is None or value.size != 1:
        return Reason(
            "non_constant_input",
            f"input {p['index']} must be a constant scalar on the {ctx.processor}",
            ctx.processor,
        )
    v = float(value.reshape(-1)[0])
    if not any(abs(v - a) < 1e-6 for a in p["values"]):
        return Reason(
            "attribute",
            f"input {p['index']} = {v:g} is not one of {_fmt(p['values'])} on the {ctx.processor}",
            ctx.processor,
        )
    return None


@check("positive_steps")
def check_positive_steps(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Slice starts, ends, axes and steps must be constant; steps at most {max_step} and positive."""
    for k in range(1, len(ctx.input_names)):
        if ctx.input_names[k] and not ctx.input_is_constant(k):
            return Reason(
                "non_constant_input",
                f"slice parameter {ctx.input_names[k]!r} is computed at run time (try fold-constants)",
                ctx.processor,
            )
    steps = ctx.input_value(4) if len(ctx.input_names) > 4 and ctx.input_names[4] else None
    if steps is not None:
        if any(int(s) <= 0 for s in np.atleast_1d(steps)):
            return Reason(
                "attribute",
                f"slice steps {steps.tolist()} must be positive on the {ctx.processor}",
                ctx.processor,
            )
        if "max_step" in p and any(int(s) > p["max_step"] for s in np.atleast_1d(steps)):
            return Reason(
                "attribute",
                f"slice steps {steps.tolist()} exceed {p['max_step']} on the {ctx.processor}",
                ctx.processor,
            )
    return None


@check("no_output", "index")
def check_no_output(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Optional output {index} must be unused."""
    outs = ctx.output_names
    k = p["index"]
    if (
        k < len(outs)
        and outs[k]
        and (outs[k] in ctx.view.consumers or outs[k] in ctx.view.graph_outputs)
    ):
        return Reason(
            "output",
            f"output {k} ({outs[k]!r}) is used; the {ctx.processor} does not produce it",
            ctx.processor,
        )
    return None


@check("pad", "max_dims")
def check_pad(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Pad: constant mode with value 0, at most {max_dims} padded dims, never batch or channel."""
    mode = ctx.attr("mode", "constant")
    if mode != "constant":
        return Reason(
            "attribute",
            f"pad mode {mode}; the {ctx.processor} pads with constant zeros only",
            ctx.processor,
        )
    pads = ctx.input_value(1) if len(ctx.input_names) > 1 else np.array(ctx.attr("pads", []))
    if pads is None:
        return Reason(
            "non_constant_input",
            "pads are computed at run time (try fold-constants)",
            ctx.processor,
        )
    if len(ctx.input_names) > 2 and ctx.input_names[2]:
        value = ctx.input_value(2)
        if value is None:
            return Reason(
                "non_constant_input",
                "the pad value is computed at run time (try fold-constants)",
                ctx.processor,
            )
    else:  # before opset 11 the value is an attribute; an omitted value is 0
        value = np.array(ctx.attr("value", 0.0))
    if float(np.asarray(value).reshape(-1)[0]) != 0.0:
        return Reason(
            "attribute",
            f"pad value {float(np.asarray(value).reshape(-1)[0]):g}; the {ctx.processor} pads "
            "with 0 only",
            ctx.processor,
        )
    pads = [int(x) for x in np.atleast_1d(pads)]
    half = len(pads) // 2
    padded = [a for a in range(half) if pads[a] or pads[a + half]]
    if any(a in (0, 1) for a in padded):
        return Reason(
            "axis",
            f"pads the {'batch' if 0 in padded else 'channel'} axis; the {ctx.processor} pads spatial axes only",
            ctx.processor,
        )
    if len(padded) > p["max_dims"]:
        return Reason(
            "attribute",
            f"pads {len(padded)} dims; the {ctx.processor} pads at most {p['max_dims']}",
            ctx.processor,
        )
    return None


def _resize_scales(ctx: NodeContext) -> list[float] | None:
    x, y = ctx.input(0), (ctx.outputs() or [None])[0]
    if x is not None and y is not None and x.is_static and y.is_static:
        return [yo / xi for xi, yo in zip(x.shape, y.shape, strict=True)]  # type: ignore[operator, arg-type]
    scales = ctx.input_value(2) if len(ctx.input_names) > 2 and ctx.input_names[2] else None
    return None if scales is None or scales.size == 0 else [float(s) for s in scales]


@check("resize", "modes")
def check_resize(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Resize: modes {modes}; nearest needs {nearest_scales} scales on H/W; batch and channel unscaled."""
    mode = ctx.attr("mode", "nearest")
    if mode not in p["modes"]:
        return Reason(
            "attribute",
            f"resize mode {mode}; the {ctx.processor} supports {_fmt(p['modes'])}",
            ctx.processor,
        )
    ctm = ctx.attr("coordinate_transformation_mode", "half_pixel")
    if ctm == "tf_crop_and_resize":
        return Reason(
            "attribute",
            "coordinate_transformation_mode 'tf_crop_and_resize' is not supported",
            ctx.processor,
        )
    scales = _resize_scales(ctx)
    if scales is None:
        return Reason(
            "non_constant_input",
            "the resize scale is not known before run time (fix input shapes or fold constants)",
            ctx.processor,
        )
    if len(scales) >= 2 and (abs(scales[0] - 1) > 1e-6 or abs(scales[1] - 1) > 1e-6):
        return Reason(
            "attribute",
            f"resize scales batch/channel ({scales[0]:g}, {scales[1]:g}); only H/W may be scaled",
            ctx.processor,
        )
    spatial = scales[2:]
    rule = p.get("nearest_scales" if mode == "nearest" else "linear_scales", "any")
    for s in spatial:
        ok = _scale_ok(s, rule, ctm, ctx.attr("nearest_mode", "round_prefer_floor"))
        if not ok:
            return Reason(
                "attribute",
                f"{mode} resize by {s:g} is not supported on the {ctx.processor} (needs {rule.replace('_', ' ')} scales)",
                ctx.processor,
            )
    return None


def _scale_ok(s: float, rule: str, ctm: str, nearest_mode: str) -> bool:
    if rule == "any":
        return True
    integer = abs(s - round(s)) < 1e-6 and round(s) >= 1
    if rule == "power_of_two":
        if s >= 1:
            r = round(s)
            if integer and r & (r - 1) == 0:
                return True
            return integer and r % 2 == 0 and ctm == "half_pixel" and nearest_mode == "floor"
        inv = 1 / s
        r = round(inv)
        return abs(inv - r) < 1e-6 and r & (r - 1) == 0
    if rule.startswith("integer_"):
        lo, hi = (int(x) for x in rule.split("_")[1:3])
        return integer and (lo <= round(s) <= hi or round(s) == 1)
    return False


@check("einsum")
def check_einsum(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Einsum: two inputs; each index appears in at least two tensors, at most once per tensor."""
    eq = str(ctx.attr("equation", "")).replace(" ", "")
    if "->" not in eq or len(ctx.input_names) != 2 or "..." in eq:
        return Reason(
            "attribute",
            f"einsum {eq}: the {ctx.processor} needs two inputs and an explicit output",
            ctx.processor,
        )
    lhs, out = eq.split("->")
    terms = [*lhs.split(","), out]
    for t in terms:
        if len(set(t)) != len(t):
            return Reason(
                "attribute", f"einsum {eq} repeats an index within one tensor", ctx.processor
            )
    for idx in set("".join(terms)):
        if sum(idx in t for t in terms) < 2:
            return Reason(
                "attribute",
                f"einsum {eq}: index {idx} appears in only one tensor",
                ctx.processor,
            )
    constant = (ctx.input_is_constant(0), ctx.input_is_constant(1))
    if not _contracted_as_one_axis(terms[0], terms[1], out, *constant):
        return Reason(
            "attribute",
            f"einsum {eq}: the summed indices are not one run of axes in the same order in "
            "both operands (the product would need a copy, not a view)",
            ctx.processor,
        )
    return None


def _contracted_as_one_axis(a: str, b: str, out: str, a_constant: bool, b_constant: bool) -> bool:
    """Whether the indices summed over can be read as one axis: one run of adjacent axes in
    each operand computed at run time, in the same order in both (a constant operand is stored
    in whatever order the product wants)."""
    summed = [i for i in a if i in b and i not in out]
    if len(summed) < 2:
        return True
    if a_constant:
        summed = [i for i in b if i in summed]

    def one_run(term: str) -> bool:
        first = term.index(summed[0])
        return term[first : first + len(summed)] == "".join(summed)

    return (a_constant or one_run(a)) and (b_constant or one_run(b))


@check("cumsum", "max_length")
def check_cumsum(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """CumSum: constant axis, length at most {max_length}, not reversed."""
    if ctx.attr("reverse", 0):
        return Reason("attribute", "reverse CumSum is not supported", ctx.processor)
    axis = ctx.input_value(1)
    if axis is None:
        return Reason("non_constant_input", "the CumSum axis must be a constant", ctx.processor)
    x = ctx.input(0)
    if x is not None and x.shape is not None:
        d = x.shape[int(axis.reshape(-1)[0]) % len(x.shape)]
        if isinstance(d, int) and d > p["max_length"]:
            return Reason(
                "shape",
                f"CumSum over {d} elements; the {ctx.processor} allows at most {p['max_length']}",
                ctx.processor,
            )
    return None


@check("dim_max", "axes", "max")
def check_dim_max(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Dimensions {axes} of data tensors must be at most {max}."""
    for role, t in _selected_tensors(ctx, p.get("tensors", "data")):
        if t.shape is None:
            continue
        for a in p["axes"]:
            if a < len(t.shape) and isinstance(t.shape[a], int) and t.shape[a] > p["max"]:
                return Reason(
                    "shape",
                    f"{role} {t.name!r} dim {a} is {t.shape[a]}; the {ctx.processor} allows at most {p['max']}",
                    ctx.processor,
                )
    return None


@check("matmul_k_max", "max")
def check_matmul_k_max(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """The MatMul reduction dimension must be at most {max}."""
    a = ctx.input(0)
    if a is not None and a.shape and isinstance(a.shape[-1], int) and a.shape[-1] > p["max"]:
        return Reason(
            "shape",
            f"MatMul reduces over {a.shape[-1]}; the {ctx.processor} allows at most {p['max']}",
            ctx.processor,
        )
    return None


@check("float_data")
def check_float_data(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """The op must work on floating-point (quantizable) data."""
    for t in ctx.data_inputs():
        if t.elem_type and t.elem_type not in FLOAT_TYPES:
            return Reason(
                "dtype",
                f"input {t.name!r} is {dtype_name(t.elem_type)}; the {ctx.processor} runs quantized float data",
                ctx.processor,
            )
    return None


@check("attr_each_in", "attr", "values")
def check_attr_each_in(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """Every value of attribute {attr} must be one of: {values}."""
    value = ctx.attr(p["attr"], p.get("default"))
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if any(v not in p["values"] for v in values):
        return Reason(
            "attribute",
            f"attribute {p['attr']}={value} is not supported on the {ctx.processor} (each must be one of {_fmt(p['values'])})",
            ctx.processor,
        )
    return None


@check("conv_transpose", "strides", "depthwise_strides")
def check_conv_transpose(ctx: NodeContext, p: dict[str, Any]) -> Reason | None:
    """ConvTranspose: group 1 or depthwise; strides in {{{strides}}} (depthwise {{{depthwise_strides}}})."""
    group = ctx.attr("group", 1)
    x = ctx.input(0)
    channels = x.shape[1] if x is not None and x.shape is not None and len(x.shape) > 1 else None
    depthwise = group > 1 and group == channels
    if group != 1 and not depthwise:
        return Reason(
            "attribute",
            f"grouped ConvTranspose (group={group}) is not supported; only group 1 or depthwise",
            ctx.processor,
        )
    allowed = p["depthwise_strides"] if depthwise else p["strides"]
    strides = ctx.attr("strides", [1, 1])
    if any(s not in allowed for s in strides):
        return Reason(
            "attribute",
            f"ConvTranspose strides {strides} not in {_fmt(allowed)} on the {ctx.processor}",
            ctx.processor,
        )
    return None
