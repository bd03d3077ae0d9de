"""lrn-to-conv: local response normalization written with ops an MLA without LRN runs."""

from __future__ import annotations

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
)

_ROOTS = {1.0: 0, 0.5: 1, 0.75: 2}
"""beta → how the denominator d**beta is written: d itself, Sqrt(d), Sqrt(d)·Sqrt(Sqrt(d))."""


def lrn_window(
    channels: int, size: int, alpha: float, bias: float
) -> tuple[np.ndarray, np.ndarray]:
    """The 1×1 Conv (weight [C, C, 1, 1], bias [C]) that maps x² to LRN's base
    bias + alpha/size · Σ x[c']² over ONNX's window c' ∈ [c − ⌊(size−1)/2⌋, c + ⌈(size−1)/2⌉]."""
    weight = np.zeros((channels, channels, 1, 1), np.float32)
    below, above = (size - 1) // 2, -(-(size - 1) // 2)
    for c in range(channels):
        weight[c, max(0, c - below) : min(channels, c + above + 1)] = alpha / size
    return weight, np.full(channels, bias, np.float32)


@register
class LrnToConv(GraphRule):
    """Rewrite LRN (AlexNet, GoogLeNet, Inception v1, ZFNet) as x / d**beta with
    d = Conv1×1(x·x) — the window sum of squares as a band of weights alpha/size, `bias` as
    the conv's bias — and d**beta as d, Sqrt(d) or Sqrt(d)·Sqrt(Sqrt(d)) for beta 1, 0.5 and
    0.75 (the value every one of those networks uses).

    An MLA without LRN (rk3588's table) runs Mul, Conv, Sqrt and Div; the LRN otherwise runs
    on the CPU between two MLA segments. The same function to float rounding (the window sum
    in another order, the power as square roots). Other betas are left alone. Only nodes the
    target keeps off its MLA are matched.
    """

    name = "lrn-to-conv"
    suggest_for = frozenset({"LRN"})
    summary = "LRN → x / (Conv1×1(x²) + bias)^beta with beta 0.5/0.75/1 as square roots."
    category = "replace"
    example = "surgery apply lrn-to-conv googlenet.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("LRN"):
            x = pat.ins(node)[0]
            shape = pat.shape(x)
            attrs = pat.attrs(node)
            beta = float(attrs.get("beta", 0.75))
            if shape is None or len(shape) != 4 or not pat.is_float(x) or pat.is_const(x):
                continue
            if beta not in _ROOTS or "size" not in attrs:
                continue
            spec = pat.spec(x)
            size, alpha = int(attrs["size"]), float(attrs.get("alpha", 1e-4))
            weight, bias = lrn_window(shape[1], size, alpha, float(attrs.get("bias", 1.0)))
            probes = [
                probe_node(ctx, "Mul", [spec, spec], [spec]),
                probe_node(
                    ctx, "Conv", [spec, TensorSpec.const(weight), TensorSpec.const(bias)], [spec]
                ),
                probe_node(ctx, "Div", [spec, spec], [spec]),
            ]
            if _ROOTS[beta]:
                probes.append(probe_node(ctx, "Sqrt", [spec], [spec]))
            if _ROOTS[beta] == 2:
                probes.append(probe_node(ctx, "Mul", [spec, spec], [spec]))
            name = pat.name(node)
            found.append(
                self.match(
                    [name],
                    f"LRN {name} (size {size}, beta {beta}) → Mul, 1×1 Conv, "
                    + ("Div" if not _ROOTS[beta] else "Sqrt, Div"),
                    net_freed(ctx, [name], probes),
                    channels=shape[1],
                    size=size,
                    alpha=alpha,
                    bias=float(bias[0]),
                    roots=_ROOTS[beta],
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        lrn = ed.node_named(match.nodes[0])
        assert lrn is not None
        x, y = lrn.inputs[0], lrn.outputs[0]
        ed.detach(lrn)
        d = match.data
        weight, bias = lrn_window(d["channels"], d["size"], d["alpha"], d["bias"])
        squared = ed.op("Mul", "lrn_square", [x, x], x.shape, x.dtype)
        conv = [squared, ed.const("lrn_window", weight), ed.const("lrn_bias", bias)]
        base = ed.op("Conv", "lrn_sum", conv, x.shape, x.dtype, kernel_shape=[1, 1])
        denominator = base
        if d["roots"]:
            denominator = ed.op("Sqrt", "lrn_sqrt", [base], x.shape, x.dtype)
        if d["roots"] == 2:
            fourth = ed.op("Sqrt", "lrn_fourth_root", [denominator], x.shape, x.dtype)
            denominator = ed.op("Mul", "lrn_power", [denominator, fourth], x.shape, x.dtype)
        ed.node("Div", "lrn_normalise", [x, denominator], [y])
        return True
