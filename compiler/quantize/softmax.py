"""Activations whose only use is a Softmax input, so calibration can ignore what it cannot see.

Transformer exports add the attention mask to the scores before the Softmax — `scores + (1 −
mask)·finfo(float32).min`, `Where(mask, finfo.min, scores)`, or −1e4 / −1e9 — and the sum often
passes through a Reshape or Transpose before it reaches the Softmax. A range that covered the
mask would make the int8 step ~1e36 and every real score the same code. Softmax is
shift-invariant and a value far below its row's maximum contributes nothing its output can
resolve (`compiler.quantize.observers.softmax_span`), so such a tensor is observed by a
`SoftmaxInputObserver` and its range stops at the span below the row maxima.

That is safe only where every reader of the quantized value is that Softmax. A tensor qualifies
when the Q/DQ pair's readers form a chain of value-permuting ops (Reshape, Transpose, Squeeze, …)
that share its scale and end in one Softmax, with no graph output or other reader on the way:
another reader (a residual, a second head) would see the clamped values. The observer then reads
the Softmax's own input — the same values in the Softmax's layout, so its rows are found along the
Softmax's axis — and, because the ops only permute, sees exactly the values of the tensor it
stands for: where nothing is clamped, the range is the one the tensor itself would get.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from compiler.defines import QuantizationScheme
from compiler.quantize.observers import Observer, SoftmaxInputObserver
from compiler.quantize.plan import ActivationSpec, QuantPlan
from compiler.quantize.ranges import Range
from surgery.graph import GraphView, default_opset

__all__ = ["SoftmaxInput", "mask_operand_floors", "observer_for", "softmax_inputs"]

PERMUTING_OPS = frozenset(
    {
        "Reshape",
        "Flatten",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Identity",
        "Dropout",
        "DepthToSpace",
        "SpaceToDepth",
    }
)
"""Ops whose output holds each input value exactly once: observing the Softmax's input after a
chain of them sees the same values (the same histogram) as observing the chain's start."""

_FLOAT_OUTPUT_BITS = {"float16": 11, "bfloat16": 8}
"""Significand bits (with the implicit one) of float output schemes: their step next to the
row's largest probability."""

_FLOAT32_BITS = 24
"""Significand bits of a Softmax left in float32 (not quantized)."""


@dataclass(frozen=True)
class SoftmaxInput:
    """How to observe one activation read only by a Softmax."""

    tensor: str
    """The tensor to observe: the Softmax's input (the activation's own tensor, or the end of a
    chain of permuting ops from it)."""
    axis: int
    flatten: bool
    """True before opset 13: the Softmax normalises over all axes from `axis` on."""
    output_bits: int
    """Resolution of the Softmax's output in bits (its integer width or float significand)."""


def observer_for(inner: Observer, found: SoftmaxInput) -> SoftmaxInputObserver:
    """`inner` (the calibration method's observer) behind the Softmax-aware filter."""
    return SoftmaxInputObserver(
        inner=inner, axis=found.axis, flatten=found.flatten, output_bits=found.output_bits
    )


def softmax_inputs(view: GraphView, plan: QuantPlan) -> dict[str, SoftmaxInput]:
    """Activation key → the Softmax input to observe it by, for each observed integer activation
    whose quantized value reaches nothing but one Softmax (see the module docstring)."""
    opset = default_opset(view.model)
    found: dict[str, SoftmaxInput] = {}
    for key, spec in plan.observed().items():
        chain_end = _softmax_reader(view, plan, spec)
        if chain_end is None:
            continue
        tensor, softmax = chain_end
        node = view.nodes[softmax]
        default_axis = -1 if opset >= 13 else 1
        axis = next((int(a.i) for a in node.attribute if a.name == "axis"), default_axis)
        found[key] = SoftmaxInput(tensor, axis, opset < 13, _output_bits(view, plan, softmax))
    return found


def _softmax_reader(
    view: GraphView, plan: QuantPlan, spec: ActivationSpec
) -> tuple[str, int] | None:
    """(the Softmax's input tensor, the Softmax's node index) when every reader of `spec`'s
    dequantized value is on one chain of permuting ops ending in a Softmax; else None."""
    tensor = spec.tensor
    if spec.produced_by_quantized:
        readers = _readers(view, tensor)
    else:
        readers = [idx for idx, _ in spec.consumers]
    if readers is None or len(set(readers)) != 1:
        return None
    while True:
        (idx,) = set(readers)
        node = view.nodes[idx]
        if list(node.input).count(tensor) != 1 or node.input[0] != tensor:
            return None
        if node.op_type == "Softmax" and node.domain in ("", "ai.onnx"):
            return tensor, idx
        if node.op_type not in PERMUTING_OPS or node.domain not in ("", "ai.onnx"):
            return None
        out = node.output[0]
        if not _shares_scale(plan, out, spec.key):
            return None
        readers = _readers(view, out)
        if readers is None or len(readers) != 1:
            return None
        tensor = out


def _readers(view: GraphView, tensor: str) -> list[int] | None:
    """Nodes reading `tensor`; None when it is also a graph output (a reader we cannot see)."""
    if tensor in view.graph_outputs:
        return None
    return list(view.consumers.get(tensor, []))


def _shares_scale(plan: QuantPlan, tensor: str, key: str) -> bool:
    """True when every Q/DQ pair on `tensor` (if any) reuses `key`'s scale: the permuting op
    then hands the clamped values on without quantizing them anew."""
    specs = [s for s in plan.activations.values() if s.tensor == tensor]
    return all(s.share_with == key for s in specs)


def _output_bits(view: GraphView, plan: QuantPlan, softmax: int) -> int:
    """The resolution of the Softmax's output: its quantized width, or a float significand."""
    out = view.nodes[softmax].output[0]
    spec = plan.activations.get(out)
    if softmax not in plan.configs or spec is None or not spec.produced_by_quantized:
        return _FLOAT32_BITS
    return _scheme_bits(spec.scheme)


def _scheme_bits(scheme: QuantizationScheme) -> int:
    if scheme.is_float:
        return _FLOAT_OUTPUT_BITS.get(scheme.kind, _FLOAT32_BITS)
    return scheme.bits


def mask_operand_floors(
    view: GraphView, plan: QuantPlan, ranges: Mapping[str, Range], clamped: Iterable[str]
) -> dict[str, float]:
    """Activation key → the lowest value worth representing, for mask operands of a clamped sum.

    `m` in Add(scores, m) → Softmax, with m = (1 − mask)·finfo.min computed on the MLA, is an
    activation of its own; its range would keep the −3.4e38 the sum's range no longer covers,
    and the integer Add would have to scale it down by ~1e37 (no fixed-point multiplier can).
    Every m below c = lo_sum − hi_other − (hi_sum − lo_sum) makes the sum fall a whole range
    width below lo_sum — more than the rounding of all three tensors can undo — so the sum's
    QuantizeLinear gives its lowest code however low m is: m's range can stop at c. That holds
    only when every reader of m's dequantized value is such an Add (`clamped` lists the sums'
    keys); `ranges` are the calibrated ranges of the observed activations.

    A floored m is itself a clamped sum when it is computed by an Add: T5's position bias
    plus (1 − mask)·finfo.min, shared by the attention of every layer, is such an m, and its
    own mask operand can stop where that sum's lowest code no longer moves. The floors are
    taken again with each new one until none changes."""
    sums = set(clamped)
    current = dict(ranges)
    constants = view.initializers
    floors: dict[str, float] = {}
    observed = plan.observed()
    changed = True
    while changed:
        changed = False
        for key, spec in observed.items():
            if key in floors:
                continue
            floor = _operand_floor(view, plan, current, sums, constants, spec)
            if floor is not None and key in current and floor > current[key].lo:
                floors[key] = floor
                current[key] = Range(floor, current[key].hi)
                sums.add(key)
                changed = True
    return floors


def _operand_floor(
    view: GraphView,
    plan: QuantPlan,
    ranges: Mapping[str, Range],
    sums: set[str],
    constants: Mapping[str, onnx.TensorProto],
    spec: ActivationSpec,
) -> float | None:
    """The lowest value every reader of `spec`'s tensor allows, or None when one of them is
    not an Add whose quantized sum has a clamped range."""
    if spec.produced_by_quantized:
        readers = _readers(view, spec.tensor)
    else:
        readers = [idx for idx, _ in spec.consumers]
    if not readers or spec.key not in ranges:
        return None
    bounds = [_floor_for(view, plan, ranges, sums, constants, idx, spec.tensor) for idx in readers]
    if any(b is None for b in bounds):
        return None
    return min(b for b in bounds if b is not None)


def _floor_for(
    view: GraphView,
    plan: QuantPlan,
    ranges: Mapping[str, Range],
    sums: set[str],
    constants: Mapping[str, onnx.TensorProto],
    idx: int,
    tensor: str,
) -> float | None:
    """The floor reader `idx` allows for its operand `tensor`, or None when it is not an Add
    whose quantized sum has a Softmax-clamped range."""
    node = view.nodes[idx]
    if node.op_type != "Add" or len(node.input) != 2 or list(node.input).count(tensor) != 1:
        return None
    out = ranges.get(node.output[0]) if node.output[0] in sums else None
    if out is None:
        return None
    other = node.input[1] if node.input[0] == tensor else node.input[0]
    hi_other = _upper(plan, ranges, constants, other)
    if hi_other is None:
        return None
    return out.lo - hi_other - (out.hi - out.lo)


def _upper(
    plan: QuantPlan,
    ranges: Mapping[str, Range],
    constants: Mapping[str, onnx.TensorProto],
    tensor: str,
) -> float | None:
    """The largest value `tensor` takes after its Q/DQ: its range's top, a constant's maximum."""
    if tensor in constants:
        value = numpy_helper.to_array(constants[tensor])
        return float(np.max(value)) if value.size else None
    spec = plan.activations.get(tensor)
    if spec is None:
        return None
    r = ranges.get(spec.share_with or spec.key)
    return None if r is None else r.hi
