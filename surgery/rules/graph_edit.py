"""onnx-graphsurgeon plumbing shared by the rules: import/export, lookups, small edits."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.logger import G_LOGGER

from surgery.errors import SurgeryError
from surgery.graph import GraphView, shape_from_type
from surgery.model import load_model, raise_ir_version, toposort_nodes
from surgery.ort_logging import quiet_ort_logging

G_LOGGER.severity = G_LOGGER.ERROR  # graphsurgeon logs to stdout; stdout belongs to --json and MCP

GRAPH_METADATA_ATTR = "surgery_metadata"
"""A rule that changes model metadata (e.g. placement pins) stores {key: value} in
`vars(graph)[GRAPH_METADATA_ATTR]`; `export_graph` writes it into `metadata_props`."""


@contextlib.contextmanager
def quiet_graphsurgeon() -> Iterator[None]:
    previous = G_LOGGER.severity
    G_LOGGER.severity = G_LOGGER.CRITICAL
    try:
        yield
    finally:
        G_LOGGER.severity = previous


def fold_graph_constants(graph: gs.Graph) -> None:
    """onnx-graphsurgeon's constant folding (shape arithmetic included), in place, quietly.

    Its shape folding reads `Shape` as the whole shape and ignores the `start`/`end`
    attributes of opset 15 (which torch's dynamo exporter writes for `x.size(i)`): a
    `Shape(x, start=1)` would fold to the wrong vector and the model would compute garbage.
    Those nodes become a plain `Shape` and a `Slice` first, which fold correctly (or stay,
    meaning the same, when the dims are dynamic). A `CastLike` whose target type is known
    becomes a `Cast`, so a constant it converts (ONNX function bodies cast their scalars
    "like" a run-time tensor) folds too. An Identity of a weight is bypassed, not folded:
    folding would copy the weight once per Identity (torch exports a shared weight, as in
    ALBERT's shared layers, through one Identity per use).
    """
    _split_shape_ranges(graph)
    _cast_like_to_cast(graph)
    _bypass_constant_identities(graph)
    with quiet_graphsurgeon():
        quiet_ort_logging()  # onnx-graphsurgeon folds in sessions without options
        graph.fold_constants(fold_shapes=True, error_ok=True, flatten_subgraphs=False)
        graph.cleanup()


def _bypass_constant_identities(graph: gs.Graph) -> None:
    """Readers of Identity(weight) read the weight itself (graph outputs keep their Identity)."""
    outputs = set(map(id, graph.outputs))
    for node in graph.nodes:
        if node.op != "Identity" or not isinstance(node.inputs[0], gs.Constant):
            continue
        out = node.outputs[0]
        if id(out) in outputs:
            continue
        for reader in list(out.outputs):
            for k, tensor in enumerate(reader.inputs):
                if tensor is out:
                    reader.inputs[k] = node.inputs[0]


def _split_shape_ranges(graph: gs.Graph) -> None:
    """Shape(x, start, end) → Slice(Shape(x), [start], [end]) for every such node."""
    for node in list(graph.nodes):
        if node.op != "Shape" or not ({"start", "end"} & node.attrs.keys()):
            continue
        start = int(node.attrs.pop("start", 0))
        end = node.attrs.pop("end", None)
        whole = gs.Variable(f"{node.outputs[0].name}_whole_shape", np.int64, None)
        ranged = node.outputs[0]
        node.outputs = [whole]
        bounds = [
            gs.Constant(f"{ranged.name}_{label}", np.array([value], np.int64))
            for label, value in (("start", start), ("end", _INT64_MAX if end is None else end))
        ]
        graph.nodes.append(
            gs.Node("Slice", f"{node.name}_range", inputs=[whole, *bounds], outputs=[ranged])
        )


_INT64_MAX = np.iinfo(np.int64).max


def _cast_like_to_cast(graph: gs.Graph) -> None:
    """CastLike(x, like) → Cast(x, to=type of like) wherever that type is known."""
    for node in graph.nodes:
        if node.op != "CastLike" or len(node.inputs) != 2 or node.inputs[1].dtype is None:
            continue
        like = node.inputs[1].dtype
        to = like if isinstance(like, int) else onnx.helper.np_dtype_to_tensor_dtype(np.dtype(like))
        node.op = "Cast"
        node.attrs = {
            "to": int(to),
            **({"saturate": node.attrs["saturate"]} if "saturate" in node.attrs else {}),
        }
        node.inputs = [node.inputs[0]]


_MAX_FOLD_ROUNDS = 64
"""Fold → re-infer rounds; each round resolves one more level of shape arithmetic. The loop
stops as soon as a round folds nothing, so this only bounds pathological graphs: a Swin-T's
window padding and shift mask chain their shapes through all twelve blocks (15 rounds)."""


def fold_until_fixed_point(graph: gs.Graph, like: onnx.ModelProto) -> None:
    """Fold constants, re-infer shapes, and again, until a round folds nothing (`like`: the
    model the graph came from, for the fields export needs)."""
    for _ in range(_MAX_FOLD_ROUNDS):
        count = len(graph.nodes)
        fold_graph_constants(graph)
        if len(graph.nodes) == count or not _refresh_shapes(graph, like):
            break


def _refresh_shapes(graph: gs.Graph, like: onnx.ModelProto) -> bool:
    """Give the graph's unshaped tensors the shapes inference now finds; whether any changed.

    A folded Reshape target makes its output's shape known only after re-inference, and only
    then can the Shape nodes that read that output fold in turn (a transformer's
    `Reshape(x, Concat(Shape(y)[:2], -1))` chains several such steps), as onnxsim iterates.
    """
    try:
        inferred = load_model(export_graph(graph.copy(), like))
    except SurgeryError:
        return False
    tensors = graph.tensors()
    changed = False
    for info in (*inferred.graph.value_info, *inferred.graph.output):
        tensor = tensors.get(info.name)
        if not isinstance(tensor, gs.Variable) or _static(tensor.shape):
            continue
        elem, shape = shape_from_type(info.type)
        if shape is None or (tensor.shape is not None and _static(tensor.shape) >= _static(shape)):
            continue
        tensor.shape = [d if isinstance(d, int) else None for d in shape]
        tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else tensor.dtype
        changed = True
    return changed


def _static(shape: Sequence[int | str | None] | None) -> bool:
    """Whether every dimension of a (graphsurgeon or inferred) shape is a number."""
    return shape is not None and all(isinstance(d, int) for d in shape)


def with_unique_node_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every node the display name coverage uses (`<Op>_<i>` when unnamed, `#i` if taken).

    Rules and users address nodes by name, so names must be unique before any edit. Renaming
    nodes changes no numbers.
    """
    view = GraphView(model)
    if all(node.name == label for node, label in zip(view.nodes, view.names, strict=True)):
        return model
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    for node, label in zip(renamed.graph.node, view.names, strict=True):
        node.name = label
    return renamed


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    with quiet_graphsurgeon():
        return gs.import_onnx(model)


_MERGE_BYTES = 1 << 20
"""Constants made in memory from this size on are compared for duplicates at export."""


def _merge_equal_derived_constants(graph: gs.Graph) -> None:
    """Readers of equal large constants a rewrite made in memory read one of them.

    Rules derive a weight per use (a 1×1 Conv's [M, K, 1, 1] from a MatMul's [K, M]); a weight
    that several layers share (ALBERT's) would be copied once per use, quadrupling a 785 MB
    model. Constants still lazy (as imported) are left alone: reading them would copy every
    weight of the model on every export."""
    groups: dict[tuple, list[gs.Constant]] = {}
    for tensor in graph.tensors().values():
        values = getattr(tensor, "_values", None)
        if isinstance(values, np.ndarray) and values.nbytes >= _MERGE_BYTES:
            groups.setdefault(_fingerprint(values), []).append(tensor)
    for same in groups.values():
        for other in same[1:]:
            if not np.array_equal(other.values, same[0].values):
                continue
            for reader in list(other.outputs):
                for k, tensor in enumerate(reader.inputs):
                    if tensor is other:
                        reader.inputs[k] = same[0]


def _fingerprint(values: np.ndarray) -> tuple:
    """Dtype, shape and a hash of an evenly spaced sample: equal arrays agree on all three."""
    flat = values.reshape(-1)
    sample = np.ascontiguousarray(flat[:: max(1, flat.size // 4096)])
    return (
        values.dtype.str,
        values.shape,
        hashlib.blake2b(sample.tobytes(), digest_size=16).digest(),
    )


def export_graph(graph: gs.Graph, like: onnx.ModelProto) -> onnx.ModelProto:
    """Export, keeping the model-level fields graphsurgeon does not carry (IR, metadata, …).

    Sorted by `toposort_nodes`, not graphsurgeon's toposort, which recurses once per node of a
    dependency chain and overflows Python's stack on the chains of an unrolled recurrence
    (three GRU layers of 50 steps)."""
    _merge_equal_derived_constants(graph)
    with quiet_graphsurgeon():
        graph.cleanup(remove_unused_graph_inputs=False)
        model = gs.export_onnx(graph, do_type_check=False)
    toposort_nodes(model)
    model.ir_version = like.ir_version
    model.producer_name = like.producer_name
    model.producer_version = like.producer_version
    model.domain = like.domain
    model.model_version = like.model_version
    model.doc_string = like.doc_string
    updates = vars(graph).get(GRAPH_METADATA_ATTR) or {}  # not getattr: gs.Graph logs misses
    kept = [p for p in like.metadata_props if p.key not in updates]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in updates.items():
        model.metadata_props.add(key=key, value=value)
    default = {o.domain: o.version for o in like.opset_import}
    for o in model.opset_import:
        if o.domain in default:
            o.version = max(o.version, default[o.domain])
    declared = {o.domain for o in model.opset_import}
    for o in like.opset_import:
        if o.domain not in declared:
            model.opset_import.append(o)
    default_version = next(
        (o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0
    )
    if default_version > default.get("", default.get("ai.onnx", 0)):
        raise_ir_version(model)  # a rule that raised the opset must raise the IR version too
    del model.graph.value_info[:]  # stale after edits; the engine re-infers
    if model.ir_version < 4:
        _list_initializers_as_inputs(model)
    return model


def _list_initializers_as_inputs(model: onnx.ModelProto) -> None:
    """IR < 4 requires every initializer to be a graph input too; list the new ones."""
    listed = {i.name for i in model.graph.input}
    for init in model.graph.initializer:
        if init.name not in listed:
            model.graph.input.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
            listed.add(init.name)


def nodes_by_name(graph: gs.Graph) -> dict[str, gs.Node]:
    return {n.name: n for n in graph.nodes}


def constant(name: str, value: np.ndarray) -> gs.Constant:
    """A constant of this value and shape (a scalar stays 0-d: np.ascontiguousarray alone
    makes it [1], which Clip's bounds, for one, may not be)."""
    arr = np.asarray(value)
    return gs.Constant(name, np.ascontiguousarray(arr).reshape(arr.shape))


def replace_tensor_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Point every consumer (and graph output) of `old` at `new`."""
    for node in list(old.outputs):
        for k, t in enumerate(node.inputs):
            if t is old:
                node.inputs[k] = new
    graph.outputs = [new if t is old else t for t in graph.outputs]


def bypass_node(graph: gs.Graph, node: gs.Node, keep_input: int = 0) -> None:
    """Remove a single-path node, wiring its consumers to its `keep_input`-th input.

    When the node's output is a graph output, the producer's tensor is renamed so the graph
    keeps its output name.
    """
    src, dst = node.inputs[keep_input], node.outputs[0]
    if dst in graph.outputs:
        if isinstance(src, gs.Variable) and src not in graph.inputs and len(src.outputs) == 1:
            node.outputs.clear()
            src.name, dst.name = dst.name, src.name + "__bypassed"
            src.dtype, src.shape = dst.dtype or src.dtype, dst.shape or src.shape
            graph.outputs = [src if t is dst else t for t in graph.outputs]
            node.inputs.clear()
            return
        identity = gs.Node("Identity", name=node.name, inputs=[src], outputs=[dst])
        node.inputs.clear()
        node.outputs.clear()
        graph.nodes.append(identity)
        return
    replace_tensor_uses(graph, dst, src)
    node.inputs.clear()
    node.outputs.clear()
