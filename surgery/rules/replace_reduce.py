"""Reductions and normalisations in the MLA's form: reducemean-to-gap, reducemin-to-reducemax,
softmax-to-channel, reducel2-to-sum, channel-reduce-to-conv, reduce-to-spatial. Each is an
identity of the math: exact, or (the last three) equal up to float summation order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    all_on_mla,
    fmt_shape,
    model_opset,
    net_freed,
    probe_node,
    reduce_axes,
)


@dataclass(frozen=True)
class Reduction:
    """A Reduce* node of a run-time float tensor with static shapes: what the rewrites read."""

    x: str
    y: str
    shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    axes: list[int]


def float_reduction(pat: Pattern, node: int) -> Reduction | None:
    """The reduction `node` computes, or None for a constant or non-float input, unknown shapes
    or axes that are not constant."""
    x, y = pat.ins(node)[0], pat.outs(node)[0]
    shape, out_shape = pat.shape(x), pat.shape(y)
    if shape is None or out_shape is None or pat.is_const(x) or not pat.is_float(x):
        return None
    axes = reduce_axes(pat, node, len(shape))
    return None if axes is None else Reduction(x, y, shape, out_shape, axes)


@register
class ReduceMeanToGap(GraphRule):
    """Rewrite ReduceMean over H and W of a 4-D tensor as GlobalAveragePool.

    keepdims=1 gives the same [N, C, 1, 1]; keepdims=0 adds a Reshape to [N, C]. Same sum and
    same divisor, so the result is exact to float rounding. GlobalAveragePool is the MLA's
    native form of this reduction (the SE blocks of MobileNetV3/EfficientNet exports).
    Only nodes the target keeps off its MLA are matched.
    """

    name = "reducemean-to-gap"
    suggest_for = frozenset({"ReduceMean"})
    summary = "ReduceMean over H,W → GlobalAveragePool (+Reshape when keepdims=0)."
    category = "replace"
    example = "surgery apply reducemean-to-gap model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("ReduceMean"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            shape, out_shape = pat.shape(x), pat.shape(y)
            if shape is None or out_shape is None or len(shape) != 4 or not pat.is_float(x):
                continue
            if reduce_axes(pat, node, 4) != [2, 3]:
                continue
            keep = bool(pat.attrs(node).get("keepdims", 1))
            gap_shape = (*shape[:2], 1, 1)
            main = [probe_node(ctx, "GlobalAveragePool", [pat.spec(x)], [TensorSpec(gap_shape)])]
            helpers = []
            if not keep:
                helpers.append(
                    probe_node(
                        ctx,
                        "Reshape",
                        [TensorSpec(gap_shape), TensorSpec.const(np.array(out_shape, np.int64))],
                        [TensorSpec(out_shape)],
                    )
                )
            found.append(
                self.match(
                    [pat.name(node)],
                    f"ReduceMean {pat.name(node)} over H,W → GlobalAveragePool"
                    + ("" if keep else " + Reshape"),
                    net_freed(ctx, [pat.name(node)], main, helpers),
                    keep=keep,
                    out_shape=list(out_shape),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        if match.data["keep"]:
            ed.node("GlobalAveragePool", "gap", [x], [y])
            return True
        pooled = ed.op("GlobalAveragePool", "gap", [x], None, x.dtype)
        shape = ed.const("gap_shape", np.array(match.data["out_shape"], np.int64))
        ed.node("Reshape", "gap_reshape", [pooled, shape], [y])
        return True


@register
class ReduceMinToReduceMax(GraphRule):
    """Rewrite ReduceMin(x) as −ReduceMax(−x).

    min(x) = −max(−x) holds exactly in floating point (negation only flips the sign bit). The
    negations are Mul by −1, not Neg, because the MLA runs Mul and (on SiMa targets) not Neg.
    Axes and keepdims carry over unchanged.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "reducemin-to-reducemax"
    suggest_for = frozenset({"ReduceMin"})
    summary = "ReduceMin(x) → −ReduceMax(−x) (negations as Mul by −1)."
    category = "replace"
    example = "surgery apply reducemin-to-reducemax model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("ReduceMin"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            if not pat.is_float(x) or pat.is_const(x):
                continue
            minus = TensorSpec.const(np.array(-1, np.float32))
            axes_in = [pat.spec(i, with_value=True) for i in pat.ins(node)[1:]]
            main = [
                probe_node(ctx, "Mul", [pat.spec(x), minus], [pat.spec(x)]),
                probe_node(
                    ctx, "ReduceMax", [pat.spec(x), *axes_in], [pat.spec(y)], pat.attrs(node)
                ),
                probe_node(ctx, "Mul", [pat.spec(y), minus], [pat.spec(y)]),
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"ReduceMin {pat.name(node)} → −ReduceMax(−x)",
                    net_freed(ctx, [pat.name(node)], main),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        rest = list(node.inputs[1:])
        attrs = dict(node.attrs)
        ed.detach(node)
        minus = ed.const("minus_one", np.array(-1, dtype=x.dtype or np.float32))
        negated = ed.op("Mul", "negate", [x, minus], x.shape, x.dtype)
        reduced = ed.op("ReduceMax", "reducemax", [negated, *rest], y.shape, x.dtype, **attrs)
        ed.node("Mul", "negate_back", [reduced, minus], [y])
        return True


@register
class SoftmaxToChannel(GraphRule):
    """Move a 4-D Softmax onto the channel axis: Transpose → Softmax(axis=1) → Transpose.

    The MLA normalises over channels only. Swapping the softmax axis with axis 1, normalising
    there and swapping back is the same computation (the swap is its own inverse). Needs opset
    ≥ 13: before that Softmax flattened every axis from `axis` on, so axis 1 would mean C·H·W.
    The batch axis is never moved.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "softmax-to-channel"
    suggest_for = frozenset({"Softmax"})
    summary = "Softmax on H or W of a 4-D tensor → Transpose, channel Softmax, Transpose back."
    category = "replace"
    example = "surgery apply softmax-to-channel vit_tiny_patch16_224.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        if model_opset(ctx) < 13:
            return []
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Softmax"):
            x = pat.ins(node)[0]
            shape = pat.shape(x)
            if shape is None or len(shape) != 4 or not pat.is_float(x):
                continue
            axis = int(pat.attrs(node).get("axis", -1)) % 4
            if axis < 2:
                continue
            perm = self.perm(axis)
            moved = TensorSpec(tuple(shape[p] for p in perm))
            main = [
                probe_node(ctx, "Transpose", [pat.spec(x)], [moved], {"perm": perm}),
                probe_node(ctx, "Softmax", [moved], [moved], {"axis": 1}),
                probe_node(ctx, "Transpose", [moved], [pat.spec(x)], {"perm": perm}),
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Softmax {pat.name(node)} on axis {axis} → channel Softmax between "
                    f"Transposes {perm}",
                    net_freed(ctx, [pat.name(node)], main),
                    axis=axis,
                )
            )
        return found

    @staticmethod
    def perm(axis: int) -> list[int]:
        perm = [0, 1, 2, 3]
        perm[1], perm[axis] = axis, 1
        return perm

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        perm = self.perm(match.data["axis"])
        moved = ed.op("Transpose", "to_channel", [x], None, x.dtype, perm=perm)
        normed = ed.op("Softmax", "softmax_channel", [moved], None, x.dtype, axis=1)
        ed.node("Transpose", "from_channel", [normed], [y], perm=perm)
        return True


@register
class ReduceL2ToSum(GraphRule):
    """Rewrite ReduceL2(x) as Sqrt(ReduceSum(x · x)) and ReduceSumSquare(x) as ReduceSum(x · x).

    The definitions of both ops, written with ops the MLA runs (a Mul, a spatial ReduceSum and
    a Sqrt table): ConvNeXt V2's Global Response Norm takes the L2 norm of every channel over
    H and W; torch's F.normalize over the last axis (EdgeNeXt's cross-covariance attention)
    takes it over the tokens, which the sum then reduces as a spatial reduction when the MLA
    rejects the long last axis on its own (see reduce-to-spatial); a norm over axes [1, 2] of
    a channels-last map (Hugging Face's ConvNeXt V2 lifted to 4-D) is summed over H and W of
    its Transpose (see channels-last-reduce-to-spatial). Same sums in the same order, so the
    result is ONNX Runtime's up to rounding.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "reducel2-to-sum"
    suggest_for = frozenset({"ReduceL2", "ReduceSumSquare"})
    summary = "ReduceL2 → Sqrt(ReduceSum(x·x)); ReduceSumSquare → ReduceSum(x·x)."
    category = "replace"
    example = "surgery apply reducel2-to-sum convnextv2.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in [*pat.blocked("ReduceL2"), *pat.blocked("ReduceSumSquare")]:
            site = float_reduction(pat, node)
            if site is None or not site.axes:
                continue
            x, y, shape, out_shape, axes = site.x, site.y, site.shape, site.out_shape, site.axes
            keep = int(pat.attrs(node).get("keepdims", 1))
            root = pat.op(node) == "ReduceL2"
            square = probe_node(ctx, "Mul", [pat.spec(x), pat.spec(x)], [pat.spec(x)])
            axes_in, axes_attr = _reduce_axes_operand(ctx, "ReduceSum", axes)
            direct = [
                probe_node(
                    ctx,
                    "ReduceSum",
                    [pat.spec(x), *axes_in],
                    [pat.spec(y)],
                    {"keepdims": keep, **axes_attr},
                )
            ]
            if root:
                direct.append(probe_node(ctx, "Sqrt", [pat.spec(y)], [pat.spec(y)]))
            view = move = None
            how = ""
            if not all_on_mla(direct) and (view := spatial_view(shape, axes)) is not None:
                direct = probe_spatial(ctx, "ReduceSum", shape, view, out_shape, root)
                how = f" summed over H,W of {fmt_shape(view)}"
            elif not all_on_mla(direct) and (move := channels_last_move(site, keep)):
                direct = probe_channels_last(
                    ctx, "ReduceSum", pat.spec(x), pat.spec(y), move, then_sqrt=root
                )
                how = f" summed over H,W of its Transpose {move.perm}"
            found.append(
                self.match(
                    [pat.name(node)],
                    f"{pat.op(node)} {pat.name(node)} over axes {axes} → "
                    + ("Sqrt(ReduceSum(x·x))" if root else "ReduceSum(x·x)")
                    + how,
                    net_freed(ctx, [pat.name(node)], [square, *direct]),
                    axes=axes,
                    keep=keep,
                    root=root,
                    view=list(view) if view else None,
                    move=move.as_data() if move else None,
                    out_shape=list(out_shape),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        axes, keep, root = match.data["axes"], match.data["keep"], match.data["root"]
        squared = ed.op("Mul", "square", [x, x], x.shape, x.dtype)
        if match.data["move"]:
            move = ChannelsLastMove(**match.data["move"])
            emit_channels_last(ed, "ReduceSum", squared, y, move, "Sqrt" if root else None)
            return True
        if match.data["view"]:
            then = "Sqrt" if root else None
            emit_spatial(
                ed, "ReduceSum", squared, y, match.data["view"], match.data["out_shape"], then
            )
            return True
        axes_in, axes_attr = _reduce_axes_operand(ed.ctx, "ReduceSum", axes)
        inputs = [squared, *(ed.const("sum_axes", np.asarray(a.value)) for a in axes_in)]
        if not root:
            ed.node("ReduceSum", "sum_of_squares", inputs, [y], keepdims=keep, **axes_attr)
            return True
        summed = ed.op(
            "ReduceSum", "sum_of_squares", inputs, y.shape, x.dtype, keepdims=keep, **axes_attr
        )
        ed.node("Sqrt", "norm", [summed], [y])
        return True


@register
class ChannelReduceToConv(GraphRule):
    """Rewrite ReduceMean / ReduceSum over the channels of a 4-D tensor as a 1×1 Conv to one
    channel with every weight 1/C (or 1).

    The MLA reduces spatial axes only; a channel sum is exactly what a 1×1 convolution
    computes, and the Conv is the MLA's native op. ConvNeXt V2's Global Response Norm averages
    its channel norms this way; CBAM-style spatial attention averages over channels. Equal to
    the reduction up to float summation order; keepdims=0 adds a Reshape.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "channel-reduce-to-conv"
    suggest_for = frozenset({"ReduceMean", "ReduceSum"})
    summary = "ReduceMean/ReduceSum over C of a 4-D tensor → 1×1 Conv C→1 (weights 1/C or 1)."
    category = "replace"
    example = "surgery apply channel-reduce-to-conv convnextv2.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in [*pat.blocked("ReduceMean"), *pat.blocked("ReduceSum")]:
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            shape, out_shape = pat.shape(x), pat.shape(y)
            if shape is None or out_shape is None or len(shape) != 4 or pat.is_const(x):
                continue
            if pat.elem_type(x) != onnx.TensorProto.FLOAT:
                continue
            if reduce_axes(pat, node, 4) != [1]:
                continue
            keep = bool(pat.attrs(node).get("keepdims", 1))
            conv_shape = (shape[0], 1, *shape[2:])
            weight = TensorSpec.const(np.ones((1, shape[1], 1, 1), np.float32))
            main = [probe_node(ctx, "Conv", [pat.spec(x), weight], [TensorSpec(conv_shape)])]
            helpers = []
            if not keep:
                target = TensorSpec.const(np.array(out_shape, np.int64))
                helpers.append(
                    probe_node(
                        ctx, "Reshape", [TensorSpec(conv_shape), target], [TensorSpec(out_shape)]
                    )
                )
            found.append(
                self.match(
                    [pat.name(node)],
                    f"{pat.op(node)} {pat.name(node)} over {shape[1]} channels → 1×1 Conv"
                    + ("" if keep else " + Reshape"),
                    net_freed(ctx, [pat.name(node)], main, helpers),
                    channels=int(shape[1]),
                    mean=pat.op(node) == "ReduceMean",
                    keep=keep,
                    out_shape=list(out_shape),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        channels = match.data["channels"]
        value = 1.0 / channels if match.data["mean"] else 1.0
        weight = ed.const("channel_weight", np.full((1, channels, 1, 1), value, np.float32))
        if match.data["keep"]:
            ed.node("Conv", "channel_reduce", [x, weight], [y], kernel_shape=[1, 1])
            return True
        summed = ed.op("Conv", "channel_reduce", [x, weight], None, x.dtype, kernel_shape=[1, 1])
        shape = ed.const("channel_reduce_shape", np.array(match.data["out_shape"], np.int64))
        ed.node("Reshape", "channel_reduce_reshape", [summed, shape], [y])
        return True


@register
class ReduceToSpatial(GraphRule):
    """Rewrite ReduceSum / ReduceMean over the trailing axes of a 4-D tensor that the MLA
    rejects — the last axis alone when it is long (≥ the target's limit), or C, H and W
    together — as Reshape → the same reduction over all spatial axes → Reshape back.

    The MLA reduces spatial axes, and a long reduction only when it covers every spatial
    axis. [N, C, H, W] reduced over W is [N, C·H, 1, W] reduced over H and W: the same
    elements summed per output, in the same order, so the result is equal up to float
    summation order. MobileViTv2 sums its context vector over the tokens of a patch this way,
    and EdgeNeXt's cross-covariance attention takes L2 norms over the tokens.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "reduce-to-spatial"
    suggest_for = frozenset({"ReduceMean", "ReduceSum"})
    summary = (
        "ReduceSum/ReduceMean over the last axis (or C,H,W) of a 4-D tensor → Reshape, "
        "reduction over all spatial axes, Reshape back."
    )
    category = "replace"
    example = "surgery apply reduce-to-spatial mobilevitv2.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in [*pat.blocked("ReduceMean"), *pat.blocked("ReduceSum")]:
            site = float_reduction(pat, node)
            view = None if site is None else spatial_view(site.shape, site.axes)
            if site is None or view is None:
                continue
            probes = probe_spatial(ctx, pat.op(node), site.shape, view, site.out_shape)
            found.append(
                self.match(
                    [pat.name(node)],
                    f"{pat.op(node)} {pat.name(node)} over axes {site.axes} of "
                    f"{fmt_shape(site.shape)} → over H,W of {fmt_shape(view)}",
                    net_freed(ctx, [pat.name(node)], probes),
                    view=list(view),
                    out_shape=list(site.out_shape),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        op = node.op
        ed.detach(node)
        emit_spatial(ed, op, x, y, match.data["view"], match.data["out_shape"])
        return True


def spatial_view(shape: Sequence[int], axes: Sequence[int]) -> tuple[int, ...] | None:
    """For a reduction over the trailing axes of a 4-D tensor that is not already over exactly
    H and W (the last axis alone, or C, H and W), the 4-D view [N, kept, 1, reduced] in which
    it reduces both spatial axes; None otherwise."""
    if len(shape) != 4 or list(axes) not in ([3], [1, 2, 3]):
        return None
    first = axes[0]
    return (shape[0], int(np.prod(shape[1:first])), 1, int(np.prod(shape[first:])))


def probe_spatial(
    ctx: RuleContext,
    op: str,
    shape: Sequence[int],
    view: Sequence[int],
    out_shape: Sequence[int],
    then_sqrt: bool = False,
) -> list:
    """Placements of `emit_spatial`'s nodes: Reshape to `view`, `op` over H and W (then a
    Sqrt), Reshape to `out_shape` (each Reshape only when it changes the shape)."""
    reduced = (view[0], view[1], 1, 1)
    axes_in, axes_attr = _reduce_axes_operand(ctx, op, [2, 3])
    probes = [
        probe_node(
            ctx,
            op,
            [TensorSpec(tuple(view)), *axes_in],
            [TensorSpec(reduced)],
            {"keepdims": 1, **axes_attr},
        )
    ]
    if then_sqrt:
        probes.append(probe_node(ctx, "Sqrt", [TensorSpec(reduced)], [TensorSpec(reduced)]))
    for a, b in ((tuple(shape), tuple(view)), (reduced, tuple(out_shape))):
        if a != b:
            target = TensorSpec.const(np.array(b, np.int64))
            probes.append(probe_node(ctx, "Reshape", [TensorSpec(a), target], [TensorSpec(b)]))
    return probes


def emit_spatial(
    ed: Editor,
    op: str,
    x: gs.Tensor,
    y: gs.Tensor,
    view: Sequence[int],
    out_shape: Sequence[int],
    then: str | None = None,
) -> None:
    """y = Reshape(then(op(Reshape(x, view), axes=[2, 3], keepdims=1)), out_shape)."""
    view, out_shape = list(view), list(out_shape)
    reduced_shape = [view[0], view[1], 1, 1]
    current = x
    if x.shape is None or list(x.shape) != view:
        target = ed.const("spatial_view_shape", np.array(view, np.int64))
        current = ed.op("Reshape", "spatial_view", [x, target], view, x.dtype)
    axes_in, axes_attr = _reduce_axes_operand(ed.ctx, op, [2, 3])
    inputs = [current, *(ed.const("spatial_axes", np.asarray(a.value)) for a in axes_in)]
    chain: list[tuple[str, list | None, dict]] = [(op, inputs, {"keepdims": 1, **axes_attr})]
    if then:
        chain.append((then, None, {}))
    for k, (step_op, step_inputs, attrs) in enumerate(chain):
        ins = [current] if step_inputs is None else step_inputs
        base = f"spatial_{step_op.lower()}"
        if k == len(chain) - 1 and reduced_shape == out_shape:
            ed.node(step_op, base, ins, [y], **attrs)
            return
        current = ed.op(step_op, base, ins, reduced_shape, x.dtype, **attrs)
    target = ed.const("spatial_back_shape", np.array(out_shape, np.int64))
    ed.node("Reshape", "spatial_back", [current, target], [y])


def _reduce_axes_operand(
    ctx: RuleContext, op: str, axes: list[int]
) -> tuple[list[TensorSpec], dict]:
    """A Reduce*'s axes in the model's opset: an input (ReduceSum from opset 13, the others
    from 18) or an attribute before."""
    if model_opset(ctx) >= (13 if op == "ReduceSum" else 18):
        return [TensorSpec.const(np.array(axes, np.int64))], {}
    return [], {"axes": axes}


@register
class ChannelsLastReduceToSpatial(GraphRule):
    """Rewrite ReduceMean / ReduceSum / ReduceMax over the channel axis and one spatial axis
    of a 4-D tensor — axes [1, 2] of a channels-last [N, H, W, C] map — as Transpose (the
    kept axis to the channels, the reduced ones to H and W) → the same reduction over H and W
    → Transpose back (or a Reshape when keepdims=0).

    tf2onnx keeps a Keras model's squeeze-excite blocks in NHWC: the global pool over H and W
    is ReduceMean(axes=[1, 2]) between Transposes, which the MLA (spatial reductions only)
    rejects, splitting MobileNetV3 into a segment per block. The moved tensor reduces the same
    elements per output; merge-transposes then cancels the Transposes against tf2onnx's own.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "channels-last-reduce-to-spatial"
    suggest_for = frozenset({"ReduceMean", "ReduceSum", "ReduceMax"})
    summary = "Reduce over axes [1,2] or [1,3] of a 4-D tensor (NHWC pooling) → Transpose, reduce over H,W, Transpose back."
    category = "replace"
    example = "surgery apply channels-last-reduce-to-spatial mobilenetv3_tf.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("ReduceMean", "ReduceSum", "ReduceMax"):
            site = float_reduction(pat, node)
            move = channels_last_move(site, int(pat.attrs(node).get("keepdims", 1)))
            if site is None or move is None:
                continue
            op = pat.op(node)
            probes = probe_channels_last(ctx, op, pat.spec(site.x), pat.spec(site.y), move)
            found.append(
                self.match(
                    [pat.name(node)],
                    f"{op} {pat.name(node)} over axes {site.axes} of {fmt_shape(site.shape)} → "
                    f"over H,W of its Transpose {move.perm}",
                    net_freed(ctx, [pat.name(node)], probes),
                    move=move.as_data(),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        op = node.op
        ed.detach(node)
        emit_channels_last(ed, op, x, y, ChannelsLastMove(**match.data["move"]))
        return True


@dataclass(frozen=True)
class ChannelsLastMove:
    """A reduction over the channels and one spatial axis of a 4-D map (axes [1, 2] or [1, 3]:
    NHWC pooling) done over H and W: Transpose `perm`, reduce to `reduced`, then Transpose
    `back` (keepdims) or Reshape to `out_shape`."""

    perm: list[int]
    moved: list[int]
    reduced: list[int]
    back: list[int] | None
    out_shape: list[int]

    def as_data(self) -> dict:
        return {
            "perm": self.perm,
            "moved": self.moved,
            "reduced": self.reduced,
            "back": self.back,
            "out_shape": self.out_shape,
        }


def channels_last_move(site: Reduction | None, keep: int) -> ChannelsLastMove | None:
    """The move for a reduction over axes [1, 2] or [1, 3] of a 4-D tensor, else None."""
    if site is None or len(site.shape) != 4 or site.axes not in ([1, 2], [1, 3]):
        return None
    kept = [a for a in (1, 2, 3) if a not in site.axes]
    perm = [0, *kept, *site.axes]
    moved = [int(site.shape[a]) for a in perm]
    back = [perm.index(a) for a in range(4)] if keep else None
    return ChannelsLastMove(perm, moved, [*moved[:2], 1, 1], back, list(site.out_shape))


def probe_channels_last(
    ctx: RuleContext,
    op: str,
    x: TensorSpec,
    y: TensorSpec,
    move: ChannelsLastMove,
    then_sqrt: bool = False,
) -> list:
    """Placements of `emit_channels_last`'s nodes."""
    moved = TensorSpec(tuple(move.moved), x.elem_type)
    reduced = TensorSpec(tuple(move.reduced), x.elem_type)
    axes_in, axes_attr = _reduce_axes_operand(ctx, op, [2, 3])
    probes = [
        probe_node(ctx, "Transpose", [x], [moved], {"perm": move.perm}),
        probe_node(ctx, op, [moved, *axes_in], [reduced], {"keepdims": 1, **axes_attr}),
    ]
    if then_sqrt:
        probes.append(probe_node(ctx, "Sqrt", [reduced], [reduced]))
    if move.back is not None:
        probes.append(probe_node(ctx, "Transpose", [reduced], [y], {"perm": move.back}))
    else:
        target = TensorSpec.const(np.array(move.out_shape, np.int64))
        probes.append(probe_node(ctx, "Reshape", [reduced, target], [y]))
    return probes


def emit_channels_last(
    ed: Editor, op: str, x: gs.Tensor, y: gs.Tensor, move: ChannelsLastMove, then: str | None = None
) -> None:
    """y = back(then(op(Transpose(x, perm), axes=[2, 3], keepdims=1)))."""
    moved = ed.op("Transpose", "to_spatial", [x], move.moved, x.dtype, perm=move.perm)
    axes_in, axes_attr = _reduce_axes_operand(ed.ctx, op, [2, 3])
    inputs = [moved, *(ed.const("spatial_axes", np.asarray(a.value)) for a in axes_in)]
    reduced = ed.op(op, "spatial_reduce", inputs, move.reduced, x.dtype, keepdims=1, **axes_attr)
    if then:
        reduced = ed.op(then, f"spatial_{then.lower()}", [reduced], move.reduced, x.dtype)
    if move.back is not None:
        ed.node("Transpose", "from_spatial", [reduced], [y], perm=move.back)
    else:
        shape = ed.const("reduced_shape", np.array(move.out_shape, np.int64))
        ed.node("Reshape", "reduced_view", [reduced, shape], [y])
