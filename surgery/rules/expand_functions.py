"""expand-function-ops: an op the MLA does not run, replaced by the ONNX function that defines it.

ONNX defines many newer ops as functions of older ones (opset 23's Attention and
RotaryEmbedding, GroupNormalization, Mish, Selu, Celu, Softsign, …), and exporters emit them as
single nodes: torch's dynamo exporter writes `scaled_dot_product_attention` as one Attention
node from opset 23 on. A target that does not know the op sends it to the host; its function
body is made of MatMul, Softmax, Reshape and shape arithmetic that the MLA runs once the shapes
fold (the rule folds them with the expansion). The body comes from ONNX's own schema (for the model's opset and, for context-dependent
functions, the node's input types), so the expansion means exactly what the op means.
"""

from __future__ import annotations

from functools import cache

import onnx
import onnx_graphsurgeon as gs
from onnx import defs, helper

from surgery.graph import attribute_value
from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.graph_edit import fold_until_fixed_point
from surgery.rules.registry import register
from surgery.rules.replace_common import Editor, GraphRule

_SHAPE_ONLY = frozenset({"Shape", "Size", "CastLike"})
"""Body ops whose result depends only on the (static) shape or type of their first input, or
(CastLike) on the type of the second: constant once shapes are known."""
_LEFT_TO_LATER_RULES = frozenset(
    {"Identity", "Cast", "Where", "Expand", "Reshape", "Squeeze", "Unsqueeze", "Flatten"}
)
"""Body ops that later rules remove or make 4-D (a same-type Cast, a same-shape Expand, a
Where whose condition folds to one side, the reshapes around attention heads): not counted
against the expansion."""


@cache
def _has_function(op_type: str, opset: int) -> bool:
    """Whether ONNX defines `op_type` (default domain, as of `opset`) by a function body."""
    try:
        schema = defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return False
    versions = [*schema.function_opset_versions, *schema.context_dependent_function_opset_versions]
    return any(v <= opset for v in versions)


def function_body(ctx: RuleContext, idx: int) -> onnx.FunctionProto | None:
    """The ONNX function that defines node `idx` at the model's opset, or None (no function, or
    one that needs input types the model does not know, or nodes of other domains)."""
    view, opset = ctx.view, ctx.opset
    node = view.nodes[idx]
    schema = defs.get_schema(node.op_type, opset, "")
    try:
        if schema.has_context_dependent_function:
            types = []
            for name in node.input:
                if not name:  # an optional input left out
                    types.append(onnx.TypeProto().SerializeToString())
                    continue
                info = view.tensor(name)
                if not info.elem_type:
                    return None
                type_proto = helper.make_tensor_type_proto(info.elem_type, info.shape)
                types.append(type_proto.SerializeToString())
            raw = schema.get_context_dependent_function_with_opset_version(
                opset, node.SerializeToString(), types
            )
        else:
            raw = schema.get_function_with_opset_version(opset)
    except (defs.SchemaError, RuntimeError, ValueError, TypeError):
        return None
    if not raw:
        return None
    body = onnx.FunctionProto.FromString(raw)
    if any(n.domain not in ("", "ai.onnx") for n in body.node) or any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for n in body.node
        for a in n.attribute
    ):
        return None
    return body


def _off_mla_ops(
    ctx: RuleContext, idx: int, body: onnx.FunctionProto
) -> tuple[list[str], list[str]]:
    """Body ops that compute on run-time data and that the target cannot run on the MLA (the
    shape arithmetic folds away; pass-through ops are left to the cleanups), and the MLA ops of
    the body that compute on their results: an opset-13 LogSoftmax is x - max - Log(Σ exp(…)),
    and on a target without Log its last Sub would be an MLA island between host nodes."""
    view = ctx.view
    node_inputs = view.node_inputs[idx]
    constant = {
        formal
        for formal, actual in zip(body.input, node_inputs, strict=False)
        if actual and actual in ctx.constants
    }
    constant.update(body.input[len(node_inputs) :])  # inputs left out are empty
    constant.add("")
    off, after_off = [], []
    downstream: set[str] = set()  # run-time tensors computed from an off-MLA op's result
    for inner in body.node:  # a function body lists its nodes in topological order
        ins = list(inner.input)
        if (
            inner.op_type == "Constant"
            or all(i in constant for i in ins)
            or (
                inner.op_type in _SHAPE_ONLY and (inner.op_type != "CastLike" or ins[0] in constant)
            )
        ):
            constant.update(inner.output)
            continue
        fed = any(i in downstream for i in ins)
        if inner.op_type in _LEFT_TO_LATER_RULES:
            pass
        elif not ctx.target.supports(inner.op_type, "MLA"):
            off.append(inner.op_type)
            downstream.update(inner.output)
        elif fed:
            after_off.append(inner.op_type)
        if fed:
            downstream.update(inner.output)
    return off, after_off


@register
class ExpandFunctionOps(GraphRule):
    """Replace an op the target runs off the MLA by the ONNX function that defines it.

    Newer ONNX ops are defined as functions of older ones: opset 23's Attention (which torch's
    dynamo exporter writes for `scaled_dot_product_attention`) is MatMuls, a Softmax and shape
    arithmetic; RotaryEmbedding is Slices, Muls and Adds; GroupNormalization, Mish, Selu, Celu,
    Softsign, ThresholdedRelu and others are a few elementwise ops. A target without the op
    sends it to the host, while the body's ops run on the MLA once its shape arithmetic folds
    (`fold-constants`) and its no-ops go (`remove-identity`).

    The body is ONNX's own definition for the model's opset (for context-dependent functions
    such as Attention, for the node's input types and attributes), so the result computes what
    the op computes; verification compares the two in ONNX Runtime. Only ops that the target
    does not support on the MLA at all are expanded: an op the MLA runs under some constraint
    (LayerNormalization on a 4-D tensor) is left to the rules that meet the constraint. A match
    lists the node as freed when every run-time op of the body is one the MLA supports. A body
    whose off-MLA op feeds MLA ops of the body is not expanded: the op's host work stays and
    the ops after it become an MLA island between host nodes (opset 13's LogSoftmax on a target
    without Log, after a CRNN's classifier), where the op whole was one host node at the end.
    """

    name = "expand-function-ops"
    summary = (
        "Ops ONNX defines as functions (opset-23 Attention, RotaryEmbedding, "
        "GroupNormalization, Mish, Selu, …) → their function body, where the MLA lacks the op."
    )
    category = "cleanup"
    example = "surgery apply expand-function-ops model.onnx -o expanded.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        view, opset = ctx.view, ctx.opset
        found = []
        for blocker in ctx.coverage.blockers:  # only blocked nodes are expanded
            idx, op, name = blocker.index, blocker.op_type, blocker.name
            if (
                view.domains[idx] not in ("", "ai.onnx")
                or op in _SHAPE_ONLY
                or ctx.target.supports(op, "MLA")
                or not _has_function(op, opset)
            ):
                continue
            body = function_body(ctx, idx)
            if body is None:
                continue
            off, after_off = _off_mla_ops(ctx, idx, body)
            if after_off:  # the op's host work stays, and what follows it in the body splits off
                continue
            note = f"{op} {name} → its ONNX function ({len(body.node)} nodes)"
            if off:
                note += f"; {', '.join(sorted(set(off)))} of it stay off the MLA"
            found.append(
                self.match([name], note, [] if off else [name], body=body.SerializeToString())
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        if node is None:
            return False
        body = onnx.FunctionProto.FromString(match.data["body"])
        inline_function(ed, node, body)
        return True

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        """Inline every match, then fold the bodies' shape arithmetic (with the rest of the
        graph's): an expansion whose Reshape targets and split lengths are still computed
        would count its ops as dynamic and look worse than the op it replaces."""
        applied = super().apply_all(graph, matches, params, ctx)
        if applied:
            fold_until_fixed_point(graph, ctx.model)
        return applied


def inline_function(ed: Editor, node: gs.Node, body: onnx.FunctionProto) -> None:
    """Put `body`'s nodes in place of `node`: formal inputs and outputs bound to the node's
    tensors (a missing optional one to an empty tensor), every inner tensor and node under a
    fresh name, and attribute references resolved to the node's attributes (an attribute the
    node does not set is left out, so the inner op takes its default)."""
    tensors: dict[str, gs.Tensor] = {"": gs.Variable.empty()}
    for k, formal in enumerate(body.input):
        tensors[formal] = node.inputs[k] if k < len(node.inputs) else gs.Variable.empty()
    for k, formal in enumerate(body.output):
        if k < len(node.outputs) and node.outputs[k].name:
            tensors[formal] = node.outputs[k]
    base = node.name
    ed.detach(node)
    for inner in body.node:
        ins = [_bound(ed, tensors, base, t) for t in inner.input]
        outs = [_bound(ed, tensors, base, t) for t in inner.output]
        attrs = {}
        for a in inner.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name in node.attrs:
                    attrs[a.name] = node.attrs[a.ref_attr_name]
                continue
            attrs[a.name] = _gs_attribute(a)
        ed.node(inner.op_type, f"{base}/{inner.name or inner.op_type}", ins, outs, **attrs)


def _bound(ed: Editor, tensors: dict[str, gs.Tensor], base: str, name: str) -> gs.Tensor:
    """The graph tensor for body tensor `name`, created (fresh name, unknown type) when new."""
    tensor = tensors.get(name)
    if tensor is None:
        tensor = ed.var(f"{base}/{name}", None)
        tensors[name] = tensor
    return tensor


def _gs_attribute(a: onnx.AttributeProto) -> object:
    """An attribute value in the form onnx-graphsurgeon nodes hold (tensors as gs.Constant)."""
    value = attribute_value(a)
    if isinstance(value, onnx.TensorProto):
        return gs.Constant(value.name or "value", onnx.numpy_helper.to_array(value))
    return value
