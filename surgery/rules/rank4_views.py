"""axis-op-to-4d-view: a Split, Slice or max/mean reduction along one run of axes of a rank-5/6
tensor, done on the tensor's 4-D view [1, outer, n, inner].

An op that works along one axis (or a run of adjacent axes) of a row-major tensor only sees
three things: the elements before the run (`outer`), the run itself (`n`) and the elements
after it (`inner`). Viewed as [1, outer, n, inner] — a Reshape, no data moves — the same op
along axis 2 computes the same numbers, whatever the rank. Hiera's mask-unit attention splits
q, k, v out of a rank-6 [3, 1, heads, windows, tokens, hd] tensor and max-pools q over a
rank-6 view (the stride factor of the tokens); with five non-unit axes no 4-D layout holds
either, so both stay on the host between MLA segments. On the view the Split is a channel
Slice, the max a MaxPool of kernel [n, 1] (the mean an AveragePool). Reshapes that feed the op
from a ≤ 4-D tensor, or take its result to one, are absorbed: the view is read from and
written to those tensors directly, so no rank-5/6 tensor is left. Data movement, a max, or a
mean of the same elements: exact up to float summation order for the mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.rank4_layout import broadcast_blocks
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    net_freed,
    probe_node,
    probe_reshape,
    probe_slice,
    reduce_axes,
    reshape_source,
    reshaped_by_reader,
)
from surgery.rules.replace_slicing import SplitToSlices

POOLS = {"ReduceMax": "MaxPool", "ReduceMean": "AveragePool"}
"""Reductions over one run of axes and the pool that computes them on the view."""


@dataclass
class ViewedOp:
    """One op done on the [1, outer, n, inner] view of its input."""

    node: str
    op: str
    source: str
    """The tensor the view reads: the op's input, or the ≤ 4-D tensor a Reshape made it from."""
    view: list[int]
    pieces: list[tuple[int, int, str, list[int]]]
    """Per result: (start, end) along the view's axis 2 (the whole axis for a reduction), the
    tensor written and its shape."""
    absorbed: list[str]
    """Reshape nodes at the edges whose work the view's Reshapes take over."""


def _run(pat: Pattern, node: int, rank: int) -> tuple[int, int] | None:
    """[first, last] axis of the run `node` works along, or None."""
    op, ins, attrs = pat.op(node), pat.ins(node), pat.attrs(node)
    if op == "Split":
        axis = int(attrs.get("axis", 0)) % rank
        return axis, axis
    if op == "Slice":
        values = [pat.value(i) if i else None for i in ins[1:5]]
        starts, ends = values[0], values[1]
        axes = values[2] if len(ins) > 3 and ins[3] else np.zeros(1, np.int64)
        steps = values[3] if len(ins) > 4 and ins[4] else np.ones(1, np.int64)
        if any(v is None or v.size != 1 for v in (starts, ends, axes, steps)):
            return None
        if int(steps.reshape(-1)[0]) != 1:
            return None
        axis = int(axes.reshape(-1)[0]) % rank
        return axis, axis
    axes = reduce_axes(pat, node, rank)
    if not axes or axes != list(range(axes[0], axes[-1] + 1)):
        return None
    return axes[0], axes[-1]


@register
class AxisOpTo4dView(GraphRule):
    """Do a Split, a Slice (step 1) or a ReduceMax / ReduceMean along one run of adjacent axes
    of a rank-5/6 tensor on its 4-D view [1, outer, n, inner]: Slices of axis 2, or a MaxPool /
    AveragePool of kernel [n, 1] (then the result reshaped back).

    Row-major order makes the view exact: element (o, j, i) of the view is element j of the run
    between the o-th block of leading axes and the i-th block of trailing ones. Reshapes that
    connect the op to ≤ 4-D tensors are absorbed into the view's Reshapes. Only ops the target
    keeps off the MLA, on tensors with five or more non-unit axes (fewer fit a 4-D layout, and
    the rank lifts carry the op with its neighbours), are matched.
    """

    name = "axis-op-to-4d-view"
    suggest_for = frozenset({"Split", "Slice", *POOLS})
    summary = (
        "Split / Slice / ReduceMax / ReduceMean along one run of axes of a rank-5/6 tensor → "
        "the same on its 4-D view [1, outer, n, inner] (a Slice, a MaxPool / AveragePool)."
    )
    category = "rank"
    example = "surgery apply axis-op-to-4d-view hiera_tiny.onnx -o hiera_views.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Split", "Slice", *POOLS):
            site = self._site(pat, node)
            if site is None:
                continue
            removed = [site.node, *site.absorbed]
            found.append(
                self.match(
                    removed,
                    f"{site.op} {site.node} on the 4-D view {site.view} of {site.source}",
                    net_freed(ctx, removed, *self._probes(ctx, pat, site)),
                    site=dict(vars(site)),
                )
            )
        return found

    def _site(self, pat: Pattern, node: int) -> ViewedOp | None:
        x = pat.ins(node)[0]
        shape = pat.shape(x)
        if shape is None or pat.is_const(x) or not pat.is_float(x):
            return None
        if sum(d != 1 for d in shape) <= 4:
            return None  # a 4-D layout holds the tensor: the rank lifts carry the op
        run = _run(pat, node, len(shape))
        if run is None:
            return None
        first, last = run
        view = [1, prod(shape[:first]), prod(shape[first : last + 1]), prod(shape[last + 1 :])]
        if pat.op(node) in POOLS:
            if pat.attrs(node).get("keepdims", 1) not in (0, 1):
                return None
            windows = [(pat.outs(node)[0], 0, view[2])]
        elif pat.op(node) == "Split":
            windows = SplitToSlices._windows(pat, node, first)
        else:
            out_shape = pat.shape(pat.outs(node)[0])
            if out_shape is None:
                return None
            start = int(pat.value(pat.ins(node)[1]).reshape(-1)[0])
            start = min(max(start + shape[first] if start < 0 else start, 0), shape[first])
            windows = [(pat.outs(node)[0], start, start + out_shape[first])]
        if windows is None:
            return None
        source, absorbed = reshape_source(pat, x)
        pieces = []
        for out, start, end in windows:
            final, more = reshaped_by_reader(pat, out)
            final_shape = pat.shape(final)
            if final_shape is None:
                return None
            absorbed += more
            pieces.append((start, end, final, list(final_shape)))
        return ViewedOp(pat.name(node), pat.op(node), source, view, pieces, absorbed)

    @staticmethod
    def _probes(ctx: RuleContext, pat: Pattern, site: ViewedOp) -> tuple[list, list]:
        """(main, helpers): the view and the op must run on the MLA; a Reshape from or to a
        tensor that stays above rank 4 (a neighbour's to rewrite next) may not yet."""
        view = TensorSpec(tuple(site.view))
        main, helpers = [], []
        source = pat.spec(site.source)
        (main if len(source.shape or ()) <= 4 else helpers).append(probe_reshape(ctx, source, view))
        outer, n, inner = site.view[1:]
        for start, end, _, final in site.pieces:
            if site.op in POOLS:
                part = TensorSpec((1, outer, 1, inner))
                attrs = {"kernel_shape": [n, 1], "strides": [n, 1]}
                main.append(probe_node(ctx, POOLS[site.op], [view], [part], attrs))
            else:
                part = TensorSpec((1, outer, end - start, inner))
                main.append(probe_slice(ctx, view, part, [start], [end], [2]))
            (main if len(final) <= 4 else helpers).append(
                probe_reshape(ctx, part, TensorSpec(tuple(final)))
            )
        return main, helpers

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        data = dict(match.data["site"])
        site = ViewedOp(**data)
        nodes = [ed.node_named(n) for n in (site.node, *site.absorbed)]
        if any(n is None for n in nodes):
            return False
        source = ed.tensor(site.source)
        dtype = nodes[0].outputs[0].dtype or np.float32
        ed.detach(*nodes)
        target = ed.const("axis_view_shape", np.array(site.view, np.int64))
        view = ed.op("Reshape", "axis_view", [source, target], site.view, dtype)
        outer, n, inner = site.view[1:]
        for start, end, final, final_shape in site.pieces:
            if site.op in POOLS:
                part = ed.op(
                    POOLS[site.op],
                    "axis_pool",
                    [view],
                    [1, outer, 1, inner],
                    dtype,
                    kernel_shape=[n, 1],
                    strides=[n, 1],
                )
            else:
                part = ed.var("axis_slice_out", dtype, [1, outer, end - start, inner])
                add_slice(ed, view, part, [start], [end], [2])
            back = ed.const("axis_back_shape", np.array(final_shape, np.int64))
            ed.node("Reshape", "axis_back", [part, back], [ed.tensor(final)])
        return True


BROADCAST_OPS = ("Add", "Sub", "Mul", "Div")


def broadcast_view(shapes: list[tuple[int, ...]], out: tuple[int, ...]) -> list[list[int]] | None:
    """4-D views of `shapes` (operands of a broadcasting op) and `out` (the last entry) that
    merge runs of adjacent non-unit axes where every operand is either whole or broadcast
    alike (the lift's `broadcast_blocks` over the axes that are not 1); None when more than
    four such runs remain."""
    padded = [(1,) * (len(out) - len(s)) + tuple(s) for s in shapes]
    kept = [a for a, d in enumerate(out) if d != 1]
    layout = broadcast_blocks([out[a] for a in kept], [[s[a] for a in kept] for s in padded])
    if layout is None:
        return None
    return [list(layout.shape4([s[a] for a in kept])) for s in [*padded, out]]


@register
class BroadcastOpTo4dView(GraphRule):
    """Do an Add / Sub / Mul / Div whose result has five or more non-unit axes on 4-D views of
    its operands: runs of adjacent axes over which every operand is whole, or broadcast in the
    same way, merge into one (at most four runs), so the op broadcasts exactly as before.

    Decomposed relative positions add per-row and per-column tables to the attention scores
    viewed [B, heads, qh, qw, kh, kw] (MViTv2, SAM): the scores are whole everywhere, the
    tables broadcast over kw or kh, so [B·heads·qh·qw, kh, kw] holds all three. Reshapes that
    connect the operands or the result to ≤ 4-D tensors are absorbed. Exact. Only ops the
    target keeps off the MLA are matched.
    """

    name = "broadcast-op-to-4d-view"
    suggest_for = frozenset(BROADCAST_OPS)
    summary = (
        "Add/Sub/Mul/Div with five or more non-unit axes → the same on 4-D views that merge "
        "runs of axes broadcast alike."
    )
    category = "rank"
    example = "surgery apply broadcast-op-to-4d-view mvitv2_tiny.onnx -o mvit_bcast.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked(*BROADCAST_OPS):
            site = self._site(pat, node)
            if site is None:
                continue
            sources, views, final, absorbed = site
            removed = [pat.name(node), *absorbed]
            main = [
                probe_node(
                    ctx,
                    pat.op(node),
                    [TensorSpec(tuple(v)) for v in views[:2]],
                    [TensorSpec(tuple(views[2]))],
                )
            ]
            helpers = [
                probe_reshape(ctx, pat.spec(s), TensorSpec(tuple(v)))
                for s, v in zip(sources, views, strict=False)
            ]
            helpers.append(probe_reshape(ctx, TensorSpec(tuple(views[2])), pat.spec(final)))
            found.append(
                self.match(
                    removed,
                    f"{pat.op(node)} {pat.name(node)} on 4-D views {views[:2]}",
                    net_freed(ctx, removed, main, helpers),
                    sources=sources,
                    views=views,
                    final=final,
                    final_shape=list(pat.shape(final) or ()),
                )
            )
        return found

    @staticmethod
    def _site(pat: Pattern, node: int):
        ins, y = pat.ins(node), pat.outs(node)[0]
        out = pat.shape(y)
        shapes = [pat.shape(t) for t in ins[:2]]
        if out is None or len(ins) != 2 or any(s is None for s in shapes):
            return None
        if sum(d != 1 for d in out) <= 4 or not pat.is_float(y):
            return None
        views = broadcast_view(shapes, out)  # type: ignore[arg-type]
        if views is None:
            return None
        sources, absorbed = [], []
        for t in ins[:2]:
            source, more = reshape_source(pat, t) if not pat.is_const(t) else (t, [])
            sources.append(source)
            absorbed += [m for m in more if m not in absorbed]
        final, more = reshaped_by_reader(pat, y)
        if pat.shape(final) is None:
            return None
        return sources, views, final, [*absorbed, *more]

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        nodes = [ed.node_named(n) for n in match.nodes]
        if any(n is None for n in nodes):
            return False
        op = nodes[0]
        d = match.data
        final = ed.tensor(d["final"])
        dtype = op.outputs[0].dtype or np.float32
        ed.detach(*nodes)
        operands = []
        for source, view in zip(d["sources"], d["views"], strict=False):
            shape = ed.const("broadcast_view_shape", np.array(view, np.int64))
            operands.append(
                ed.op("Reshape", "broadcast_view", [ed.tensor(source), shape], view, dtype)
            )
        result = ed.op(op.op, f"{op.name}_4d", operands, d["views"][2], dtype)
        back = ed.const("broadcast_back_shape", np.array(d["final_shape"], np.int64))
        ed.node("Reshape", "broadcast_back", [result, back], [final])
        return True
