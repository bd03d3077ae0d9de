"""Padding and broadcasting as data movement: pad-to-slices, pad-to-concat, expand-into-broadcast,
expand-to-concat, repeat-to-concat, conv-pads-to-pad.

An MLA pads with constant zeros only and has no Expand, but every MLA slices and concatenates.
A reflect or edge Pad copies rows and columns of its input next to it, a constant Pad puts
blocks of one value next to it, and an Expand copies its input along the broadcast axes: all
are Concats of (slices of) the input and constants, so they run where the original op was
rejected instead of cutting the network into two MLA segments around a host op. Data movement
only: exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.graph_edit import bypass_node
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    add_zero_pad,
    all_on_mla,
    axis_view,
    fmt_shape,
    model_opset,
    net_freed,
    probe_node,
    probe_reshape,
    probe_slice,
    probe_zero_pad,
    with_axis,
)
from surgery.rules.replace_pool import pad_mode_and_amounts
from surgery.targets import Reason

MAX_PAD = 8
"""Most rows/columns padded on one side: each is one Slice (edge: one shared Slice) and one
Concat input, so wider pads cost more movement than the host round trip they save."""

MAX_COPIES = 32
"""Most copies an Expand may make along one axis (one Concat input each)."""

AXES = (3, 2, 1, 0)
"""The axes a Pad is rewritten along, W, H, then C and N (the result is the same in any order:
reflect and edge padding index each axis independently)."""


def _border(mode: str, size: int, before: int, after: int) -> tuple[list[int], list[int]]:
    """Which input index each padded position copies, before and after the input, on one axis:
    reflect mirrors around the edge without repeating it (b, …, 1 | n−2, …, n−1−a), edge
    repeats the first and last index."""
    if mode == "reflect":
        return list(range(before, 0, -1)), [size - 2 - k for k in range(after)]
    return [0] * before, [size - 1] * after


@register
class PadToSlices(GraphRule):
    """Rewrite a reflect or edge Pad of a 4-D tensor as, per padded axis (W, H, C, N), a
    Concat of one-row/column step-1 Slices of the input around the input itself.

    Reflect padding by (b, a) on an axis of size n is x[b], …, x[1], x, x[n−2], …, x[n−1−a];
    edge padding repeats x[0] b times and x[n−1] a times (one Slice, read b times). The batch
    and channel axes are padded on the view [1, outer, n, inner] between two Reshapes (a
    time-major sequence [T, 1, 1, C] after an unrolled LSTM pads its T). Applied to constant
    pads of at most 8 per side, and for reflect only when the pads are smaller than the axis
    (ONNX's own limit). Only Pads the target keeps
    off its MLA are matched; a match frees the Pad only when every Slice and Concat runs there.
    """

    name = "pad-to-slices"
    suggest_for = frozenset({"Pad"})
    summary = "Reflect/edge Pad of H/W → Concat of single-row/column Slices around the input."
    category = "replace"
    example = "surgery apply pad-to-slices model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Pad"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            shape = pat.shape(x)
            if shape is None or len(shape) != 4 or pat.shape(y) is None:
                continue
            plan = self._plan(pat, node, shape)
            if plan is None:
                continue
            mode, steps = plan
            probes = self._probes(ctx, pat.elem_type(x), shape, steps)
            names = [pat.name(node)]
            sides = ", ".join(f"axis {a}: {len(b)}+{len(e)}" for a, b, e in steps)
            found.append(
                self.match(
                    names,
                    f"{mode} Pad {pat.name(node)} of {fmt_shape(shape)} ({sides}) → "
                    f"Slices + Concat",
                    net_freed(ctx, names, probes),
                    shape=list(shape),
                    steps=[[a, b, e] for a, b, e in steps],
                )
            )
        return found

    @staticmethod
    def _plan(
        pat: Pattern, node: int, shape: tuple[int, ...]
    ) -> tuple[str, list[tuple[int, list[int], list[int]]]] | None:
        """The mode and, per padded axis in rewrite order, the input indices copied before and
        after it; None when the Pad is not one this rule rewrites."""
        read = pad_mode_and_amounts(pat, node, len(shape))
        if read is None:
            return None
        mode, pads = read
        if mode not in ("reflect", "edge") or any(p < 0 or p > MAX_PAD for p in pads):
            return None
        if not any(pads):
            return None
        steps = []
        for axis in AXES:
            before, after, size = pads[axis], pads[axis + 4], shape[axis]
            if not (before or after):
                continue
            if mode == "reflect" and max(before, after) >= size:
                return None
            steps.append((axis, *_border(mode, size, before, after)))
        return mode, steps

    @staticmethod
    def _probes(
        ctx: RuleContext,
        elem_type: int,
        shape: tuple[int, ...],
        steps: list[tuple[int, list[int], list[int]]],
    ) -> list[Reason | None]:
        """Placement of every Slice and Concat of the rewrite, axis after axis."""
        probes: list[Reason | None] = []
        current = shape
        for axis, before, after in steps:
            view, on = axis_view(current, axis)
            view = tuple(view)
            padded = with_axis(current, axis, current[axis] + len(before) + len(after))
            padded_view = with_axis(view, on, view[on] + len(before) + len(after))
            source = TensorSpec(view, elem_type)
            line = TensorSpec(with_axis(view, on, 1), elem_type)
            if axis < 2:
                probes.append(probe_reshape(ctx, TensorSpec(current, elem_type), source))
                probes.append(
                    probe_reshape(
                        ctx, TensorSpec(padded_view, elem_type), TensorSpec(padded, elem_type)
                    )
                )
            for index in sorted({*before, *after}):
                probes.append(probe_slice(ctx, source, line, [index], [index + 1], [on]))
            parts = [line] * len(before) + [source] + [line] * len(after)
            probes.append(
                probe_node(ctx, "Concat", parts, [TensorSpec(padded_view, elem_type)], {"axis": on})
            )
            current = padded
        return probes

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        pad = ed.node_named(match.nodes[0])
        assert pad is not None
        x, y = pad.inputs[0], pad.outputs[0]
        ed.detach(pad)
        steps, shape = match.data["steps"], match.data["shape"]
        current = x
        for k, (axis, before, after) in enumerate(steps):
            view, on = axis_view(shape, axis)
            source = current
            if axis < 2:
                target = ed.const(f"{pad.name}_view", np.array(view, np.int64))
                source = ed.op("Reshape", f"{pad.name}_view", [current, target], view, x.dtype)
            lines: dict[int, gs.Variable] = {}
            for index in sorted({*before, *after}):
                lines[index] = ed.var(f"{pad.name}_line", x.dtype, with_axis(view, on, 1))
                add_slice(ed, source, lines[index], [index], [index + 1], [on])
            size = shape[axis] + len(before) + len(after)
            shape = list(with_axis(shape, axis, size))
            out = y if k == len(steps) - 1 else ed.var(f"{pad.name}_axis{axis}", x.dtype, shape)
            parts = [lines[i] for i in before] + [source] + [lines[i] for i in after]
            if axis < 2:
                joined = ed.op(
                    "Concat",
                    f"{pad.name}_concat",
                    parts,
                    with_axis(view, on, size),
                    x.dtype,
                    axis=on,
                )
                back = ed.const(f"{pad.name}_shape", np.array(shape, np.int64))
                ed.node("Reshape", f"{pad.name}_unview", [joined, back], [out])
            else:
                ed.node("Concat", f"{pad.name}_concat", parts, [out], axis=axis)
            current = out
        return True


def _pad_value(pat: Pattern, node: int) -> float | None:
    """A constant-mode Pad's fill value (0 when omitted); None when computed at run time."""
    ins = pat.ins(node)
    if model_opset(pat.ctx) < 11:
        return float(pat.attrs(node).get("value", 0.0))
    if len(ins) > 2 and ins[2]:
        return pat.scalar(ins[2])
    return 0.0


@register
class PadToConcat(GraphRule):
    """Rewrite a constant-mode Pad the target rejects (a non-zero pad value, a padded channel
    axis, more padded axes than the MLA pads at once) as, per padded axis, a Concat of the
    input between constant blocks filled with the pad value.

    LiteMLA (EfficientViT) appends a row of ones to its values with `F.pad(v, (0, 1),
    value=1)` so one MatMul also yields the attention normaliser; the MLA pads with zeros
    only. A Concat with a constant operand is data movement: the result is the Pad's,
    bit for bit. Along an axis the MLA does not concatenate (the batch axis; any axis of a
    tensor that is not 4-D) the Concat runs on the 4-D view [1, outer, n, inner] between two
    Reshapes: Funnel Transformer's decoder zero-pads its tokens, which a transformer lift has
    put on the batch axis. Applied when the pads are constant and non-negative (a negative pad
    crops) and the input's shape is static; only Pads the target keeps off its MLA are
    matched, and a match frees the Pad only when every Concat runs there.
    """

    name = "pad-to-concat"
    suggest_for = frozenset({"Pad"})
    summary = "Constant Pad the MLA rejects (non-zero value, channel axis) → Concat with constants."
    category = "replace"
    example = "surgery apply pad-to-concat efficientvit_b0.onnx --target mlsoc"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Pad"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            shape = pat.shape(x)
            if shape is None or pat.shape(y) is None or not pat.is_float(x):
                continue
            read = pad_mode_and_amounts(pat, node, len(shape))
            value = _pad_value(pat, node)
            if read is None or value is None or read[0] != "constant":
                continue
            pads = read[1]
            rank = len(shape)
            if any(p < 0 for p in pads) or not any(pads):
                continue
            steps = [(a, pads[a], pads[a + rank]) for a in range(rank) if pads[a] or pads[a + rank]]
            elem_type = pat.elem_type(x)
            probes: list[Reason | None] = []
            views: list[bool] = []
            current = shape
            for axis, before, after in steps:
                direct = _concat_probes(ctx, current, axis, before, after, elem_type)
                viewed = _concat_probes(ctx, current, axis, before, after, elem_type, view=True)
                views.append(not all_on_mla(direct) and viewed is not None)
                probes.extend(viewed if views[-1] else direct)  # type: ignore[arg-type]
                current = with_axis(current, axis, current[axis] + before + after)
            names = [pat.name(node)]
            sides = ", ".join(f"axis {a}: {b}+{e}" for a, b, e in steps)
            found.append(
                self.match(
                    names,
                    f"constant Pad {pat.name(node)} of {fmt_shape(shape)} ({sides}, value "
                    f"{value:g}) → Concat with constant blocks",
                    net_freed(ctx, names, probes),
                    shape=list(shape),
                    steps=[[a, b, e] for a, b, e in steps],
                    views=views,
                    value=value,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        pad = ed.node_named(match.nodes[0])
        assert pad is not None
        x, y = pad.inputs[0], pad.outputs[0]
        ed.detach(pad)
        steps, shape = match.data["steps"], list(match.data["shape"])
        dtype = x.dtype or np.float32
        current = x
        for k, ((axis, before, after), viewed) in enumerate(
            zip(steps, match.data["views"], strict=True)
        ):
            padded = list(with_axis(shape, axis, shape[axis] + before + after))
            out = y if k == len(steps) - 1 else ed.var(f"{pad.name}_axis{axis}", x.dtype, padded)
            view, on = axis_view(shape, axis) if viewed else (shape, axis)
            source = current
            if viewed:
                target = ed.const(f"{pad.name}_view", np.array(view, np.int64))
                source = ed.op("Reshape", f"{pad.name}_view", [current, target], view, x.dtype)
            blocks = {
                side: ed.const(
                    f"{pad.name}_{side}",
                    np.full(with_axis(view, on, count), match.data["value"], dtype),
                )
                for side, count in (("before", before), ("after", after))
                if count
            }
            parts = [
                t for t in (blocks.get("before"), source, blocks.get("after")) if t is not None
            ]
            if viewed:
                joined_shape = with_axis(view, on, view[on] + before + after)
                joined = ed.op(
                    "Concat", f"{pad.name}_concat", parts, joined_shape, x.dtype, axis=on
                )
                back = ed.const(f"{pad.name}_shape", np.array(padded, np.int64))
                ed.node("Reshape", f"{pad.name}_unview", [joined, back], [out])
            else:
                ed.node("Concat", f"{pad.name}_concat", parts, [out], axis=axis)
            shape = padded
            current = out
        return True


def _concat_probes(
    ctx: RuleContext,
    shape: Sequence[int],
    axis: int,
    before: int,
    after: int,
    elem_type: int,
    *,
    view: bool = False,
) -> list[Reason | None] | None:
    """Placement of a Concat padding `axis` of `shape` with constant blocks — on the tensor, or
    (`view`) on its 4-D view [1, outer, n, inner] between two Reshapes, for an axis the MLA does
    not concatenate along (the batch axis, or any axis of a tensor that is not 4-D). None when
    the view is the tensor itself."""
    on_view, on = axis_view(shape, axis) if view else (list(shape), axis)
    if view and on_view == list(shape):
        return None
    padded_view = with_axis(on_view, on, on_view[on] + before + after)
    parts = [TensorSpec(tuple(on_view), elem_type)]
    parts += [
        TensorSpec(with_axis(on_view, on, count), elem_type, None, True)
        for count in (before, after)
        if count
    ]
    probes = [probe_node(ctx, "Concat", parts, [TensorSpec(padded_view, elem_type)], {"axis": on})]
    if view:
        padded = with_axis(shape, axis, shape[axis] + before + after)
        probes.append(
            probe_reshape(
                ctx, TensorSpec(tuple(shape), elem_type), TensorSpec(tuple(on_view), elem_type)
            )
        )
        probes.append(
            probe_reshape(ctx, TensorSpec(padded_view, elem_type), TensorSpec(padded, elem_type))
        )
    return probes


BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean"})
"""Elementwise ops with numpy (multidirectional) broadcasting of every input."""


@register
class ExpandIntoBroadcast(GraphRule):
    """Remove an Expand whose every consumer is an elementwise op that broadcasts its inputs
    (Add, Sub, Mul, Div, Pow, Max, Min, Sum, Mean) to the same result without it.

    torch exports `x * ctx.expand_as(v)` and `q / norm.expand_as(q)` — MobileViTv2's context
    vector broadcast over every token, EdgeNeXt's L2 normalisation of q and k — as an Expand
    feeding a Mul or Div whose other operand already has the expanded shape. The consumer
    broadcasts the small tensor by itself, so the copy is redundant: the values are the same
    bit for bit and nothing is copied at all (expand-to-concat copies at most 32 times per
    axis; these broadcast over hundreds of tokens). Matched only when every consumer's output
    shape is unchanged and every consumer on the MLA stays there with the smaller operand.

    A cleanup: the Expand is a no-op for its consumers, and removing it first lets the rank
    lifts carry the broadcast as it is (SwiftFormer's F.normalize on rank-3 tokens: a region
    lifted around the Expand would keep it, and its reshapes, on the host).
    """

    name = "expand-into-broadcast"
    suggest_for = frozenset({"Expand"})
    summary = "Expand feeding only broadcasting elementwise ops (Mul, Add, Div, …) → removed."
    category = "cleanup"
    example = "surgery apply expand-into-broadcast mobilevitv2.onnx -o mvit_bcast.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Expand"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            shape = pat.shape(x)
            users = pat.consumers(y)
            if shape is None or not users or y in pat.outputs:
                continue
            probes = [self._probe(ctx, pat, user, y, x) for user in users]
            if any(p is False for p in probes):
                continue
            # Consumers on the MLA must stay there; one off it is no worse for the removal.
            kept = [
                p
                for user, p in zip(users, probes, strict=True)
                if ctx.coverage.placements[user].processor == "MLA"
            ]
            if not all_on_mla(kept):
                continue
            names = [pat.name(node)]
            found.append(
                self.match(
                    names,
                    f"Expand {pat.name(node)} {fmt_shape(shape)} → {fmt_shape(pat.shape(y))} "
                    f"removed: {', '.join(pat.op(u) for u in users)} broadcast it",
                    net_freed(ctx, names, kept),
                )
            )
        return found

    @staticmethod
    def _probe(ctx: RuleContext, pat: Pattern, user: int, expanded: str, x: str):
        """False when `user` would not compute the same result from `x`; else the placement
        of `user` reading `x` in place of the expanded tensor."""
        if pat.op(user) not in BROADCASTING or len(pat.outs(user)) != 1:
            return False
        out = pat.shape(pat.outs(user)[0])
        inputs = [x if t == expanded else t for t in pat.ins(user)]
        shapes = [pat.shape(t) for t in inputs]
        if out is None or any(s is None for s in shapes):
            return False
        try:
            if tuple(np.broadcast_shapes(*shapes)) != out:  # type: ignore[arg-type]
                return False
        except ValueError:
            return False
        specs = [pat.spec(t, with_value=True) for t in inputs]
        return probe_node(ctx, pat.op(user), specs, [pat.spec(pat.outs(user)[0])], pat.attrs(user))

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        expand = ed.node_named(match.nodes[0])
        assert expand is not None
        bypass_node(ed.graph, expand)
        return True


@register
class TransposeBeforeExpand(GraphRule):
    """Swap a Transpose that reads an Expand (and nothing else reads the Expand): the input is
    transposed first, then expanded to the permuted shape.

    Broadcasting commutes with permuting axes, so Transpose(Expand(x, s), p) =
    Expand(Transpose(x, p), s permuted by p), exactly; the Transpose then moves the small
    tensor instead of the copies. timm's relative position logits (HaloNet, BoTNet) expand
    the height and width logits over a new axis and permute them into place before adding
    them; swapped, the Expands feed the Add directly and expand-into-broadcast removes them.
    A cleanup: the same op count, less data moved.
    """

    name = "transpose-before-expand"
    suggest_for = frozenset({"Transpose", "Expand"})
    summary = "Transpose(Expand(x)) → Expand(Transpose(x)): the small tensor is transposed."
    category = "cleanup"
    example = "surgery apply transpose-before-expand halonet.onnx -o halonet_swapped.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Transpose"):
            expanded = pat.ins(node)[0]
            expand = pat.producer(expanded, "Expand")
            if expand is None or not pat.private(expanded):
                continue
            x, shape = pat.ins(expand)[0], pat.shape(expanded)
            source = pat.shape(x)
            perm = pat.attrs(node).get("perm")
            if source is None or shape is None or perm is None or len(source) != len(shape):
                continue
            names = [pat.name(expand), pat.name(node)]
            found.append(
                self.match(
                    names,
                    f"Transpose {pat.name(node)} of Expand {pat.name(expand)} → of its "
                    f"{fmt_shape(source)} input",
                    [],
                    perm=list(perm),
                    shape=[int(shape[p]) for p in perm],
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        expand, transpose = (ed.node_named(n) for n in match.nodes)
        if expand is None or transpose is None:
            return False
        x, y = expand.inputs[0], transpose.outputs[0]
        ed.detach(expand, transpose)
        moved = ed.op("Transpose", "expand_input_t", [x], None, x.dtype, perm=match.data["perm"])
        target = ed.const("expanded_shape", np.array(match.data["shape"], np.int64))
        ed.node("Expand", "expand_moved", [moved, target], [y])
        return True


@register
class ExpandToConcat(GraphRule):
    """Rewrite an Expand to a constant shape of the same rank as a Concat of copies of its input
    along each broadcast axis (an axis of size 1 expanded to k: k copies).

    Expand is a broadcast copy; an MLA without it concatenates. Applied when the input's shape is
    static, the output has the input's rank, and no axis is copied more than 32 times. Only
    Expands the target keeps off its MLA are matched; a match frees the Expand only when every
    Concat runs there.
    """

    name = "expand-to-concat"
    suggest_for = frozenset({"Expand"})
    summary = "Expand to a constant shape → Concat of copies of the input along broadcast axes."
    category = "replace"
    example = "surgery apply expand-to-concat model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Expand"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            copies = self._copies(pat, node)
            if copies is None:
                continue
            shape = pat.shape(x)
            assert shape is not None
            elem_type = pat.elem_type(x)
            probes: list[Reason | None] = []
            current = shape
            for axis, k in copies:
                copied = with_axis(current, axis, k)
                source = TensorSpec(current, elem_type)
                probes.append(
                    probe_node(
                        ctx, "Concat", [source] * k, [TensorSpec(copied, elem_type)], {"axis": axis}
                    )
                )
                current = copied
            names = [pat.name(node)]
            found.append(
                self.match(
                    names,
                    f"Expand {pat.name(node)} {fmt_shape(shape)} → {fmt_shape(pat.shape(y))} as "
                    + ", ".join(f"{k} copies on axis {a}" for a, k in copies),
                    net_freed(ctx, names, probes),
                    shape=list(shape),
                    copies=[[a, k] for a, k in copies],
                )
            )
        return found

    @staticmethod
    def _copies(pat: Pattern, node: int) -> list[tuple[int, int]] | None:
        """(axis, copies) for each broadcast axis, when the Expand is one this rule rewrites."""
        x, target = pat.ins(node)[:2]
        shape, out = pat.shape(x), pat.shape(pat.outs(node)[0])
        value = pat.value(target)
        if shape is None or out is None or value is None or len(out) != len(shape):
            return None
        try:
            broadcast = np.broadcast_shapes(shape, tuple(int(d) for d in value.reshape(-1)))
        except ValueError:
            return None
        if tuple(broadcast) != out:
            return None
        copies = [(a, o) for a, (d, o) in enumerate(zip(shape, out, strict=True)) if d != o]
        if not copies or any(k < 2 or k > MAX_COPIES for _, k in copies):
            return None
        return copies

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        expand = ed.node_named(match.nodes[0])
        assert expand is not None
        x, y = expand.inputs[0], expand.outputs[0]
        ed.detach(expand)
        copies, shape = match.data["copies"], match.data["shape"]
        current = x
        for n, (axis, k) in enumerate(copies):
            shape = list(with_axis(shape, axis, k))
            last = n == len(copies) - 1
            out = y if last else ed.var(f"{expand.name}_axis{axis}", x.dtype, shape)
            ed.node("Concat", f"{expand.name}_concat", [current] * k, [out], axis=axis)
            current = out
        return True


MAX_REPEAT_COPIES = 64
"""Most copies repeat-to-concat makes (one Concat input each): GCViT repeats its global query
over 64 windows."""


@dataclass(frozen=True)
class Repeat:
    """An Unsqueeze → Expand/Tile → Reshape that repeats its input `copies` times along a new
    unit axis with `before` elements ahead of it and `after` behind it in memory order.

    The expanded tensor's memory is then [before, copies, after], and any Reshape only relabels
    it: the input staged as [1, before, 1, after], `copies` of it concatenated on axis 2, and
    the result reshaped to the output give the same values. When the output is just the input
    with axis `tile_axis` `copies` times longer (the new axis folded into the one after it),
    a Concat of the input along that axis is all it takes.
    """

    before: int
    after: int
    copies: int
    tile_axis: int | None = None

    def staging_shape(self) -> list[int] | None:
        """[1, before, 1, after], or None when a plain Concat along `tile_axis` does."""
        return None if self.tile_axis is not None else [1, self.before, 1, self.after]

    def concat_axis(self) -> int:
        return self.tile_axis if self.tile_axis is not None else 2


def plan_repeat(
    source: Sequence[int], unsqueezed: Sequence[int], expanded: Sequence[int], out: Sequence[int]
) -> Repeat | None:
    """The repeat these four shapes describe, when they describe one: the unit axis the
    Unsqueeze inserts is the only one the Expand (or Tile) copies."""
    if len(unsqueezed) != len(source) + 1 or len(expanded) != len(unsqueezed):
        return None
    differ = [a for a, (u, e) in enumerate(zip(unsqueezed, expanded, strict=True)) if u != e]
    if len(differ) != 1 or unsqueezed[differ[0]] != 1:
        return None
    new = differ[0]
    copies = expanded[new]
    if [*unsqueezed[:new], *unsqueezed[new + 1 :]] != list(source):
        return None
    if not 2 <= copies <= MAX_REPEAT_COPIES or math.prod(out) != math.prod(expanded):
        return None
    before, after = math.prod(source[:new]), math.prod(source[new:])
    if new < len(source) and list(out) == [*source[:new], copies * source[new], *source[new + 1 :]]:
        return Repeat(before, after, copies, tile_axis=new)
    return Repeat(before, after, copies)


@register
class RepeatToConcat(GraphRule):
    """Rewrite Unsqueeze → Expand (or Tile) → Reshape that repeats one axis as a Concat of
    copies.

    Grouped-query attention shares each key/value head among several query heads
    (`repeat_kv` in Llama, Qwen2, Mistral, Gemma): [1, kv, L, d] is unsqueezed to
    [1, kv, 1, L, d], expanded to [1, kv, n, L, d] and reshaped to [1, kv·n, L, d]. The rank-5
    middle and the Expand keep it off an MLA, splitting every attention layer. The same values
    come from Reshape to [1, kv, 1, L·d] → Concat of n copies on axis 2 → Reshape to the output
    (each head repeated in place), whatever shape the Reshape gives (GCViT tiles its global
    query [1, 7, 7, 64] over 64 windows and reshapes it to [64, 49, 2, 32]); when the new axis
    is folded into the one after it (a tile), the Concat of n copies of the input along that
    axis alone. A Tile of the new unit axis is the same copy as an Expand. The unit axis may
    come from a Reshape instead of the Unsqueeze, and a Transpose may sit between the copy
    and the Reshape (tf2onnx writes Keras 3's UpSampling2D as two such repeats, the first
    moving the channels last): the input is then transposed the same way first. Data
    movement: exact.
    """

    name = "repeat-to-concat"
    suggest_for = frozenset({"Expand", "Tile", "Unsqueeze", "Reshape"})
    summary = (
        "Unsqueeze → Expand/Tile → Reshape repeating an axis (GQA repeat_kv, GCViT's global "
        "query) → Concat of copies."
    )
    category = "replace"
    example = "surgery apply repeat-to-concat llama.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for expand in pat.nodes("Expand", "Tile"):
            chain = self._chain(pat, expand)
            if chain is None:
                continue
            nodes, x, y, repeat, perm_x = chain
            if not any(pat.name(n) in ctx.blocker_names for n in nodes):
                continue
            shape, out = pat.shape(x), pat.shape(y)
            assert shape is not None and out is not None
            elem_type = pat.elem_type(x)
            staged = repeat.staging_shape()
            probes: list[Reason | None] = []
            source = TensorSpec(tuple(shape), elem_type)
            if perm_x is not None:
                moved = TensorSpec(tuple(shape[a] for a in perm_x), elem_type)
                probes.append(
                    probe_node(ctx, "Transpose", [source], [moved], {"perm": list(perm_x)})
                )
                source = moved
            if staged is not None:
                staged_spec = TensorSpec(tuple(staged), elem_type)
                probes.append(probe_reshape(ctx, source, staged_spec))
                source = staged_spec
            axis = repeat.concat_axis()
            assert source.shape is not None
            joined = TensorSpec(with_axis(source.shape, axis, repeat.copies), elem_type)
            probes.append(
                probe_node(ctx, "Concat", [source] * repeat.copies, [joined], {"axis": axis})
            )
            if staged is not None:
                probes.append(probe_reshape(ctx, joined, pat.spec(y)))
            names = [pat.name(n) for n in nodes]
            form = "Concat" if staged is None else "Reshape → Concat → Reshape"
            found.append(
                self.match(
                    names,
                    f"{' → '.join(pat.op(n) for n in nodes)} {pat.name(expand)}: "
                    f"{repeat.copies} copies of {fmt_shape(shape)} → {fmt_shape(out)} as {form}",
                    net_freed(ctx, names, probes),
                    repeat=asdict(repeat),
                    out=list(out),
                    perm_x=perm_x,
                )
            )
        return found

    @staticmethod
    def _chain(
        pat: Pattern, expand: int
    ) -> tuple[list[int], str, str, Repeat, list[int] | None] | None:
        """(Unsqueeze or Reshape, Expand or Tile, [Transpose,] Reshape), the input, the output,
        the repeat and the permutation of the input that the Transpose amounts to (None
        without one); None if the copy is not the middle of such a chain with private
        intermediates.

        A Reshape in place of the Unsqueeze (merge-reshapes folds the Unsqueeze into the
        reshape before it) only relabels memory, so the repeat reads its input through the
        staging Reshape. A Transpose between the copy and the final Reshape (tf2onnx writes
        Keras' UpSampling2D so, the channels moved last) moves the input's axes the same way:
        the input is transposed first, and the new axis sits where the Transpose puts it."""
        middle = pat.ins(expand)[0]
        producer = pat.producer(middle, "Unsqueeze", "Reshape")
        if producer is None or not pat.private(middle):
            return None
        copied = pat.outs(expand)[0]
        transpose = pat.sole_consumer(copied, "Transpose")
        last = pat.outs(transpose)[0] if transpose is not None else copied
        reshape = pat.sole_consumer(last, "Reshape")
        if reshape is None:
            return None
        x, y = pat.ins(producer)[0], pat.outs(reshape)[0]
        shapes = [pat.shape(t) for t in (x, middle, copied, y)]
        if any(s is None for s in shapes) or pat.is_const(x) or not pat.is_float(x):
            return None
        source, unsqueezed, expanded, out = (list(s) for s in shapes)  # type: ignore[arg-type]
        if len(expanded) != len(unsqueezed):
            return None
        differ = [a for a, (u, e) in enumerate(zip(unsqueezed, expanded, strict=True)) if u != e]
        if len(differ) != 1:
            return None
        new = differ[0]
        kept = [*unsqueezed[:new], *unsqueezed[new + 1 :]]
        relabel = kept != source  # a Reshape producer that also merges or splits axes
        if relabel and pat.op(producer) == "Unsqueeze":
            return None
        perm_x = None
        if transpose is not None:
            perm = list(pat.attrs(transpose).get("perm") or reversed(range(len(expanded))))
            order = [a - (a > new) for a in perm if a != new]
            if order != sorted(order):
                perm_x = order
            new = perm.index(new)
            kept = [kept[a] for a in order]
            unsqueezed = [*kept[:new], 1, *kept[new:]]
            expanded = [*kept[:new], expanded[differ[0]], *kept[new:]]
        if relabel and perm_x is not None:
            return None
        repeat = plan_repeat(kept, unsqueezed, expanded, out)
        if repeat is None:
            return None
        if relabel:  # x is read through the staging Reshape, never as it is
            repeat = Repeat(repeat.before, repeat.after, repeat.copies)
        nodes = [producer, expand, *([transpose] if transpose is not None else []), reshape]
        return nodes, x, y, repeat, perm_x

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        nodes = [ed.node_named(n) for n in match.nodes]
        if any(n is None for n in nodes):
            return False
        first, last = nodes[0], nodes[-1]
        assert first is not None and last is not None
        x, y = first.inputs[0], last.outputs[0]
        ed.detach(*nodes)  # type: ignore[arg-type]
        d = match.data
        repeat = Repeat(**d["repeat"])
        if d["perm_x"] is not None:
            x = ed.op("Transpose", "repeat_order", [x], None, x.dtype, perm=d["perm_x"])
        staged = repeat.staging_shape()
        if staged is None:
            ed.node("Concat", "repeat", [x] * repeat.copies, [y], axis=repeat.concat_axis())
            return True
        source = ed.op(
            "Reshape", "repeat_stage", [x, ed.const("shape", _int64(staged))], staged, x.dtype
        )
        joined_shape = list(with_axis(staged, repeat.concat_axis(), repeat.copies))
        joined = ed.op(
            "Concat",
            "repeat",
            [source] * repeat.copies,
            joined_shape,
            x.dtype,
            axis=repeat.concat_axis(),
        )
        ed.node("Reshape", "repeat_unstage", [joined, ed.const("shape", _int64(d["out"]))], [y])
        return True


def _int64(values: Sequence[int]) -> np.ndarray:
    return np.array(list(values), np.int64)


@register
class ConvPadsToPad(GraphRule):
    """Rewrite a Conv whose padding the MLA rejects (rk3588 pads 0..15; DeepLabV3's ASPP pads a
    dilated 3×3 by 12/24/36) as a constant-zero Pad followed by the same Conv without padding.

    A Conv's padding is zeros around the input, which is exactly what the Pad writes, so the
    sums are the same: exact. Only Convs the target keeps off its MLA are matched, and only
    when both the Pad and the unpadded Conv then run on it.
    """

    name = "conv-pads-to-pad"
    suggest_for = frozenset({"Conv"})
    summary = "Conv with padding past the MLA's limit → zero Pad + Conv with pads 0."
    category = "replace"
    example = "surgery apply conv-pads-to-pad deeplabv3.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Conv"):
            ins, y = pat.ins(node), pat.outs(node)[0]
            shape = pat.shape(ins[0])
            attrs = pat.attrs(node)
            pads = [int(p) for p in attrs.get("pads", [])]
            if shape is None or len(shape) != 4 or not pat.is_float(ins[0]):
                continue
            if not any(pads) or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", ""):
                continue
            if len(pads) != 4:
                continue  # not a 2-D Conv's pads: malformed, the checker's to report
            top, left, bottom, right = pads
            padded = (*shape[:2], shape[2] + top + bottom, shape[3] + left + right)
            onnx_pads = [0, 0, top, left, 0, 0, bottom, right]
            pad_probe = probe_zero_pad(ctx, pat.spec(ins[0]), padded, onnx_pads)
            unpadded = {k: v for k, v in attrs.items() if k != "pads"}
            conv_probe = probe_node(
                ctx,
                "Conv",
                [TensorSpec(padded), *(pat.spec(t, with_value=False) for t in ins[1:] if t)],
                [pat.spec(y)],
                unpadded,
            )
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Conv {pat.name(node)} pads {pads} → Pad + Conv without padding",
                    net_freed(ctx, [pat.name(node)], [pad_probe, conv_probe]),
                    pads=onnx_pads,
                    padded=list(padded),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x = node.inputs[0]
        node.inputs[0] = add_zero_pad(ed, x, match.data["pads"], match.data["padded"], "conv_pad")
        node.attrs.pop("pads", None)
        return True
