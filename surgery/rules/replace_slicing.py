"""Indexing as slices: split-to-slices, gather-to-slice.

Slice is the MLA's general "take a window" op; Split and a constant-index Gather are windows
too. Writing them as Slices lets them run where the original was rejected (a Split whose sizes
are computed at run time, a Gather the int8 MLA does not run). Data movement only: exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    model_opset,
    net_freed,
    probe_node,
)
from surgery.targets import Reason


def slice_inputs(starts: Sequence[int], ends: Sequence[int], axes: Sequence[int]) -> list:
    """Constant Slice operands (opset ≥ 10), as probe specs."""
    return [TensorSpec.const(np.array(v, np.int64)) for v in (starts, ends, axes)]


def probe_slice(
    ctx: RuleContext,
    x: TensorSpec,
    out: TensorSpec,
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int],
) -> Reason | None:
    if model_opset(ctx) < 10:
        attrs = {"starts": list(starts), "ends": list(ends), "axes": list(axes)}
        return probe_node(ctx, "Slice", [x], [out], attrs)
    return probe_node(ctx, "Slice", [x, *slice_inputs(starts, ends, axes)], [out])


def add_slice(
    ed: Editor,
    x: gs.Tensor,
    out: gs.Tensor,
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int],
) -> gs.Node:
    """A Slice node in the form the model's opset expects (attributes before opset 10)."""
    if model_opset(ed.ctx) < 10:
        return ed.node(
            "Slice", "slice", [x], [out], starts=list(starts), ends=list(ends), axes=list(axes)
        )
    consts = [
        ed.const(f"slice_{what}", np.array(v, np.int64))
        for what, v in (("starts", starts), ("ends", ends), ("axes", axes))
    ]
    return ed.node("Slice", "slice", [x, *consts], [out])


@register
class SplitToSlices(GraphRule):
    """Rewrite a Split as one Slice per used output.

    The sizes come from the inferred output shapes, so Splits whose sizes are an input computed
    at run time (or given by `num_outputs`) are handled alike; unused outputs produce no Slice.
    Each Slice reads the same input with constant starts/ends, which the MLA accepts.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "split-to-slices"
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
    is not static. Gathers from constant tables are left to fold-constants.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "gather-to-slice"
    suggest_for = frozenset({"Gather"})
    summary = "Gather with a constant scalar or consecutive 1-D index → Slice (+Reshape)."
    category = "replace"
    example = "surgery apply gather-to-slice vit_tiny_patch16_224.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Gather"):
            plan = self._plan(pat, node)
            if plan is None:
                continue
            data, out = pat.ins(node)[0], pat.outs(node)[0]
            axis, start, end, scalar = plan
            sliced = self._sliced_shape(pat, data, axis, end - start)
            main = [probe_slice(ctx, pat.spec(data), TensorSpec(sliced), [start], [end], [axis])]
            helpers = [self._squeeze_probe(ctx, pat, sliced, out)] if scalar else []
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Gather {pat.name(node)} takes [{start}:{end}) of axis {axis} → Slice"
                    + (" + Reshape" if scalar else ""),
                    net_freed(ctx, [pat.name(node)], main, helpers),
                    axis=axis,
                    start=start,
                    end=end,
                    scalar=scalar,
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
        ed.detach(gather)
        d = match.data
        if not d["scalar"]:
            add_slice(ed, data, out, [d["start"]], [d["end"]], [d["axis"]])
            return True
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
