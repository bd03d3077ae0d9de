"""GELU: the exported erf form as one Gelu op (exact), and two approximations for targets that
have no erf (gelu-to-tanh, gelu-to-quickgelu)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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
    model_opset,
    net_freed,
    opset_upgrade_error,
    probe_node,
)
from surgery.targets import Reason

GELU_OPSET = 20
SWISH_OPSET = 24
SQRT2 = math.sqrt(2.0)
TANH_SCALE = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715
QUICK_ALPHA = 1.702


@dataclass
class GeluSite:
    """One GELU in the graph: its input and output and the nodes that compute it."""

    x: str
    y: str
    nodes: list[str]
    form: str


class _ErfGelu:
    """Matches x·0.5·(1 + erf(x/√2)) in the association orders exporters produce."""

    def __init__(self, pat: Pattern) -> None:
        self.pat = pat

    def scalar_is(self, tensor: str | None, value: float) -> bool:
        s = self.pat.scalar(tensor) if tensor else None
        return s is not None and close(s, value)

    def sites(self) -> list[GeluSite]:
        pat = self.pat
        found = []
        for erf in pat.nodes("Erf"):
            site = self._from_erf(erf)
            if site is not None:
                x, y, nodes = site
                found.append(GeluSite(x, y, [pat.name(n) for n in nodes], "erf"))
        return found

    def _scaled_input(self, erf: int) -> tuple[str, int] | None:
        """erf's input is x/√2 or x·(1/√2): (x, that node)."""
        pat = self.pat
        t = pat.ins(erf)[0]
        node = pat.producer(t, "Div", "Mul")
        if node is None or not pat.private(t):
            return None
        a, b = pat.ins(node)[:2]
        if pat.op(node) == "Div":
            return (a, node) if self.scalar_is(b, SQRT2) and not pat.is_const(a) else None
        for x, c in ((a, b), (b, a)):
            if self.scalar_is(c, 1.0 / SQRT2) and not pat.is_const(x):
                return x, node
        return None

    def _from_erf(self, erf: int) -> tuple[str, str, list[int]] | None:
        pat = self.pat
        scaled = self._scaled_input(erf)
        if scaled is None:
            return None
        x, div = scaled
        add = pat.sole_consumer(pat.outs(erf)[0], "Add")
        if add is None or not self.scalar_is(pat.other_input(add, pat.outs(erf)[0]), 1.0):
            return None
        a = pat.outs(add)[0]
        m1 = pat.sole_consumer(a, "Mul")
        if m1 is None:
            return None
        o1 = pat.other_input(m1, a)
        head = [div, erf, add, m1]
        if o1 == x:  # (x·(1+erf))·0.5 or /2
            p = pat.outs(m1)[0]
            m2 = pat.sole_consumer(p, "Mul", "Div")
            other = pat.other_input(m2, p) if m2 is not None else None
            half = 2.0 if m2 is not None and pat.op(m2) == "Div" else 0.5
            if m2 is not None and self.scalar_is(other, half):
                return x, pat.outs(m2)[0], [*head, m2]
            return None
        if self.scalar_is(o1, 0.5):  # x·((1+erf)·0.5)
            h = pat.outs(m1)[0]
            m2 = pat.sole_consumer(h, "Mul")
            if m2 is not None and pat.other_input(m2, h) == x:
                return x, pat.outs(m2)[0], [*head, m2]
            return None
        hx = pat.producer(o1, "Mul") if o1 else None  # (x·0.5)·(1+erf)
        if hx is not None and pat.private(o1):  # type: ignore[arg-type]
            other = pat.other_input(hx, x)
            if x in pat.ins(hx) and self.scalar_is(other, 0.5):
                return x, pat.outs(m1)[0], [hx, *head]
        return None


def gelu_nodes(pat: Pattern, approximations: tuple[str, ...]) -> list[GeluSite]:
    """Gelu ops whose `approximate` attribute is one of `approximations`."""
    found = []
    for node in pat.nodes("Gelu"):
        approx = pat.attrs(node).get("approximate", "none")
        if approx in approximations:
            site = GeluSite(
                pat.ins(node)[0], pat.outs(node)[0], [pat.name(node)], f"Gelu({approx})"
            )
            found.append(site)
    return found


class _GeluRule(OpsetGraphRule):
    """Shared plumbing: sites → matches with a replacement plan; opset upgrade before edits."""

    def _site_match(
        self, ctx: RuleContext, site: GeluSite, plan: str, opset: int, probes: list
    ) -> Match:
        return self.match(
            site.nodes,
            f"GELU ({site.form}, {len(site.nodes)} node(s)) at {site.nodes[-1]} → {plan}"
            + conversion_note(ctx, opset),
            net_freed(ctx, site.nodes, probes),
            site=asdict(site),
            plan=plan,
            opset=opset,
        )

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        site = GeluSite(**match.data["site"])
        x, y = ed.tensor(site.x), ed.tensor(site.y)
        ed.detach(*(n for n in (ed.node_named(name) for name in site.nodes) if n is not None))
        self.build(ed, x, y, match.data["plan"])
        return True

    def build(self, ed: Editor, x: gs.Tensor, y: gs.Tensor, plan: str) -> None:
        raise NotImplementedError


@register
class ErfGeluToGelu(_GeluRule):
    """Fold the exported erf form of GELU, x·0.5·(1 + erf(x/√2)) in any of its association
    orders (and with x·(1/√2) or a division by 2), into one Gelu(approximate="none").

    Five or six elementwise nodes become one, which the MLA evaluates as a single lookup table
    instead of quantising every intermediate. Same function: exact to float rounding. Gelu
    exists from opset 20; an older model is converted (ONNX version converter, then the full
    checker; ONNX Runtime then runs the verification) or the rule does not apply.
    """

    name = "erf-gelu-to-gelu"
    keeps_ranks = True
    summary = "x·0.5·(1+erf(x/√2)) (any exported variant) → Gelu (opset ≥ 20)."
    category = "replace"
    example = "surgery apply erf-gelu-to-gelu vit_tiny_patch16_224.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        sites = _ErfGelu(pat).sites()
        if not sites or opset_upgrade_error(ctx, GELU_OPSET) is not None:
            return []
        opset = max(model_opset(ctx), GELU_OPSET)
        found = []
        for site in sites:
            spec = pat.spec(site.x)
            probe = probe_node(ctx, "Gelu", [spec], [spec], opset=opset)
            found.append(self._site_match(ctx, site, "Gelu", opset, [probe]))
        return found

    def build(self, ed: Editor, x: gs.Tensor, y: gs.Tensor, plan: str) -> None:
        ed.node("Gelu", "gelu", [x], [y])


def _tanh_formula_probes(ctx: RuleContext, spec: TensorSpec) -> list[Reason | None]:
    scalar = TensorSpec.const(np.array(1.0, np.float32))
    return [
        probe_node(ctx, op, [spec, spec if op == "Mul" else scalar], [spec])
        for op in ("Mul", "Add")
    ] + [probe_node(ctx, "Tanh", [spec], [spec])]


@register
class GeluToTanh(_GeluRule):
    """Replace an exact GELU (the erf form, or Gelu with approximate="none") by the tanh
    approximation 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).

    For targets that run tanh but not erf. The pointwise error is below 4.8e-4 (largest near
    x ≈ −2.7), so the declared bound is 1e-3 of the output's magnitude. Emitted as
    Gelu(approximate="tanh") when the target runs that on its MLA (opset ≥ 20), otherwise as
    Mul/Add/Tanh, which every MLA runs.
    """

    name = "gelu-to-tanh"
    keeps_ranks = True
    summary = "Exact GELU (erf form or Gelu none) → tanh approximation (max error 4.8e-4)."
    category = "replace"
    exactness = "approximate"
    error_bound = 1e-3
    example = "surgery apply gelu-to-tanh bert_tiny.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        sites = _ErfGelu(pat).sites() + gelu_nodes(pat, ("none",))
        if not sites:
            return []
        gelu_ok = opset_upgrade_error(ctx, GELU_OPSET) is None
        opset = max(model_opset(ctx), GELU_OPSET) if gelu_ok else model_opset(ctx)
        found = []
        for site in sites:
            spec = pat.spec(site.x)
            op_probe = (
                probe_node(ctx, "Gelu", [spec], [spec], {"approximate": "tanh"}, opset=opset)
                if gelu_ok
                else Reason("opset", "Gelu needs opset 20")
            )
            if op_probe is None:
                found.append(self._site_match(ctx, site, "Gelu(tanh)", opset, [op_probe]))
                continue
            probes = _tanh_formula_probes(ctx, spec)
            found.append(self._site_match(ctx, site, "tanh formula", model_opset(ctx), probes))
        return found

    def build(self, ed: Editor, x: gs.Tensor, y: gs.Tensor, plan: str) -> None:
        if plan == "Gelu(tanh)":
            ed.node("Gelu", "gelu_tanh", [x], [y], approximate="tanh")
            return
        dtype = x.dtype or np.float32

        def c(value: float) -> gs.Constant:
            return ed.const("gelu_c", np.array(value, dtype))

        x2 = ed.op("Mul", "gelu_sq", [x, x], x.shape, dtype)
        x3 = ed.op("Mul", "gelu_cube", [x2, x], x.shape, dtype)
        cubic = ed.op("Mul", "gelu_cubic", [x3, c(TANH_CUBIC)], x.shape, dtype)
        inner = ed.op("Add", "gelu_inner", [x, cubic], x.shape, dtype)
        scaled = ed.op("Mul", "gelu_scale", [inner, c(TANH_SCALE)], x.shape, dtype)
        th = ed.op("Tanh", "gelu_tanh", [scaled], x.shape, dtype)
        one = ed.op("Add", "gelu_one", [th, c(1.0)], x.shape, dtype)
        half = ed.op("Mul", "gelu_half", [x, c(0.5)], x.shape, dtype)
        ed.node("Mul", "gelu_out", [half, one], [y])


@register
class GeluToQuickGelu(_GeluRule):
    """Replace any GELU (erf form or Gelu op) by QuickGELU, x·sigmoid(1.702·x).

    The cheapest form: one sigmoid table. Its pointwise error against the exact GELU is up to
    0.0203 (near x ≈ −2.27), so the declared bound is 0.03 of the output's magnitude — use it
    when accuracy after quantisation is checked anyway. Emitted as Swish(alpha=1.702) when the
    target runs Swish on its MLA and the model converts to opset 24, else as Mul/Sigmoid/Mul.
    """

    name = "gelu-to-quickgelu"
    keeps_ranks = True
    summary = "GELU → x·sigmoid(1.702x) (QuickGELU; max error 0.0203)."
    category = "replace"
    exactness = "approximate"
    error_bound = 0.03
    example = "surgery apply gelu-to-quickgelu vit_tiny_patch16_224.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        sites = _ErfGelu(pat).sites() + gelu_nodes(pat, ("none", "tanh"))
        if not sites:
            return []
        swish_ok = (
            ctx.target.supports("Swish", "MLA") and opset_upgrade_error(ctx, SWISH_OPSET) is None
        )
        found = []
        for site in sites:
            spec = pat.spec(site.x)
            if swish_ok:
                probe = probe_node(
                    ctx, "Swish", [spec], [spec], {"alpha": QUICK_ALPHA}, opset=SWISH_OPSET
                )
                opset = max(model_opset(ctx), SWISH_OPSET)
                found.append(self._site_match(ctx, site, "Swish(1.702)", opset, [probe]))
                continue
            scalar = TensorSpec.const(np.array(QUICK_ALPHA, np.float32))
            probes = [
                probe_node(ctx, "Mul", [spec, scalar], [spec]),
                probe_node(ctx, "Sigmoid", [spec], [spec]),
                probe_node(ctx, "Mul", [spec, spec], [spec]),
            ]
            found.append(self._site_match(ctx, site, "x·sigmoid(1.702x)", model_opset(ctx), probes))
        return found

    def build(self, ed: Editor, x: gs.Tensor, y: gs.Tensor, plan: str) -> None:
        if plan == "Swish(1.702)":
            ed.node("Swish", "quick_gelu", [x], [y], alpha=QUICK_ALPHA)
            return
        dtype = x.dtype or np.float32
        alpha = ed.const("quick_gelu_alpha", np.array(QUICK_ALPHA, dtype))
        scaled = ed.op("Mul", "quick_gelu_scale", [x, alpha], x.shape, dtype)
        gate = ed.op("Sigmoid", "quick_gelu_gate", [scaled], x.shape, dtype)
        ed.node("Mul", "quick_gelu", [x, gate], [y])
