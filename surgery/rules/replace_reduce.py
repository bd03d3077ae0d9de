"""Reductions and normalisations in the MLA's form: reducemean-to-gap, reducemin-to-reducemax,
softmax-to-channel. Each is an identity of the math, so all three are exact."""

from __future__ import annotations

import numpy as np

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
    reduce_axes,
)


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
