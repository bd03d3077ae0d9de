"""Rank-6 shuffles spelled out as Reshape → Transpose → Reshape. Pixel shuffles fold back into
the one DepthToSpace / SpaceToDepth op they compute (shuffle-to-depth-to-space); any other
permutation, such as MobileViT's patch unfold and fold, becomes a short chain of 4-D Transposes
of blocks of axes (transpose-to-block-swaps).

torch exports `nn.PixelShuffle` (super-resolution heads, some segmentation decoders) and
hand-written space-to-depth blocks this way; the rank-6 middle tensor keeps all three nodes off
a 4-D MLA, while the single op is a DMA move there. Data movement only: exact.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

import numpy as np
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.rank4_layout import moving_runs, transpose_runs
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    OpsetGraphRule,
    Pattern,
    TensorSpec,
    conversion_note,
    fmt_shape,
    model_opset,
    net_freed,
    opset_upgrade_error,
    probe_node,
    probe_reshape,
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
        sandwich = reshape_transpose_reshape(pat, transpose)
        if sandwich is None:
            return None
        first, last, x, middle, y = sandwich
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


def reshape_transpose_reshape(
    pat: Pattern, transpose: int
) -> tuple[int, int, str, str, str] | None:
    """(first Reshape, last Reshape, input, the Reshape's output the Transpose reads, output)
    of Reshape → Transpose → Reshape with private intermediates; None otherwise."""
    middle = pat.ins(transpose)[0]
    first = pat.producer(middle, "Reshape")
    last = pat.sole_consumer(pat.outs(transpose)[0], "Reshape")
    if first is None or last is None or not pat.private(middle):
        return None
    return first, last, pat.ins(first)[0], middle, pat.outs(last)[0]


def _describe(attrs: dict) -> str:
    mode = f"{attrs['mode']}, " if "mode" in attrs else ""
    return f"{mode}blocksize {attrs['blocksize']}"


BlockSwap = tuple[tuple[int, int, int, int], tuple[int, ...]]
"""One step of a block-swap chain: the 4-D shape the tensor is viewed as, and the Transpose."""

MAX_RUNS = 6
"""Most blocks of axes that move independently (a rank-6 transpose has at most six): the
search visits at most 6! orders; more (none seen in exports) is not attempted."""


@register
class TransposeToBlockSwaps(GraphRule):
    """Rewrite Reshape → Transpose → Reshape through a rank-5/6 tensor as a chain of 4-D
    Transposes, each swapping consecutive blocks of axes behind a fixed leading block.

    MobileViT (v1/v2/v3) unfolds a feature map into patches this way —
    [1,C,H,W] → [1,C,nh,ph,nw,pw] → perm (0,1,3,5,2,4) → [1,C,ph·pw,nh·nw] — and folds it
    back with the inverse; five axes move on their own, so no single 4-D Transpose and no
    pixel shuffle computes it, and all three nodes leave the MLA. Any permutation is a
    product of block moves: view the tensor as [A, X, Y, Z] (A the axes that stay in front,
    X, Y, Z consecutive blocks after it) and permute X, Y, Z; the batch slot A never moves,
    as the MLA requires. The shortest chain is found by breadth-first search over the order
    of the moving axes (two Transposes for a patch unfold or fold). Pure data movement: exact.
    Pixel shuffles are left to shuffle-to-depth-to-space (one op instead of a chain), and
    permutations that move at most four blocks (a channel shuffle, a Swin window partition)
    to the rank-4 lift, which carries them as one 4-D Transpose inside its region.
    """

    name = "transpose-to-block-swaps"
    suggest_for = frozenset({"Reshape", "Transpose"})
    summary = (
        "Reshape → Transpose → Reshape through a rank-5/6 tensor (patch unfold/fold) → "
        "a chain of 4-D Transposes of blocks of axes."
    )
    category = "replace"
    example = "surgery apply transpose-to-block-swaps mobilevitv2.onnx -o mvit_4d.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for transpose in pat.nodes("Transpose"):
            site = self._site(pat, transpose)
            if site is None or ShuffleToDepthToSpace._site(pat, transpose) is not None:
                continue
            nodes, x, y, steps = site
            elem = pat.elem_type(x)
            probes = []
            current = pat.spec(x)
            for shape4, perm in steps:
                view = TensorSpec(shape4, elem)
                moved = TensorSpec(tuple(shape4[p] for p in perm), elem)
                probes.append(probe_reshape(ctx, current, view))
                probes.append(probe_node(ctx, "Transpose", [view], [moved], {"perm": list(perm)}))
                current = moved
            probes.append(probe_reshape(ctx, current, pat.spec(y)))
            names = [pat.name(n) for n in nodes]
            found.append(
                self.match(
                    names,
                    f"rank-{len(pat.shape(pat.outs(nodes[0])[0]) or ())} transpose "
                    f"{' → '.join(names)} → {len(steps)} 4-D block swap(s) "
                    + ", ".join(f"{fmt_shape(s)} perm {list(p)}" for s, p in steps),
                    net_freed(ctx, names, probes),
                    x=x,
                    y=y,
                    steps=[[list(s), list(p)] for s, p in steps],
                )
            )
        return found

    @staticmethod
    def _site(pat: Pattern, transpose: int) -> tuple[list[int], str, str, list[BlockSwap]] | None:
        sandwich = reshape_transpose_reshape(pat, transpose)
        if sandwich is None:
            return TransposeToBlockSwaps._lone_site(pat, transpose)
        first, last, x, middle, y = sandwich
        xs, ms, ys = pat.shape(x), pat.shape(middle), pat.shape(y)
        if ms is not None and len(ms) <= 4:
            return TransposeToBlockSwaps._lone_site(pat, transpose)
        if xs is None or ms is None or ys is None or len(ys) > 4:
            return None
        if not pat.is_float(x):
            return None
        perm = tuple(pat.attrs(transpose).get("perm") or reversed(range(len(ms))))
        if transpose_runs(ms, perm) is not None:
            return None  # one 4-D Transpose of at most four blocks: the rank-4 lift's case
        steps = block_swaps(ms, perm)
        if not steps:
            return None
        return [first, transpose, last], x, y, steps

    @staticmethod
    def _lone_site(
        pat: Pattern, transpose: int
    ) -> tuple[list[int], str, str, list[BlockSwap]] | None:
        """A Transpose of at most four dimensions the target keeps off the MLA because it moves
        the batch axis (the rank lifts write one when a head split puts a non-unit axis in front,
        e.g. Hiera's (3, heads) of the qkv split): block swaps behind a unit batch slot."""
        x, y = pat.ins(transpose)[0], pat.outs(transpose)[0]
        shape = pat.shape(x)
        if shape is None or len(shape) > 4 or not pat.is_float(x):
            return None
        if pat.name(transpose) not in pat.ctx.blocker_names:
            return None
        perm = tuple(pat.attrs(transpose).get("perm") or reversed(range(len(shape))))
        if perm[0] == 0 or pat.shape(y) is None:
            return None
        steps = block_swaps(shape, perm)
        if not steps:
            return None
        return [transpose], x, y, steps

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        ed.detach(*(n for n in (ed.node_named(name) for name in match.nodes) if n is not None))
        x, y = ed.tensor(match.data["x"]), ed.tensor(match.data["y"])
        emit_block_swaps(ed, x, y, match.data["steps"], list(y.shape or ()))
        return True


def emit_block_swaps(
    ed: Editor, x: gs.Tensor, y: gs.Tensor, steps: Sequence[BlockSwap], y_shape: Sequence[int]
) -> None:
    """Write y (of `y_shape`) as x through the 4-D `steps` of `block_swaps`: per step a
    Reshape to its 4-D view (when the shape changes) and its Transpose, then a Reshape to y."""
    current: gs.Tensor = x
    shape = list(x.shape or ())
    for shape4, perm in steps:
        if shape != list(shape4):
            target = ed.const("block_view_shape", np.array(shape4, np.int64))
            current = ed.op("Reshape", "block_view", [current, target], list(shape4), x.dtype)
        shape = [shape4[p] for p in perm]
        current = ed.op("Transpose", "block_swap", [current], shape, x.dtype, perm=list(perm))
    out = ed.const("block_out_shape", np.array(y_shape, np.int64))
    ed.node("Reshape", "block_out", [current, out], [y])


def block_swaps(shape: Sequence[int], perm: Sequence[int]) -> list[BlockSwap] | None:
    """The shortest chain of 4-D block moves computing `transpose(x, perm)` for x of `shape`
    (read in memory order, as a Reshape would read the result): each step views the current
    tensor as [A, X, Y, Z] and permutes X, Y, Z. [] when no data moves; None when the axes
    that move independently are too many to search."""
    steps = _block_swaps(tuple(shape), tuple(perm))
    return None if steps is None else list(steps)


@lru_cache(maxsize=256)
def _block_swaps(shape: tuple[int, ...], perm: tuple[int, ...]) -> tuple[BlockSwap, ...] | None:
    """`block_swaps`, once per shape and perm: `surgery check` asks on every run, and a model
    repeats the same unfold in every block."""
    runs = moving_runs(shape, perm)
    if len(runs) > MAX_RUNS:
        return None
    by_start = sorted(range(len(runs)), key=lambda k: runs[k][0])
    label = {k: i for i, k in enumerate(by_start)}
    size = [prod(shape[a] for a in runs[k]) for k in by_start]
    start = tuple(range(len(runs)))
    goal = tuple(label[k] for k in range(len(runs)))
    previous: dict[tuple[int, ...], tuple[tuple[int, ...], BlockSwap] | None] = {start: None}
    frontier = deque([start])
    while frontier and goal not in previous:
        state = frontier.popleft()
        for nxt, step in _block_moves(state, size):
            if nxt not in previous:
                previous[nxt] = (state, step)
                frontier.append(nxt)
    if goal not in previous:
        return None
    steps: list[BlockSwap] = []
    state = goal
    while (back := previous[state]) is not None:
        state, step = back
        steps.append(step)
    return tuple(steps[::-1])


def _block_moves(state: tuple[int, ...], size: Sequence[int]):
    """Every state one 4-D Transpose away, with its step: a prefix A stays in slot 0, the rest
    is cut into up to three consecutive blocks that are permuted."""
    n = len(state)

    def dims(block: Sequence[int]) -> int:
        return prod(size[k] for k in block)

    for a in range(n - 1):
        rest = state[a:]
        for i in range(1, len(rest)):
            for j in range(i + 1, len(rest) + 1):
                blocks = [rest[:i], rest[i:j], rest[j:]]
                shape4 = (dims(state[:a]), *(dims(b) for b in blocks))
                for order in itertools.permutations(range(3)):
                    if order == (0, 1, 2) or (not blocks[2] and order[2] != 2):
                        continue
                    moved = state[:a] + tuple(k for o in order for k in blocks[o])
                    yield moved, (shape4, (0, *(1 + o for o in order)))
