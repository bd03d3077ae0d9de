"""Branches stacked on a new axis and summed, as 4-D sums: stacked-branches-to-sum.

Selective-kernel networks (SKNet, timm's SelectiveKernel in skresnet) stack their branch
outputs p₁…p_k [N, C, H, W] into [N, k, C, H, W], sum them to pool an attention vector, turn
that into per-branch weights with a softmax over the branch axis of a rank-5 reshape, and sum
the weighted stack. Rank 5 and reductions over that axis keep every block off an MLA (reshaped
to 4-D, the branch axis lands on the batch axis, which the MLA does not reduce or concatenate).
The same values are sums of 4-D tensors: Σ pᵢ, and Σ pᵢ·aᵢ with the softmax taken on a 4-D
[N, k, C, h·w] view of the attention logits and aᵢ its i-th slice. ResNeSt's split attention
is the same sum with the stack a Reshape of one [N, k·C, H, W] tensor (its branches are
channel slices) and the weights a Reshape of a 4-D softmax (its "rSoftMax").
"""

from __future__ import annotations

import math
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
    probe_reshape,
    probe_slice,
    reduce_axes,
)
from surgery.targets import Reason


@dataclass
class WeightedSum:
    """ReduceSum over the branch axis of the stack times per-branch weights [N, k, C, h, w]:
    Softmax(Reshape(logits), axis=1) of 4-D logits [N, k·C, h, w] (`softmax` set), or a
    Reshape of 4-D weights [N, k·C, h, w] (`softmax` None)."""

    mul: str
    reduce: str
    reshape: str
    softmax: str | None
    source: str
    source_shape: list[int]
    rest: list[int]
    """The weights' trailing [h, w] (1, 1 for per-channel weights)."""

    def nodes(self) -> list[str]:
        return [self.mul, self.reduce, self.reshape, *([self.softmax] if self.softmax else [])]


@dataclass
class Stack:
    """k 4-D branches [N, C, H, W] stacked on a new axis 1, and the sums that read the stack.

    Built by a Concat of Unsqueezed branches (`branches`), or by a Reshape of one tensor
    [N, k·C, H, W] (`merged`; the branches are its channel slices)."""

    builders: list[str]
    branches: list[str]
    merged: str | None
    copies: int
    shape: list[int]
    plain_sums: list[str]
    weighted_sums: list[WeightedSum]

    def nodes(self) -> list[str]:
        weighted = [n for w in self.weighted_sums for n in w.nodes()]
        return [*self.builders, *self.plain_sums, *weighted]


@register
class StackedBranchesToSum(GraphRule):
    """Rewrite branches stacked on a new axis 1 and reduced over it as sums of 4-D tensors.

    Matched: a stack [N, k, C, H, W] — Concat(Unsqueeze(pᵢ, 1)…, axis=1), or a Reshape of
    x [N, k·C, H, W] (pᵢ = channel slice i of x) — whose every reader is a ReduceSum over
    axis 1 (keepdims=0), rewritten as p₁ + … + p_k, or a Mul by weights [N, k, C, h, w]
    followed by such a ReduceSum, rewritten as Σ pᵢ·aᵢ. The weights are Softmax(Reshape(z),
    axis=1) of 4-D logits z [N, k·C, h, w] (aᵢ: slice i of Softmax(Reshape(z, [N, k, C, h·w]),
    axis=1), reshaped to [N, C, h, w]), or a Reshape of 4-D weights w [N, k·C, h, w] (aᵢ:
    channel slice i of w). The same sums of the same products: equal up to float summation
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
        for builder in pat.nodes("Concat", "Reshape"):
            stack = _stack(pat, builder)
            if stack is None or not any(n in ctx.blocker_names for n in stack.nodes()):
                continue
            probes = _probes(ctx, pat, stack)
            found.append(
                self.match(
                    stack.nodes(),
                    f"{stack.copies} branches {fmt_shape(stack.shape)} stacked by "
                    f"{stack.builders[-1]} → {len(stack.plain_sums)} sum(s), "
                    f"{len(stack.weighted_sums)} weighted sum(s) in 4-D",
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
        outputs = [nodes[name].outputs[0] for name in stack.plain_sums]  # type: ignore[union-attr]
        weighted = [(w, nodes[w.reduce].outputs[0]) for w in stack.weighted_sums]  # type: ignore[union-attr]
        ed.detach(*nodes.values())  # type: ignore[arg-type]
        if stack.merged is not None:
            branches = _channel_slices(ed, ed.tensor(stack.merged), stack.copies, stack.shape)
        else:
            branches = [ed.tensor(b) for b in stack.branches]
        for y in outputs:
            _add_all(ed, branches, y, stack.shape)
        for w, y in weighted:
            source = ed.tensor(w.source)
            if w.softmax is not None:
                weights = _softmax_weights(ed, source, w.source_shape, stack.copies)
            else:
                weights = _weight_slices(ed, source, w, stack)
            products = [
                ed.op("Mul", "branch_weighted", [p, a], stack.shape, p.dtype)
                for p, a in zip(branches, weights, strict=True)
            ]
            _add_all(ed, products, y, stack.shape)
        return True


def _stack(pat: Pattern, builder: int) -> Stack | None:
    """The stack a Concat or Reshape node builds, when it and all its readers are the pattern."""
    s = pat.outs(builder)[0]
    shape = pat.shape(s)
    if shape is None or len(shape) != 5 or s in pat.outputs or not pat.is_float(s):
        return None
    copies, branch_shape = shape[1], [shape[0], *shape[2:]]
    if pat.op(builder) == "Concat":
        built = _concat_of_unsqueezed(pat, builder, shape)
        if built is None:
            return None
        builders, branches, merged = [*built[0], pat.name(builder)], built[1], None
    else:
        merged = pat.ins(builder)[0]
        if pat.shape(merged) != (shape[0], copies * shape[2], *shape[3:]):
            return None
        builders, branches = [pat.name(builder)], []
    if copies < 2:
        return None
    plain, weighted = [], []
    for reader in pat.consumers(s):
        if _sums_branch_axis(pat, reader):
            plain.append(pat.name(reader))
            continue
        w = _weighted_sum(pat, reader, s, shape)
        if w is None:
            return None
        weighted.append(w)
    return Stack(builders, branches, merged, copies, branch_shape, plain, weighted)


def _concat_of_unsqueezed(
    pat: Pattern, concat: int, shape: tuple[int, ...]
) -> tuple[list[str], list[str]] | None:
    """(the Unsqueeze nodes, the branches) of Concat(Unsqueeze(pᵢ, 1)…, axis=1)."""
    if pat.attrs(concat).get("axis", 0) % 5 != 1:
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
    return unsqueezes, branches


def _sums_branch_axis(pat: Pattern, node: int) -> bool:
    return (
        pat.op(node) == "ReduceSum"
        and reduce_axes(pat, node, 5) == [1]
        and not pat.attrs(node).get("keepdims", 1)
    )


def _weighted_sum(pat: Pattern, mul: int, s: str, shape: tuple[int, ...]) -> WeightedSum | None:
    """Mul(stack, weights) → ReduceSum over axis 1, the weights [N, k, C, h, w] built from a
    4-D tensor by Softmax(Reshape(z), axis=1) or by a Reshape alone."""
    if pat.op(mul) != "Mul":
        return None
    a = pat.other_input(mul, s)
    reduce = pat.sole_consumer(pat.outs(mul)[0], "ReduceSum")
    if not a or reduce is None or not _sums_branch_axis(pat, reduce) or not pat.private(a):
        return None
    a_shape = pat.shape(a)
    k, c = shape[1], shape[2]
    if a_shape is None or a_shape[:3] != (shape[0], k, c):
        return None
    softmax = pat.producer(a, "Softmax")
    if softmax is not None:
        if pat.attrs(softmax).get("axis", -1) % 5 != 1:
            return None
        a = pat.ins(softmax)[0]
        if not pat.private(a):
            return None
    reshape = pat.producer(a, "Reshape")
    if reshape is None:
        return None
    source = pat.ins(reshape)[0]
    source_shape = pat.shape(source)
    merged = (shape[0], k * c, *a_shape[3:])
    if source_shape is None or len(source_shape) != 4:
        return None
    if softmax is not None and source_shape != merged:
        return None
    if softmax is None and math.prod(source_shape) != math.prod(merged):
        return None  # a Reshape keeps memory order: any 4-D source of that size will do
    return WeightedSum(
        pat.name(mul),
        pat.name(reduce),
        pat.name(reshape),
        pat.name(softmax) if softmax is not None else None,
        source,
        list(source_shape),
        list(a_shape[3:]),
    )


def _logits_view(logits_shape: list[int], k: int) -> list[int]:
    """z [N, k·C, h, w] viewed as [N, k, C, h·w]: the softmax runs over axis 1 in 4-D."""
    n, kc, h, w = logits_shape
    return [n, k, kc // k, h * w]


def _probes(ctx: RuleContext, pat: Pattern, stack: Stack) -> list[Reason | None]:
    k, (n, c, *rest) = stack.copies, stack.shape
    dtype = pat.elem_type(stack.merged or stack.branches[0])
    branch = TensorSpec(tuple(stack.shape), dtype)
    probes = [probe_node(ctx, "Add", [branch, branch], [branch])]
    if stack.merged is not None:
        probes.append(_probe_channel_slice(ctx, (n, k * c, *rest), c, dtype))
    for w in stack.weighted_sums:
        source = TensorSpec(tuple(w.source_shape), dtype)
        weight = TensorSpec((n, c, *w.rest), dtype)
        if w.softmax is None:
            merged = (n, k * c, *w.rest)
            if tuple(w.source_shape) != merged:
                probes.append(probe_reshape(ctx, source, TensorSpec(merged, dtype)))
            probes.append(_probe_channel_slice(ctx, merged, c, dtype))
        else:
            view = _logits_view(w.source_shape, k)
            viewed = TensorSpec(tuple(view), dtype)
            one = TensorSpec((view[0], 1, *view[2:]), dtype)
            probes += [
                probe_reshape(ctx, source, viewed),
                probe_node(ctx, "Softmax", [viewed], [viewed], {"axis": 1}),
                probe_slice(ctx, viewed, one, [0], [1], [1]),
                probe_reshape(ctx, one, weight),
            ]
        probes.append(probe_node(ctx, "Mul", [branch, weight], [branch]))
    return probes


def _probe_channel_slice(
    ctx: RuleContext, shape: tuple[int, ...], channels: int, dtype: int
) -> Reason | None:
    part = TensorSpec((shape[0], channels, *shape[2:]), dtype)
    return probe_slice(ctx, TensorSpec(shape, dtype), part, [0], [channels], [1])


def _softmax_weights(
    ed: Editor, logits: gs.Tensor, logits_shape: list[int], k: int
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


def _weight_slices(ed: Editor, source: gs.Tensor, w: WeightedSum, stack: Stack) -> list[gs.Tensor]:
    """aᵢ [N, C, h, w]: channel slice i of the weights, first reshaped to [N, k·C, h, w] when
    they come in another 4-D shape (ResNeSt's softmax output [N, k, 1, C])."""
    n, c = stack.shape[0], stack.shape[1]
    merged = [n, stack.copies * c, *w.rest]
    if list(w.source_shape) != merged:
        target = ed.const("branch_weights_shape", np.array(merged, np.int64))
        source = ed.op("Reshape", "branch_weights", [source, target], merged, source.dtype)
    return _channel_slices(ed, source, stack.copies, [n, c, *w.rest])


def _channel_slices(ed: Editor, x: gs.Tensor, k: int, part_shape: list[int]) -> list[gs.Tensor]:
    """The k channel slices [N, C, …] of x [N, k·C, …]."""
    c = part_shape[1]
    parts = []
    for i in range(k):
        part = ed.var("branch", x.dtype, part_shape)
        add_slice(ed, x, part, [i * c], [(i + 1) * c], [1])
        parts.append(part)
    return parts


def _add_all(ed: Editor, terms: list[gs.Tensor], y: gs.Tensor, shape: list[int]) -> None:
    """y = terms[0] + terms[1] + …, left to right."""
    total = terms[0]
    for k, term in enumerate(terms[1:], start=1):
        if k == len(terms) - 1:
            ed.node("Add", "branch_sum", [total, term], [y])
        else:
            total = ed.op("Add", "branch_sum", [total, term], shape, term.dtype)
