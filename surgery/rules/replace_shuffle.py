"""Pixel shuffles spelled out as Reshape → Transpose → Reshape, folded back into the one
DepthToSpace / SpaceToDepth op they compute: shuffle-to-depth-to-space.

torch exports `nn.PixelShuffle` (super-resolution heads, some segmentation decoders) and
hand-written space-to-depth blocks this way; the rank-6 middle tensor keeps all three nodes off
a 4-D MLA, while the single op is a DMA move there. Data movement only: exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    OpsetGraphRule,
    Pattern,
    conversion_note,
    model_opset,
    net_freed,
    opset_upgrade_error,
    probe_node,
)

MODE_OPSET = 11
"""DepthToSpace has its `mode` attribute (and CRD) from opset 11."""


@dataclass(frozen=True)
class _Form:
    """One spelling: the op it is, its mode, the Transpose perm, and the rank-6 shape of the
    first Reshape for input [n, c, h, w] and block r."""

    op: str
    mode: str | None
    perm: tuple[int, ...]

    def middle(self, n: int, c: int, h: int, w: int, r: int) -> tuple[int, ...] | None:
        if self.op == "SpaceToDepth":
            if h % r or w % r:
                return None
            return (n, c, h // r, r, w // r, r)
        if c % (r * r):
            return None
        if self.mode == "CRD":
            return (n, c // (r * r), r, r, h, w)
        return (n, r, r, c // (r * r), h, w)

    @staticmethod
    def result(op: str, n: int, c: int, h: int, w: int, r: int) -> tuple[int, ...]:
        if op == "SpaceToDepth":
            return (n, c * r * r, h // r, w // r)
        return (n, c // (r * r), h * r, w * r)


_FORMS = (
    _Form("DepthToSpace", "CRD", (0, 1, 4, 2, 5, 3)),
    _Form("DepthToSpace", "DCR", (0, 3, 4, 1, 5, 2)),
    _Form("SpaceToDepth", None, (0, 3, 5, 1, 2, 4)),
)


@register
class ShuffleToDepthToSpace(OpsetGraphRule):
    """Fold Reshape → Transpose → Reshape that moves r×r blocks between channels and space
    into one DepthToSpace (CRD: torch's PixelShuffle; DCR) or SpaceToDepth.

    Matched by the shapes and the permutation, whatever the Reshapes' targets look like
    (constants with 0 or −1 included): the 4-D input [N, C, H, W], the rank-6 middle tensor,
    the perm of one of the three spellings and the 4-D result must all agree.
    """

    name = "shuffle-to-depth-to-space"
    suggest_for = frozenset({"Reshape", "Transpose"})
    summary = "Reshape → Transpose → Reshape pixel shuffle → DepthToSpace / SpaceToDepth."
    category = "replace"
    example = "surgery apply shuffle-to-depth-to-space espcn.onnx -o espcn_d2s.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for transpose in pat.nodes("Transpose"):
            site = self._site(pat, transpose)
            if site is None:
                continue
            nodes, x, y, op, attrs = site
            opset = model_opset(ctx)
            if attrs.get("mode") == "CRD" and opset < MODE_OPSET:
                if opset_upgrade_error(ctx, MODE_OPSET) is not None:
                    continue
                opset = MODE_OPSET
            elif opset < MODE_OPSET:
                attrs.pop("mode", None)  # DCR, the only mode before opset 11
            probe = probe_node(ctx, op, [pat.spec(x)], [pat.spec(y)], attrs, opset=opset)
            names = [pat.name(n) for n in nodes]
            found.append(
                self.match(
                    names,
                    f"pixel shuffle {' → '.join(names)} → {op}({_describe(attrs)})"
                    + conversion_note(ctx, opset),
                    net_freed(ctx, names, [probe]),
                    opset=opset,
                    op=op,
                    attrs=attrs,
                    x=x,
                    y=y,
                )
            )
        return found

    @staticmethod
    def _site(pat: Pattern, transpose: int) -> tuple[list[int], str, str, str, dict] | None:
        middle = pat.ins(transpose)[0]
        first = pat.producer(middle, "Reshape")
        shuffled = pat.outs(transpose)[0]
        last = pat.sole_consumer(shuffled, "Reshape")
        if first is None or last is None or not pat.private(middle):
            return None
        x, y = pat.ins(first)[0], pat.outs(last)[0]
        xs, ms, ys = pat.shape(x), pat.shape(middle), pat.shape(y)
        perm = tuple(pat.attrs(transpose).get("perm", ()))
        if xs is None or ms is None or ys is None or len(xs) != 4 or len(ms) != 6:
            return None
        for form in _FORMS:
            if perm != form.perm:
                continue
            r = ms[5] if form.op == "SpaceToDepth" else ms[2]
            if r < 2 or form.middle(*xs, r) != ms or form.result(form.op, *xs, r) != ys:
                continue
            attrs = {"blocksize": r} | ({"mode": form.mode} if form.mode else {})
            return [first, transpose, last], x, y, form.op, attrs
        return None

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        ed.detach(*(n for n in (ed.node_named(name) for name in match.nodes) if n is not None))
        x, y = ed.tensor(match.data["x"]), ed.tensor(match.data["y"])
        ed.node(match.data["op"], match.data["op"].lower(), [x], [y], **match.data["attrs"])
        return True


def _describe(attrs: dict) -> str:
    mode = f"{attrs['mode']}, " if "mode" in attrs else ""
    return f"{mode}blocksize {attrs['blocksize']}"
