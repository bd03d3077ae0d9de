"""Nodes checked against their ONNX operator schema: input/output counts and attribute types.

ONNX Runtime and onnx.checker refuse a Relu with two inputs or a Transpose whose perm is a
float; analysing such a model anyway would report a single .elf for a model nothing can run,
or fail deep inside a constraint. The counts are checked for every node on load (cheap: from
the GraphView); attribute types, which cost a walk over every attribute proto, and whether each
weight's data fits its dims and type, which costs serialising the weights, only once some
analysis failed, to name the attribute or weight instead of the exception.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache

import onnx
from onnx import defs

from surgery.errors import InvalidGraphError, MalformedTensorError
from surgery.graph import (
    DAMAGED_FILE_HINT,
    DEFAULT_DOMAINS,
    GraphView,
    default_opset,
    tensor_data_problem,
)


@cache
def _schema(op_type: str, opset: int) -> defs.OpSchema | None:
    try:
        return defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return None


def _count_problem(
    schema: defs.OpSchema, inputs: Sequence[str], outputs: Sequence[str]
) -> str | None:
    n_in, n_out = len(inputs), len(outputs)
    if not schema.min_input <= n_in <= schema.max_input:
        return f"has {n_in} input(s); {schema.name}-{schema.since_version} takes {_span(schema.min_input, schema.max_input)}"
    if not schema.min_output <= n_out <= schema.max_output:
        return f"has {n_out} output(s); {schema.name}-{schema.since_version} gives {_span(schema.min_output, schema.max_output)}"
    return None


def _span(low: int, high: int) -> str:
    if low == high:
        return str(low)
    return f"{low} or more" if high > 1000 else f"{low} to {high}"


def check_node_counts(model: onnx.ModelProto, view: GraphView, label: str) -> None:
    """InvalidGraphError for the first default-domain node whose input or output count its
    schema (at the model's opset) does not allow."""
    opset = default_opset(model)
    for idx, (op_type, domain) in enumerate(zip(view.op_types, view.domains, strict=True)):
        if domain not in DEFAULT_DOMAINS:
            continue
        schema = _schema(op_type, opset)
        if schema is None:
            continue  # not an ONNX op at this opset: placement says so
        problem = _count_problem(schema, view.node_inputs[idx], view.node_outputs[idx])
        if problem:
            raise InvalidGraphError(
                f"{label}: node {view.names[idx]!r} ({op_type}) {problem}",
                hint="it breaks its operator schema (onnx.checker refuses it): re-export the model",
            )


def attribute_problem(node: onnx.NodeProto, opset: int) -> str | None:
    """What is wrong with the node's attributes for its schema (an unknown name, or a value of
    another type), or None."""
    if node.domain not in DEFAULT_DOMAINS:
        return None
    schema = _schema(node.op_type, opset)
    if schema is None:
        return None
    seen: set[str] = set()
    for attr in node.attribute:
        if attr.name in seen:
            return f"attribute {attr.name!r} is given twice"
        seen.add(attr.name)
        spec = schema.attributes.get(attr.name)
        if spec is None:
            return f"attribute {attr.name!r} is not one of {node.op_type}'s"
        if attr.type and int(spec.type) != attr.type:
            given = onnx.AttributeProto.AttributeType.Name(attr.type)
            wanted = onnx.AttributeProto.AttributeType.Name(int(spec.type))
            return f"attribute {attr.name!r} is {given}; {node.op_type} takes {wanted}"
    return None


def raise_malformed(model: onnx.ModelProto) -> None:
    """InvalidGraphError for the first top-level node whose attributes do not fit its schema,
    else `raise_malformed_weights`. A walk over every attribute and weight: for the path where
    some analysis already failed, to name the model's problem instead of the exception."""
    opset = default_opset(model)
    for node in model.graph.node:
        problem = attribute_problem(node, opset)
        if problem:
            raise InvalidGraphError(
                f"node {node.name!r} ({node.op_type}): {problem}",
                hint="ONNX Runtime cannot run it either: re-export the model",
            )
    raise_malformed_weights(model)


def raise_malformed_weights(model: onnx.ModelProto) -> None:
    """MalformedTensorError for the first weight (initializer or Constant value of the top
    graph) whose data does not fit its dims and type: a truncated weight made rules fail
    decoding it, check report a model ONNX Runtime cannot load, and the quantizer fail in
    numpy. It serialises every weight: for the stages that read them all anyway (quantize,
    compile) and for explaining a failure."""
    for kind, name, tensor in _weights(model.graph):
        problem = tensor_data_problem(tensor)
        if problem:
            raise MalformedTensorError(f"{kind} {name!r}: {problem}", hint=DAMAGED_FILE_HINT)


def _weights(graph: onnx.GraphProto) -> Iterator[tuple[str, str, onnx.TensorProto]]:
    for t in graph.initializer:
        yield "initializer", t.name, t
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    yield "Constant node", node.name or node.output[0], a.t
