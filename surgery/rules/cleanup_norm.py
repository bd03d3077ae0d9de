"""Normalisations spelled out by exporters, folded back into the one op they compute.

torch.onnx below opset 17 and paddle2onnx write `nn.LayerNorm` as nine elementwise and
reduction nodes. Spread out like that it cannot be lifted to the MLA: the two ReduceMeans run
over the feature axis, which the MLA does not reduce, and every intermediate is its own
quantized tensor. As one LayerNormalization it is what `transformer-to-4d` carries on the
channel axis and what the MLA runs as a single normalisation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    OpsetGraphRule,
    Pattern,
    TensorSpec,
    conversion_note,
    freed_blockers,
    model_opset,
    opset_upgrade_error,
    probe_node,
    reduce_axes,
)

LAYERNORM_OPSET = 17
_AFFINE_ELEMENTS = 1 << 22
"""Largest scale/bias constant read (a per-feature vector; far more than any hidden size)."""


@dataclass
class LayerNormSite:
    """One decomposed LayerNorm: input, output, the nodes computing it and its parameters."""

    x: str
    y: str
    nodes: list[str]
    axes: list[int]
    """The normalised axes of x, ascending (trailing ones unless `perm` is set)."""
    epsilon: float
    scale: str | None
    bias: str | None
    perm: list[int] | None = None
    """Transpose moving the normalised axes last (a channels-first LayerNorm), or None."""

    @property
    def axis(self) -> int:
        """LayerNormalization's axis on x (or on x transposed by `perm`)."""
        return min(self.axes) if self.perm is None else len(self.perm) - len(self.axes)


class _Decomposed:
    """Matches mean → x − mean → (·)² → mean → + ε → √ → (x − mean) / √ [· γ] [+ β]."""

    def __init__(self, pat: Pattern) -> None:
        self.pat = pat

    def sites(self) -> list[LayerNormSite]:
        found = []
        taken: set[int] = set()
        for mean in self.pat.nodes("ReduceMean"):
            site = self._from_mean(mean, taken)
            if site is not None:
                found.append(site)
        return found

    def _axes(self, node: int, x: str) -> list[int] | None:
        """The normalised axes of a keepdims reduction: axis..rank-1 when it covers them
        (size-1 axes among them may be left out), else exactly the reduced axes."""
        pat = self.pat
        shape = pat.shape(x)
        if shape is None or not shape or not pat.attrs(node).get("keepdims", 1):
            return None
        axes = reduce_axes(pat, node, len(shape))
        if not axes:
            return None
        tail = range(min(axes), len(shape))
        if all(a in axes or shape[a] == 1 for a in tail):
            return list(tail)
        return axes

    def _from_mean(self, mean: int, taken: set[int]) -> LayerNormSite | None:
        pat = self.pat
        x = pat.ins(mean)[0]
        if not x or pat.is_const(x) or not pat.is_float(x) or mean in taken:
            return None
        axes = self._axes(mean, x)
        if axes is None:
            return None
        centred = self._centred(mean, x)
        if centred is None:
            return None
        chain = self._variance(centred)
        if chain is None:
            return None
        var_nodes, eps, std = chain
        div = self._normalised(centred, std)
        if div is None:
            return None
        second_mean = var_nodes[1]
        if self._axes(second_mean, pat.outs(var_nodes[0])[0]) != axes:
            return None
        y, affine, scale, bias = self._affine(pat.outs(div)[0], pat.shape(x), axes)
        nodes = [mean, *centred, *var_nodes, div, *affine]
        if any(n in taken for n in nodes) or not self._closed(nodes, y):
            return None
        taken.update(nodes)
        rank = len(pat.shape(x) or ())
        perm = None
        if axes != list(range(axes[0], rank)):
            perm = [a for a in range(rank) if a not in axes] + axes
        return LayerNormSite(x, y, [pat.name(n) for n in nodes], axes, eps, scale, bias, perm)

    def _centred(self, mean: int, x: str) -> list[int] | None:
        """The Subs x − mean (torch's LayerNorm writes it once, ConvNeXt's channels-first one twice)."""
        pat = self.pat
        users = pat.consumers(pat.outs(mean)[0])
        if not users or len(users) > 2 or pat.outs(mean)[0] in pat.outputs:
            return None
        if any(
            pat.op(u) != "Sub" or tuple(pat.ins(u)[:2]) != (x, pat.outs(mean)[0]) for u in users
        ):
            return None
        return users

    def _variance(self, centred: list[int]) -> tuple[list[int], float, int] | None:
        """(Pow|Mul, ReduceMean, Add ε, Sqrt) from one of the centred tensors."""
        pat = self.pat
        for sub in centred:
            d = pat.outs(sub)[0]
            for sq in pat.consumers(d):
                if not self._squares(sq, d):
                    continue
                var = pat.sole_consumer(pat.outs(sq)[0], "ReduceMean")
                add = pat.sole_consumer(pat.outs(var)[0], "Add") if var is not None else None
                if add is None:
                    continue
                eps = pat.scalar(pat.other_input(add, pat.outs(var)[0]) or "")
                root = pat.sole_consumer(pat.outs(add)[0], "Sqrt", "Pow")
                if eps is None or eps < 0 or root is None or not self._sqrt(root):
                    continue
                return [sq, var, add, root], eps, root
        return None

    def _squares(self, node: int, d: str) -> bool:
        pat = self.pat
        ins = pat.ins(node)[:2]
        if pat.op(node) == "Mul":
            return tuple(ins) == (d, d)
        if pat.op(node) == "Pow" and ins[0] == d:
            exponent = pat.scalar(ins[1])
            return exponent is not None and exponent == 2.0
        return False

    def _sqrt(self, node: int) -> bool:
        pat = self.pat
        if pat.op(node) == "Sqrt":
            return True
        exponent = pat.scalar(pat.ins(node)[1])
        return exponent is not None and exponent == 0.5

    def _normalised(self, centred: list[int], std: int) -> int | None:
        """Div(x − mean, std), reading one of the centred tensors."""
        pat = self.pat
        div = pat.sole_consumer(pat.outs(std)[0], "Div")
        if div is None or pat.ins(div)[1] != pat.outs(std)[0]:
            return None
        if pat.ins(div)[0] not in {pat.outs(s)[0] for s in centred}:
            return None
        return div

    def _affine(
        self, normed: str, shape: tuple[int, ...] | None, axes: list[int]
    ) -> tuple[str, list[int], str | None, str | None]:
        """The optional Mul by γ and Add of β after the normalisation, when both are constants
        that vary only along the normalised axes (so they are LayerNorm's scale and bias)."""
        pat = self.pat
        y, nodes, found = normed, [], {}
        for op in ("Mul", "Add"):
            node = pat.sole_consumer(y, op)
            if node is None:
                break
            other = pat.other_input(node, y)
            if other is None or not self._per_feature(other, shape, axes):
                break
            if pat.shape(pat.outs(node)[0]) != shape:
                break
            found[op] = other
            nodes.append(node)
            y = pat.outs(node)[0]
        return y, nodes, found.get("Mul"), found.get("Add")

    def _per_feature(self, tensor: str, shape: tuple[int, ...] | None, axes: list[int]) -> bool:
        """A constant that varies only along the normalised axes."""
        pat = self.pat
        value = pat.view.constant_value(tensor, _AFFINE_ELEMENTS) if pat.is_const(tensor) else None
        if value is None or shape is None or value.ndim > len(shape):
            return False
        lead = len(shape) - value.ndim
        return all(d == 1 for k, d in enumerate(value.shape) if k + lead not in axes)

    def _closed(self, nodes: list[int], y: str) -> bool:
        """Every intermediate is read only inside the pattern and none is a graph output."""
        pat = self.pat
        inside = set(nodes)
        for n in nodes:
            for t in pat.outs(n):
                if t == y or not t:
                    continue
                if t in pat.outputs or any(c not in inside for c in pat.consumers(t)):
                    return False
        return True


@register
class FuseLayerNorm(OpsetGraphRule):
    """Fold a LayerNorm written out as ReduceMean, Sub, Pow(2) (or x·x), ReduceMean, Add ε,
    Sqrt (or Pow 0.5), Div — and the Mul by γ and Add of β after it — into one
    LayerNormalization(axis, epsilon).

    This is how torch.onnx exports `nn.LayerNorm` below opset 17 and how paddle2onnx writes
    it at any opset (ViT/DeiT, DETR, BERT, SVTR). The reductions must cover the trailing axes
    with keepdims (size-1 axes may be left out), γ and β must be constants varying only along
    them. The same mean and variance in one op: exact to float rounding. LayerNormalization
    exists from opset 17; an older model is converted, as for erf-gelu-to-gelu. A cleanup:
    the fused op is the form `transformer-to-4d` lifts onto the MLA's channel axis, so it runs
    first, and only on targets whose MLA runs LayerNormalization.
    """

    name = "fuse-layernorm"
    suggest_for = frozenset({"ReduceMean"})
    summary = "Decomposed LayerNorm (ReduceMean, Sub, Pow, …, Div, Mul, Add) → LayerNormalization."
    category = "cleanup"
    example = "surgery apply fuse-layernorm deit_opset13.onnx -o deit_ln.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        if not ctx.target.supports("LayerNormalization", "MLA"):
            return []
        if opset_upgrade_error(ctx, LAYERNORM_OPSET) is not None:
            return []
        pat = Pattern(ctx)
        opset = max(model_opset(ctx), LAYERNORM_OPSET)
        found = []
        for site in _Decomposed(pat).sites():
            spec = pat.spec(site.x)
            if site.perm is not None and spec.shape is not None:
                spec = TensorSpec(tuple(spec.shape[p] for p in site.perm), spec.elem_type)
            probe = probe_node(
                ctx, "LayerNormalization", [spec], [spec], {"axis": site.axis}, opset=opset
            )
            where = f"axes {site.axes}" + (" (between Transposes)" if site.perm else "")
            found.append(
                self.match(
                    site.nodes,
                    f"LayerNorm over {where} spelled out in {len(site.nodes)} nodes "
                    f"→ LayerNormalization at {site.nodes[-1]}" + conversion_note(ctx, opset),
                    freed_blockers(ctx, site.nodes, probe is None),
                    site=asdict(site),
                    opset=opset,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        site = LayerNormSite(**match.data["site"])
        x, y = ed.tensor(site.x), ed.tensor(site.y)
        shape = tuple(int(d) for d in ed.ctx.view.tensor(site.x).shape)  # type: ignore[union-attr]
        dtype = np.dtype(x.dtype or np.float32)
        scale = _parameter(ed, site.scale, shape, site.axes, dtype, 1.0)
        bias = _parameter(ed, site.bias, shape, site.axes, dtype, 0.0)
        ed.detach(*(n for n in (ed.node_named(name) for name in site.nodes) if n is not None))
        params_in = [ed.const("layernorm_scale", scale), ed.const("layernorm_bias", bias)]
        attrs = {"axis": site.axis, "epsilon": float(site.epsilon)}
        if site.perm is None:
            ed.node("LayerNormalization", "layernorm", [x, *params_in], [y], **attrs)
            return True
        moved = tuple(shape[p] for p in site.perm)
        inverse = [site.perm.index(a) for a in range(len(shape))]
        last = ed.op("Transpose", "layernorm_in", [x], moved, x.dtype, perm=site.perm)
        normed = ed.op(
            "LayerNormalization", "layernorm", [last, *params_in], moved, x.dtype, **attrs
        )
        ed.node("Transpose", "layernorm_out", [normed], [y], perm=inverse)
        return True


def _parameter(
    ed: Editor,
    name: str | None,
    shape: tuple[int, ...],
    axes: list[int],
    dtype: np.dtype,
    default: float,
) -> np.ndarray:
    """γ or β over the normalised axes, in their order (the default when the export had none)."""
    features = tuple(shape[a] for a in axes)
    if name is None:
        return np.full(features, default, dtype)
    value = ed.ctx.view.constant_value(name, _AFFINE_ELEMENTS)
    assert value is not None  # find read it
    full = value.reshape((1,) * (len(shape) - value.ndim) + value.shape)
    picked = full[tuple(slice(None) if a in axes else 0 for a in range(len(shape)))]
    return np.ascontiguousarray(np.broadcast_to(picked, features).astype(dtype))
