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
from onnx import numpy_helper

from surgery.coverage import (
    NON_FOLDABLE_OPS,
    CoverageReport,
    NodePlacement,
    NodePlacer,
    analyze_coverage,
    dynamic_inputs,
    shape_slice,
)
from surgery.errors import SurgeryError
from surgery.graph import GraphView, remove_at
from surgery.model import infer_model_shapes
from surgery.targets import Target
from surgery.verify import quiet_session_options

__all__ = [
    "constant_node_tensor",
    "constants_to_initializers",
    "coverage_as_compiled",
    "fold_shapes_and_constants",
    "fold_in_place",
    "folded_copy",
    "folded_coverage",
    "shapes_wait_for_folding",
    "waits_for_folding",
]

FOLD_LIMIT_BYTES = 256 * 2**20
"""A folded constant larger than this stays a subgraph (e.g. an Expand to a full image)."""


def constant_node_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The value of a Constant node as a tensor (any of its value attributes), or None."""
    value = _constant_value(node)
    if value is None:
        return None
    copy = onnx.TensorProto()
    copy.CopyFrom(value)
    return copy


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """`constant_node_tensor` without copying a `value` attribute's tensor (the node's own
    tensor then: not to be changed)."""
    for a in node.attribute:
        if a.name == "value":
            return a.t
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
    """Constant nodes (except those giving a graph output) become initializers; the count.

    The tensors are appended in one `extend` (one copy each) and named there: copying each
    into a new TensorProto first, then appending it, copied every weight twice."""
    g = model.graph
    outputs = {o.name for o in g.output}
    moved: list[int] = []
    tensors: list[onnx.TensorProto] = []
    names: list[str] = []
    for idx, node in enumerate(g.node):
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        tensor = _constant_value(node)
        if tensor is None or node.output[0] in outputs:
            continue
        moved.append(idx)
        tensors.append(tensor)
        names.append(node.output[0])
    if moved:
        start = len(g.initializer)
        g.initializer.extend(tensors)
        for tensor, name in zip(g.initializer[start:], names, strict=True):
            tensor.name = name
        remove_at(g.node, moved)
    return len(moved)


FOLD_ROUNDS = 8
"""Most fold → re-infer rounds: each round's folds can make more shapes static (a Reshape whose
target was Concat(Gather(Shape(…))) gets a static output, whose Shape then folds too)."""


def fold_shapes_and_constants(model: onnx.ModelProto) -> int:
    """Fold Shapes of static tensors and constant subgraphs, re-inferring shapes after each
    round until nothing more folds (as onnxsim does)."""
    folded = _bypass_weight_identities(model)
    for _ in range(FOLD_ROUNDS):
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
    weights = {t.name for t in g.initializer}
    outputs = {o.name for o in g.output}
    identities = [
        idx
        for idx, node in enumerate(g.node)
        if node.op_type == "Identity"
        and node.domain in ("", "ai.onnx")
        and node.input[0] in weights
        and node.output[0] not in outputs
    ]
    # Only then the scan of every attribute (most models have no such Identity).
    if not identities or any(a.type in _GRAPH_ATTRIBUTES for n in g.node for a in n.attribute):
        return 0  # a subgraph may read an Identity's output by name
    alias = {g.node[idx].output[0]: g.node[idx].input[0] for idx in identities}
    remove_at(
        g.node,
        [idx for idx, n in enumerate(g.node) if n.op_type == "Identity" and n.output[0] in alias],
    )
    for node in g.node:
        for k, name in enumerate(node.input):
            if name in alias:
                node.input[k] = alias[name]
    return len(alias)


def folded_copy(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto | None:
    """A copy of `model` with its nodes named `names` (coverage's labels, so that nodes keep
    their names through the fold) and its constants folded; None when no shape arithmetic or
    constant subgraph folds."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy if fold_in_place(copy, names) else None


def fold_in_place(model: onnx.ModelProto, names: Sequence[str]) -> bool:
    """`folded_copy` on `model` itself (for a caller that owns it); whether anything folded.
    When nothing folds, `model` has been changed all the same (nodes renamed, Constant
    nodes turned into initializers)."""
    for node, label in zip(model.graph.node, names, strict=True):
        node.name = label
    constants_to_initializers(model)
    try:
        return fold_shapes_and_constants(model) > 0
    except SurgeryError:
        return False


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
    folded: list[int] = []
    for idx, node in enumerate(g.node):
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx") or not node.input:
            continue
        shape = shapes.get(node.input[0])
        if shape is None or node.output[0] in outputs:
            continue
        value = np.array(shape[shape_slice(node, len(shape))], np.int64)
        g.initializer.append(numpy_helper.from_array(value, node.output[0]))
        folded.append(idx)
    remove_at(g.node, folded)
    return len(folded)


def _fold_constant_subgraphs(model: onnx.ModelProto) -> int:
    """Evaluate nodes whose inputs are all constant once, with ONNX Runtime."""
    g = model.graph
    constants = {t.name for t in g.initializer}
    initializers = set(constants)
    node_inputs = [[i for i in node.input if i] for node in g.node]
    folded: list[int] = []
    for idx, node in enumerate(g.node):
        ins = node_inputs[idx]
        if (
            ins
            and constants.issuperset(ins)
            and node.op_type not in NON_FOLDABLE_OPS
            and not any(a.type in _GRAPH_ATTRIBUTES for a in node.attribute)
        ):
            folded.append(idx)
            constants.update(o for o in node.output if o)
    if not folded:
        return 0
    folded_set = set(folded)
    boundary = {i for idx, ins in enumerate(node_inputs) if idx not in folded_set for i in ins}
    boundary |= {o.name for o in g.output}
    needed = sorted(t for t in boundary if t in constants and t not in initializers)
    values = evaluate_nodes(model, [g.node[i] for i in folded], needed) if needed else {}
    if values is None:
        return 0
    oversize = {n for n, v in values.items() if v.nbytes > FOLD_LIMIT_BYTES}
    keep = _ancestors(g, folded_set, oversize)
    kept_outputs = {o for i in keep for o in g.node[i].output}
    for name, value in values.items():
        if name not in kept_outputs:
            g.initializer.append(numpy_helper.from_array(value, name))
    removed = [i for i in folded if i not in keep]
    remove_at(g.node, removed)
    return len(removed)


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


def evaluate_nodes(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], outputs: list[str]
) -> dict[str, np.ndarray] | None:
    """The values of `outputs` of `nodes`, which read only `model`'s initializers, computed
    once with ONNX Runtime (which runs every opset; ONNX's reference evaluator lacks some
    versions, such as DequantizeLinear-13); None if ONNX Runtime cannot."""
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
    import onnxruntime as ort  # loaded only when something folds: most checks never need it

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
    labels = [p.name for p in report.placements]
    return _with_folded_nodes(labels, [p.op_type for p in report.placements], after)


def folded_coverage(
    model: onnx.ModelProto,
    view: GraphView,
    target: Target,
    *,
    op_target: Mapping[str, str] | None = None,
    suggest: bool = False,
) -> CoverageReport | None:
    """The analysis of `model` (viewed by `view`) folded, over every node of `model`: what
    `coverage_as_compiled` makes of `model`'s analysis where `waits_for_folding`, without
    analysing the unfolded model first; None when nothing folds.

    Folds `model` in place, for a caller that owns it (check, on the model it loaded): when
    nothing folds, `model` and `view` are spent (see `fold_in_place`)."""
    names, op_types = view.names, view.op_types
    if not fold_in_place(model, names):
        return None
    after = analyze_coverage(model, target, op_target=op_target, suggest=suggest)
    return _with_folded_nodes(names, op_types, after)


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
    return any(_blocked_by_unknown_shape(b) for b in report.blockers)


def _blocked_by_unknown_shape(p: NodePlacement) -> bool:
    return p.is_blocker and any(r.code in _UNKNOWN_SHAPE for r in p.reasons)


def waits_for_folding(
    model: onnx.ModelProto,
    view: GraphView,
    target: Target,
    constants: tuple[set[str], list[bool]],
    op_target: Mapping[str, str] | None,
) -> bool:
    """`shapes_wait_for_folding` of the analysis of `model` (`constants` being
    `constant_tensors(view)`), placing only the nodes that could make it true.

    The placement reasons about an unknown rank or a dynamic shape are about a node's data
    tensors (its outputs and computed inputs) or, for a node without computed inputs, its
    first input: a node whose data tensors are all static cannot give one otherwise. Those
    are the tensors the analysis reads anyway, and most models have no such node (or have
    dynamic inputs, or no foldable computation) and place nothing here."""
    if dynamic_inputs(view):
        return False
    known, foldable = constants
    if not any(f and op != "Constant" for f, op in zip(foldable, view.op_types, strict=True)):
        return False
    place = NodePlacer(model, target, view, frozenset(known), op_target)
    # From the last node back: every shape after the arithmetic inference gave up on stays
    # unknown, so such a blocker is found first near the outputs.
    return any(
        _blocked_by_unknown_shape(place(idx))
        for idx in reversed(range(len(foldable)))
        if not foldable[idx] and _suspect(view, idx, known)
    )


def _suspect(view: GraphView, idx: int, constants: set[str]) -> bool:
    """Whether a data tensor of node `idx` has an unknown or dynamic shape, or it has none."""
    tensor = view.tensor
    data = [t for t in view.node_inputs[idx] if t and t not in constants]
    if not data:
        return True
    return not all(tensor(t).is_static for t in (*data, *view.node_outputs[idx]) if t)


def _with_folded_nodes(
    names: Sequence[str], op_types: Sequence[str], after: CoverageReport
) -> CoverageReport:
    """`after` (the folded model's analysis) over every node of the model as given, whose
    nodes coverage labels `names`: a node folding removed is a foldable APU node, as coverage
    reports constant nodes. Shapes wait for folding only without dynamic inputs, so the
    model as given has none."""
    placed = {p.name: p for p in after.placements}
    placements = []
    for idx, (name, op_type) in enumerate(zip(names, op_types, strict=True)):
        kept = placed.get(name)
        if kept is None:
            placements.append(NodePlacement(idx, name, op_type, "APU", (), True))
        else:
            kept.index = idx
            placements.append(kept)
    return CoverageReport(after.target, placements, after.segments, {})
