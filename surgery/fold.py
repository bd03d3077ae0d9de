"""Constant folding on a ModelProto, as the quantizer prepares a model and as `surgery check`
counts segments where ONNX's data propagation leaves shapes unknown: Constant nodes become
initializers, Shape nodes of statically shaped tensors become their values, and subgraphs of
constants are evaluated once with ONNX Runtime, re-inferring shapes after each round.

One implementation for both, so that check counts the segments of the model the compiler
sees."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from surgery.coverage import (
    NON_FOLDABLE_OPS,
    CoverageReport,
    NodePlacement,
    analyze_coverage,
)
from surgery.errors import SurgeryError
from surgery.model import infer_model_shapes
from surgery.targets import Target
from surgery.verify import quiet_session_options

__all__ = [
    "constant_node_tensor",
    "constants_to_initializers",
    "coverage_as_compiled",
    "fold_shapes_and_constants",
    "folded_copy",
    "shapes_wait_for_folding",
]

_FOLD_LIMIT_BYTES = 256 * 2**20
"""A folded constant larger than this stays a subgraph (e.g. an Expand to a full image)."""


def constant_node_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The value of a Constant node as a tensor (any of its value attributes), or None."""
    for a in node.attribute:
        if a.name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(a.t)
            return t
        if a.name == "value_float":
            return numpy_helper.from_array(np.array(a.f, dtype=np.float32))
        if a.name == "value_floats":
            return numpy_helper.from_array(np.array(list(a.floats), dtype=np.float32))
        if a.name == "value_int":
            return numpy_helper.from_array(np.array(a.i, dtype=np.int64))
        if a.name == "value_ints":
            return numpy_helper.from_array(np.array(list(a.ints), dtype=np.int64))
    return None


def constants_to_initializers(model: onnx.ModelProto) -> int:
    """Constant nodes (except those giving a graph output) become initializers; the count."""
    g = model.graph
    outputs = {o.name for o in g.output}
    keep: list[onnx.NodeProto] = []
    moved = 0
    for node in g.node:
        tensor = (
            constant_node_tensor(node)
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
            else None
        )
        if tensor is None or node.output[0] in outputs:
            keep.append(node)
            continue
        tensor.name = node.output[0]
        g.initializer.append(tensor)
        moved += 1
    if moved:
        del g.node[:]
        g.node.extend(keep)
    return moved


_FOLD_ROUNDS = 8
"""Most fold → re-infer rounds: each round's folds can make more shapes static (a Reshape whose
target was Concat(Gather(Shape(…))) gets a static output, whose Shape then folds too)."""


def fold_shapes_and_constants(model: onnx.ModelProto) -> int:
    """Fold Shapes of static tensors and constant subgraphs, re-inferring shapes after each
    round until nothing more folds (as onnxsim does)."""
    folded = _bypass_weight_identities(model)
    for _ in range(_FOLD_ROUNDS):
        count = _static_shapes_to_initializers(model) + _fold_constant_subgraphs(model)
        if not count:
            break
        folded += count
        del model.graph.value_info[:]  # stale symbolic dims would shadow the new static ones
        infer_model_shapes(model)
    return folded


_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _bypass_weight_identities(model: onnx.ModelProto) -> int:
    """Readers of Identity(initializer) read the initializer; the Identities go (those that
    give a graph output stay). Evaluating them would copy the weight once per Identity: torch
    exports a weight shared across layers (ALBERT's) through one Identity per use."""
    g = model.graph
    if any(a.type in _GRAPH_ATTRIBUTES for n in g.node for a in n.attribute):
        return 0  # a subgraph may read an Identity's output by name
    weights = {t.name for t in g.initializer}
    outputs = {o.name for o in g.output}
    alias = {
        node.output[0]: node.input[0]
        for node in g.node
        if node.op_type == "Identity"
        and node.domain in ("", "ai.onnx")
        and node.input[0] in weights
        and node.output[0] not in outputs
    }
    if not alias:
        return 0
    keep = [n for n in g.node if not (n.op_type == "Identity" and n.output[0] in alias)]
    for node in keep:
        for k, name in enumerate(node.input):
            if name in alias:
                node.input[k] = alias[name]
    del g.node[:]
    g.node.extend(keep)
    return len(alias)


def folded_copy(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto | None:
    """A copy of `model` with its nodes named `names` (coverage's labels, so that nodes keep
    their names through the fold) and its constants folded; None when no shape arithmetic or
    constant subgraph folds."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node, label in zip(copy.graph.node, names, strict=True):
        node.name = label
    constants_to_initializers(copy)
    try:
        return copy if fold_shapes_and_constants(copy) else None
    except SurgeryError:
        return None


def _static_shapes_to_initializers(model: onnx.ModelProto) -> int:
    """Shape nodes of tensors whose inferred shape is static, as int64 initializers.

    Exporters compute Resize sizes and Reshape targets from Shape(x) (torchvision's
    F.interpolate(size=x.shape[-2:])); with static input shapes those are constants, and the
    subgraph behind them folds. Left as computation, an integer op reading them has no constant
    operand and runs on the host."""
    g = model.graph
    read = {
        node.input[0]
        for node in g.node
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx") and node.input
    }
    if not read:
        return 0
    shapes: dict[str, list[int]] = {}
    for info in (*g.output, *g.value_info, *g.input):
        if info.name not in read or not info.type.HasField("tensor_type"):
            continue
        dims = info.type.tensor_type.shape.dim
        if info.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[info.name] = [d.dim_value for d in dims]
    outputs = {o.name for o in g.output}
    keep: list[onnx.NodeProto] = []
    for node in g.node:
        shape = shapes.get(node.input[0]) if node.input else None
        is_shape = node.op_type == "Shape" and node.domain in ("", "ai.onnx")
        if not is_shape or shape is None or node.output[0] in outputs:
            keep.append(node)
            continue
        attrs = {a.name: a.i for a in node.attribute}
        rank = len(shape)
        start, end = attrs.get("start", 0), attrs.get("end", rank)
        value = np.array(shape[slice(start, end)], np.int64)
        g.initializer.append(numpy_helper.from_array(value, node.output[0]))
    folded = len(g.node) - len(keep)
    if folded:
        del g.node[:]
        g.node.extend(keep)
    return folded


def _fold_constant_subgraphs(model: onnx.ModelProto) -> int:
    """Evaluate nodes whose inputs are all constant once, with ONNX Runtime."""
    g = model.graph
    constants = {t.name for t in g.initializer}
    initializers = set(constants)
    folded: list[int] = []
    for idx, node in enumerate(g.node):
        if node.op_type in NON_FOLDABLE_OPS or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in node.attribute
        ):
            continue
        ins = [i for i in node.input if i]
        if ins and all(i in constants for i in ins):
            folded.append(idx)
            constants.update(o for o in node.output if o)
    if not folded:
        return 0
    folded_set = set(folded)
    boundary = {i for idx, n in enumerate(g.node) if idx not in folded_set for i in n.input if i}
    boundary |= {o.name for o in g.output}
    needed = sorted(t for t in boundary if t in constants and t not in initializers)
    values = _evaluate(model, [g.node[i] for i in folded], needed) if needed else {}
    if values is None:
        return 0
    oversize = {n for n, v in values.items() if v.nbytes > _FOLD_LIMIT_BYTES}
    keep = _ancestors(g, folded_set, oversize)
    kept_outputs = {o for i in keep for o in g.node[i].output}
    for name, value in values.items():
        if name not in kept_outputs:
            g.initializer.append(numpy_helper.from_array(value, name))
    nodes = [n for i, n in enumerate(g.node) if i not in folded_set or i in keep]
    removed = len(g.node) - len(nodes)
    del g.node[:]
    g.node.extend(nodes)
    return removed


def _ancestors(g: onnx.GraphProto, within: set[int], tensors: set[str]) -> set[int]:
    """Indices of nodes in `within` that (transitively) produce `tensors`."""
    producer = {o: i for i in within for o in g.node[i].output if o}
    stack = [producer[t] for t in tensors if t in producer]
    seen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(producer[t] for t in g.node[i].input if t in producer)
    return seen


def _evaluate(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], outputs: list[str]
) -> dict[str, np.ndarray] | None:
    g = model.graph
    used = {i for n in nodes for i in n.input if i}
    graph = onnx.helper.make_graph(
        nodes,
        "fold",
        [],
        [onnx.helper.make_empty_tensor_value_info(o) for o in outputs],
        [t for t in g.initializer if t.name in used],
    )
    sub = onnx.helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=model.ir_version
    )
    options = quiet_session_options()
    try:
        session = ort.InferenceSession(
            sub.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        results = session.run(outputs, {})
    except Exception:  # ORT's own exception types; unfoldable constants are left to ORT at run time
        return None
    return {name: np.asarray(v) for name, v in zip(outputs, results, strict=True)}


def coverage_as_compiled(
    model: onnx.ModelProto,
    report: CoverageReport,
    target: str | Target,
    names: Sequence[str],
    *,
    op_target: Mapping[str, str] | None = None,
    suggest: bool = False,
) -> CoverageReport:
    """`report` (the analysis of `model`, whose nodes coverage labels `names`) as the compiler
    will see the model: where shapes wait for folding, the analysis of the folded model over
    every node given (`report` itself otherwise)."""
    if not shapes_wait_for_folding(report):
        return report
    folded = folded_copy(model, names)
    if folded is None:
        return report
    after = analyze_coverage(folded, target, op_target=op_target, suggest=suggest)
    return _with_folded_nodes(report, after)


_UNKNOWN_SHAPE = frozenset({"rank_unknown", "dynamic_shape"})


def shapes_wait_for_folding(report: CoverageReport) -> bool:
    """Whether shapes stay unknown past nodes that compute constants, with static inputs.

    ONNX's data propagation gives up on some shape arithmetic (the product of two gathered
    dims in `x.view(b, c * h, w)`), leaving every shape after such a Reshape unknown; the
    quantizer folds those subgraphs before compiling, and would then count other segments
    than this analysis of the unfolded model."""
    if report.dynamic_inputs:
        return False
    if not any(p.foldable and p.op_type != "Constant" for p in report.placements):
        return False
    return any(r.code in _UNKNOWN_SHAPE for b in report.blockers for r in b.reasons)


def _with_folded_nodes(before: CoverageReport, after: CoverageReport) -> CoverageReport:
    """`after` (the folded model's analysis) over every node of the model as given: a node
    folding removed is a foldable APU node, as `before` reports constant nodes."""
    placed = {p.name: p for p in after.placements}
    placements = []
    for p in before.placements:
        kept = placed.get(p.name)
        if kept is None:
            placements.append(NodePlacement(p.index, p.name, p.op_type, "APU", (), True))
        else:
            kept.index = p.index
            placements.append(kept)
    return CoverageReport(after.target, placements, after.segments, before.dynamic_inputs)
