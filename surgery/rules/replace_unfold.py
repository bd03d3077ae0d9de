"""Non-overlapping unfold and fold as the data movement they are: gather-table-to-transpose,
col2im-to-transpose.

torch writes `F.unfold` with kernel = stride as Gathers of constant index tables (one per
spatial axis: table[i, j] = s·j + i picks pixel j of patch position i) and `F.fold` as
Col2Im (opset 18). Both only move data, but neither op runs on an MLA and the tables make
them opaque to the rank lifts. Rewritten as Reshape → Transpose (→ Reshape), they are the
patch shuffles that transpose-to-block-swaps and the rank-4 lifts already carry as 4-D
Transposes (HF MobileViTV2 unfolds and folds every attention block so). Both write the
permutation directly as the 4-D block swaps of transpose-to-block-swaps (`block_swaps`), so a
rewrite leaves at most the reshape at its edge off the MLA. Both are cleanups: canonical forms
the rank lifts continue from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    model_opset,
    net_freed,
    probe_node,
    probe_reshape,
    probe_slice,
    reshape_source,
    reshaped_by_reader,
)
from surgery.rules.replace_shuffle import block_swaps, emit_block_swaps

_FOLD = (0, 1, 4, 2, 5, 3)
"""[N, C, kh, kw, H/kh, W/kw] → [N, C, H/kh, kh, W/kw, kw]: the blocks placed side by side."""


def _table_gather(pat: Pattern, node: int) -> tuple[str, tuple[int, ...], np.ndarray, int] | None:
    """(data, its shape, the index table, the axis) of a Gather of a run-time float tensor of
    static shape by a constant index table; None for any other Gather."""
    data, index = pat.ins(node)[:2]
    shape, table = pat.shape(data), pat.value(index)
    if shape is None or table is None or pat.is_const(data) or not pat.is_float(data):
        return None
    return data, shape, table, int(pat.attrs(node).get("axis", 0)) % len(shape)


def _table_split(table: np.ndarray, size: int) -> tuple[int, int, bool] | None:
    """For a 2-D index table over an axis of `size`: (p, q, swapped) when the table is
    arange(size) viewed as [p, q] (swapped False) or viewed as [q, p] and transposed
    (swapped True, the unfold form); else None."""
    if table.ndim != 2 or table.size != size:
        return None
    flat = np.where(table < 0, table + size, table)
    p, q = table.shape
    if np.array_equal(flat, np.arange(size).reshape(p, q)):
        return p, q, False
    if np.array_equal(flat, np.arange(size).reshape(q, p).T):
        return p, q, True
    return None


@register
class GatherTableToTranspose(GraphRule):
    """Rewrite a Gather whose constant 2-D index table permutes one axis as a reshape of it,
    or a reshape and a swap, as Reshape (split the axis into the table's two axes) and, for
    the swap, Transpose of those two axes.

    The index table of a non-overlapping unfold over an axis of size s·n, table[i, j] =
    s·j + i, is arange(s·n) viewed as [n, s] and transposed: out[…, i, j, …] = x[…, s·j + i, …]
    is x reshaped to […, n, s, …] with the two new axes swapped. Pure data movement: exact.
    Only Gathers the target keeps off its MLA are matched.
    """

    name = "gather-table-to-transpose"
    suggest_for = frozenset({"Gather"})
    summary = "Gather by a constant 2-D index table that reshapes an axis (F.unfold) → Reshape (+ Transpose)."
    category = "cleanup"
    example = "surgery apply gather-table-to-transpose mobilevitv2.onnx -o mvit_unfold.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Gather"):
            site = _table_gather(pat, node)
            if site is None:
                continue
            data, shape, table, axis = site
            split = _table_split(table, shape[axis])
            if split is None:
                continue
            p, q, swapped = split
            steps: list | None = []
            if swapped:  # the axis viewed as [q, p], then the two swapped
                viewed = (*shape[:axis], q, p, *shape[axis + 1 :])
                perm = list(range(len(viewed)))
                perm[axis], perm[axis + 1] = axis + 1, axis
                steps = block_swaps(viewed, perm)
                if steps is None:
                    continue
            name = pat.name(node)
            found.append(
                self.match(
                    [name],
                    f"Gather {name} views axis {axis} ({shape[axis]}) as [{p}, {q}]"
                    + (" transposed" if swapped else ""),
                    [name],
                    steps=[[list(v), list(m)] for v, m in steps],
                    out=[*shape[:axis], p, q, *shape[axis + 1 :]],
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        gather = ed.node_named(match.nodes[0])
        assert gather is not None
        data, out = gather.inputs[0], gather.outputs[0]
        ed.detach(gather)
        d = match.data
        if d["steps"]:  # the unfold: a reshape and a swap that moves data
            emit_block_swaps(ed, data, out, d["steps"], d["out"])
            return True
        target = ed.const("unfold_shape", np.array(d["out"], np.int64))
        ed.node("Reshape", "unfold_view", [data, target], [out])
        return True


@register
class Col2ImToTranspose(GraphRule):
    """Rewrite a Col2Im (F.fold) whose blocks do not overlap — strides equal to the block
    shape, no padding, unit dilations — as Reshape → Transpose → Reshape.

    Each output pixel then receives exactly one column entry: out[n, c, i·kh + a, j·kw + b] =
    in[n, (c·kh + a)·kw + b, i·(W/kw) + j], the inverse of the non-overlapping unfold, i.e.
    in viewed as [N, C, kh, kw, H/kh, W/kw], permuted (0, 1, 4, 2, 5, 3) and viewed as
    [N, C, H, W]. A sum of one term: exact.
    """

    name = "col2im-to-transpose"
    suggest_for = frozenset({"Col2Im"})
    summary = "Col2Im with strides = block shape, no padding (F.fold of patches) → Reshape, Transpose, Reshape."
    category = "cleanup"
    example = "surgery apply col2im-to-transpose mobilevitv2.onnx -o mvit_fold.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Col2Im"):
            fold = _fold(pat, node)
            if fold is None or fold.strides != fold.kernel or any(fold.pads):
                continue
            (kh, kw), (h, w), n, c = fold.kernel, fold.image, fold.n, fold.c
            if h % kh or w % kw:
                continue
            out = (n, c, h, w)
            steps = block_swaps((n, c, kh, kw, h // kh, w // kw), _FOLD)
            if steps is None:
                continue
            name = pat.name(node)
            found.append(
                self.match(
                    [name],
                    f"Col2Im {name} places {kh}×{kw} blocks side by side → "
                    f"{len(steps)} 4-D Transpose(s)",
                    [name],
                    steps=[[list(v), list(m)] for v, m in steps],
                    out=list(out),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        fold = ed.node_named(match.nodes[0])
        assert fold is not None
        data, out = fold.inputs[0], fold.outputs[0]
        ed.detach(fold)
        emit_block_swaps(ed, data, out, match.data["steps"], match.data["out"])
        return True


def _windows(table: np.ndarray, size: int) -> tuple[list[int], int] | None:
    """For a 2-D index table over an axis of `size` whose every row is an arithmetic run with
    one common step (row i = s_i, s_i + step, …): (the starts s_i, step); else None."""
    if table.ndim != 2 or table.shape[1] == 0:
        return None
    flat = np.where(table < 0, table + size, table)
    if flat.min() < 0 or flat.max() >= size:
        return None
    starts = flat[:, 0]
    step = int(flat[0, 1] - flat[0, 0]) if table.shape[1] > 1 else 1
    if step < 1 or not np.array_equal(flat, starts[:, None] + step * np.arange(table.shape[1])):
        return None
    return [int(s) for s in starts], step


@register
class GatherWindowsToSlices(GraphRule):
    """Rewrite a Gather whose constant 2-D index table lists windows of evenly spaced positions
    — table[i, j] = s_i + step·j, the table of an F.unfold whose windows overlap (the rows are
    the kernel offsets, the step its stride) — as one Slice per window, concatenated on the
    gathered axis and reshaped to the Gather's output.

    Window i of the output is x[…, s_i : s_i + step·(L−1) + 1 : step, …]; side by side on the
    axis they are the output's [k, L] block in memory order, so the Concat (then a Reshape that
    splits the axis) is the Gather exactly. ConvBERT's span-based dynamic convolution unfolds
    its padded keys so (kernel 9, stride 1), VOLO's outlook attention its values (kernel 3,
    stride 2, one Gather per spatial axis). Data movement only: exact. Only Gathers the target
    keeps off its MLA are matched; tables that only permute the axis are
    gather-table-to-transpose's. A cleanup: the window Gathers of a 2-D unfold come in pairs
    (rows, then columns), and the first one's result stays rank 5 until the second is
    rewritten and the rank lifts carry the rest.
    """

    name = "gather-windows-to-slices"
    suggest_for = frozenset({"Gather"})
    summary = (
        "Gather by a constant table of (strided) windows (overlapping F.unfold) → Slices "
        "concatenated on the axis, Reshape."
    )
    category = "cleanup"
    example = "surgery apply gather-windows-to-slices convbert.onnx -o convbert_windows.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Gather"):
            site, out = _table_gather(pat, node), pat.shape(pat.outs(node)[0])
            if site is None or out is None:
                continue
            data, shape, table, axis = site
            windows = _windows(table, shape[axis])
            if windows is None or _table_split(table, shape[axis]) is not None:
                continue
            (starts, step), width = windows, table.shape[1]
            if step != 1 and model_opset(ctx) < 10:
                continue  # Slice has steps from opset 10
            span = step * (width - 1) + 1
            spec = pat.spec(data)
            piece = TensorSpec((*shape[:axis], width, *shape[axis + 1 :]), spec.elem_type)
            joined = TensorSpec((*shape[:axis], width * len(starts), *shape[axis + 1 :]))
            probes = [
                probe_slice(ctx, spec, piece, [s], [s + span], [axis], [step]) for s in set(starts)
            ]
            probes.append(
                probe_node(ctx, "Concat", [piece] * len(starts), [joined], {"axis": axis})
            )
            name = pat.name(node)
            final, absorbed = reshaped_by_reader(pat, pat.outs(node)[0])
            back = probe_reshape(ctx, joined, pat.spec(final))
            removed = [name, *absorbed]
            found.append(
                self.match(
                    removed,
                    f"Gather {name}: {len(starts)} windows of {width} along axis {axis} → "
                    "Slices + Concat",
                    net_freed(ctx, removed, probes, [back]),
                    axis=axis,
                    starts=starts,
                    step=step,
                    width=width,
                    out=final,
                    out_shape=list(pat.shape(final) or out),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        nodes = [ed.node_named(n) for n in match.nodes]
        if any(n is None for n in nodes):
            return False
        d = match.data
        data, out = nodes[0].inputs[0], ed.tensor(d["out"])
        ed.detach(*nodes)
        axis, width, step = d["axis"], d["width"], d["step"]
        pieces = []
        for start in d["starts"]:
            piece = ed.var("window", data.dtype)
            add_slice(ed, data, piece, [start], [start + step * (width - 1) + 1], [axis], [step])
            pieces.append(piece)
        joined = ed.op("Concat", "windows", pieces, None, data.dtype, axis=axis)
        target = ed.const("windows_shape", np.array(d["out_shape"], np.int64))
        ed.node("Reshape", "windows_view", [joined, target], [out])
        return True


@dataclass(frozen=True)
class Fold:
    """A Col2Im's geometry: input [N, C·kh·kw, oh·ow], output [N, C, H, W]."""

    n: int
    c: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: tuple[int, int, int, int]
    blocks: tuple[int, int]
    image: tuple[int, int]

    def output_padding(self) -> list[int]:
        """What a ConvTranspose adds at the end to reach the image size."""
        return [
            self.image[a]
            - (
                (self.blocks[a] - 1) * self.strides[a]
                - self.pads[a]
                - self.pads[a + 2]
                + self.kernel[a]
            )
            for a in (0, 1)
        ]


def _fold(pat: Pattern, node: int) -> Fold | None:
    """The geometry of a 2-D Col2Im with a static input, constant image and block shapes and
    unit dilations; None otherwise."""
    data, image, block = pat.ins(node)[:3]
    shape, size, kernel = pat.shape(data), pat.value(image), pat.value(block)
    if shape is None or size is None or kernel is None or len(shape) != 3:
        return None
    attrs = pat.attrs(node)
    if kernel.size != 2 or size.size != 2 or any(d != 1 for d in attrs.get("dilations", [1, 1])):
        return None
    kh, kw = (int(k) for k in kernel.reshape(-1))
    h, w = (int(v) for v in size.reshape(-1))
    sh, sw = (int(s) for s in attrs.get("strides", [1, 1]))
    pads = tuple(int(p) for p in attrs.get("pads", [0, 0, 0, 0]))
    oh, ow = (h + pads[0] + pads[2] - kh) // sh + 1, (w + pads[1] + pads[3] - kw) // sw + 1
    n, ckk, blocks = shape
    if ckk % (kh * kw) or blocks != oh * ow:
        return None
    return Fold(n, ckk // (kh * kw), (kh, kw), (sh, sw), pads, (oh, ow), (h, w))  # type: ignore[arg-type]


@register
class Col2ImToConvTranspose(GraphRule):
    """Rewrite a Col2Im (F.fold) whose blocks overlap as the sum, over the kernel's taps, of a
    depthwise ConvTranspose per tap with a one-hot kernel.

    Col2Im adds column entry (c, a, b) of block (i, j) to pixel (i·sh + a − pt, j·sw + b − pl).
    A depthwise ConvTranspose with the fold's strides and pads whose kernel is 1 at (a, b) and
    0 elsewhere puts each input pixel at exactly that place: one per tap, on the channels of
    that tap (the columns viewed [N, C, kh·kw, blocks] and swapped to [N, kh·kw·C, oh, ow] make
    them contiguous), summed. VOLO's outlook attention folds its 3×3 windows (stride 2) so.
    Each sum has the same terms as Col2Im's (products by 1 and 0): equal up to float rounding
    of the sums. Non-overlapping folds are col2im-to-transpose's.
    """

    name = "col2im-to-conv-transpose"
    suggest_for = frozenset({"Col2Im"})
    summary = (
        "Col2Im with overlapping blocks (F.fold) → one-hot depthwise ConvTranspose per tap, summed."
    )
    category = "replace"
    example = "surgery apply col2im-to-conv-transpose volo_d1.onnx -o volo_fold.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Col2Im"):
            data = pat.ins(node)[0]
            if pat.is_const(data) or not pat.is_float(data):
                continue
            fold = _fold(pat, node)
            if fold is None or (fold.strides == fold.kernel and not any(fold.pads)):
                continue
            out_pad = fold.output_padding()
            if any(p < 0 or p >= s for p, s in zip(out_pad, fold.strides, strict=True)):
                continue
            taps = fold.kernel[0] * fold.kernel[1]
            grid = TensorSpec((fold.n, taps * fold.c, *fold.blocks))
            one = TensorSpec((fold.n, fold.c, *fold.blocks))
            image = TensorSpec((fold.n, fold.c, *fold.image))
            weight = TensorSpec.const(np.zeros((fold.c, 1, *fold.kernel), np.float32))
            probes = [
                probe_slice(ctx, grid, one, [0], [fold.c], [1]),
                probe_node(ctx, "ConvTranspose", [one, weight], [image], self._attrs(fold)),
                probe_node(ctx, "Add", [image, image], [image]),
            ]
            name = pat.name(node)
            source, absorbed = reshape_source(pat, pat.ins(node)[0])
            removed = [name, *absorbed]
            found.append(
                self.match(
                    removed,
                    f"Col2Im {name}: {taps} taps of a {fold.kernel} fold, stride {fold.strides} "
                    "→ one-hot depthwise ConvTranspose each",
                    net_freed(ctx, removed, probes),
                    fold=dict(vars(fold)),
                    source=source,
                )
            )
        return found

    @staticmethod
    def _attrs(fold: Fold) -> dict:
        return {
            "group": fold.c,
            "kernel_shape": list(fold.kernel),
            "strides": list(fold.strides),
            "pads": list(fold.pads),
            "output_padding": fold.output_padding(),
        }

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        nodes = [ed.node_named(name) for name in match.nodes]
        if any(n is None for n in nodes):
            return False
        data, out = ed.tensor(match.data["source"]), nodes[0].outputs[0]
        ed.detach(*nodes)
        raw = match.data["fold"]
        fold = Fold(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
        (kh, kw), (oh, ow), c, n = fold.kernel, fold.blocks, fold.c, fold.n
        dtype = data.dtype or np.float32
        view = [n, c, kh * kw, oh * ow]
        cols = ed.op(
            "Reshape", "fold_cols", [data, ed.const("fold_cols_shape", np.array(view))], view, dtype
        )
        by_tap = ed.op(
            "Transpose", "fold_taps", [cols], [n, kh * kw, c, oh * ow], dtype, perm=[0, 2, 1, 3]
        )
        grid_shape = [n, kh * kw * c, oh, ow]
        grid = ed.op(
            "Reshape",
            "fold_grid",
            [by_tap, ed.const("fold_grid_shape", np.array(grid_shape))],
            grid_shape,
            dtype,
        )
        taps = kh * kw
        total = None
        for tap in range(taps):
            part = ed.var("fold_tap", dtype, [n, c, oh, ow])
            add_slice(ed, grid, part, [tap * c], [(tap + 1) * c], [1])
            kernel = np.zeros((c, 1, kh, kw), np.float32)
            kernel[:, 0, tap // kw, tap % kw] = 1.0
            weight = ed.const("fold_tap_kernel", kernel.astype(dtype))
            inputs = [part, weight]
            if total is None and taps == 1:
                ed.node("ConvTranspose", "fold_place", inputs, [out], **self._attrs(fold))
                break
            image = [n, c, *fold.image]
            placed = ed.op("ConvTranspose", "fold_place", inputs, image, dtype, **self._attrs(fold))
            if total is None:
                total = placed
            elif tap == taps - 1:
                ed.node("Add", "fold_sum", [total, placed], [out])
            else:
                total = ed.op("Add", "fold_sum", [total, placed], image, dtype)
        return True
