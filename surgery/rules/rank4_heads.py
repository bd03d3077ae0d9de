"""slice-qkv: pick q, k and v by slicing the qkv projection instead of out of its rank-5 split.

Attention exports split the fused qkv projection [B, N, 3C] with Reshape(B, N, 3, heads, hd),
move the 3 to the front with Transpose(2, 0, 3, 1, 4) and pick q, k, v with Gather (or Split
and Squeeze) on that axis. With one image the rank-5 tensor has four non-unit axes and
`transformer-to-4d` carries it as 4-D; with several windows (Swin, windowed ViT) or a real batch
it has five, fits no 4-D layout, and the Reshape, Transpose and the three Gathers stay on the
host between two MLA segments. Each pick is a contiguous third of the features, so it is the
same data as Slice → Reshape(B, N, heads, hd) → Transpose(0, 2, 1, 3): all 4-D once the slice
reads the 4-D tensor the lifted projection produced.
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
    net_freed,
    probe_node,
    probe_reshape,
)


@dataclass
class Pick:
    """One selected index: the nodes producing it and the tensor it is written to."""

    index: int
    nodes: list[str]
    output: str
    reshaped: list[int] | None = None
    """The output's shape when the pick ends in a Reshape (rather than a Squeeze): the
    rewrite then reshapes the picked heads to it."""


@dataclass
class QkvSite:
    source: str
    """The tensor sliced: the projection itself, or the 4-D tensor it was reshaped from."""
    axis: int
    """The axis of `source` holding the features."""
    width: int
    """Features per pick (the elements after the picked axis of the split)."""
    heads_shape: list[int]
    """Reshape target of one pick: the split's shape without the picked axis."""
    perm: list[int] | None
    """Transpose of one pick (the original perm without the picked axis), None if identity."""
    picks: list[Pick]
    view: list[int] | None = None
    """A 4-D shape [outer, features, 1, 1] the source is reshaped to first, when no axis of it
    holds the features alone (a lift merged a window axis into them); None: sliced as is."""


class _Selectors:
    """Gather with a constant scalar index, Split into size-1 pieces each Squeezed, or Slices
    of one index each Squeezed (torch's dynamo exporter writes `unbind` so), on one axis of a
    tensor: index → (nodes, output). A Reshape that drops the axis stands for the Squeeze
    (`transformer-to-4d` lifts a Squeeze so)."""

    def __init__(self, pat: Pattern) -> None:
        self.pat = pat

    def of(self, tensor: str, rank: int) -> tuple[int, list[Pick]] | None:
        pat = self.pat
        users = pat.consumers(tensor)
        if not users or tensor in pat.outputs:
            return None
        axes, picks = set(), []
        for user in users:
            found = self._gather(user, rank) if pat.op(user) == "Gather" else None
            if found is None and pat.op(user) == "Split":
                found = self._split(user, tensor, rank)
            if found is None and pat.op(user) == "Slice":
                found = self._slice(user, tensor, rank)
            if found is None:
                return None
            axis, more = found
            axes.add(axis)
            picks.extend(more)
        if len(axes) != 1:
            return None
        return axes.pop(), picks

    def _gather(self, node: int, rank: int) -> tuple[int, list[Pick]] | None:
        pat = self.pat
        index = pat.value(pat.ins(node)[1])
        if index is None or index.ndim != 0:
            return None
        axis = int(pat.attrs(node).get("axis", 0)) % rank
        dim = (pat.shape(pat.ins(node)[0]) or ())[axis]
        return axis, [Pick(int(index) % dim, [pat.name(node)], pat.outs(node)[0])]

    def _split(self, node: int, tensor: str, rank: int) -> tuple[int, list[Pick]] | None:
        pat = self.pat
        axis = int(pat.attrs(node).get("axis", 0)) % rank
        shape = pat.shape(tensor)
        if shape is None or any(
            pat.shape(o) != (*shape[:axis], 1, *shape[axis + 1 :]) for o in pat.outs(node)
        ):
            return None
        picks = []
        for k, out in enumerate(pat.outs(node)):
            if not pat.consumers(out) and out not in pat.outputs:
                continue
            squeeze = pat.sole_consumer(out, "Squeeze")
            if squeeze is not None and self._squeezed(squeeze) == [axis]:
                picks.append(Pick(k, [pat.name(node), pat.name(squeeze)], pat.outs(squeeze)[0]))
                continue
            reshaped = self._reshaped(out)
            if reshaped is None:
                return None
            picks.append(Pick(k, [pat.name(node), pat.name(reshaped[0])], *reshaped[1:]))
        return axis, picks

    def _reshaped(self, piece: str) -> tuple[int, str, list[int]] | None:
        """(node, output, shape) of the Reshape that is the only reader of a picked piece
        (the lifted form of its Squeeze), or None."""
        pat = self.pat
        reshape = pat.sole_consumer(piece, "Reshape")
        if reshape is None:
            return None
        final = pat.shape(pat.outs(reshape)[0])
        if final is None or prod(final) != prod(pat.shape(piece) or (0,)):
            return None
        return reshape, pat.outs(reshape)[0], list(final)

    def _slice(self, node: int, tensor: str, rank: int) -> tuple[int, list[Pick]] | None:
        pat = self.pat
        ins = pat.ins(node)
        shape = pat.shape(tensor)
        if shape is None or len(ins) < 3:
            return None
        starts, ends = pat.value(ins[1]), pat.value(ins[2])
        axes = pat.value(ins[3]) if len(ins) > 3 and ins[3] else np.zeros(1, np.int64)
        steps = pat.value(ins[4]) if len(ins) > 4 and ins[4] else np.ones(1, np.int64)
        if any(v is None or v.size != 1 for v in (starts, ends, axes, steps)):
            return None
        axis = int(axes.reshape(-1)[0]) % rank
        out = pat.outs(node)[0]
        if int(steps.reshape(-1)[0]) != 1 or pat.shape(out) != (
            *shape[:axis],
            1,
            *shape[axis + 1 :],
        ):
            return None
        index = int(starts.reshape(-1)[0])
        index = index + shape[axis] if index < 0 else index
        squeeze = pat.sole_consumer(out, "Squeeze")
        if squeeze is not None and self._squeezed(squeeze) == [axis]:
            return axis, [Pick(index, [pat.name(node), pat.name(squeeze)], pat.outs(squeeze)[0])]
        reshaped = self._reshaped(out)
        if reshaped is None:
            return None
        return axis, [Pick(index, [pat.name(node), pat.name(reshaped[0])], *reshaped[1:])]

    def _squeezed(self, node: int) -> list[int] | None:
        pat = self.pat
        ins = pat.ins(node)
        raw = pat.value(ins[1]) if len(ins) > 1 and ins[1] else pat.attrs(node).get("axes")
        rank = len(pat.shape(ins[0]) or ())
        return (
            None if raw is None or not rank else sorted(int(a) % rank for a in np.atleast_1d(raw))
        )


def _without_unit_axes(shape: list[int], perm: list[int]) -> tuple[list[int], list[int]]:
    """`shape` and the Transpose `perm` of it with the size-1 axes dropped (and padded back to
    4-D with leading ones) when at most four axes are left: the same data in the same order, so
    a pick the lift reshapes to 4-D anyway (`Pick.reshaped`) moves in 4-D throughout."""
    kept = [a for a, d in enumerate(shape) if d != 1]
    if len(kept) > 4 or len(shape) <= 4:
        return shape, perm
    pad = 4 - len(kept)
    position = {a: pad + k for k, a in enumerate(kept)}
    return [1] * pad + [shape[a] for a in kept], [
        *range(pad),
        *(position[a] for a in perm if a in position),
    ]


@register
class SliceQkv(GraphRule):
    """Pick q, k and v by slicing the fused qkv projection instead of with Gather (or Split +
    Squeeze) from its rank-5 head split Reshape(B, N, 3, heads, hd) → Transpose(2, 0, 3, 1, 4).

    The picked axis must be the outermost factor of the projection's last axis, so each pick is
    a contiguous slice of the features; it becomes Slice → Reshape(B, N, heads, hd) →
    Transpose(0, 2, 1, 3). When the projection is the reshape of a 4-D tensor (the 1×1 Conv that
    `transformer-to-4d` made of the Linear), the slice reads that tensor on its channel axis, so
    the whole split runs on the MLA. It matters where the rank-5 tensor has five non-unit axes
    (Swin's windows, a batch) and fits no 4-D layout. Data movement only: exact.
    """

    name = "slice-qkv"
    suggest_for = frozenset({"Gather", "Split", "Squeeze", "Transpose", "Reshape"})
    summary = (
        "q/k/v picked from a rank-5 qkv split → Slice of the projection, 4-D Reshape, Transpose."
    )
    category = "rank"
    example = "surgery apply slice-qkv swin_tiny.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for t in pat.nodes("Transpose"):
            site = self._site(pat, t)
            if site is None:
                continue
            names = [n for p in site.picks for n in p.nodes]
            removed = [pat.name(t), pat.name(pat.producer(pat.ins(t)[0])), *names]  # type: ignore[arg-type]
            found.append(
                self.match(
                    list(dict.fromkeys(removed)),
                    f"{len(site.picks)} pick(s) from the rank-5 split at {pat.name(t)} → Slice "
                    f"of {site.source} on axis {site.axis}",
                    net_freed(ctx, removed, self._probes(ctx, pat, site)),
                    site=asdict(site),
                )
            )
        return found

    def _site(self, pat: Pattern, t: int) -> QkvSite | None:
        split = pat.ins(t)[0]
        r = pat.producer(split, "Reshape")
        perm = pat.attrs(t).get("perm")
        shape = pat.shape(split)
        if r is None or perm is None or shape is None or not pat.private(split):
            return None
        if not pat.is_float(split) or len(shape) != len(perm):
            return None
        selected = _Selectors(pat).of(pat.outs(t)[0], len(perm))
        if selected is None:
            return None
        axis, picks = selected
        picked = perm[axis]
        outer, features = prod(shape[:picked]), prod(shape[picked:])
        source, view = self._source(pat, pat.ins(r)[0], outer, features), None
        if source is None and sum(d != 1 for d in shape) > 4:
            # No 4-D layout holds the split; every pick is still a contiguous run of each
            # row of `features`, so a [outer, features, 1, 1] view of the input slices it.
            source, view = (pat.ins(r)[0], 1), [outer, features, 1, 1]
        if source is None:
            return None
        rest = [p - (p > picked) for p in perm if p != picked]
        heads = [*shape[:picked], *shape[picked + 1 :]]
        if all(p.reshaped is not None and len(p.reshaped) <= 4 for p in picks):
            heads, rest = _without_unit_axes(heads, rest)
        return QkvSite(
            source[0],
            source[1],
            prod(shape[picked + 1 :]),
            heads,
            None if rest == sorted(rest) else rest,
            picks,
            view,
        )

    @staticmethod
    def _source(pat: Pattern, x: str, outer: int, features: int) -> tuple[str, int] | None:
        """(tensor, axis) to slice: an axis holding exactly the `features` (the picked axis and
        the ones after it) with only size-1 axes after it and `outer` elements before it. A
        4-D tensor that `x` is a reshape of is preferred (the lifted projection)."""

        def feature_axis(tensor: str) -> int | None:
            shape = pat.shape(tensor)
            if shape is None:
                return None
            for k, d in enumerate(shape):
                if d == features and prod(shape[:k]) == outer and prod(shape[k + 1 :]) == 1:
                    return k
            return None

        r = pat.producer(x, "Reshape")
        if r is not None and len(pat.shape(pat.ins(r)[0]) or ()) == 4:
            k = feature_axis(pat.ins(r)[0])
            if k is not None:
                return pat.ins(r)[0], k
        k = feature_axis(x)
        return None if k is None else (x, k)

    @staticmethod
    def _probes(ctx: RuleContext, pat: Pattern, site: QkvSite) -> list:
        shape = list(site.view or pat.shape(site.source) or ())
        sliced = tuple(site.width if a == site.axis else d for a, d in enumerate(shape))
        heads = tuple(site.heads_shape)
        const = TensorSpec.const
        source = pat.spec(site.source)
        probes = []
        if site.view is not None:
            probes.append(probe_reshape(ctx, source, TensorSpec(tuple(site.view))))
            source = TensorSpec(tuple(site.view))
        probes += [
            probe_node(
                ctx,
                "Slice",
                [source, *(const(np.array([v])) for v in (0, site.width, site.axis))],
                [TensorSpec(sliced)],
            ),
            probe_node(
                ctx,
                "Reshape",
                [TensorSpec(sliced), const(np.array(heads, np.int64))],
                [TensorSpec(heads)],
            ),
        ]
        if site.perm is not None:
            moved = tuple(heads[p] for p in site.perm)
            probes.append(
                probe_node(
                    ctx, "Transpose", [TensorSpec(heads)], [TensorSpec(moved)], {"perm": site.perm}
                )
            )
        return probes

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        data = dict(match.data["site"])
        picks = [Pick(**p) for p in data.pop("picks")]
        site = QkvSite(**data, picks=picks)
        source = ed.tensor(site.source)
        dtype = source.dtype or np.float32
        if site.view is not None:
            view = ed.const("qkv_rows_shape", np.array(site.view, np.int64))
            source = ed.op("Reshape", "qkv_rows", [source, view], site.view, dtype)
        for pick in site.picks:
            nodes = [ed.node_named(n) for n in pick.nodes]
            out = ed.tensor(pick.output)
            ed.detach(*(n for n in nodes if n is not None))
            bounds = [
                ed.const("qkv_slice", np.array([v], np.int64))
                for v in (pick.index * site.width, (pick.index + 1) * site.width, site.axis)
            ]
            part = ed.op("Slice", "qkv_slice", [source, *bounds], None, dtype)
            if site.perm is None:  # the heads are the output's layout: reshape to it directly
                target = pick.reshaped or site.heads_shape
                shape = ed.const("qkv_heads_shape", np.array(target, np.int64))
                ed.node("Reshape", "qkv_heads", [part, shape], [out])
                continue
            shape = ed.const("qkv_heads_shape", np.array(site.heads_shape, np.int64))
            heads = ed.op("Reshape", "qkv_heads", [part, shape], site.heads_shape, dtype)
            if pick.reshaped is None:
                ed.node("Transpose", "qkv_heads_t", [heads], [out], perm=site.perm)
                continue
            moved = ed.op("Transpose", "qkv_heads_t", [heads], None, dtype, perm=site.perm)
            final = ed.const("qkv_pick_shape", np.array(pick.reshaped, np.int64))
            ed.node("Reshape", "qkv_pick", [moved, final], [out])
        return True
