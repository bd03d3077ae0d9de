"""relative-gather-to-slices: the relative-position GatherElements of disentangled attention
(DeBERTa's c2p / p2c scores) as one flat Slice and two Reshapes.

DeBERTa scores every query against every relative distance (q · pos_keyᵀ: [heads, L, 2k]) and
then picks, for query i and key j, distance i − j: GatherElements along the last axis with the
constant index k + i − j (c2p) or k − i + j (p2c). No MLA runs GatherElements, so each layer
left two host stages between MLA segments. The index is affine in the row and the column —
index[m, n] = a + b·m + s·n with b, s = ±1 — and such a pick is a skew: in the row-major
flattened scores, element (m, n) sits at a + m·(R + b) + n, so the picks are the flat run from a
read as rows of R + b (the Transformer-XL relative shift). Before that, the constant operand
of the MatMul that made the scores is cut to the distances the index uses (the rest is never
read: fewer MACs) and, for s = −1, reversed so that the columns run forwards. Data movement
and the same products: exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import prod

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    add_zero_pad,
    net_freed,
    probe_node,
    probe_reshape,
    probe_slice,
    probe_zero_pad,
    reshape_source,
    reshaped_by_reader,
)


@dataclass
class Skew:
    """One GatherElements read as a skew of its (re-made) scores."""

    gather: str
    scores: str
    """The MatMul making the scores (rewritten with the cut constant), or "" to read the data
    as it is."""
    lo: int
    reverse: bool
    """Columns lo … lo + width − 1 of the constant operand are used (reversed if True)."""
    width: int
    rows: int
    start: int
    stride: int
    picks: int
    leading: int
    """Product of the axes before the rows (heads)."""
    out: str
    out_shape: list[int]
    absorbed: list[str]
    queries: str = ""
    """The ≤ 4-D tensor the scores MatMul's left operand is a reshape of (read directly, as
    `queries_shape`, so the MatMul is 4-D), or "" to keep the left operand."""
    queries_shape: list[int] | None = None


def affine_index(index: np.ndarray) -> tuple[int, int, int] | None:
    """(a, b, s) when every leading slice of the 2-D-or-more `index` is the same
    index[m, n] = a + b·m + s·n with b in {−1, 0, 1} and s in {−1, 1}; else None."""
    if index.ndim < 2 or index.shape[-1] < 1:
        return None
    table = index.reshape(-1, *index.shape[-2:])
    if not (table == table[0]).all():
        return None
    rows, cols = table[0].shape
    a = int(table[0, 0, 0])
    b = int(table[0, 1, 0] - a) if rows > 1 else 0
    s = int(table[0, 0, 1] - a) if cols > 1 else 1
    if b not in (-1, 0, 1) or s not in (-1, 1):
        return None
    expected = a + b * np.arange(rows)[:, None] + s * np.arange(cols)[None, :]
    return (a, b, s) if np.array_equal(table[0], expected) else None


@register
class RelativeGatherToSlices(GraphRule):
    """Rewrite a GatherElements along the last axis whose constant index is affine in the row
    and the column (index[…, m, n] = a + b·m + s·n, b, s = ±1, the same for every head) — the
    relative-position picks of DeBERTa's disentangled attention — as a flat Slice of the scores
    read as rows of R + b, then a Slice of the first N columns.

    When the scores are a MatMul by a constant (the projected relative embeddings), that
    constant is cut to the columns the index reaches and, for s = −1, reversed; other data is
    read as it is (s = +1 only). Pure data movement after the same products: exact. Only
    GatherElements the target keeps off its MLA are matched.
    """

    name = "relative-gather-to-slices"
    suggest_for = frozenset({"GatherElements"})
    summary = (
        "GatherElements by a constant index a ± row ± column (DeBERTa's relative positions) "
        "→ the skew as a flat Slice and Reshapes."
    )
    category = "replace"
    example = "surgery apply relative-gather-to-slices deberta_v3.onnx -o deberta_skew.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("GatherElements"):
            site = self._site(pat, node)
            if site is None:
                continue
            removed = [site.gather, *site.absorbed]
            found.append(
                self.match(
                    removed,
                    f"GatherElements {site.gather}: the skew of {site.rows} rows as a flat "
                    f"Slice read in rows of {site.stride}",
                    net_freed(ctx, removed, self._probes(ctx, site)),
                    skew=asdict(site),
                )
            )
        return found

    def _site(self, pat: Pattern, node: int) -> Skew | None:
        data, index = pat.ins(node)[:2]
        shape, table = pat.shape(data), pat.stored(index)
        if shape is None or table is None or len(shape) < 2 or not pat.is_float(data):
            return None
        if int(pat.attrs(node).get("axis", 0)) % len(shape) != len(shape) - 1:
            return None
        if table.shape[:-1] != tuple(shape[:-1]) or pat.is_const(data):
            return None
        affine = affine_index(table)
        if affine is None:
            return None
        a, b, s = affine
        rows, picks, width = shape[-2], table.shape[-1], shape[-1]
        used = np.unique(table)
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= width:
            return None
        scores, reverse = self._scores(pat, data), s == -1
        if scores is None:
            if reverse:
                return None
            lo, hi = 0, width - 1
        cut = hi - lo + 1
        # Index into the cut (and maybe reversed) columns, then the skew's flat geometry.
        start = (hi - a) if reverse else (a - lo)
        slope = -b if reverse else b
        stride = cut + slope
        if stride < picks or start < 0:
            return None
        final, absorbed = reshaped_by_reader(pat, pat.outs(node)[0])
        out_shape = pat.shape(final)
        if out_shape is None:
            return None
        queries, queries_shape = "", None
        if scores is not None:
            left = pat.ins(scores)[0]
            source, more = reshape_source(pat, left)
            left_shape = pat.shape(left)
            if source != left and left_shape is not None and len(left_shape) <= 4:
                queries, queries_shape = source, [1] * (4 - len(left_shape)) + list(left_shape)
                absorbed = [*absorbed, *more]
        return Skew(
            pat.name(node),
            pat.name(scores) if scores is not None else "",
            lo,
            reverse,
            cut,
            rows,
            start,
            stride,
            picks,
            prod(shape[:-2]),
            final,
            list(out_shape),
            absorbed,
            queries,
            queries_shape,
        )

    @staticmethod
    def _scores(pat: Pattern, data: str) -> int | None:
        """The MatMul by a constant matrix (columns last) that makes `data`, read by nothing
        else; None otherwise."""
        mm = pat.producer(data, "MatMul")
        if mm is None or not pat.private(data):
            return None
        weight = pat.ins(mm)[1]
        shape = pat.shape(weight)
        # Known before run time is enough here: the edit reads the value (evaluating a
        # constant subgraph, DeBERTa's projected relative embeddings, costs more than a check).
        if not pat.is_const(weight) or shape is None or len(shape) > 4:
            return None
        return mm

    @staticmethod
    def _probes(ctx: RuleContext, site: Skew) -> list:
        """The skew's nodes from the flat view on (the scores are lifted to 4-D with the
        attention around them)."""
        flat = TensorSpec((1, site.leading, 1, site.rows * site.width))
        taken = TensorSpec((1, site.leading, 1, site.rows * site.stride))
        grid = TensorSpec((1, site.leading, site.rows, site.stride))
        picked = TensorSpec((1, site.leading, site.rows, site.picks))
        probes = []
        if site.queries_shape is not None:
            weight = (1, site.leading, site.queries_shape[-1], site.width)
            scores = (*site.queries_shape[:-1], site.width)
            probes.append(
                probe_node(
                    ctx,
                    "MatMul",
                    [TensorSpec(tuple(site.queries_shape)), TensorSpec(weight, constant=True)],
                    [TensorSpec(scores)],
                )
            )
        end = site.start + site.rows * site.stride
        if end > site.rows * site.width:
            padded = (1, site.leading, 1, end)
            pads = [0, 0, 0, 0, 0, 0, 0, end - site.rows * site.width]
            probes.append(probe_zero_pad(ctx, flat, padded, pads))
            flat = TensorSpec(padded)
        probes.append(probe_slice(ctx, flat, taken, [site.start], [end], [3]))
        probes.append(probe_reshape(ctx, taken, grid))
        probes.append(probe_slice(ctx, grid, picked, [0], [site.picks], [3]))
        probes.append(probe_reshape(ctx, picked, TensorSpec(tuple(site.out_shape))))
        return probes

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        site = Skew(**match.data["skew"])
        nodes = [ed.node_named(n) for n in (site.gather, *site.absorbed)]
        if any(n is None for n in nodes):
            return False
        data = nodes[0].inputs[0]
        dtype = data.dtype or np.float32
        out = ed.tensor(site.out)
        ed.detach(*nodes)
        if site.scores:
            data = self._cut_scores(ed, site, dtype)
        flat_shape = [1, site.leading, 1, site.rows * site.width]
        flat = ed.op(
            "Reshape",
            "skew_flat",
            [data, ed.const("skew_flat_shape", np.array(flat_shape, np.int64))],
            flat_shape,
            dtype,
        )
        end = site.start + site.rows * site.stride
        if end > flat_shape[3]:
            pads = [0, 0, 0, 0, 0, 0, 0, end - flat_shape[3]]
            flat = add_zero_pad(ed, flat, pads, [*flat_shape[:3], end], "skew_pad")
        taken = ed.var("skew_run", dtype, [1, site.leading, 1, site.rows * site.stride])
        add_slice(ed, flat, taken, [site.start], [end], [3])
        grid_shape = [1, site.leading, site.rows, site.stride]
        grid = ed.op(
            "Reshape",
            "skew_rows",
            [taken, ed.const("skew_rows_shape", np.array(grid_shape, np.int64))],
            grid_shape,
            dtype,
        )
        picked = ed.var("skew_picked", dtype, [1, site.leading, site.rows, site.picks])
        add_slice(ed, grid, picked, [0], [site.picks], [3])
        back = ed.const("skew_out_shape", np.array(site.out_shape, np.int64))
        ed.node("Reshape", "skew_out", [picked, back], [out])
        return True

    @staticmethod
    def _cut_scores(ed: Editor, site: Skew, dtype) -> object:
        """The scores MatMul again, by its constant cut to the used columns (reversed for a
        descending index); returns the new scores tensor."""
        mm = ed.node_named(site.scores)
        assert mm is not None
        a, weight = mm.inputs[0], mm.inputs[1]
        value = ed.value(weight, weight.name)
        assert value is not None
        cut = value[..., site.lo : site.lo + site.width]
        if site.reverse:
            cut = cut[..., ::-1]
        ed.detach(mm)
        if site.queries_shape is not None:  # the product in 4-D, on the queries' own tensor
            shape = np.array(site.queries_shape, np.int64)
            a = ed.op(
                "Reshape",
                "relative_queries",
                [ed.tensor(site.queries), ed.const("relative_queries_shape", shape)],
                site.queries_shape,
                dtype,
            )
            cut = cut.reshape((1,) * (4 - cut.ndim) + cut.shape)
        const = ed.const("relative_weight", np.ascontiguousarray(cut))
        return ed.op("MatMul", "relative_scores", [a, const], None, dtype)
