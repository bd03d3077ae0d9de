"""reshape-to-flatten: a Reshape to [rows, columns] that is a Flatten, written as one."""

from __future__ import annotations

import math

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    fmt_shape,
    net_freed,
    probe_node,
)


def flatten_axis(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> int | None:
    """The axis k with out_shape == [prod(shape[:k]), prod(shape[k:])], or None; k = 0 (all
    axes in the columns) only when no k >= 1 fits (a [1, 8, 4, 4] map flattens at axis 1)."""
    if len(out_shape) != 2:
        return None
    for k in (*range(1, len(shape) + 1), 0):
        if (math.prod(shape[:k]), math.prod(shape[k:])) == tuple(out_shape):
            return k
    return None


@register
class ReshapeToFlatten(GraphRule):
    """Rewrite a Reshape to a matrix [rows, columns] whose rows are the leading axes of its
    input and columns the trailing ones as Flatten(axis=k), which it is.

    `x.view(x.size(0), -1)` before a classifier's Linear exports as a Reshape; a target whose
    MLA runs Flatten and a 2-D Gemm but no Reshape to rank 2 (rk3588) otherwise puts that
    Reshape on the host and the Gemm after it in an MLA segment of its own. Same elements in
    the same order, so the result is bit-exact.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "reshape-to-flatten"
    suggest_for = frozenset({"Reshape"})
    summary = "Reshape to [prod(x[:k]), prod(x[k:])] → Flatten(axis=k)."
    category = "replace"
    example = "surgery apply reshape-to-flatten crnn.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Reshape"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            shape, out_shape = pat.shape(x), pat.shape(y)
            if shape is None or out_shape is None:
                continue
            axis = flatten_axis(shape, out_shape)
            if axis is None:
                continue
            probe = probe_node(ctx, "Flatten", [pat.spec(x)], [pat.spec(y)], {"axis": axis})
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Reshape {pat.name(node)} {fmt_shape(shape)} → {fmt_shape(out_shape)} "
                    f"is Flatten(axis={axis})",
                    net_freed(ctx, [pat.name(node)], [probe]),
                    axis=axis,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        return ed.replace_op(match.nodes[0], "Flatten", "flatten", axis=match.data["axis"])
