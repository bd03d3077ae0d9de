"""inline-if-branch: a model whose If reads a boolean graph input, as the model for one value.

Hugging Face Optimum's merged decoder (decoder_model_merged.onnx) is one If on the graph input
`use_cache_branch`: the cache branch reads `past_key_values.*`, the other does not. The If runs
on the host whole, so the MLA gets none of the decoder; with the value fixed, the chosen branch
becomes the graph and `surgery fix` can map it. The model's inputs change (the condition, and
inputs only the other branch read, go), so the rule is never picked by `surgery fix`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from pydantic import Field

from surgery.rules.base import Match, Rule, RuleContext, RuleParams
from surgery.rules.engine import RuleFailedError
from surgery.rules.registry import register


class InlineBranchParams(RuleParams):
    value: bool | None = Field(
        None,
        description="The value the condition input always has: its If nodes become the branch "
        "taken for it (then_branch for true). Required to apply.",
    )
    condition: str | None = Field(
        None,
        description="The boolean graph input that drives the If nodes; needed only when "
        "several do.",
    )


def branch_conditions(ctx: RuleContext) -> dict[str, list[str]]:
    """The boolean one-element graph inputs that are the condition of If nodes, with them."""
    view = ctx.view
    found: dict[str, list[str]] = {}
    for k, op in enumerate(view.op_types):
        ins = view.node_inputs[k]
        if op != "If" or not ins or ins[0] not in view.graph_inputs:
            continue
        info = view.tensor(ins[0])
        if info.elem_type != onnx.TensorProto.BOOL:
            continue
        if info.shape is not None and any(isinstance(d, int) and d != 1 for d in info.shape):
            continue
        found.setdefault(ins[0], []).append(view.names[k])
    return found


@register
class InlineIfBranch(Rule):
    """Fix a boolean graph input that drives If nodes to one value (`--param value=true`): each
    If becomes the nodes of the branch taken, the condition input goes, and so does every input
    only the other branch read. Hugging Face Optimum's merged decoder (one If on
    use_cache_branch) becomes the decoder with past (value=true) or without (value=false),
    which `surgery fix` can then map; the whole If ran on the host. Verified on the condition
    fixed to the value. Never used by `surgery fix`: it changes the model's inputs."""

    name = "inline-if-branch"
    summary = "Fix an If's boolean input to one value: the branch taken becomes the graph."
    category = "structure"
    auto = False
    Params = InlineBranchParams
    example = (
        "surgery apply inline-if-branch decoder_model_merged.onnx --param value=true "
        "-o decoder_with_past.onnx"
    )
    suggest_for = frozenset({"If"})

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        assert isinstance(params, InlineBranchParams)
        conditions = branch_conditions(ctx)
        if params.condition is not None:
            if params.condition not in conditions:
                drives = ", ".join(sorted(conditions)) or "none"
                raise RuleFailedError(
                    f"rule {self.name!r}: input {params.condition!r} is not the boolean "
                    f"condition of an If (the inputs that are: {drives})"
                )
            conditions = {params.condition: conditions[params.condition]}
        if len(conditions) > 1:
            raise RuleFailedError(
                f"rule {self.name!r}: If nodes read several boolean inputs "
                f"({', '.join(sorted(conditions))}); say which with --param condition=NAME"
            )
        matches = []
        for condition, nodes in conditions.items():
            branch = "then_branch" if params.value else "else_branch"
            if params.value is None:
                branch = "then_branch or else_branch (--param value=true|false)"
            blockers = sorted(set(nodes) & ctx.blocker_names)
            reason = f"{len(nodes)} If node(s) on {condition!r} become their {branch}"
            match = Match(self.name, nodes, reason, blockers, {"branch": branch})
            if params.value is not None:
                match.fixed_inputs = {condition: np.array([params.value])}
            matches.append(match)
        return matches

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        assert isinstance(params, InlineBranchParams)
        if params.value is None:
            raise RuleFailedError(
                f"rule {self.name!r} needs the condition's value: --param value=true (the "
                "then_branch; Optimum's use_cache_branch with past) or value=false"
            )
        read_before = {t.name for t in graph.inputs if t.outputs}
        for match in matches:
            for name in match.nodes:
                node = next(n for n in graph.nodes if n.name == name)
                _inline(graph, node, match.data["branch"])
        graph.cleanup().toposort()
        conditions = {c for m in matches for c in m.fixed_inputs}
        outputs = {t.name for t in graph.outputs}
        graph.inputs = [
            t
            for t in graph.inputs
            if t.name not in conditions
            and (t.outputs or t.name in outputs or t.name not in read_before)
        ]
        return matches


def _inline(graph: gs.Graph, node: gs.Node, branch_attr: str) -> None:
    """Replace If `node` by the nodes of its branch `branch_attr`, whose outputs become the
    If's outputs; branch tensors whose names the outer graph has are renamed, and the other
    branch lets go of the outer tensors it read (they count as read while it does)."""
    branch: gs.Graph = node.attrs[branch_attr]
    other = node.attrs["else_branch" if branch_attr == "then_branch" else "then_branch"]
    for dropped in other.nodes:
        dropped.inputs.clear()
        dropped.outputs.clear()
    taken = set(graph.tensors())
    local = {t.name: t for n in branch.nodes for t in n.outputs}
    for name, tensor in local.items():
        if name in taken:
            tensor.name = f"{name}__{node.name}"
    outputs = list(node.outputs)
    node.outputs.clear()
    node.inputs.clear()
    for out, inner in zip(outputs, branch.outputs, strict=True):
        producer = inner.inputs[0] if inner.inputs else None
        if producer is not None and producer in branch.nodes and inner not in branch.inputs:
            producer.outputs[producer.outputs.index(inner)] = out
            for reader in list(inner.outputs):
                reader.inputs[reader.inputs.index(inner)] = out
        else:  # the branch passes an outer tensor or a constant through
            graph.nodes.append(gs.Node("Identity", inputs=[inner], outputs=[out]))
    # drop the If before cleanup: with its branch still attached, cleanup would also clean the
    # branch, whose nodes are now the graph's
    del graph.nodes[next(k for k, n in enumerate(graph.nodes) if n is node)]
    graph.nodes.extend(branch.nodes)
