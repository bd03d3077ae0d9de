"""Elementwise arithmetic in the cheapest exact form: sub-div-to-add-mul, neg-to-mul,
pow2-to-mul, where-to-mask-arith."""

from __future__ import annotations

import numpy as np
from onnx import helper

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.graph_edit import bypass_node
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
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
    keeps_ranks = True
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
            new, name = ("Add" if op == "Sub" else "Mul"), pat.name(node)
            freed: list[str] = []
            if name in ctx.blocker_names:  # the probe only matters for a blocker
                out = pat.spec(pat.outs(node)[0])
                probe = probe_node(ctx, new, [pat.spec(x), pat.spec(c)], [out])
                freed = net_freed(ctx, [name], [probe])
            found.append(self.match([name], f"{op} {name} by a constant → {new}", freed))
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


@register
class NegToMul(GraphRule):
    """Rewrite Neg(x) as Mul(x, −1) where the target keeps Neg off its MLA.

    Negation is exact either way. SiMa-style MLAs multiply but have no Neg, and a Neg in the
    middle of a block splits it: rotary position embeddings negate half of every query and key
    (rotate_half in Llama, Qwen, Mistral, GPT-NeoX, RoFormer), so each attention layer would
    otherwise cost an MLA segment.
    """

    name = "neg-to-mul"
    keeps_ranks = True
    suggest_for = frozenset({"Neg"})
    summary = "Neg(x) → Mul(x, −1)."
    category = "replace"
    example = "surgery apply neg-to-mul llama.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Neg"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            if pat.is_const(x) or not pat.is_float(x):
                continue
            dtype = helper.tensor_dtype_to_np_dtype(pat.elem_type(x))
            minus_one = TensorSpec.const(np.array(-1, dtype=dtype))
            probe = probe_node(ctx, "Mul", [pat.spec(x), minus_one], [pat.spec(y)])
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Neg {pat.name(node)} → Mul by −1",
                    net_freed(ctx, [pat.name(node)], [probe]),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x = node.inputs[0]
        dtype = np.dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)
        node.op = "Mul"
        node.inputs = [x, ed.const("minus_one", np.array(-1, dtype=dtype))]
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


@register
class WhereToMaskArith(GraphRule):
    """Rewrite Where(cond, c, x) with a constant scalar c as x·keep + fill, where
    keep = 1 − Cast(cond) and fill = c·Cast(cond) (mirrored for Where(cond, x, c)).

    This is torch's `masked_fill` (DistilBERT, HF attention masks, Longformer, T5 padding): the
    scores between two MLA MatMuls pass through a Where the MLA cannot run, which cuts the
    attention in two segments. After the rewrite the mask arithmetic (Cast, Sub, Mul of the
    condition) depends only on the condition — usually a model input — and runs as a host
    pre-stage, while the Mul and Add on the scores run on the MLA. It is exact for finite x and
    c: x·1 + c·0 = x and x·0 + c·1 = c in float arithmetic. Only Wheres the target blocks,
    with a finite constant scalar branch, a float tensor branch and a non-constant condition.
    """

    name = "where-to-mask-arith"
    suggest_for = frozenset({"Where"})
    summary = "Where(cond, c, x) with a constant c (masked_fill) → x·(1−cond) + c·cond."
    category = "replace"
    example = "surgery apply where-to-mask-arith distilbert.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Where"):
            cond, a, b = pat.ins(node)[:3]
            filled = 1 if pat.is_const(a) else 2 if pat.is_const(b) else 0
            if not filled or pat.is_const(cond) or (pat.is_const(a) and pat.is_const(b)):
                continue
            fill, x = (a, b) if filled == 1 else (b, a)
            c = pat.scalar(fill)
            out = pat.outs(node)[0]
            shape, mask_shape = pat.shape(out), pat.shape(cond)
            if c is None or not np.isfinite(c) or not pat.is_float(x) or not pat.is_float(fill):
                continue
            if shape is None or mask_shape is None:
                continue
            mask = TensorSpec(mask_shape)
            probes = [
                probe_node(ctx, "Mul", [pat.spec(x), mask], [TensorSpec(shape)]),
                probe_node(ctx, "Add", [TensorSpec(shape), mask], [TensorSpec(shape)]),
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Where {pat.name(node)} filling {c:g} → x·keep + fill on the MLA",
                    net_freed(ctx, [pat.name(node)], probes),
                    fill_first=filled == 1,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        cond, a, b = node.inputs[:3]
        fill, x = (a, b) if match.data["fill_first"] else (b, a)
        value = ed.value(fill, fill.name)
        if value is None:
            return False
        y = node.outputs[0]
        ed.detach(node)
        dtype = np.asarray(value).dtype
        hit = ed.op(
            "Cast", "mask", [cond], cond.shape, dtype, to=helper.np_dtype_to_tensor_dtype(dtype)
        )
        miss = ed.op(
            "Sub", "mask_not", [ed.const("one", np.ones((), dtype)), hit], cond.shape, dtype
        )
        keep, put = (miss, hit) if match.data["fill_first"] else (hit, miss)
        scalar = ed.const("fill", np.asarray(value, dtype).reshape(()))
        filled = ed.op("Mul", "mask_fill", [put, scalar], cond.shape, dtype)
        kept = ed.op("Mul", "masked", [x, keep], y.shape, dtype)
        ed.node("Add", "mask_filled", [kept, filled], [y])
        return True
