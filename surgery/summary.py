"""A compact description of a model: what an agent or a person needs before touching it."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx

from surgery.graph import GraphView, TensorInfo, shape_from_type
from surgery.model import STANDARD_DOMAINS


@dataclass
class ModelSummary:
    graph_name: str
    ir_version: int
    opsets: dict[str, int]
    producer: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    nodes: int
    nodes_including_subgraphs: int
    op_histogram: dict[str, int]
    parameters: int
    parameter_bytes: int
    initializers: int
    dynamic_dims: dict[str, list[Any]]
    custom_domains: list[str]
    subgraph_ops: list[str] = field(default_factory=list)
    legacy_initializer_inputs: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _iter_subgraph_nodes(graph: onnx.GraphProto):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _iter_subgraph_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _iter_subgraph_nodes(g)


def _tensor_elements(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n


def summarize(model: onnx.ModelProto) -> ModelSummary:
    """Inputs/outputs, opsets, node counts, op histogram, parameters, dynamic dims, domains."""
    g = model.graph
    view = GraphView(model)
    init_names = set(view.initializers)
    inputs = [view.tensor(n).to_dict() for n in view.graph_inputs]
    outputs = []
    for o in g.output:
        elem, shape = shape_from_type(o.type)
        outputs.append(TensorInfo(o.name, elem, shape).to_dict())
    params = 0
    nbytes = 0
    for t in g.initializer:
        n = _tensor_elements(t)
        params += n
        nbytes += n * _itemsize(t.data_type)
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and _tensor_elements(a.t) > 1:
                    n = _tensor_elements(a.t)
                    params += n
                    nbytes += n * _itemsize(a.t.data_type)
    all_nodes = list(_iter_subgraph_nodes(g))
    dynamic = {
        d["name"]: d["shape"]
        for d in inputs
        if d["shape"] is None or any(not isinstance(x, int) for x in d["shape"])
    }
    sub_ops = sorted({n.op_type for n in all_nodes} - {n.op_type for n in g.node})
    return ModelSummary(
        graph_name=g.name,
        ir_version=model.ir_version,
        opsets={(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        producer=f"{model.producer_name} {model.producer_version}".strip(),
        inputs=inputs,
        outputs=outputs,
        nodes=len(g.node),
        nodes_including_subgraphs=len(all_nodes),
        op_histogram=dict(Counter(n.op_type for n in g.node).most_common()),
        parameters=params,
        parameter_bytes=nbytes,
        initializers=len(g.initializer),
        dynamic_dims=dynamic,
        custom_domains=sorted({n.domain for n in all_nodes if n.domain not in STANDARD_DOMAINS}),
        subgraph_ops=sub_ops,
        legacy_initializer_inputs=sum(1 for i in g.input if i.name in init_names),
    )


def _itemsize(data_type: int) -> int:
    if data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return 0
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 1
