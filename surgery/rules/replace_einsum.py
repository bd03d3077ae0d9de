"""einsum-to-matmul: a two-operand Einsum that is a batched matrix product, as MatMul;
position-einsum-to-matmul: a product by a constant table batched over one axis (decomposed
relative positions), as 4-D views around one MatMul."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    RESHAPES,
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    net_freed,
    probe_node,
    probe_reshape,
    reshape_source,
)


@dataclass(frozen=True)
class ProductPlan:
    """Einsum `lhs,rhs->out` as Transpose(lhs) · Transpose(rhs) → Transpose to `out`: each
    perm is None when the operand is already in [batch…, rows, depth] / [batch…, depth, cols]
    order (or the product in `out`'s)."""

    lhs_perm: list[int] | None
    rhs_perm: list[int] | None
    out_perm: list[int] | None


def _two_operands(equation: str) -> tuple[str, str, str] | None:
    """(lhs, rhs, out) of an explicit two-operand equation without ellipsis; else None."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or "." in eq:
        return None
    inputs, out = eq.split("->")
    terms = inputs.split(",")
    return (terms[0], terms[1], out) if len(terms) == 2 else None


def plan_product(equation: str) -> ProductPlan | None:
    """The MatMul form of `equation` when it has two operands and each letter is a batch axis
    (in all three terms, in the same order), the one row axis (lhs and out), the one column axis
    (rhs and out) or the one contracted axis (lhs and rhs); else None."""
    terms = _two_operands(equation)
    if terms is None:
        return None
    lhs, rhs, out = terms
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


@dataclass
class PositionProduct:
    """Einsum "…s…c,{s,k,c}->…s…k" of a run-time tensor by a constant table batched over s."""

    einsum: str
    source: str
    table: list[int]
    """Axes of the constant that give its [s, c, k] order."""
    outer: int
    size: int
    inner: int
    depth: int
    cols: int
    out: str
    out_shape: list[int]
    absorbed: list[str]


def _position_plan(equation: str) -> tuple[int, list[int]] | None:
    """(position of the batch letter in lhs, axes of rhs in [s, c, k] order) when `equation`
    is lhs,rhs->out with lhs = rows… s rows… c, out = lhs with c replaced by k, and rhs a
    permutation of s, k, c; else None."""
    terms = _two_operands(equation)
    if terms is None:
        return None
    lhs, rhs, out = terms
    if len(rhs) != 3 or len(set(lhs)) != len(lhs) or len(lhs) < 2 or len(set(rhs)) != 3:
        return None
    c = lhs[-1]
    shared = [x for x in lhs[:-1] if x in rhs]
    cols = [x for x in rhs if x not in lhs]
    if c not in rhs or len(shared) != 1 or len(cols) != 1 or out != lhs[:-1] + cols[0]:
        return None
    s, k = shared[0], cols[0]
    return lhs.index(s), [rhs.index(s), rhs.index(c), rhs.index(k)]


@register
class PositionEinsumToMatmul(GraphRule):
    """Rewrite an Einsum of a run-time tensor with a constant table batched over one of its
    axes — decomposed relative positions, "bhwc,hkc->bhwk" (SAM, ViTDet, MViTv2: each query
    row h meets its own [k, c] table) — as 4-D ops: the tensor viewed [1, outer, s, inner·c],
    the batch axis swapped to the front, one MatMul by the table as [1, s, c, k], and the
    swap undone.

    Every letter before and after s is a row of the product; with the table's rows put in
    [s, c, k] order once (a constant), the product is a batched MatMul over s. No rank-5
    tensor and no Einsum remain (rk3588 and mlsoc run neither). Exact: the same sums of the
    same products. Only Einsums the target keeps off its MLA are matched.
    """

    name = "position-einsum-to-matmul"
    suggest_for = frozenset({"Einsum"})
    summary = (
        "Einsum of a tensor with a constant table batched over one of its axes "
        '("bhwc,hkc->bhwk", relative positions) → 4-D views, one MatMul.'
    )
    category = "replace"
    example = "surgery apply position-einsum-to-matmul mvitv2_tiny.onnx -o mvit_relpos.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Einsum"):
            site = self._site(pat, node)
            if site is None:
                continue
            removed = [site.einsum, *site.absorbed]
            found.append(
                self.match(
                    removed,
                    f"Einsum {site.einsum} by a constant table over one axis → 4-D MatMul",
                    net_freed(ctx, removed, *self._probes(ctx, pat, site)),
                    site=dict(vars(site)),
                )
            )
        return found

    def _site(self, pat: Pattern, node: int) -> PositionProduct | None:
        ins = pat.ins(node)
        plan = _position_plan(str(pat.attrs(node).get("equation", "")))
        if plan is None or len(ins) != 2 or not pat.is_const(ins[1]) or pat.is_const(ins[0]):
            return None
        at, table = plan
        shape, weight, out = pat.shape(ins[0]), pat.shape(ins[1]), pat.shape(pat.outs(node)[0])
        if shape is None or weight is None or out is None or not pat.is_float(ins[0]):
            return None
        source, absorbed = reshape_source(pat, ins[0])
        final, y = pat.outs(node)[0], pat.sole_consumer(pat.outs(node)[0], *RESHAPES)
        if y is not None and pat.shape(pat.outs(y)[0]) is not None:
            final, absorbed = pat.outs(y)[0], [*absorbed, pat.name(y)]
        return PositionProduct(
            pat.name(node),
            source,
            table,
            prod(shape[:at]),
            shape[at],
            prod(shape[at + 1 : -1]),
            shape[-1],
            weight[table[2]],
            final,
            list(pat.shape(final)),  # type: ignore[arg-type]
            absorbed,
        )

    @staticmethod
    def _steps(site: PositionProduct) -> list[tuple[str, tuple, tuple]]:
        """(op, input shape, output shape) of each emitted node, in order."""
        a, s, r, c, k = site.outer, site.size, site.inner, site.depth, site.cols
        return [
            ("Reshape", (), (1, a, s, r * c)),
            ("Transpose", (1, a, s, r * c), (1, s, a, r * c)),
            ("Reshape", (1, s, a, r * c), (1, s, a * r, c)),
            ("MatMul", (1, s, a * r, c), (1, s, a * r, k)),
            ("Reshape", (1, s, a * r, k), (1, s, a, r * k)),
            ("Transpose", (1, s, a, r * k), (1, a, s, r * k)),
            ("Reshape", (1, a, s, r * k), tuple(site.out_shape)),
        ]

    def _probes(self, ctx: RuleContext, pat: Pattern, site: PositionProduct) -> tuple[list, list]:
        main, helpers = [], []
        source = pat.spec(site.source)
        for op, src, dst in self._steps(site):
            first = TensorSpec(src) if src else source
            if op == "MatMul":
                table = TensorSpec((1, site.size, site.depth, site.cols), constant=True)
                main.append(probe_node(ctx, "MatMul", [first, table], [TensorSpec(dst)]))
            elif op == "Transpose":
                perm = {"perm": [0, 2, 1, 3]}
                main.append(probe_node(ctx, "Transpose", [first], [TensorSpec(dst)], perm))
            else:
                probe = probe_reshape(ctx, first, TensorSpec(dst))
                edge = len(first.shape or ()) > 4 or len(dst) > 4
                (helpers if edge else main).append(probe)
        return main, helpers

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        site = PositionProduct(**match.data["site"])
        nodes = [ed.node_named(n) for n in (site.einsum, *site.absorbed)]
        if any(n is None for n in nodes):
            return False
        einsum = nodes[0]
        value = ed.value(einsum.inputs[1], einsum.inputs[1].name)
        if value is None:
            return False
        dtype = einsum.outputs[0].dtype or np.float32
        out = ed.tensor(site.out)
        ed.detach(*nodes)
        table = np.ascontiguousarray(value.transpose(site.table))[None]
        current = ed.tensor(site.source)
        steps = self._steps(site)
        for k, (op, _, dst) in enumerate(steps):
            last = k == len(steps) - 1
            target = out if last else ed.var(f"position_{op.lower()}", dtype, list(dst))
            if op == "Reshape":
                shape = ed.const("position_shape", np.array(dst, np.int64))
                ed.node("Reshape", "position_view", [current, shape], [target])
            elif op == "Transpose":
                ed.node("Transpose", "position_swap", [current], [target], perm=[0, 2, 1, 3])
            else:
                weight = ed.const("position_table", table.astype(value.dtype))
                ed.node("MatMul", "position_product", [current, weight], [target])
            current = target
        return True
