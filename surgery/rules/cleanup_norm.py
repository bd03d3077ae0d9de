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
import onnx
import onnx_graphsurgeon as gs

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


class _Spelled:
    """Lookups shared by the spelled-out normalisations: reduced axes, squares, roots,
    per-feature constants and a closed set of nodes."""

    def __init__(self, pat: Pattern) -> None:
        self.pat = pat

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


def _perm(axes: list[int], rank: int) -> list[int] | None:
    """The Transpose moving non-trailing normalised axes last (None when they are trailing)."""
    if axes == list(range(axes[0], rank)):
        return None
    return [a for a in range(rank) if a not in axes] + axes


class _Decomposed(_Spelled):
    """Matches mean → x − mean → (·)² → mean → + ε → √ → (x − mean) / √ [· γ] [+ β]."""

    def sites(self) -> list[LayerNormSite]:
        found = []
        taken: set[int] = set()
        for mean in self.pat.nodes("ReduceMean"):
            site = self._from_mean(mean, taken)
            if site is not None:
                found.append(site)
        return found

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
        perm = _perm(axes, len(pat.shape(x) or ()))
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
        _emit(ed, "LayerNormalization", "layernorm", x, y, params_in, shape, site.perm, attrs)
        return True


def _emit(
    ed: Editor,
    op: str,
    base: str,
    x: gs.Tensor,
    y: gs.Tensor,
    params_in: list[gs.Tensor],
    shape: tuple[int, ...],
    perm: list[int] | None,
    attrs: dict,
) -> None:
    """The fused normalisation from x to y, between Transposes when `perm` moves its axes last
    (the output takes the type of y, which the normalisation's scale has)."""
    if perm is None:
        ed.node(op, base, [x, *params_in], [y], **attrs)
        return
    moved = tuple(shape[p] for p in perm)
    inverse = [perm.index(a) for a in range(len(shape))]
    last = ed.op("Transpose", f"{base}_in", [x], moved, x.dtype, perm=perm)
    normed = ed.op(op, base, [last, *params_in], moved, y.dtype or x.dtype, **attrs)
    ed.node("Transpose", f"{base}_out", [normed], [y], perm=inverse)


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


RMSNORM_OPSET = 23


@dataclass
class RMSNormSite:
    """One decomposed RMSNorm: input, output, the nodes computing it and its parameters."""

    x: str
    y: str
    nodes: list[str]
    axes: list[int]
    """The normalised axes of x, ascending (trailing ones unless `perm` is set)."""
    epsilon: float
    scale: str | None
    scale_type: int
    """The element type of the scale, and so of y (the float32 normalisation cast back to it)."""
    perm: list[int] | None = None

    @property
    def axis(self) -> int:
        return min(self.axes) if self.perm is None else len(self.perm) - len(self.axes)


class _DecomposedRMS(_Spelled):
    """Matches [Cast] → (·)² → mean → + ε → √ → 1/√ (Div, Reciprocal, or Pow −0.5 for both)
    → x · (1/√) or x / √ → [Cast] → [· γ]: T5LayerNorm, LlamaRMSNorm, Gemma's RMSNorm."""

    def sites(self) -> list[RMSNormSite]:
        found = []
        taken: set[int] = set()
        for var in self.pat.nodes("ReduceMean"):
            site = self._from_mean(var, taken)
            if site is not None:
                found.append(site)
        return found

    def _from_mean(self, var: int, taken: set[int]) -> RMSNormSite | None:
        pat = self.pat
        sq = pat.producer(pat.ins(var)[0], "Pow", "Mul")
        if sq is None or var in taken:
            return None
        xf = pat.ins(sq)[0]
        if not xf or pat.is_const(xf) or not pat.is_float(xf) or not self._squares(sq, xf):
            return None
        if self._centred(xf):
            return None  # a LayerNorm: fuse-layernorm's
        axes = self._axes(var, xf)
        if axes is None or pat.sole_consumer(pat.outs(sq)[0]) != var:
            return None
        add = pat.sole_consumer(pat.outs(var)[0], "Add")
        if add is None:
            return None
        eps = pat.scalar(pat.other_input(add, pat.outs(var)[0]) or "")
        if eps is None or eps < 0:
            return None
        chain = self._normalised(pat.outs(add)[0], xf)
        if chain is None:
            return None
        inner, normed = chain
        y, tail, scale = self._scaled(pat.outs(normed)[0], pat.shape(xf), axes)
        x, head = self._source(xf, {sq, normed}, pat.elem_type(y))
        if pat.elem_type(x) != pat.elem_type(y):  # a Cast back after a Cast left in place
            y, tail, scale = pat.outs(normed)[0], [], None
        nodes = [*head, sq, var, add, *inner, normed, *tail]
        if any(n in taken for n in nodes) or not self._closed(nodes, y):
            return None
        taken.update(nodes)
        perm = _perm(axes, len(pat.shape(xf) or ()))
        names = [pat.name(n) for n in nodes]
        return RMSNormSite(x, y, names, axes, eps, scale, pat.elem_type(y), perm)

    def _centred(self, xf: str) -> bool:
        """xf is x − mean(x): the RMS of a centred tensor is a LayerNorm's deviation."""
        pat = self.pat
        sub = pat.producer(xf, "Sub")
        if sub is None:
            return False
        mean = pat.producer(pat.ins(sub)[1], "ReduceMean")
        return mean is not None and pat.ins(mean)[0] == pat.ins(sub)[0]

    def _normalised(self, ve: str, xf: str) -> tuple[list[int], int] | None:
        """From var + ε to the normalised tensor: √ then x / √, or 1/√ (Div 1 by it, Reciprocal
        or Pow −0.5 directly) then x · it. Returns the nodes in between and the last one."""
        pat = self.pat
        root = pat.sole_consumer(ve, "Sqrt", "Pow")
        if root is None:
            return None
        root_out = pat.outs(root)[0]
        if pat.op(root) == "Pow" and pat.scalar(pat.ins(root)[1]) == -0.5:
            inverse = [root]
        elif self._sqrt(root):
            step = pat.sole_consumer(root_out, "Div", "Reciprocal")
            if step is None:
                return None
            if pat.op(step) == "Div" and pat.ins(step)[:2] == (xf, root_out):
                return [root], step
            if pat.op(step) == "Div" and (
                pat.ins(step)[1] != root_out or pat.scalar(pat.ins(step)[0]) != 1.0
            ):
                return None
            inverse = [root, step]
        else:
            return None
        mul = pat.sole_consumer(pat.outs(inverse[-1])[0], "Mul")
        if mul is None or pat.other_input(mul, pat.outs(inverse[-1])[0]) != xf:
            return None
        return inverse, mul

    def _scaled(
        self, normed: str, shape: tuple[int, ...] | None, axes: list[int]
    ) -> tuple[str, list[int], str | None]:
        """The optional Cast back to the model's float type and Mul by a per-feature γ."""
        pat = self.pat
        y, nodes, scale = normed, [], None
        cast = pat.sole_consumer(y, "Cast")
        if cast is not None and pat.is_float(pat.outs(cast)[0]):
            nodes.append(cast)
            y = pat.outs(cast)[0]
        mul = pat.sole_consumer(y, "Mul")
        if mul is not None:
            other = pat.other_input(mul, y)
            out = pat.outs(mul)[0]
            if (
                other is not None
                and self._per_feature(other, shape, axes)
                and pat.shape(out) == shape
                and pat.elem_type(out) == pat.elem_type(y)
            ):
                nodes.append(mul)
                y, scale = out, other
        return y, nodes, scale

    def _source(self, xf: str, readers: set[int], elem_type: int) -> tuple[str, list[int]]:
        """x itself, or the input of the Cast to float32 that feeds only this normalisation
        (HF's fp16-safe `hidden_states.to(torch.float32)`) when it has the type of the output
        (RMSNormalization computes in float32 whatever its input type, stash_type 1, and ONNX
        infers its output type from its input)."""
        pat = self.pat
        cast = pat.producer(xf, "Cast")
        if cast is None or pat.attrs(cast).get("to") != onnx.TensorProto.FLOAT:
            return xf, []
        src = pat.ins(cast)[0]
        if not src or pat.is_const(src) or pat.elem_type(src) != elem_type:
            return xf, []
        if pat.shape(src) is None:
            return xf, []
        if xf in pat.outputs or not set(pat.consumers(xf)) <= readers:
            return xf, []
        return src, [cast]


@register
class FuseRMSNorm(OpsetGraphRule):
    """Fold an RMSNorm written out as Pow(2) (or x·x), ReduceMean, Add ε, Sqrt, then Div(1, ·)
    or Reciprocal and Mul by x (or Div of x by the root, or Pow −0.5 and Mul) — and the Mul
    by γ after it, on either side — into one RMSNormalization(axis, epsilon).

    This is how torch.onnx exports T5LayerNorm, LlamaRMSNorm (Mistral, Qwen) and Gemma's
    RMSNorm (γ = 1 + w, a constant once folded). The Casts HF writes around it for fp16
    safety are part of the op: a Cast to float32 that only this normalisation reads becomes
    its input (RMSNormalization computes in float32, stash_type 1) and a Cast back before γ
    is its CastLike to γ's type. The reduction must cover the trailing axes with keepdims
    (or other axes: then between Transposes), γ must be a constant varying only along them.
    The same mean of squares in one op: exact to float rounding. RMSNormalization exists from
    opset 23; an older model is converted, as for fuse-layernorm. A cleanup: the fused op is
    what `transformer-to-4d` lifts onto the MLA's channel axis (the MLA runs it on its fp16
    normalisation unit), so it runs first, and only on targets whose MLA runs RMSNormalization.
    """

    name = "fuse-rmsnorm"
    suggest_for = frozenset({"ReduceMean"})
    summary = "Decomposed RMSNorm (Pow, ReduceMean, Add, Sqrt, Div, Mul) → RMSNormalization."
    category = "cleanup"
    example = "surgery apply fuse-rmsnorm t5_encoder.onnx -o t5_rms.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        if not ctx.target.supports("RMSNormalization", "MLA"):
            return []
        if opset_upgrade_error(ctx, RMSNORM_OPSET) is not None:
            return []
        pat = Pattern(ctx)
        opset = max(model_opset(ctx), RMSNORM_OPSET)
        found = []
        for site in _DecomposedRMS(pat).sites():
            spec = pat.spec(site.x)
            if site.perm is not None and spec.shape is not None:
                spec = TensorSpec(tuple(spec.shape[p] for p in site.perm), spec.elem_type)
            out = TensorSpec(spec.shape, site.scale_type)
            probe = probe_node(
                ctx, "RMSNormalization", [spec], [out], {"axis": site.axis}, opset=opset
            )
            where = f"axes {site.axes}" + (" (between Transposes)" if site.perm else "")
            found.append(
                self.match(
                    site.nodes,
                    f"RMSNorm over {where} spelled out in {len(site.nodes)} nodes "
                    f"→ RMSNormalization at {site.nodes[-1]}" + conversion_note(ctx, opset),
                    freed_blockers(ctx, site.nodes, probe is None),
                    site=asdict(site),
                    opset=opset,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        site = RMSNormSite(**match.data["site"])
        x, y = ed.tensor(site.x), ed.tensor(site.y)
        shape = tuple(int(d) for d in ed.ctx.view.tensor(site.x).shape)  # type: ignore[union-attr]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(site.scale_type)
        scale = _parameter(ed, site.scale, shape, site.axes, dtype, 1.0)
        ed.detach(*(n for n in (ed.node_named(name) for name in site.nodes) if n is not None))
        attrs = {"axis": site.axis, "epsilon": float(site.epsilon)}
        scale_in = [ed.const("rmsnorm_scale", scale)]
        _emit(ed, "RMSNormalization", "rmsnorm", x, y, scale_in, shape, site.perm, attrs)
        return True
