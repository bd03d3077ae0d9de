"""Elementwise arithmetic in the cheapest exact form: sub-div-to-add-mul, pow2-to-mul."""

from __future__ import annotations

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.graph_edit import bypass_node
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    close,
    constant_array,
    net_freed,
    probe_node,
)

_MAX_CONSTANT = 1 << 22


@register
class SubDivToAddMul(GraphRule):
    """Rewrite Sub(x, c) as Add(x, −c) and Div(x, c) as Mul(x, 1/c) for a constant c.

    Add and Mul are what an int8 accelerator computes natively (a division by a constant is a
    multiply by its reciprocal after quantization anyway), and canonical Add/Mul chains are what
    later rules and the compiler's fusions match. −c is exact; 1/c is computed in float64 and
    rounded once, so x·(1/c) differs from x/c by at most about one ulp — float rounding, within
    the exact tolerance. Divisors containing 0 and integer tensors (integer division) are left
    alone.
    """

    name = "sub-div-to-add-mul"
    suggest_for = frozenset({"Sub", "Div"})
    summary = "Sub/Div by a constant → Add/Mul by its negation/reciprocal."
    category = "replace"
    example = "surgery apply sub-div-to-add-mul yolov8n.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.nodes("Sub", "Div"):
            x, c = pat.ins(node)[:2]
            if pat.is_const(x) or not pat.is_const(c) or not pat.is_float(x):
                continue
            op = pat.op(node)
            if op == "Div":
                value = constant_array(ctx, c, _MAX_CONSTANT)
                if value is None or not np.all(value != 0):
                    continue
            new = "Add" if op == "Sub" else "Mul"
            probe = probe_node(ctx, new, [pat.spec(x), pat.spec(c)], [pat.spec(pat.outs(node)[0])])
            found.append(
                self.match(
                    [pat.name(node)],
                    f"{op} {pat.name(node)} by a constant → {new}",
                    net_freed(ctx, [pat.name(node)], [probe]),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        c = ed.value(node.inputs[1])
        if c is None:
            return False
        c = np.asarray(c)
        wide = c.astype(np.float64)
        value = -wide if node.op == "Sub" else 1.0 / wide
        node.inputs[1] = ed.const(
            "negated" if node.op == "Sub" else "reciprocal", value.astype(c.dtype)
        )
        node.op = "Add" if node.op == "Sub" else "Mul"
        return True


_POWERS: dict[float, str] = {
    1.0: "removed",
    2.0: "x·x",
    3.0: "x·x·x",
    4.0: "(x·x)·(x·x)",
    0.5: "Sqrt(x)",
    -1.0: "Reciprocal(x)",
    -0.5: "Reciprocal(Sqrt(x))",
}


def _chain(exponent: float) -> list[str]:
    """The ops the replacement of x**exponent uses (for placement probes)."""
    return {
        1.0: [],
        2.0: ["Mul"],
        3.0: ["Mul", "Mul"],
        4.0: ["Mul", "Mul"],
        0.5: ["Sqrt"],
        -1.0: ["Reciprocal"],
        -0.5: ["Sqrt", "Reciprocal"],
    }[exponent]


@register
class Pow2ToMul(GraphRule):
    """Rewrite Pow with a small constant exponent as plain arithmetic.

    x**2 → x·x, x**3 → x·x·x, x**4 → (x·x)², x**0.5 → Sqrt, x**-1 → Reciprocal,
    x**-0.5 → Reciprocal(Sqrt), x**1 → removed. Accelerators take Mul/Sqrt/Reciprocal where a
    general Pow needs a lookup table, or not at all. Results match to float rounding (powf and
    repeated multiplication differ by an ulp or two). Only scalar exponents that do not change
    the output shape by broadcasting.
    """

    name = "pow2-to-mul"
    suggest_for = frozenset({"Pow"})
    summary = "Pow(x, 2|3|4|0.5|-1|-0.5|1) → Mul / Sqrt / Reciprocal (or nothing)."
    category = "replace"
    example = "surgery apply pow2-to-mul yolov5n_anchor.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.nodes("Pow"):
            x, e = pat.ins(node)[:2]
            y = pat.outs(node)[0]
            exponent = pat.scalar(e)
            power = next((p for p in _POWERS if exponent is not None and close(exponent, p)), None)
            if power is None or not pat.is_float(x) or pat.is_const(x):
                continue
            xt, yt = pat.view.tensor(x), pat.view.tensor(y)
            if xt.shape is None or xt.shape != yt.shape:
                continue
            spec = pat.spec(x)
            probes = [
                probe_node(ctx, op, [spec, spec] if op == "Mul" else [spec], [spec])
                for op in _chain(power)
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Pow {pat.name(node)} (exponent {power:g}) → {_POWERS[power]}",
                    net_freed(ctx, [pat.name(node)], probes),
                    power=power,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        power = match.data["power"]
        if power == 1.0:
            bypass_node(ed.graph, node)
            return True
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        shape, dtype = x.shape, x.dtype
        if power in (2.0, 3.0, 4.0):
            square = ed.op("Mul", "square", [x, x], shape, dtype) if power != 2.0 else None
            if power == 2.0:
                ed.node("Mul", "square", [x, x], [y])
            elif power == 3.0:
                ed.node("Mul", "cube", [square, x], [y])
            else:
                ed.node("Mul", "fourth", [square, square], [y])
            return True
        if power == 0.5:
            ed.node("Sqrt", "sqrt", [x], [y])
        elif power == -1.0:
            ed.node("Reciprocal", "reciprocal", [x], [y])
        else:
            root = ed.op("Sqrt", "sqrt", [x], shape, dtype)
            ed.node("Reciprocal", "reciprocal", [root], [y])
        return True
