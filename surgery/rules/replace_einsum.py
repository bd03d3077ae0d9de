"""einsum-to-matmul: a two-operand Einsum that is a batched matrix product, as MatMul."""

from __future__ import annotations

from dataclasses import dataclass

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    net_freed,
    probe_node,
)


@dataclass(frozen=True)
class ProductPlan:
    """Einsum `lhs,rhs->out` as Transpose(lhs) · Transpose(rhs) → Transpose to `out`: each
    perm is None when the operand is already in [batch…, rows, depth] / [batch…, depth, cols]
    order (or the product in `out`'s)."""

    lhs_perm: list[int] | None
    rhs_perm: list[int] | None
    out_perm: list[int] | None


def plan_product(equation: str) -> ProductPlan | None:
    """The MatMul form of `equation` when it has two operands and each letter is a batch axis
    (in all three terms, in the same order), the one row axis (lhs and out), the one column axis
    (rhs and out) or the one contracted axis (lhs and rhs); else None."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or "." in eq:
        return None
    inputs, out = eq.split("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        return None
    lhs, rhs = terms
    if not all(t.isalpha() for t in (lhs, rhs, out)) or not set(out) <= set(lhs) | set(rhs):
        return None
    if any(len(set(t)) != len(t) for t in (lhs, rhs, out)):
        return None
    batch = [c for c in out if c in lhs and c in rhs]
    rows = [c for c in out if c in lhs and c not in rhs]
    cols = [c for c in out if c in rhs and c not in lhs]
    depth = [c for c in lhs if c in rhs and c not in out]
    if len(rows) != 1 or len(cols) != 1 or len(depth) != 1:
        return None
    if set(lhs) != {*batch, *rows, *depth} or set(rhs) != {*batch, *cols, *depth}:
        return None  # a letter summed inside one operand
    if [c for c in lhs if c in batch] != batch or [c for c in rhs if c in batch] != batch:
        return None
    a, b, y = [*batch, *rows, *depth], [*batch, *depth, *cols], [*batch, *rows, *cols]

    def perm(source: str, order: list[str]) -> list[int] | None:
        p = [source.index(c) for c in order]
        return None if p == sorted(p) else p

    return ProductPlan(
        perm(lhs, a), perm(rhs, b), [y.index(c) for c in out] if y != list(out) else None
    )


@register
class EinsumToMatmul(GraphRule):
    """Rewrite an Einsum that is a batched matrix product as MatMul, with Transposes where the
    operands or the result are in another order (`bhlk,bhtk->bhlt` is q·kᵀ: one Transpose of k).

    Targets without Einsum (rk3588) run MatMul; CvT, BoTNet and other attention exports write
    their products as Einsum. Each letter must be a batch axis (in both operands and the output,
    in the same order), the row, the column or the contracted axis; equations with a letter
    summed inside one operand, an ellipsis or more than two operands are left alone. Exact: the
    same sums of products (float rounding may differ in the order of additions).
    Only nodes the target keeps off its MLA are matched.
    """

    name = "einsum-to-matmul"
    suggest_for = frozenset({"Einsum"})
    summary = "Two-operand Einsum that is a batched matrix product → MatMul (+ Transposes)."
    category = "replace"
    example = "surgery apply einsum-to-matmul cvt.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Einsum"):
            ins = pat.ins(node)
            plan = plan_product(str(pat.attrs(node).get("equation", "")))
            if plan is None or len(ins) != 2:
                continue
            shapes = [pat.shape(t) for t in (*ins, pat.outs(node)[0])]
            if any(s is None for s in shapes):
                continue
            a, b, y = (self._moved(s, p) for s, p in zip(shapes, self._perms(plan), strict=True))
            main = [probe_node(ctx, "MatMul", [TensorSpec(a), TensorSpec(b)], [TensorSpec(y)])]
            helpers = [
                probe_node(ctx, "Transpose", [TensorSpec(src)], [TensorSpec(dst)], {"perm": p})
                for src, dst, p in (
                    (shapes[0], a, plan.lhs_perm),
                    (shapes[1], b, plan.rhs_perm),
                    (y, shapes[2], plan.out_perm),
                )
                if p is not None
            ]
            name = pat.name(node)
            found.append(
                self.match(
                    [name],
                    f"Einsum {name} ({pat.attrs(node).get('equation')}) → MatMul",
                    net_freed(ctx, [name], main, helpers),
                    lhs_perm=plan.lhs_perm,
                    rhs_perm=plan.rhs_perm,
                    out_perm=plan.out_perm,
                )
            )
        return found

    @staticmethod
    def _perms(plan: ProductPlan) -> tuple:
        inverse = None
        if plan.out_perm is not None:
            inverse = [plan.out_perm.index(k) for k in range(len(plan.out_perm))]
        return plan.lhs_perm, plan.rhs_perm, inverse

    @staticmethod
    def _moved(shape, perm: list[int] | None) -> tuple:
        return tuple(shape) if perm is None else tuple(shape[p] for p in perm)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        einsum = ed.node_named(match.nodes[0])
        assert einsum is not None
        a, b = einsum.inputs[0], einsum.inputs[1]
        out = einsum.outputs[0]
        ed.detach(einsum)
        d = match.data
        if d["lhs_perm"] is not None:
            a = ed.op("Transpose", "einsum_lhs", [a], None, a.dtype, perm=d["lhs_perm"])
        if d["rhs_perm"] is not None:
            b = ed.op("Transpose", "einsum_rhs", [b], None, b.dtype, perm=d["rhs_perm"])
        if d["out_perm"] is None:
            ed.node("MatMul", "einsum_matmul", [a, b], [out])
            return True
        product = ed.op("MatMul", "einsum_matmul", [a, b], None, out.dtype)
        ed.node("Transpose", "einsum_out", [product], [out], perm=d["out_perm"])
        return True
