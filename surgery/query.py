"""Focused graph queries, for agents that must not read a 2,000-node dump.

One node with its tensors and neighbours, a k-hop neighbourhood, and nodes by op type or name
pattern — each returns plain dicts ready for JSON.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import onnx
from onnx import numpy_helper

from surgery.errors import NodeNotFoundError, SurgeryError
from surgery.graph import GraphView, attribute_values


def _find_index(view: GraphView, name: str) -> int:
    idx = view.index_by_name.get(name)
    if idx is not None:
        return idx
    producer = view.producer.get(name)
    if producer is not None:
        return producer
    close = [n for n in view.names if name.lower() in n.lower()][:5]
    hint = f"similar: {', '.join(close)}" if close else "use `surgery inspect MODEL --find PATTERN`"
    raise NodeNotFoundError(f"no node named {name!r} (nor a tensor of that name)", hint=hint)


def _attr_for_json(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):
        n = 1
        for d in value.dims:
            n *= d
        if n <= 16:
            return {"tensor": numpy_helper.to_array(value).tolist()}
        return {
            "tensor": {
                "dims": list(value.dims),
                "dtype": onnx.TensorProto.DataType.Name(value.data_type),
            }
        }
    if isinstance(value, onnx.GraphProto):
        return {"graph": value.name, "nodes": len(value.node)}
    if isinstance(value, list) and value and isinstance(value[0], onnx.GraphProto):
        return [{"graph": g.name, "nodes": len(g.node)} for g in value]
    return value


def describe_node(view: GraphView, idx: int, *, constants_inline: int = 8) -> dict[str, Any]:
    node = view.nodes[idx]
    inputs = []
    for name in node.input:
        if not name:
            inputs.append(None)
            continue
        entry = view.tensor(name).to_dict()
        if name in view.initializers:
            entry["initializer"] = True
        value = view.constant_value(name, max_elements=constants_inline)
        if value is not None:
            entry["value"] = value.tolist()
        p = view.producer.get(name)
        entry["producer"] = view.names[p] if p is not None else None
        inputs.append(entry)
    outputs = []
    for name in node.output:
        entry = view.tensor(name).to_dict()
        entry["consumers"] = [view.names[c] for c in view.consumers.get(name, ())]
        if name in view.graph_outputs:
            entry["graph_output"] = True
        outputs.append(entry)
    return {
        "name": view.names[idx],
        "index": idx,
        "op_type": node.op_type,
        "domain": node.domain or "ai.onnx",
        "attributes": {k: _attr_for_json(v) for k, v in attribute_values(node).items()},
        "inputs": inputs,
        "outputs": outputs,
        "producers": sorted({view.names[p] for p in view.predecessors(idx)}),
        "consumers": sorted({view.names[c] for c in view.successors(idx)}),
    }


def inspect_node(
    model: onnx.ModelProto, name: str, view: GraphView | None = None
) -> dict[str, Any]:
    """One node (by node name, or by the name of a tensor it produces)."""
    view = view or GraphView(model)
    return describe_node(view, _find_index(view, name))


def neighbourhood(
    model: onnx.ModelProto, name: str, hops: int = 1, view: GraphView | None = None
) -> dict[str, Any]:
    """The nodes within `hops` edges of a node, as a small subgraph listing."""
    view = view or GraphView(model)
    centre = _find_index(view, name)
    distance = {centre: 0}
    frontier = [centre]
    for d in range(1, hops + 1):
        nxt = []
        for i in frontier:
            for j in (*view.predecessors(i), *view.successors(i)):
                if j not in distance:
                    distance[j] = d
                    nxt.append(j)
        frontier = nxt
    nodes = []
    for i in sorted(distance):
        node = view.nodes[i]
        nodes.append(
            {
                "name": view.names[i],
                "op_type": node.op_type,
                "distance": distance[i],
                "inputs": [{"name": t, **_shape(view, t)} for t in node.input if t],
                "outputs": [{"name": t, **_shape(view, t)} for t in node.output if t],
            }
        )
    return {"centre": view.names[centre], "hops": hops, "nodes": nodes}


def _shape(view: GraphView, tensor: str) -> dict[str, Any]:
    t = view.tensor(tensor)
    out: dict[str, Any] = {
        "shape": list(t.shape) if t.shape is not None else None,
        "dtype": t.dtype,
    }
    if tensor in view.initializers:
        out["initializer"] = True
    return out


def find_nodes(
    model: onnx.ModelProto,
    *,
    op_type: str | None = None,
    pattern: str | None = None,
    limit: int = 100,
    view: GraphView | None = None,
) -> dict[str, Any]:
    """Nodes whose op type matches and whose name matches a glob (or /regex/) pattern."""
    view = view or GraphView(model)
    matcher = _name_matcher(pattern)
    hits = []
    for i, node in enumerate(view.nodes):
        if op_type and node.op_type.lower() != op_type.lower():
            continue
        if matcher and not matcher(view.names[i]):
            continue
        hits.append(i)
    listed = [
        {
            "name": view.names[i],
            "op_type": view.nodes[i].op_type,
            "outputs": [{"name": t, **_shape(view, t)} for t in view.nodes[i].output if t],
        }
        for i in hits[:limit]
    ]
    return {"count": len(hits), "truncated": len(hits) > limit, "nodes": listed}


def _name_matcher(pattern: str | None):
    if not pattern:
        return None
    if len(pattern) > 1 and pattern.startswith("/") and pattern.endswith("/"):
        try:
            rx = re.compile(pattern[1:-1])
        except re.error as exc:
            raise SurgeryError(f"invalid regular expression {pattern!r}: {exc}") from None
        return lambda s: rx.search(s) is not None
    if not any(c in pattern for c in "*?["):
        return lambda s: pattern.lower() in s.lower()
    return lambda s: fnmatch.fnmatchcase(s, pattern)
