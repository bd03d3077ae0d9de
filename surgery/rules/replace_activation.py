"""Activation functions spelled out by exporters, folded back into the single op the MLA has:
normalise-activations."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    OpsetGraphRule,
    Pattern,
    TensorSpec,
    close,
    conversion_note,
    freed_blockers,
    model_opset,
    net_freed,
    opset_upgrade_error,
    probe_node,
)

SIXTH = 1.0 / 6.0
_OPSET = {"HardSwish": 14, "Swish": 24, "HardSigmoid": 6, "Relu": 6, "Clip": 6}
_PATTERN_EDGES = 3
"""The longest path from an anchor back through its pattern: (x·Clip(x+3, 0, 6))/6 is
Div ← Mul ← Clip ← Add. A new matcher that reaches further must raise it."""


@dataclass
class Activation:
    """One spelled-out activation: the op it becomes, its input and output, the nodes it
    replaces (by name) and the new op's attributes."""

    op: str
    x: str
    y: str
    nodes: list[str]
    attrs: dict
    form: str

    def to_data(self) -> dict:
        """The fields as plain data for `Match.data` (what `dataclasses.asdict` gives, cheaper:
        `find` builds one per match on every `surgery check`)."""
        return {
            "op": self.op,
            "x": self.x,
            "y": self.y,
            "nodes": list(self.nodes),
            "attrs": dict(self.attrs),
            "form": self.form,
        }


def clip_bounds(pat: Pattern, node: int) -> tuple[float, float] | None:
    """(min, max) of a Clip with constant bounds (attributes before opset 11, inputs after)."""
    ins = pat.ins(node)
    if model_opset(pat.ctx) < 11:
        attrs = pat.attrs(node)
        return float(attrs.get("min", -math.inf)), float(attrs.get("max", math.inf))
    bounds = []
    for k, default in ((1, -math.inf), (2, math.inf)):
        if len(ins) > k and ins[k]:
            value = pat.scalar(ins[k])
            if value is None:
                return None
            bounds.append(value)
        else:
            bounds.append(default)
    return bounds[0], bounds[1]


class _Finder:
    """The structural matchers, sharing one Pattern and the set of nodes already claimed."""

    def __init__(self, pat: Pattern) -> None:
        self.pat = pat
        self.used: set[int] = set()

    def scalar_is(self, tensor: str, value: float) -> bool:
        s = self.pat.scalar(tensor)
        return s is not None and close(s, value)

    def private_from(self, tensor: str, *ops: str) -> int | None:
        """The producer of `tensor` (one of `ops`) when nothing else reads the tensor."""
        pat = self.pat
        idx = pat.producer(tensor, *ops)
        if idx is None or not pat.private(tensor) or idx in self.used:
            return None
        return idx

    def relu6_of_x_plus_3(self, tensor: str) -> tuple[str, list[int]] | None:
        """tensor = Clip(x + 3, 0, 6) → (x, [add, clip])."""
        pat = self.pat
        clip = self.private_from(tensor, "Clip")
        if clip is None or clip_bounds(pat, clip) != (0.0, 6.0):
            return None
        add = self.private_from(pat.ins(clip)[0], "Add")
        if add is None:
            return None
        a, b = pat.ins(add)[:2]
        for x, three in ((a, b), (b, a)):
            if self.scalar_is(three, 3.0) and not pat.is_const(x):
                return x, [add, clip]
        return None

    def divided_by_six(self, node: int) -> str | None:
        """For Div(t, 6) or Mul(t, 1/6): the tensor t."""
        pat = self.pat
        a, b = pat.ins(node)[:2]
        if pat.op(node) == "Div":
            return a if self.scalar_is(b, 6.0) else None
        if pat.op(node) == "Mul":
            for t, c in ((a, b), (b, a)):
                if self.scalar_is(c, SIXTH):
                    return t
        return None

    def hard_sigmoid_of(self, tensor: str) -> tuple[str, list[int]] | None:
        """tensor = HardSigmoid(x; 1/6, 1/2) or Clip(x + 3, 0, 6)/6 → (x, nodes)."""
        pat = self.pat
        hs = self.private_from(tensor, "HardSigmoid")
        if hs is not None:
            attrs = pat.attrs(hs)
            if close(attrs.get("alpha", 0.2), SIXTH) and close(attrs.get("beta", 0.5), 0.5):
                return pat.ins(hs)[0], [hs]
            return None
        div = self.private_from(tensor, "Div", "Mul")
        t = self.divided_by_six(div) if div is not None else None
        core = self.relu6_of_x_plus_3(t) if t is not None else None
        return (core[0], [*core[1], div]) if core else None  # type: ignore[list-item]

    def hard_swish(self, node: int) -> Activation | None:
        """x·HardSigmoid(x), x·Clip(x+3,0,6)/6 or (x·Clip(x+3,0,6))/6 → HardSwish(x)."""
        pat = self.pat
        y = pat.outs(node)[0]
        if pat.op(node) == "Mul":
            a, b = pat.ins(node)[:2]
            for x, h in ((a, b), (b, a)):
                found = self.hard_sigmoid_of(h)
                if found and found[0] == x:
                    return self._act("HardSwish", x, y, [*found[1], node], {}, "x·hardsigmoid(x)")
        t = self.divided_by_six(node)
        mul = self.private_from(t, "Mul") if t is not None else None
        if mul is None:
            return None
        a, b = pat.ins(mul)[:2]
        for x, c in ((a, b), (b, a)):
            core = self.relu6_of_x_plus_3(c)
            if core and core[0] == x:
                return self._act("HardSwish", x, y, [*core[1], mul, node], {}, "x·relu6(x+3)/6")
        return None

    def hard_sigmoid(self, node: int) -> Activation | None:
        """Clip(x+3, 0, 6)/6 → HardSigmoid(x; alpha=1/6, beta=0.5)."""
        t = self.divided_by_six(node)
        core = self.relu6_of_x_plus_3(t) if t is not None else None
        if core is None:
            return None
        attrs = {"alpha": SIXTH, "beta": 0.5}
        y = self.pat.outs(node)[0]
        return self._act("HardSigmoid", core[0], y, [*core[1], node], attrs, "relu6(x+3)/6")

    def swish(self, node: int) -> Activation | None:
        """x·Sigmoid(x) → Swish(x)."""
        pat = self.pat
        a, b = pat.ins(node)[:2]
        for x, s in ((a, b), (b, a)):
            sig = self.private_from(s, "Sigmoid")
            if sig is not None and pat.ins(sig)[0] == x:
                return self._act("Swish", x, pat.outs(node)[0], [sig, node], {}, "x·sigmoid(x)")
        return None

    def min_max(self, node: int) -> Activation | None:
        """Max(x, a) / Min(x, b) / Min(Max(x, a), b) with constant a ≤ b → Relu or Clip."""
        pat = self.pat
        bound = self._bound(node)
        if bound is None:
            return None
        x, value = bound
        lo, hi = (value, math.inf) if pat.op(node) == "Max" else (-math.inf, value)
        nodes = [node]
        inner = self.private_from(x, "Min" if pat.op(node) == "Max" else "Max")
        inner_bound = self._bound(inner) if inner is not None else None
        if inner_bound is not None:
            x, value = inner_bound
            lo, hi = (lo, value) if pat.op(node) == "Max" else (value, hi)
            nodes.insert(0, inner)  # type: ignore[arg-type]
            if lo > hi:
                return None
        y = pat.outs(node)[0]
        if lo == 0.0 and hi == math.inf:
            return self._act("Relu", x, y, nodes, {}, "max(x, 0)")
        return self._act("Clip", x, y, nodes, {"min": lo, "max": hi}, "min/max with constants")

    def _bound(self, node: int) -> tuple[str, float] | None:
        pat = self.pat
        ins = pat.ins(node)
        if len(ins) != 2:
            return None
        for x, c in ((ins[0], ins[1]), (ins[1], ins[0])):
            value = pat.scalar(c)
            if value is not None and not pat.is_const(x) and pat.is_float(x):
                xt, yt = pat.view.tensor(x), pat.view.tensor(pat.outs(node)[0])
                if xt.shape is not None and xt.shape == yt.shape:
                    return x, value
        return None

    def _act(self, op: str, x: str, y: str, nodes: list[int], attrs: dict, form: str):
        self.used.update(nodes)
        names = [self.pat.name(n) for n in nodes]
        return Activation(op, x, y, names, attrs, form)


@register
class NormaliseActivations(OpsetGraphRule):
    """Fold activations that exporters spell out with arithmetic back into one op:

    - x·HardSigmoid(x) (alpha 1/6, beta 1/2), x·Clip(x+3, 0, 6)/6 and (x·Clip(x+3, 0, 6))/6
      (Paddle's hardswish) → HardSwish (opset ≥ 14);
    - Clip(x+3, 0, 6)/6 (Paddle's hardsigmoid) → HardSigmoid(alpha=1/6, beta=1/2);
    - x·Sigmoid(x) → Swish (opset ≥ 24), only when the target runs Swish on its MLA;
    - Max(x, 0) → Relu; Max/Min with constant bounds (Relu6 as Min(Max(x, 0), 6)) → Clip.

    One op instead of three or four means one lookup table or fused activation on the MLA and
    fewer int8 requantisations. The forms are the same function, so results match to float
    rounding. When a new op needs a newer opset, the model is converted (ONNX version
    converter + checker) or that form is skipped.
    """

    name = "normalise-activations"
    keeps_ranks = True
    suggest_for = frozenset({"Add", "Clip", "Div", "Mul", "HardSigmoid", "Sigmoid", "Max", "Min"})
    summary = "Spelled-out HardSwish/HardSigmoid/Swish/Relu6 patterns → the single activation op."
    category = "replace"
    example = "surgery apply normalise-activations ppocrv4_det.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        finder = _Finder(pat)
        found: list[Activation] = []
        passes = (
            ("HardSwish", ("Mul", "Div"), _Finder.hard_swish),
            ("HardSigmoid", ("Mul", "Div"), _Finder.hard_sigmoid),
            ("Swish", ("Mul",), _Finder.swish),
            ("Clip", ("Max", "Min"), _Finder.min_max),
        )
        near = ctx.near_focus(3 * _PATTERN_EDGES)
        for op, ops, matcher in passes:
            nodes = pat.nodes(*ops)
            if near is not None:
                nodes = [node for node in nodes if node in near]
            if not nodes or not self._allowed(ctx, pat, op, nodes, matcher):
                continue
            if op == "Clip":
                nodes.reverse()  # outer Min/Max first, so Min(Max(x, 0), 6) is one Clip
            for node in nodes:
                if node not in finder.used and (act := matcher(finder, node)) is not None:
                    found.append(act)
        return [self._match(ctx, pat, act) for act in found]

    @staticmethod
    def _allowed(ctx: RuleContext, pat: Pattern, op: str, nodes: list[int], matcher) -> bool:
        """Whether `op` may be emitted: the target runs it on the MLA (Swish) and the model
        converts to the op's opset. The conversion is only tried when the pattern occurs at
        one of `nodes` (the candidates the pass will match)."""
        if op == "Swish" and not ctx.target.supports("Swish", "MLA"):
            return False
        if model_opset(ctx) >= _OPSET[op]:
            return True
        probe = _Finder(pat)
        if not any(matcher(probe, n) is not None for n in nodes):
            return False
        return opset_upgrade_error(ctx, _OPSET[op]) is None

    def _match(self, ctx: RuleContext, pat: Pattern, act: Activation) -> Match:
        op = act.op
        opset = max(model_opset(ctx), _OPSET[op])
        return self.match(
            act.nodes,
            f"{act.form} → {op} ({len(act.nodes)} node(s) → 1){conversion_note(ctx, opset)}",
            self._freed(ctx, pat, act, opset),
            act=act.to_data(),
            opset=opset,
        )

    @staticmethod
    def _freed(ctx: RuleContext, pat: Pattern, act: Activation, opset: int) -> list[str]:
        """The blockers the activation frees. The placement probe is only built when one of
        its nodes is a blocker: most matched activations already run on the MLA, and without
        a blocker among them `net_freed` is empty whatever the probe says."""
        if not freed_blockers(ctx, act.nodes):
            return []
        x = pat.spec(act.x)
        if act.op == "Clip":
            bounds = [TensorSpec.const(np.array(act.attrs[k], np.float32)) for k in ("min", "max")]
            probe = probe_node(ctx, "Clip", [x, *bounds], [x], opset=max(opset, 11))
        else:
            attrs = act.attrs or ({"alpha": 1.0} if act.op == "Swish" else {})
            probe = probe_node(ctx, act.op, [x], [x], attrs, opset=opset)
        return net_freed(ctx, act.nodes, [probe])

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        act = Activation(**match.data["act"])
        x, y = ed.tensor(act.x), ed.tensor(act.y)
        ed.detach(*(n for n in (ed.node_named(name) for name in act.nodes) if n is not None))
        if act.op == "Clip":
            _add_clip(ed, x, y, act.attrs["min"], act.attrs["max"])
        elif act.op == "Swish":
            ed.node("Swish", "swish", [x], [y], alpha=1.0)
        else:
            ed.node(act.op, act.op.lower(), [x], [y], **act.attrs)
        return True


def _add_clip(ed: Editor, x: gs.Tensor, y: gs.Tensor, lo: float, hi: float) -> None:
    """A Clip in the model's opset form: attributes before 11, optional constant inputs after."""
    if ed.graph.opset < 11:
        attrs = {k: v for k, v in (("min", lo), ("max", hi)) if math.isfinite(v)}
        ed.node("Clip", "clip", [x], [y], **attrs)
        return
    dtype = x.dtype or np.float32
    bounds = [
        ed.const(f"clip_{k}", np.array(v, dtype)) if math.isfinite(v) else gs.Variable.empty()
        for k, v in (("min", lo), ("max", hi))
    ]
    ed.node("Clip", "clip", [x, *bounds], [y])
