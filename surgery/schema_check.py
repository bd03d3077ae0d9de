"""Nodes checked against their ONNX operator schema: input/output counts and attribute types.

ONNX Runtime and onnx.checker refuse a Relu with two inputs or a Transpose whose perm is a
float; analysing such a model anyway would report a single .elf for a model nothing can run,
or fail deep inside a constraint. The counts are checked for every node on load (cheap: from
the GraphView); attribute types, which cost a walk over every attribute proto, only for a node
whose analysis failed, to name the attribute instead of the exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import onnx
from onnx import defs

from surgery.errors import InvalidGraphError
from surgery.graph import DEFAULT_DOMAINS, GraphView, default_opset


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
                hint="ONNX Runtime cannot run it either: re-export the model",
            )


def attribute_problem(node: onnx.NodeProto, opset: int) -> str | None:
    """What is wrong with the node's attributes for its schema (an unknown name, or a value of
    another type), or None."""
    if node.domain not in DEFAULT_DOMAINS:
        return None
    schema = _schema(node.op_type, opset)
    if schema is None:
        return None
    for attr in node.attribute:
        spec = schema.attributes.get(attr.name)
        if spec is None:
            return f"attribute {attr.name!r} is not one of {node.op_type}'s"
        if attr.type and int(spec.type) != attr.type:
            given = onnx.AttributeProto.AttributeType.Name(attr.type)
            wanted = onnx.AttributeProto.AttributeType.Name(int(spec.type))
            return f"attribute {attr.name!r} is {given}; {node.op_type} takes {wanted}"
    return None


def raise_malformed_attributes(model: onnx.ModelProto) -> None:
    """InvalidGraphError for the first top-level node whose attributes do not fit its schema
    (a walk over every attribute: for the path where some analysis already failed)."""
    opset = default_opset(model)
    for node in model.graph.node:
        problem = attribute_problem(node, opset)
        if problem:
            raise InvalidGraphError(
                f"node {node.name!r} ({node.op_type}): {problem}",
                hint="ONNX Runtime cannot run it either: re-export the model",
            )
