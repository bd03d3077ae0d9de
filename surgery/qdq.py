"""QDQ models seen as the float model they quantize: what placement and segmentation look at.

Coverage on a QDQ graph itself would be wrong: every QuantizeLinear / DequantizeLinear between
two MLA ops runs on the CVU, so each op would become its own segment. The *float view* removes
every activation QuantizeLinear -> DequantizeLinear pair (consumers read the float tensor again)
and keeps the weight DequantizeLinear nodes (they fold as constants), so `surgery check` on a
quantized model and the compiler's partition both count the segments of the float model.
Activations kept in fp16 or bf16 (Cast to the narrow type -> Cast back to float) are pairs of
the same kind and are removed alike.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from surgery.graph import (
    VALUE_MOVING_OPS,
    GraphView,
    drop_unread_initializers,
    node_reads,
    outer_reads,
    remove_at,
    remove_where,
    rename_tensors,
    subgraphs,
    tensor_value,
)

QUANTIZATION_METADATA_KEY = "surgery.quantization"
"""`metadata_props` key of the JSON record the quantizer writes into every QDQ model (target,
requantization mode, per-node decisions)."""

_STANDARD_DYNAMIC_OPS = frozenset({"DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"})
DYNAMIC_QUANTIZATION_OPS: dict[str, frozenset[str]] = {
    "": _STANDARD_DYNAMIC_OPS,
    "ai.onnx": _STANDARD_DYNAMIC_OPS,
    "com.microsoft": frozenset(
        {"DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
    ),
}
"""Ops of ONNX Runtime's dynamic quantization (`quantize_dynamic`), by domain: activations
quantized at run time, which no NPU runs. A model made of them is quantized for a CPU; the
accelerator needs the float model, quantized statically."""


DYNAMIC_QUANTIZATION_REASON = (
    "an op of ONNX Runtime's dynamic quantization (activations quantized at run time), which "
    "the MLA does not run: `surgery fix` rewrites the model as the float model it quantizes, "
    "to quantize statically with `surgery quantize`"
)


def is_dynamic_quantization_op(domain: str, op_type: str) -> bool:
    return op_type in DYNAMIC_QUANTIZATION_OPS.get(domain, frozenset())


_QUANTIZE = "QuantizeLinear"
_DEQUANTIZE = "DequantizeLinear"
_NARROW_FLOATS = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


def _cast_to(node: onnx.NodeProto) -> int | None:
    if node.op_type != "Cast":
        return None
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _narrows(node: onnx.NodeProto) -> bool:
    """A QuantizeLinear, or a Cast to fp16/bf16: the first node of an activation pair."""
    return node.op_type == _QUANTIZE or _cast_to(node) in _NARROW_FLOATS


def _widens_back(node: onnx.NodeProto, narrowing: onnx.NodeProto) -> bool:
    """Whether `node` undoes `narrowing` (DequantizeLinear after QuantizeLinear, Cast to float
    after a Cast to fp16/bf16)."""
    if narrowing.op_type == _QUANTIZE:
        return node.op_type == _DEQUANTIZE
    return _cast_to(node) == onnx.TensorProto.FLOAT


def is_qdq(view: GraphView) -> bool:
    """Whether the viewed model quantizes run-time tensors (a QuantizeLinear fed by a
    non-constant)."""
    op_types = view.op_types
    if _QUANTIZE not in op_types:
        return False
    constants = set(view.initializers)
    constants |= {
        outs[0]
        for op, outs in zip(op_types, view.node_outputs, strict=True)
        if op == "Constant" and outs
    }
    return any(
        op == _QUANTIZE and ins and ins[0] not in constants
        for op, ins in zip(op_types, view.node_inputs, strict=True)
    )


def float_view(qdq_model: onnx.ModelProto, *, in_place: bool = False) -> onnx.ModelProto:
    """The QDQ graph without its activation Q -> DQ pairs: what coverage should look at.

    Consumers of a DequantizeLinear whose input comes from a QuantizeLinear of a run-time tensor
    read that tensor directly. A pair whose DequantizeLinear output is a graph output renames the
    float tensor to the output name. Weight DequantizeLinear nodes stay: they fold to constants.
    Nodes are tracked by index (protobuf wrapper objects have no stable identity). A copy, or
    with `in_place` `qdq_model` itself rewritten (for a caller that owns it: no copy of the
    weights).
    """
    model = qdq_model if in_place else copy.deepcopy(qdq_model)
    graph = model.graph
    nodes = list(graph.node)
    constants = {init.name for init in graph.initializer}
    constants |= {n.output[0] for n in nodes if n.op_type == "Constant" and n.output}
    producer = {out: k for k, node in enumerate(nodes) for out in node.output if out}
    graph_inputs = {i.name for i in graph.input}
    alias: dict[str, str] = {}
    dropped: set[int] = set()
    for k, node in enumerate(nodes):
        if not node.input or node.op_type not in (_DEQUANTIZE, "Cast"):
            continue
        q = producer.get(node.input[0])
        if q is None or not _narrows(nodes[q]) or nodes[q].input[0] in constants:
            continue
        if not _widens_back(node, nodes[q]):
            continue
        alias[node.output[0]] = nodes[q].input[0]
        dropped.update((k, q))
    # A QuantizeLinear (or narrowing Cast) also read by anything but the node undoing it, or
    # that is a graph output, must stay.
    for k, node in enumerate(nodes):
        if k in dropped or node.op_type == _DEQUANTIZE:
            continue
        for name in node_reads(node):
            q = producer.get(name)
            if q is not None and _narrows(nodes[q]):
                dropped.discard(q)
    output_names = [o.name for o in graph.output]
    for name in output_names:
        q = producer.get(name)
        if q is not None and _narrows(nodes[q]):
            dropped.discard(q)
    rename: dict[str, str] = {}
    for name in output_names:
        source = alias.get(name)
        if source is not None and source not in graph_inputs and source not in rename:
            rename[source] = name

    def resolve(name: str) -> str:
        while name in alias:
            name = alias[name]
        return rename.get(name, name)

    kept = [node for k, node in enumerate(nodes) if k not in dropped]
    for node in kept:
        for i, name in enumerate(node.input):
            if name:
                node.input[i] = resolve(name)
        for i, name in enumerate(node.output):
            node.output[i] = rename.get(name, name)
        for body in subgraphs(node):  # a Loop body reads a Q/DQ'd tensor of the outer graph
            rename_tensors(body, {t: r for t in outer_reads(body) if (r := resolve(t)) != t})
    remove_at(graph.node, sorted(dropped))
    produced = {out for node in graph.node for out in node.output}
    remove_where(graph.value_info, lambda v: v.name not in produced)
    return model


REWRITTEN_AS_FLOAT_NOTE = (
    "the model is quantized: the rules rewrote the float model it quantizes (Q/DQ pairs, "
    "QLinear ops and ONNX Runtime's dynamic quantization removed, weights dequantized), so the result is a "
    "float model and its quantization is gone; quantize it again with `surgery quantize` "
    "before compiling"
)
"""What `fix` and `apply` say when given a quantized model (they rewrite its `float_model`)."""


def is_quantized(view: GraphView) -> bool:
    """Whether the model is quantized, statically (QDQ or ONNX Runtime's QOperator format) or
    by ONNX Runtime's dynamic quantization: the models `fix` and `apply` rewrite as their
    `float_model`."""
    from surgery.qoperator import is_qoperator  # qoperator → model → targets read this module

    return (
        is_qdq(view)
        or is_qoperator(view)
        or any(
            is_dynamic_quantization_op(domain, op)
            for domain, op in zip(view.domains, view.op_types, strict=True)
        )
    )


def float_model(qdq_model: onnx.ModelProto) -> onnx.ModelProto:
    """The float model a quantized model quantizes, for rewriting: its float view with every
    DequantizeLinear of a constant (a weight, or a Constant → Q → DQ as ONNX Runtime's quantizer
    writes a GELU's 1 and 0.5) evaluated into a float initializer, ONNX Runtime's dynamic
    quantization undone (`surgery.dynamic_quantization`), its QOperator ops read as QDQ first
    (`surgery.qoperator`), and without the quantizer's record
    (the model is no longer quantized). Rules see an operand as constant only when it is an
    initializer, and onnx-graphsurgeon's folding never folds a Dequantize."""
    # Imported here: fold, coverage and the rule engine read this module.
    from surgery.coverage import constant_tensors
    from surgery.dynamic_quantization import undo_dynamic_quantization
    from surgery.fold import evaluate_nodes
    from surgery.qoperator import qdq_form

    given = qdq_model
    qdq_model, _ = qdq_form(given)
    restored = _with_removed_activations_restored(qdq_model)
    model = float_view(restored, in_place=restored is not given)  # a copy made here: rewrite it
    view = GraphView(model)
    outputs = {o.name for o in model.graph.output}
    _, foldable = constant_tensors(view)
    behind = _computed_constants(view, foldable)
    wanted = [
        k
        for k, op in enumerate(view.op_types)
        if op == _DEQUANTIZE and k in behind and view.node_outputs[k][0] not in outputs
    ]
    values = {
        view.node_outputs[k][0]: value
        for k in wanted
        if behind[k] == {k} and (value := dequantized_weight(view, k)) is not None
    }
    left = [k for k in wanted if view.node_outputs[k][0] not in values]
    if left:  # Constant -> QuantizeLinear -> DequantizeLinear and other chains: ONNX Runtime
        within = sorted({j for k in left for j in behind[k]})
        names = [view.node_outputs[k][0] for k in left]
        values.update(evaluate_nodes(model, [view.nodes[j] for j in within], names) or {})
    if values:
        _replace_by_initializers(model, values)
    drop_unread_initializers(model.graph)  # the activations' scales and zero points
    undo_dynamic_quantization(model)
    props = [p for p in model.metadata_props if p.key != QUANTIZATION_METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    return model


_NON_NEGATIVE_OPS = frozenset(
    {"Relu", "Sigmoid", "Softmax", "Abs", "Exp", "Softplus", "HardSigmoid", "Sqrt", "Shape", "Size"}
)
"""Ops whose outputs are never negative."""

_SIGN_KEEPING_OPS = (VALUE_MOVING_OPS - {"Pad"}) | {
    "AveragePool",
    "GlobalAveragePool",
    "Concat",
    "ReduceMax",
    "ReduceMean",
    _DEQUANTIZE,
}
"""Ops whose outputs are non-negative when their data input is (moves, pools, maxima, and a
DequantizeLinear of a range from zero)."""

_INTEGER_RANGES = {
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT16: (0, 65535),
    onnx.TensorProto.INT16: (-32768, 32767),
    onnx.TensorProto.UINT4: (0, 15),
    onnx.TensorProto.INT4: (-8, 7),
}
"""The values of each integer type an activation can be quantized to."""


def _with_removed_activations_restored(qdq_model: onnx.ModelProto) -> onnx.ModelProto:
    """`qdq_model`, or a copy with a Clip in front of each activation QuantizeLinear that stands
    for a Relu or Clip the quantizer removed.

    ONNX Runtime's quantizer (asymmetric QDQ, its default) drops a Relu or Clip that follows a
    quantized op and lets the next QuantizeLinear's range, [0, max], clamp instead
    (QDQRemovableActivation). Taking that Q -> DQ pair away takes the activation with it: the
    float model of a PP-OCR classifier lost its ReLU6s and overflowed to NaN. A QuantizeLinear
    of a run-time tensor that can be negative, whose range starts at exactly 0 (zero point at
    its type's minimum) and which a DequantizeLinear reads, gets a Clip to its range: what the
    pair computes, rounding aside."""
    from surgery.coverage import constant_tensors  # coverage reads this module

    view = GraphView(qdq_model)
    if _QUANTIZE not in view.op_types:
        return qdq_model
    _, foldable = constant_tensors(view)
    non_negative: set[str] = set()
    clamps: dict[int, tuple[float, float]] = {}
    for k, (op, ins, outs) in enumerate(
        zip(view.op_types, view.node_inputs, view.node_outputs, strict=True)
    ):
        if op == _QUANTIZE and ins and ins[0]:
            clamp = _range_from_zero(view, view.nodes[k])
            if clamp is None:
                continue
            non_negative.update(outs)
            read = view.consumers.get(outs[0], ())
            if (
                not foldable[k]  # a weight's Q -> DQ is folded, not removed
                and ins[0] in view.producer
                and ins[0] not in non_negative
                and any(view.op_types[c] == _DEQUANTIZE for c in read)
            ):
                clamps[k] = clamp
        elif _keeps_non_negative(view, k, non_negative):
            non_negative.update(outs)
    if not clamps:
        return qdq_model
    model = copy.deepcopy(qdq_model)
    graph = model.graph
    taken = {*view.producer, *view.initializers, *(i.name for i in graph.input)}
    types = {v.name: v.type for v in (*graph.input, *graph.value_info)}
    clips: list[tuple[int, onnx.NodeProto]] = []
    for k in sorted(clamps):
        node = graph.node[k]
        name = f"{node.input[0]}_clamp"
        while {name, f"{name}_min", f"{name}_max"} & taken:
            name = f"{name}_{k}"
        taken.update((name, f"{name}_min", f"{name}_max"))
        bounds = [f"{name}_min", f"{name}_max"]
        graph.initializer.extend(
            numpy_helper.from_array(np.array(v, np.float32), b)
            for v, b in zip(clamps[k], bounds, strict=True)
        )
        clip = onnx.helper.make_node(
            "Clip", [node.input[0], *bounds], [name], name=f"{node.name or name}_clamp"
        )
        clips.append((k, clip))
        if node.input[0] in types:  # a Clip keeps its input's type and shape
            graph.value_info.add(name=name).type.CopyFrom(types[node.input[0]])
        node.input[0] = name
    for k, clip in reversed(clips):  # each in front of its QuantizeLinear; no node copied
        graph.node.insert(k, clip)
    return model


def _keeps_non_negative(view: GraphView, k: int, non_negative: set[str]) -> bool:
    """Whether node `k` outputs no negative value, given the tensors known `non_negative`."""
    op, ins = view.op_types[k], view.node_inputs[k]
    if op in _NON_NEGATIVE_OPS:
        return True
    if op == "Clip":
        low = view.constant_value(ins[1]) if len(ins) > 1 and ins[1] else None
        return low is not None and low.size > 0 and float(np.min(low)) >= 0

    def known(t: str) -> bool:
        if t in non_negative:
            return True
        value = view.constant_value(t)
        return value is not None and value.size > 0 and float(np.min(value)) >= 0

    if op in ("Concat", "Sum", "Max", "Add", "Mul", "Div"):
        return all(known(t) for t in ins if t)
    return (op in _SIGN_KEEPING_OPS or op == "Pow") and bool(ins) and known(ins[0])


def _range_from_zero(view: GraphView, quantize: onnx.NodeProto) -> tuple[float, float] | None:
    """(0, max) of a per-tensor QuantizeLinear whose zero point is its type's minimum, else
    None."""
    ins = quantize.input
    if len(ins) < 2:
        return None
    if len(ins) > 2 and ins[2]:  # the zero point first: most ranges do not start at 0
        zero_point = view.constant_value(ins[2])
        dtype = view.tensor(ins[2]).elem_type
    else:  # no zero point: 0 of output_dtype, uint8 unless the attribute says otherwise
        zero_point = np.zeros(1)
        attr = next((a.i for a in quantize.attribute if a.name == "output_dtype"), 0)
        dtype = attr or onnx.TensorProto.UINT8
    if zero_point is None or zero_point.size != 1 or dtype not in _INTEGER_RANGES:
        return None
    qmin, qmax = _INTEGER_RANGES[dtype]
    if int(zero_point.ravel()[0]) != qmin:
        return None
    scale = view.constant_value(ins[1])
    if scale is None or scale.size != 1 or scale.dtype.kind != "f":
        return None
    return 0.0, float((qmax - qmin) * float(scale.ravel()[0]))


def _computed_constants(view: GraphView, foldable: list[bool]) -> dict[int, set[int]]:
    """For each node that only computes constants from initializers, the nodes (itself
    included) that compute it; nodes behind a Shape or Size (a run-time tensor's shape) are
    left out, since evaluating them needs the model's inputs."""
    producer = view.producer
    behind: dict[int, set[int]] = {}
    for k in range(len(view.nodes)):
        if not foldable[k] or view.op_types[k] in ("Shape", "Size"):
            continue
        closure = {k}
        for t in view.node_inputs[k]:
            if t in producer:
                if producer[t] not in behind:
                    break
                closure |= behind[producer[t]]
        else:
            behind[k] = closure
    return behind


def _replace_by_initializers(model: onnx.ModelProto, values: dict[str, Any]) -> None:
    """The nodes making `values` give way to initializers of those values; what only fed them
    (Constant → QuantizeLinear, the int8 weights) is dead then and goes (`prune_dead`)."""
    from surgery.edit import prune_dead

    graph = model.graph
    remove_where(graph.node, lambda n: bool(n.output) and n.output[0] in values)
    for name, value in values.items():
        if value.dtype == np.float32:  # the bytes set once: from_array + extend copy them twice
            tensor = graph.initializer.add(name=name, data_type=onnx.TensorProto.FLOAT)
            tensor.dims.extend(value.shape)
            tensor.raw_data = value.astype("<f4", copy=False).tobytes()
        else:
            graph.initializer.append(numpy_helper.from_array(value, name))
    prune_dead(model)


_EXACT_CODES = frozenset({np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32)})
"""Integer types whose DequantizeLinear `dequantized_weight` computes as ONNX Runtime does."""


def dequantized_weight(view: GraphView, k: int) -> np.ndarray | None:
    """The float32 value of DequantizeLinear node `k` of initializers, per tensor or per axis,
    bit for bit as ONNX Runtime computes it, `float(x - zero_point) * scale`; None for what
    this does not cover (blocked or 4-bit codes, other scale or output types), which ONNX
    Runtime then evaluates. In numpy it takes a quarter of the time (5 ms against 20 on an
    int8 Whisper encoder's 8 M weights): no session to build, no copy of the codes into a
    model for it."""
    node = view.nodes[k]
    attrs = {a.name: a for a in node.attribute}
    if attrs.get("block_size", onnx.AttributeProto()).i or "output_dtype" in attrs:
        return None
    ins = view.node_inputs[k]
    x = _stored_value(view, ins[0])
    scale = _stored_value(view, ins[1]) if len(ins) > 1 else None
    zero = _stored_value(view, ins[2]) if len(ins) > 2 and ins[2] else None
    if x is None or scale is None or x.dtype not in _EXACT_CODES or scale.dtype != np.float32:
        return None
    if zero is not None and (zero.dtype != x.dtype or zero.shape != scale.shape):
        return None
    if scale.size == 1 and scale.ndim <= 1:  # per tensor (ONNX Runtime's reading of [s])
        scale = scale.reshape(())
        zero = zero.reshape(()) if zero is not None else None
    elif scale.ndim == 1 and x.ndim > 0:  # per axis
        axis = attrs["axis"].i if "axis" in attrs else 1
        if not -x.ndim <= axis < x.ndim or scale.size != x.shape[axis]:
            return None
        along = [1] * x.ndim
        along[axis] = scale.size
        scale = scale.reshape(along)
        zero = zero.reshape(along) if zero is not None else None
    elif scale.ndim != 0:
        return None
    if zero is None or not zero.any():
        value = x.astype(np.float32)
    else:
        value = (x.astype(np.int64) - zero.astype(np.int64)).astype(np.float32)
    value *= scale
    return value


def _stored_value(view: GraphView, name: str) -> np.ndarray | None:
    """An initializer's value, whatever its size (read-only where it views raw bytes)."""
    tensor = view.initializers.get(name)
    return tensor_value(tensor) if tensor is not None else None


def quantization_record(model: onnx.ModelProto) -> dict[str, Any]:
    """The quantizer's JSON record of `model` ({} when absent or unreadable)."""
    for prop in model.metadata_props:
        if prop.key == QUANTIZATION_METADATA_KEY:
            try:
                record = json.loads(prop.value)
            except json.JSONDecodeError:
                return {}
            return record if isinstance(record, dict) else {}
    return {}


def quantized_for(model: onnx.ModelProto) -> str | None:
    """The target the model was quantized for, from its quantization record."""
    target = quantization_record(model).get("target")
    return target if isinstance(target, str) else None
