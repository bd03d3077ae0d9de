"""Cleanup and canonicalisation rules: fold constants, remove no-op nodes.

They rarely unblock an op by themselves, but they turn exports into the plain form the other
rules pattern-match on (constants as initializers, no Identity chains).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from surgery.rules.base import Match, Rule, RuleContext, RuleParams
from surgery.rules.graph_edit import bypass_node, nodes_by_name, quiet_graphsurgeon
from surgery.rules.registry import register

_NEEDS_VALUE = {"non_constant_input", "axis_unknown"}


@register
class FoldConstants(Rule):
    """Evaluate every node whose inputs are all known before run time and store the results as
    initializers: shape arithmetic (Shape→Gather→Unsqueeze→Concat→Reshape), Constant nodes,
    constant subgraphs. Ops that need a constant operand (Reshape's shape, Resize's scales,
    Pow's exponent, Slice's starts) then see a plain initializer."""

    name = "fold-constants"
    summary = "Evaluate constant subgraphs and Constant nodes into initializers."
    category = "cleanup"
    example = "surgery apply fold-constants yolov8n.onnx -o folded.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        folded = [p for p in ctx.coverage.placements if p.foldable]
        if not folded:
            return []
        unblocked = [
            b.name for b in ctx.coverage.blockers if any(r.code in _NEEDS_VALUE for r in b.reasons)
        ]
        chains = sum(1 for p in folded if p.op_type != "Constant")
        consts = len(folded) - chains
        return [
            self.match(
                [p.name for p in folded],
                f"{chains} constant-computing node(s) and {consts} Constant node(s) become initializers",
                unblocked,
            )
        ]

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        with quiet_graphsurgeon():
            graph.fold_constants(fold_shapes=True, error_ok=True, flatten_subgraphs=False)
            graph.cleanup()
        for node in list(graph.nodes):
            if node.op == "Constant" and "value" in node.attrs:
                out = node.outputs[0]
                const = gs.Constant(out.name, node.attrs["value"].values)
                for consumer in list(out.outputs):
                    consumer.inputs[:] = [const if t is out else t for t in consumer.inputs]
                node.outputs.clear()
        return matches


_NO_OP = {"Identity", "Dropout"}


@register
class RemoveIdentity(Rule):
    """Remove nodes that do not change their input: Identity, inference-mode Dropout, Reshape
    to the same shape, Transpose with the identity permutation, Cast to the same type."""

    name = "remove-identity"
    summary = "Remove Identity, Dropout and no-op Reshape/Transpose/Cast nodes."
    category = "cleanup"
    example = "surgery apply remove-identity model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        view = ctx.view
        blockers = ctx.blocker_names
        found = []
        for idx, op in enumerate(view.op_types):
            name = view.names[idx]
            if not self._is_no_op(ctx, idx, op):
                continue
            found.append(
                self.match(
                    [name],
                    f"{op} {name} does not change its input",
                    [name] if name in blockers else [],
                )
            )
        return found

    @staticmethod
    def _is_no_op(ctx: RuleContext, idx: int, op: str) -> bool:
        view = ctx.view
        ins, outs = view.node_inputs[idx], view.node_outputs[idx]
        if not ins or not ins[0]:
            return False
        if op in _NO_OP:
            return len(outs) == 1 or not any(view.consumers.get(o) for o in outs[1:])
        x, y = view.tensor(ins[0]), view.tensor(outs[0])
        if op == "Reshape" or op == "Squeeze" or op == "Unsqueeze":
            return x.is_static and y.is_static and x.shape == y.shape
        if op == "Transpose":
            perm = view.nodes[idx].attribute
            values = next((list(a.ints) for a in perm if a.name == "perm"), None)
            return values is not None and values == sorted(values)
        if op == "Cast":
            to = next((a.i for a in view.nodes[idx].attribute if a.name == "to"), None)
            return x.elem_type != 0 and to == x.elem_type
        return False

    def apply(self, graph: gs.Graph, match: Match, params: RuleParams, ctx: RuleContext) -> None:
        node = nodes_by_name(graph)[match.nodes[0]]
        while len(node.outputs) > 1:  # e.g. Dropout's unused mask
            node.outputs.pop()
        bypass_node(graph, node)
