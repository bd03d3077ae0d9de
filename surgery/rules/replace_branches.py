"""Branches stacked on a new axis and summed, as 4-D sums: stacked-branches-to-sum.

Selective-kernel networks (SKNet, timm's SelectiveKernel in skresnet) stack their branch
outputs p₁…p_k [N, C, H, W] into [N, k, C, H, W], sum them to pool an attention vector, turn
that into per-branch weights with a softmax over the branch axis of a rank-5 reshape, and sum
the weighted stack. Rank 5 and reductions over that axis keep every block off an MLA (reshaped
to 4-D, the branch axis lands on the batch axis, which the MLA does not reduce or concatenate).
The same values are sums of 4-D tensors: Σ pᵢ, and Σ pᵢ·aᵢ with the softmax taken on a 4-D
[N, k, C, h·w] view of the attention logits and aᵢ its i-th slice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    fmt_shape,
    net_freed,
    probe_node,
    probe_slice,
    reduce_axes,
)
from surgery.targets import Reason


@dataclass
class WeightedSum:
    """ReduceSum over the branch axis of the stack times a softmax-weighted attention."""

    mul: str
    reduce: str
    reshape: str
    softmax: str
    logits: str
    logits_shape: list[int]


@dataclass
class Stack:
    """A Concat of k Unsqueezed 4-D branches on axis 1 and the sums that read it."""

    concat: str
    unsqueezes: list[str]
    branches: list[str]
    shape: list[int]
    plain_sums: list[str]
    weighted_sums: list[WeightedSum]

    def nodes(self) -> list[str]:
        weighted = [n for w in self.weighted_sums for n in (w.mul, w.reduce, w.reshape, w.softmax)]
        return [*self.unsqueezes, self.concat, *self.plain_sums, *weighted]


@register
class StackedBranchesToSum(GraphRule):
    """Rewrite branches stacked on a new axis 1 and reduced over it as sums of 4-D tensors.

    Matched: Concat(Unsqueeze(pᵢ, 1)…, axis=1) whose every reader is a ReduceSum over axis 1
    (keepdims=0) — rewritten as p₁ + … + p_k — or a Mul by Softmax(Reshape(z), axis=1),
    z a 4-D [N, k·C, h, w] reshaped to [N, k, C, h, w], followed by such a ReduceSum —
    rewritten as Σ pᵢ·aᵢ, aᵢ the i-th slice of Softmax(Reshape(z, [N, k, C, h·w]), axis=1)
    reshaped to [N, C, h, w]. The same sums of the same products: equal up to float summation
    order. Only when the target keeps the stack off its MLA and runs every replacement op.
    """

    name = "stacked-branches-to-sum"
    suggest_for = frozenset({"Concat", "Unsqueeze", "ReduceSum", "Softmax", "Mul", "Reshape"})
    summary = (
        "Branches stacked on a new axis and summed (SKNet's selective kernel) → 4-D Adds of "
        "the branches, weighted by slices of a 4-D softmax."
    )
    category = "replace"
    example = "surgery apply stacked-branches-to-sum skresnet18.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for concat in pat.nodes("Concat"):
            stack = _stack(pat, concat)
            if stack is None or not any(n in ctx.blocker_names for n in stack.nodes()):
                continue
            probes = _probes(ctx, pat, stack)
            found.append(
                self.match(
                    stack.nodes(),
                    f"{len(stack.branches)} branches {fmt_shape(stack.shape)} stacked by "
                    f"{stack.concat} → {len(stack.plain_sums)} sum(s), "
                    f"{len(stack.weighted_sums)} softmax-weighted sum(s) in 4-D",
                    net_freed(ctx, stack.nodes(), probes),
                    stack=asdict(stack),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        data = match.data["stack"]
        stack = Stack(
            **{**data, "weighted_sums": [WeightedSum(**w) for w in data["weighted_sums"]]}
        )
        nodes = {name: ed.node_named(name) for name in stack.nodes()}
        if any(node is None for node in nodes.values()):
            return False
        branches = [ed.tensor(b) for b in stack.branches]
        outputs = {name: nodes[name].outputs[0] for name in stack.plain_sums}  # type: ignore[union-attr]
        weighted = [
            (w, nodes[w.reduce].outputs[0], ed.tensor(w.logits))  # type: ignore[union-attr]
            for w in stack.weighted_sums
        ]
        ed.detach(*nodes.values())  # type: ignore[arg-type]
        for y in outputs.values():
            _add_all(ed, branches, y, stack.shape)
        for w, y, logits in weighted:
            weights = _branch_weights(ed, logits, w.logits_shape, len(branches), stack.shape)
            products = [
                ed.op("Mul", "branch_weighted", [p, a], stack.shape, p.dtype)
                for p, a in zip(branches, weights, strict=True)
            ]
            _add_all(ed, products, y, stack.shape)
        return True


def _stack(pat: Pattern, concat: int) -> Stack | None:
    """The stack a Concat node builds, when it and all its readers are the pattern."""
    s = pat.outs(concat)[0]
    shape = pat.shape(s)
    attrs = pat.attrs(concat)
    if shape is None or len(shape) != 5 or attrs.get("axis", 0) % 5 != 1:
        return None
    unsqueezes, branches = [], []
    for t in pat.ins(concat):
        u = pat.producer(t, "Unsqueeze")
        if u is None or not pat.private(t):
            return None
        p = pat.ins(u)[0]
        if pat.shape(p) != (shape[0], *shape[2:]) or pat.shape(t) != (shape[0], 1, *shape[2:]):
            return None
        unsqueezes.append(pat.name(u))
        branches.append(p)
    if len(branches) < 2 or not pat.is_float(branches[0]) or s in pat.outputs:
        return None
    branch_shape = [shape[0], *shape[2:]]
    plain, weighted = [], []
    for reader in pat.consumers(s):
        if _sums_branch_axis(pat, reader):
            plain.append(pat.name(reader))
            continue
        w = _weighted_sum(pat, reader, s, shape)
        if w is None:
            return None
        weighted.append(w)
    return Stack(pat.name(concat), unsqueezes, branches, branch_shape, plain, weighted)


def _sums_branch_axis(pat: Pattern, node: int) -> bool:
    return (
        pat.op(node) == "ReduceSum"
        and reduce_axes(pat, node, 5) == [1]
        and not pat.attrs(node).get("keepdims", 1)
    )


def _weighted_sum(pat: Pattern, mul: int, s: str, shape: tuple[int, ...]) -> WeightedSum | None:
    """Mul(stack, Softmax(Reshape(z), axis=1)) → ReduceSum over axis 1, z 4-D."""
    if pat.op(mul) != "Mul":
        return None
    a = pat.other_input(mul, s)
    product = pat.outs(mul)[0]
    reduce = pat.sole_consumer(product, "ReduceSum")
    softmax = pat.producer(a, "Softmax") if a else None
    if reduce is None or not _sums_branch_axis(pat, reduce) or softmax is None:
        return None
    if not pat.private(a) or pat.attrs(softmax).get("axis", -1) % 5 != 1:
        return None
    logits5 = pat.ins(softmax)[0]
    reshape = pat.producer(logits5, "Reshape")
    if reshape is None or not pat.private(logits5):
        return None
    z = pat.ins(reshape)[0]
    z_shape, a_shape = pat.shape(z), pat.shape(a)
    k, c = shape[1], shape[2]
    if z_shape is None or a_shape is None or len(z_shape) != 4:
        return None
    if a_shape[:3] != (shape[0], k, c) or z_shape != (shape[0], k * c, *a_shape[3:]):
        return None
    return WeightedSum(
        pat.name(mul), pat.name(reduce), pat.name(reshape), pat.name(softmax), z, list(z_shape)
    )


def _logits_view(logits_shape: list[int], k: int) -> list[int]:
    """z [N, k·C, h, w] viewed as [N, k, C, h·w]: the softmax runs over axis 1 in 4-D."""
    n, kc, h, w = logits_shape
    return [n, k, kc // k, h * w]


def _probes(ctx: RuleContext, pat: Pattern, stack: Stack) -> list[Reason | None]:
    k = len(stack.branches)
    dtype = pat.elem_type(stack.branches[0])
    branch = TensorSpec(tuple(stack.shape), dtype)
    probes = [probe_node(ctx, "Add", [branch, branch], [branch])]
    for w in stack.weighted_sums:
        view = _logits_view(w.logits_shape, k)
        logits = TensorSpec(tuple(w.logits_shape), dtype)
        viewed = TensorSpec(tuple(view), dtype)
        one = TensorSpec((view[0], 1, *view[2:]), dtype)
        weight = TensorSpec((view[0], view[2], *w.logits_shape[2:]), dtype)
        probes += [
            _probe_reshape(ctx, logits, viewed),
            probe_node(ctx, "Softmax", [viewed], [viewed], {"axis": 1}),
            probe_slice(ctx, viewed, one, [0], [1], [1]),
            _probe_reshape(ctx, one, weight),
            probe_node(ctx, "Mul", [branch, weight], [branch]),
        ]
    return probes


def _probe_reshape(ctx: RuleContext, x: TensorSpec, out: TensorSpec) -> Reason | None:
    assert out.shape is not None
    target = TensorSpec.const(np.array(out.shape, np.int64))
    return probe_node(ctx, "Reshape", [x, target], [out])


def _branch_weights(
    ed: Editor, logits: gs.Tensor, logits_shape: list[int], k: int, branch_shape: list[int]
) -> list[gs.Tensor]:
    """aᵢ [N, C, h, w]: slice i of the softmax over k of the logits viewed as [N, k, C, h·w]."""
    view = _logits_view(logits_shape, k)
    viewed = ed.op(
        "Reshape",
        "branch_logits",
        [logits, ed.const("branch_view", np.array(view, np.int64))],
        view,
        logits.dtype,
    )
    soft = ed.op("Softmax", "branch_softmax", [viewed], view, logits.dtype, axis=1)
    weight_shape = [view[0], view[2], *logits_shape[2:]]
    weights = []
    for i in range(k):
        part = ed.var("branch_weight_slice", logits.dtype, [view[0], 1, *view[2:]])
        add_slice(ed, soft, part, [i], [i + 1], [1])
        target = ed.const("branch_weight_shape", np.array(weight_shape, np.int64))
        weights.append(
            ed.op("Reshape", "branch_weight", [part, target], weight_shape, logits.dtype)
        )
    return weights


def _add_all(ed: Editor, terms: list[gs.Tensor], y: gs.Tensor, shape: list[int]) -> None:
    """y = terms[0] + terms[1] + …, left to right."""
    total = terms[0]
    for k, term in enumerate(terms[1:], start=1):
        if k == len(terms) - 1:
            ed.node("Add", "branch_sum", [total, term], [y])
        else:
            total = ed.op("Add", "branch_sum", [total, term], shape, term.dtype)
