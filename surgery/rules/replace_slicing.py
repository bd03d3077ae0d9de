"""Indexing as slices: split-to-slices, gather-to-slice, and strided or reversed slices the MLA
cannot take as they are (strided-slice-to-space-to-depth, strided-slice-to-reshape,
negative-step-slice-to-concat).

Slice is the MLA's general "take a window" op; Split and a constant-index Gather are windows
too. Writing them as Slices lets them run where the original was rejected (a Split whose sizes
are computed at run time, a Gather the int8 MLA does not run). Data movement only: exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.graph_edit import bypass_node
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    axis_view,
    fmt_shape,
    model_opset,
    net_freed,
    probe_node,
    probe_reshape,
    probe_slice,
    reshaped_by_reader,
)
from surgery.targets import Reason


@register
class SplitToSlices(GraphRule):
    """Rewrite a Split as one Slice per used output.

    The sizes come from the inferred output shapes, so Splits whose sizes are an input computed
    at run time (or given by `num_outputs`) are handled alike; unused outputs produce no Slice.
    Each Slice reads the same input with constant starts/ends, which the MLA accepts.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "split-to-slices"
    keeps_ranks = True
    suggest_for = frozenset({"Split"})
    summary = "Split → one Slice per used output (sizes from the inferred shapes)."
    category = "replace"
    example = "surgery apply split-to-slices yolov8n.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Split"):
            x = pat.ins(node)[0]
            shape = pat.shape(x)
            if not shape or pat.is_const(x) or not pat.is_float(x):
                continue
            axis = int(pat.attrs(node).get("axis", 0)) % len(shape)
            windows = self._windows(pat, node, axis)
            if windows is None:
                continue
            probes = [
                probe_slice(ctx, pat.spec(x), pat.spec(o), [s], [e], [axis]) for o, s, e in windows
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Split {pat.name(node)} → {len(windows)} Slice(s) along axis {axis}",
                    net_freed(ctx, [pat.name(node)], probes),
                    axis=axis,
                    windows=windows,
                )
            )
        return found

    @staticmethod
    def _windows(pat: Pattern, node: int, axis: int) -> list[tuple[str, int, int]] | None:
        """(output, start, end) for each used output; None when a size is unknown."""
        windows, offset = [], 0
        for out in pat.outs(node):
            shape = pat.shape(out) if out else None
            if shape is None:
                return None
            size = shape[axis]
            if pat.consumers(out) or out in pat.outputs:
                windows.append((out, offset, offset + size))
            offset += size
        return windows

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        split = ed.node_named(match.nodes[0])
        assert split is not None
        x = split.inputs[0]
        outs = {t.name: t for t in split.outputs if t.name}
        ed.detach(split)
        axis = match.data["axis"]
        for name, start, end in match.data["windows"]:
            add_slice(ed, x, outs[name], [start], [end], [axis])
        return True


@register
class GatherToSlice(GraphRule):
    """Rewrite a Gather with constant indices as a Slice when the indices are one scalar or a
    1-D run of consecutive positions (i, i+1, …, i+k-1; negative indices normalised).

    A 1-D run keeps the rank, so one Slice is the whole rewrite. A scalar index drops the axis:
    Slice [i, i+1) then Reshape to the Gather's (static) output shape, or Squeeze when that shape
    is not static. A GatherND (batch_dims 0) whose constant index tuples each pick one position
    of the first axis, consecutive, is the same Slice and a Reshape to its static output shape
    (torch's dynamo exporter writes `qkv[-2]` on Falcon's fused multi-query projection so).
    Gathers from constant tables are left to fold-constants.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "gather-to-slice"
    suggest_for = frozenset({"Gather", "GatherND"})
    summary = "Gather(ND) with a constant scalar or consecutive index run → Slice (+Reshape)."
    category = "replace"
    example = "surgery apply gather-to-slice vit_tiny_patch16_224.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Gather", "GatherND"):
            plan = self._plan(pat, node) if pat.op(node) == "Gather" else self._plan_nd(pat, node)
            if plan is None:
                continue
            data, out = pat.ins(node)[0], pat.outs(node)[0]
            axis, start, end, scalar = plan
            # A scalar pick is a view of its window: the only Reshape reading it is absorbed.
            target, absorbed = reshaped_by_reader(pat, out) if scalar else (out, [])
            unit = pat.shape(data) is not None and pat.shape(data)[axis] == 1  # type: ignore[index]
            sliced = self._sliced_shape(pat, data, axis, end - start)
            view = [self._squeeze_probe(ctx, pat, sliced, target)] if scalar else []
            if unit and scalar:  # the window is the whole tensor: the Reshape is all there is
                main, helpers = view, []
            else:
                main = [
                    probe_slice(ctx, pat.spec(data), TensorSpec(sliced), [start], [end], [axis])
                ]
                helpers = view
            removed = [pat.name(node), *absorbed]
            found.append(
                self.match(
                    removed,
                    f"{pat.op(node)} {pat.name(node)} takes [{start}:{end}) of axis {axis} → "
                    + (
                        "Reshape" if unit and scalar else "Slice" + (" + Reshape" if scalar else "")
                    ),
                    net_freed(ctx, removed, main, helpers),
                    axis=axis,
                    start=start,
                    end=end,
                    scalar=scalar,
                    unit=unit,
                )
            )
        return found

    @staticmethod
    def _plan(pat: Pattern, node: int) -> tuple[int, int, int, bool] | None:
        data, idx = pat.ins(node)[:2]
        rank = pat.view.tensor(data).rank
        value = pat.value(idx)
        if not rank or value is None or pat.is_const(data) or value.ndim > 1:
            return None
        if not pat.is_float(data):
            return None  # index arithmetic on shapes: fold-constants' job once shapes are static
        axis = int(pat.attrs(node).get("axis", 0)) % rank
        dim = pat.view.tensor(data).shape[axis]  # type: ignore[index]
        flat = [int(v) for v in value.reshape(-1)]
        if not flat or (not isinstance(dim, int) and any(v < 0 for v in flat)):
            return None
        if isinstance(dim, int):
            if any(not -dim <= v < dim for v in flat):
                return None
            flat = [v % dim for v in flat]
        if flat != list(range(flat[0], flat[0] + len(flat))):
            return None
        return axis, flat[0], flat[0] + len(flat), value.ndim == 0

    @staticmethod
    def _plan_nd(pat: Pattern, node: int) -> tuple[int, int, int, bool] | None:
        """GatherND picking consecutive positions of axis 0: (0, start, end, True) — always
        reshaped, since the index tuples' shape stays in front of the output."""
        data, idx = pat.ins(node)[:2]
        shape, out = pat.shape(data), pat.shape(pat.outs(node)[0])
        value = pat.value(idx)
        if pat.attrs(node).get("batch_dims", 0) or value is None or value.ndim < 1:
            return None
        if not shape or not isinstance(shape[0], int) or out is None or value.shape[-1] != 1:
            return None
        if pat.is_const(data) or not pat.is_float(data) or not all(isinstance(d, int) for d in out):
            return None
        dim = shape[0]
        flat = [int(v) for v in value.reshape(-1)]
        if not flat or any(not -dim <= v < dim for v in flat):
            return None
        flat = [v % dim for v in flat]
        if flat != list(range(flat[0], flat[0] + len(flat))):
            return None
        return 0, flat[0], flat[0] + len(flat), True

    @staticmethod
    def _sliced_shape(pat: Pattern, data: str, axis: int, size: int) -> tuple | None:
        shape = pat.shape(data)
        if shape is None:
            return None
        return tuple(size if k == axis else d for k, d in enumerate(shape))

    @staticmethod
    def _squeeze_probe(ctx: RuleContext, pat: Pattern, sliced: tuple | None, out: str):
        shape = pat.shape(out)
        if sliced is None or shape is None:
            return Reason("dynamic_shape", "the Gather's shapes are not static")
        return probe_node(
            ctx,
            "Reshape",
            [TensorSpec(sliced), TensorSpec.const(np.array(shape, np.int64))],
            [TensorSpec(shape)],
        )

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        gather = ed.node_named(match.nodes[0])
        assert gather is not None
        data, out = gather.inputs[0], gather.outputs[0]
        readers = [r for r in (ed.node_named(n) for n in match.nodes[1:]) if r is not None]
        if readers:  # the absorbed Reshape's output is written directly
            out = readers[-1].outputs[0]
        ed.detach(gather, *readers)
        d = match.data
        if not d["scalar"]:
            add_slice(ed, data, out, [d["start"]], [d["end"]], [d["axis"]])
            return True
        window = data
        if not d.get("unit"):
            window = ed.var("gather_window", data.dtype)
            add_slice(ed, data, window, [d["start"]], [d["end"]], [d["axis"]])
        shape = out.shape
        if shape is not None and all(isinstance(s, int) for s in shape):
            target = ed.const("gather_shape", np.array(shape, np.int64))
            ed.node("Reshape", "gather_reshape", [window, target], [out])
        elif model_opset(ed.ctx) >= 13:
            axes = ed.const("gather_axes", np.array([d["axis"]], np.int64))
            ed.node("Squeeze", "gather_squeeze", [window, axes], [out])
        else:
            ed.node("Squeeze", "gather_squeeze", [window], [out], axes=[d["axis"]])
        return True


@register
class StridedSliceToSpaceToDepth(GraphRule):
    """Rewrite step-s Slices over two axes (Swin patch merging x[:, 0::2, 1::2, :], a Focus
    layer inside the network, LeViT's query subsampling x[:, ::2][:, :, ::2] as two Slices)
    as SpaceToDepth(s) and a channel Slice, for a target whose MLA slices with step 1 only.

    A Slice starting at (i, j) with 0 ≤ i, j < s and step s on both axes of a 4-D tensor takes
    exactly block (i, j) of every s×s tile, which SpaceToDepth puts on channels
    [(i·s + j)·C, (i·s + j + 1)·C). The two axes are moved last by a Transpose when they are not
    already H and W (and moved back after), and every such Slice of one tensor shares the one
    SpaceToDepth. Both sliced axes must run to their end and the other axes must be whole; an
    axis that does not divide by s (LeViT samples 4 of 7 rows) is zero-padded up to a multiple
    of s first, and the block is cropped to the rows and columns the Slice takes. Data movement
    only: exact. Only Slices the target keeps off its MLA are matched.
    """

    name = "strided-slice-to-space-to-depth"
    suggest_for = frozenset({"Slice"})
    summary = "Step-s Slices over two axes → SpaceToDepth(s) + a channel Slice (shared per input)."
    category = "replace"
    example = "surgery apply strided-slice-to-space-to-depth swin_tiny.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        groups: dict[tuple[str, tuple[int, int], int], list[tuple[list[str], int]]] = {}
        for node in pat.blocked("Slice"):
            plan = self._plan(pat, node)
            if plan is not None:
                x, axes, step, block, chain = plan
                names = [pat.name(n) for n in chain]
                groups.setdefault((x, axes, step), []).append((names, block))
        found = []
        for (x, axes, step), slices in groups.items():
            if not _leading_slices_fully_replaced(pat, slices):
                continue
            shape = pat.shape(x)
            assert shape is not None
            perm = _last_two(axes)
            moved = tuple(shape[p] for p in perm)
            padded = _padded(moved, step)
            depth = _depth(padded, step)
            probes = [
                probe_node(
                    ctx,
                    "SpaceToDepth",
                    [TensorSpec(padded)],
                    [TensorSpec(depth)],
                    {"blocksize": step},
                ),
            ]
            for _, block in slices:
                starts, ends, slice_axes = _block_window(moved, step, block)
                window = _window(depth, moved[1], starts, ends, slice_axes)
                probes.append(
                    probe_slice(
                        ctx, TensorSpec(depth), TensorSpec(window), starts, ends, slice_axes
                    )
                )
            if padded != moved:
                pads = TensorSpec.const(_pads(moved, padded))
                probes.append(
                    probe_node(ctx, "Pad", [TensorSpec(moved), pads], [TensorSpec(padded)])
                    if model_opset(ctx) >= 11
                    else probe_node(
                        ctx,
                        "Pad",
                        [TensorSpec(moved)],
                        [TensorSpec(padded)],
                        {"pads": _pads(moved, padded).tolist()},
                    )
                )
            if perm != [0, 1, 2, 3]:
                probes.append(
                    probe_node(ctx, "Transpose", [pat.spec(x)], [TensorSpec(moved)], {"perm": perm})
                )
            names = list(dict.fromkeys(name for chain, _ in slices for name in chain))
            found.append(
                self.match(
                    names,
                    f"{len(slices)} step-{step} sampling(s) of {x} over axes {list(axes)} → "
                    f"SpaceToDepth({step}) + channel Slice",
                    net_freed(ctx, names, probes),
                    perm=perm,
                    step=step,
                    blocks={chain[-1]: block for chain, block in slices},
                    leading=list(dict.fromkeys(name for chain, _ in slices for name in chain[:-1])),
                )
            )
        return found

    @staticmethod
    def _plan(pat: Pattern, node: int) -> tuple[str, tuple[int, int], int, int, list[int]] | None:
        """(input, the two stepped axes, step, block index i·s + j, the Slices), or None when
        the Slice — alone, or after a Slice that steps the other axis (x[:, ::2][:, :, ::2], as
        LeViT subsamples its attention queries; HF Swin's patch merging reads each row Slice
        with two column Slices) — is not a
        whole-tensor step-s sampling of two axes of a static 4-D float tensor."""
        own = _slice_axes(pat, node)
        if own is None:
            return None
        x, per_axis = own
        chain = [node]
        first = pat.producer(x, "Slice")
        if sum(step != 1 for _, _, step in per_axis.values()) == 1 and first is not None:
            before = _slice_axes(pat, first)
            if before is not None and not set(before[1]) & set(per_axis):
                x, per_axis = before[0], {**before[1], **per_axis}
                chain = [first, node]
        shape = pat.shape(x)
        assert shape is not None
        stepped = sorted(a for a, (_, _, step) in per_axis.items() if step != 1)
        if len(stepped) != 2:
            return None
        step = per_axis[stepped[0]][2]
        for axis, (start, end, s) in per_axis.items():
            dim = shape[axis]
            if axis in stepped:
                if s != step or step < 2 or not 0 <= start < step or end < dim:
                    return None
            elif start > 0 or end < dim:
                return None
        i, j = (per_axis[a][0] for a in stepped)
        return x, (stepped[0], stepped[1]), step, i * step + j, chain

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        perm, step = match.data["perm"], match.data["step"]
        slices = [ed.node_named(name) for name in match.nodes]
        if any(node is None for node in slices):
            return False
        x = slices[0].inputs[0]  # type: ignore[union-attr]
        shape = [int(d) for d in x.shape]
        moved_shape = [shape[p] for p in perm]
        moved = x
        if perm != [0, 1, 2, 3]:
            moved = ed.op("Transpose", "s2d_in", [x], moved_shape, x.dtype, perm=perm)
        padded_shape = list(_padded(moved_shape, step))
        if padded_shape != moved_shape:
            pads = _pads(moved_shape, padded_shape)
            if model_opset(ed.ctx) >= 11:
                pad_in = [moved, ed.const("s2d_pads", pads)]
                moved = ed.op("Pad", "s2d_pad", pad_in, padded_shape, x.dtype)
            else:
                moved = ed.op("Pad", "s2d_pad", [moved], padded_shape, x.dtype, pads=pads.tolist())
        depth_shape = list(_depth(padded_shape, step))
        depth = ed.op("SpaceToDepth", "s2d", [moved], depth_shape, x.dtype, blocksize=step)
        back = [perm.index(k) for k in range(4)]
        leading = set(match.data["leading"])
        for node in slices:
            assert node is not None
            if node.name in leading:
                ed.detach(node)  # its one consumer, the Slice after it, is rewritten below
                continue
            out = node.outputs[0]
            block = match.data["blocks"][node.name]
            ed.detach(node)
            starts, ends, axes = _block_window(moved_shape, step, block)
            window_shape = list(_window(depth_shape, moved_shape[1], starts, ends, axes))
            window = out if perm == [0, 1, 2, 3] else ed.var("s2d_block", x.dtype, window_shape)
            add_slice(ed, depth, window, starts, ends, axes)
            if window is not out:
                ed.node("Transpose", "s2d_out", [window], [out], perm=back)
        return True


@register
class StridedSliceToReshape(GraphRule):
    """Rewrite a Slice with step k > 1 on one axis (x[..., a:b:k, ...]) as a step-1 Slice of
    the window it spans (when that is not the whole axis), a Reshape that splits the window
    into [m, k·inner], a step-1 Slice of one block of each row, and a Reshape to the output.

    The m picks a, a + k, …, a + k(m−1) lie in a window of k·m elements that starts r ≤ k − 1
    before a (r = 0 unless the window would run past the axis); in the view
    [1, outer, m, k·inner] of that window, pick j sits in row j at offset r·inner + i — a
    contiguous block of each row. Interleaved rotary embeddings (EVA-02: x[..., ::2] and
    x[..., 1::2]) and overlapping unfolds with a stride (VOLO's windows) slice so, and
    rk3588's MLA slices with step 1 only. Data movement only: exact. Slices strided over two
    spatial axes are strided-slice-to-space-to-depth's.
    """

    name = "strided-slice-to-reshape"
    suggest_for = frozenset({"Slice"})
    summary = (
        "Step-k Slice of one axis (x[..., a:b:k]) → window Slice, Reshape, step-1 Slice, Reshape."
    )
    category = "replace"
    example = "surgery apply strided-slice-to-reshape eva02_tiny.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Slice"):
            plan = self._plan(pat, node)
            if plan is None:
                continue
            x, axis, window, view, start, stop, out = plan
            source = pat.spec(x)
            probes = []
            if window is not None:
                shape = list(source.shape or ())
                shape[axis] = window[1] - window[0]
                windowed = TensorSpec(tuple(shape))
                probes.append(probe_slice(ctx, source, windowed, [window[0]], [window[1]], [axis]))
                source = windowed
            part = TensorSpec((*view[:3], stop - start))
            probes += [
                probe_reshape(ctx, source, TensorSpec(tuple(view))),
                probe_slice(ctx, TensorSpec(tuple(view)), part, [start], [stop], [3]),
                probe_reshape(ctx, part, TensorSpec(tuple(out))),
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"strided Slice {pat.name(node)} → view {fmt_shape(view)}, Slice "
                    f"[{start}:{stop}) of its last axis",
                    net_freed(ctx, [pat.name(node)], probes),
                    axis=axis,
                    window=window,
                    view=view,
                    start=start,
                    stop=stop,
                    out=out,
                )
            )
        return found

    @staticmethod
    def _plan(pat: Pattern, node: int):
        """(input, axis, window [w0, w1) or None for the whole axis, view, block start, block
        end, output shape) for a step-k Slice of one axis; None otherwise."""
        site = _slice_axes(pat, node)
        out = pat.shape(pat.outs(node)[0])
        if site is None or out is None or len(site[1]) != 1:
            return None
        x, per_axis = site
        ((axis, (start, _, step)),) = per_axis.items()
        shape = pat.shape(x)
        n, picks = shape[axis], out[axis]
        if step <= 1 or picks < 1 or not 0 <= start < n:
            return None
        span = step * picks
        offset = next((r for r in range(step) if start - r >= 0 and start - r + span <= n), None)
        if offset is None:
            return None
        first = start - offset
        window = None if (first, span) == (0, n) else [first, first + span]
        inner = prod(shape[axis + 1 :])
        view = [1, prod(shape[:axis]), picks, step * inner]
        return x, axis, window, view, offset * inner, (offset + 1) * inner, list(out)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        d = match.data
        if d["window"] is not None:
            windowed = ed.var("strided_window", x.dtype)
            add_slice(ed, x, windowed, [d["window"][0]], [d["window"][1]], [d["axis"]])
            x = windowed
        view = ed.op(
            "Reshape",
            "strided_view",
            [x, ed.const("strided_view_shape", np.array(d["view"]))],
            d["view"],
            x.dtype,
        )
        part = ed.var("strided_block", x.dtype, [*d["view"][:3], d["stop"] - d["start"]])
        add_slice(ed, view, part, [d["start"]], [d["stop"]], [3])
        ed.node(
            "Reshape",
            "strided_back",
            [part, ed.const("strided_back_shape", np.array(d["out"]))],
            [y],
        )
        return True


MAX_PICKS = 64
"""Most elements a negative-step Slice may pick along its axis: each is one Slice and one Concat
input, so a longer reversal costs more movement than the host round trip it saves."""


def negative_step_picks(pat: Pattern, node: int) -> tuple[str, int, list[int]] | None:
    """(input, axis, the indices picked in order) of a Slice with a negative step on one axis of
    a static float tensor; None otherwise. ONNX clamps as Python slicing does."""
    ins = pat.ins(node)
    if len(ins) < 5 or pat.is_const(ins[0]) or not pat.is_float(ins[0]):
        return None
    shape = pat.shape(ins[0])
    values = [pat.value(t) for t in ins[1:5]]
    if shape is None or not 1 <= len(shape) <= 4 or any(v is None for v in values):
        return None
    starts, ends, axes, steps = ([int(e) for e in np.asarray(v).reshape(-1)] for v in values)
    if len(starts) != 1 or steps[0] >= 0:
        return None
    axis = axes[0] % len(shape)
    picks = list(range(shape[axis]))[slice(starts[0], ends[0], steps[0])]
    if not 1 <= len(picks) <= MAX_PICKS:
        return None
    return ins[0], axis, picks


@register
class NegativeStepSliceToConcat(GraphRule):
    """Rewrite a Slice with a negative step on one axis (torch.flip, x[::-1], a BiLSTM's
    time-reversed sequence) as a Concat of the single-element step-1 Slices it picks, in its
    order, taken along H or W of the tensor or of the 4-D view [1, outer, n, inner] between two
    Reshapes. The MLA slices with positive steps only. At most 64 picks. Data movement only:
    exact.
    """

    name = "negative-step-slice-to-concat"
    suggest_for = frozenset({"Slice"})
    summary = "Slice with a negative step (x[::-1]) → Concat of single-element Slices."
    category = "replace"
    example = "surgery apply negative-step-slice-to-concat crnn.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Slice"):
            read = negative_step_picks(pat, node)
            out = pat.shape(pat.outs(node)[0])
            if read is None or out is None:
                continue
            x, axis, picks = read
            shape = pat.shape(x) or ()
            view, on = axis_view(shape, axis)
            source = TensorSpec(tuple(view), pat.elem_type(x))
            line = TensorSpec(tuple(view[:on] + [1] + view[on + 1 :]), source.elem_type)
            joined = TensorSpec(tuple(view[:on] + [len(picks)] + view[on + 1 :]), line.elem_type)
            probes = [
                probe_slice(ctx, source, line, [picks[0]], [picks[0] + 1], [on]),
                probe_node(ctx, "Concat", [line] * len(picks), [joined], {"axis": on}),
            ]
            if view != list(shape):
                probes.append(probe_reshape(ctx, pat.spec(x), source))
                probes.append(probe_reshape(ctx, joined, TensorSpec(out, line.elem_type)))
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Slice {pat.name(node)} (step < 0, {len(picks)} picks of axis {axis}) → "
                    "Concat of single-element Slices",
                    net_freed(ctx, [pat.name(node)], probes),
                    axis=axis,
                    picks=picks,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        picks = match.data["picks"]
        view, on = axis_view(x.shape, match.data["axis"])
        source = x
        if view != list(x.shape):
            target = ed.const("flip_view_shape", np.array(view, np.int64))
            source = ed.op("Reshape", "flip_view", [x, target], view, x.dtype)
        lines = {}
        for index in sorted(set(picks)):
            lines[index] = ed.var("flip_line", x.dtype, view[:on] + [1] + view[on + 1 :])
            add_slice(ed, source, lines[index], [index], [index + 1], [on])
        parts = [lines[i] for i in picks]
        if source is x:
            ed.node("Concat", "flip", parts, [y], axis=on)
            return True
        joined_shape = view[:on] + [len(picks)] + view[on + 1 :]
        joined = ed.op("Concat", "flip", parts, joined_shape, x.dtype, axis=on)
        back = ed.const("flip_shape", np.array(y.shape, np.int64))
        ed.node("Reshape", "flip_back", [joined, back], [y])
        return True


def writes_every_element(indices: np.ndarray, shape: Sequence[int], sample: int = 0) -> bool:
    """Whether ScatterND `indices` (…, rank) list every position of a tensor of `shape` once,
    in row-major order, laid out as the tensor itself (so updates land where they are).
    `sample` > 0 checks that many positions (spread evenly, first and last included) instead
    of all: a cheap test for `find`, which `surgery check` runs on every model."""
    rank = len(shape)
    if indices.shape != (*shape, rank):
        return False
    rows = indices.reshape(-1, rank)
    if sample and len(rows) > sample:
        picked = np.unique(np.linspace(0, len(rows) - 1, sample).astype(np.int64))
    else:
        picked = np.arange(len(rows))
    strides = np.array([prod(shape[k + 1 :]) for k in range(rank)], np.int64)
    flat = np.where(rows[picked] < 0, rows[picked] + np.array(shape), rows[picked]) @ strides
    return bool(np.array_equal(flat, picked))


SCATTER_SAMPLE = 1024
"""Index rows `find` checks (the edit checks them all)."""


@register
class ScatterEverywhereToUpdates(GraphRule):
    """Remove a ScatterND that writes every element of its data (no reduction): its result is
    its updates.

    torch exports an in-place assignment to a whole tensor, `attn[:, :, sp:, sp:] = …` with
    sp = 0 (MViTv2's relative-position bias without a class token), as ScatterND with an index
    for each element; nothing of the data survives it. Exact. A cleanup: the consumers read
    the updates directly.
    """

    name = "scatter-everywhere-to-updates"
    suggest_for = frozenset({"ScatterND"})
    summary = "ScatterND that writes every element of its data → its updates."
    category = "cleanup"
    example = (
        "surgery apply scatter-everywhere-to-updates mvitv2_tiny.onnx -o mvitv2_noscatter.onnx"
    )

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("ScatterND"):
            data, indices, updates = pat.ins(node)[:3]
            shape, y = pat.shape(data), pat.outs(node)[0]
            if shape is None or pat.shape(updates) != shape or y in pat.outputs:
                continue
            if pat.attrs(node).get("reduction", "none") != "none":
                continue
            table = pat.stored(indices)
            if table is None or not writes_every_element(table, shape, sample=SCATTER_SAMPLE):
                continue
            name = pat.name(node)
            found.append(
                self.match([name], f"ScatterND {name} writes all of {fmt_shape(shape)}", [name])
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        if node is None:
            return False
        indices = ed.value(node.inputs[1], node.inputs[1].name)
        if indices is None or not writes_every_element(indices, indices.shape[:-1]):
            return False  # find sampled the index table; the rewrite checks all of it
        bypass_node(ed.graph, node, keep_input=2)
        return True


def _leading_slices_fully_replaced(pat: Pattern, slices: list[tuple[list[str], int]]) -> bool:
    """Whether every reader of each leading Slice (the first of a chained pair) is the second
    Slice of a pair in this group, so the rewrite may remove it."""
    finals = {chain[-1] for chain, _ in slices}
    for chain, _ in slices:
        for name in chain[:-1]:
            node = pat.view.index_by_name[name]
            readers = {pat.name(c) for c in pat.consumers(pat.outs(node)[0])}
            if not readers <= finals:
                return False
    return True


def _padded(moved: Sequence[int], step: int) -> tuple[int, ...]:
    """The moved shape with H and W padded up to multiples of `step`."""
    return (*moved[:2], *(-(-d // step) * step for d in moved[2:]))


def _depth(padded: Sequence[int], step: int) -> tuple[int, ...]:
    return (padded[0], padded[1] * step * step, padded[2] // step, padded[3] // step)


def _pads(moved: Sequence[int], padded: Sequence[int]) -> np.ndarray:
    """ONNX Pad's pads (all begins, then all ends): zeros after H and W only."""
    ends = [p - m for m, p in zip(moved, padded, strict=True)]
    return np.array([0, 0, 0, 0, *ends], np.int64)


def _block_window(
    moved: Sequence[int], step: int, block: int
) -> tuple[list[int], list[int], list[int]]:
    """The Slice of the SpaceToDepth output that is block (i, j): its channels, and on H and W
    the ceil((d − i) / s) rows and columns a step-s Slice from i takes (fewer than the padded
    map has when a dimension does not divide by s)."""
    channels = moved[1]
    i, j = divmod(block, step)
    rows, cols = -(-(moved[2] - i) // step), -(-(moved[3] - j) // step)
    starts, ends, axes = [block * channels], [(block + 1) * channels], [1]
    if rows < -(-moved[2] // step) or cols < -(-moved[3] // step):
        starts += [0, 0]
        ends += [rows, cols]
        axes += [2, 3]
    return starts, ends, axes


def _window(
    depth: Sequence[int], channels: int, starts: list[int], ends: list[int], axes: list[int]
) -> tuple[int, ...]:
    """The shape `_block_window`'s Slice cuts from the SpaceToDepth output."""
    shape = [depth[0], channels, depth[2], depth[3]]
    for b, e, a in zip(starts, ends, axes, strict=True):
        shape[a] = e - b
    return tuple(shape)


def _slice_axes(pat: Pattern, node: int) -> tuple[str, dict[int, tuple[int, int, int]]] | None:
    """A Slice's input and (start, end, step) per sliced axis, with negative starts and ends
    resolved, when the input is a static 4-D float tensor and every operand a constant."""
    ins = pat.ins(node)
    if len(ins) < 5 or pat.is_const(ins[0]) or not pat.is_float(ins[0]):
        return None
    shape = pat.shape(ins[0])
    values = [pat.value(t) for t in ins[1:5]]
    if shape is None or len(shape) != 4 or any(v is None for v in values):
        return None
    starts, ends, axes, steps = (
        [int(e) for e in np.asarray(v).reshape(-1)]
        for v in values  # type: ignore[arg-type]
    )
    per_axis: dict[int, tuple[int, int, int]] = {}
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=False):
        dim = shape[axis % 4]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        per_axis[axis % 4] = (start, end, step)
    if len(per_axis) != len(starts):
        return None
    return ins[0], per_axis


def _last_two(axes: tuple[int, int]) -> list[int]:
    """The permutation of a 4-D tensor that keeps the other axes in order and puts `axes` last."""
    return [a for a in range(4) if a not in axes] + list(axes)
