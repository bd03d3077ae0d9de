"""Attention plumbing exporters write around a Softmax, taken out: drop-softmax-nan-guard.

torch.onnx's `scaled_dot_product_attention` ends its Softmax with Where(IsNaN(p), 0, p), for
rows whose every key a −inf mask shut. IsNaN and Where run on no MLA, so the guard sits on the
host between the Softmax and the MatMul of every attention block and cuts each block into
two MLA segments.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper

from surgery.coverage import topo_order
from surgery.graph import attribute_values
from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    freed_blockers,
    model_opset,
    net_freed,
    probe_node,
)

_RELABELS = ("Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze", "Flatten")
_NONFINITE_CHECKED = 1 << 16
"""Largest constant read for ±inf / NaN (masks and fills; weights larger than this are taken
as finite)."""


def _nonfinite_tensors(ctx: RuleContext, finite: set[str]) -> set[str]:
    """Tensors that may hold ±inf or NaN for finite inputs because a constant they are
    computed from does (an attention mask filled with −inf): one pass in topological order.
    `finite` are outputs known finite whatever their inputs (a guarded Softmax: in [0, 1])."""
    view = ctx.view
    tainted: set[str] = set()

    def bad(value: object) -> bool:
        if isinstance(value, onnx.TensorProto):
            value = numpy_helper.to_array(value)
        if not isinstance(value, np.ndarray | float):
            return False
        arr = np.asarray(value)
        return arr.dtype.kind in "fc" and not np.isfinite(arr).all()

    for idx in topo_order(view):
        ins = [t for t in view.node_inputs[idx] if t]
        constants = {
            t for t in ins if t not in tainted and bad(view.constant_value(t, _NONFINITE_CHECKED))
        }
        tainted |= constants  # a folded causal mask: an initializer holding −inf
        hit = bool(constants) or any(t in tainted for t in ins)
        if view.op_types[idx] in ("Constant", "ConstantOfShape"):
            hit = hit or any(bad(v) for v in attribute_values(view.nodes[idx]).values())
        if hit:
            tainted.update(t for t in view.node_outputs[idx] if t and t not in finite)
    return tainted


@register
class DropSoftmaxNanGuard(GraphRule):
    """Remove the Where(IsNaN(p), 0, p) that torch.onnx writes after the Softmax of
    `scaled_dot_product_attention` (HF's sdpa attention: DistilBERT, BERT and every model
    exported with the dynamo exporter).

    A Softmax returns NaN only for a row of −inf (every key masked) or a non-finite input.
    When no constant the Softmax input is computed from is ±inf or NaN (a mask filled with
    finfo.min, or no mask), it is finite for finite inputs and the guard does nothing: it is
    dropped. When the Softmax input is scores + mask and only the mask holds −inf (torch's
    bool mask → Where(mask, 0, −inf)), the mask is clamped to finfo.min / 2 — exp of it is 0,
    as of −inf, so every row with a key left is unchanged — and the Softmax is multiplied by
    "the row has a key left" (ReduceMax over the Softmax axis of Cast(Not(IsInf(mask)))),
    which zeroes fully masked rows as the guard did. The comparisons depend on the mask alone:
    a host pre-stage, like where-to-mask-arith's. Either way the IsNaN and Where that cut
    every attention block into two MLA segments are gone. Exact for finite scores.
    """

    name = "drop-softmax-nan-guard"
    suggest_for = frozenset({"IsNaN", "Where"})
    summary = "Where(IsNaN(Softmax(x)), 0, ·) (torch's sdpa) → the Softmax (× row-has-key mask)."
    category = "cleanup"
    example = "surgery apply drop-softmax-nan-guard bert_dynamo.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        guards = [g for g in (self._guard(n, pat) for n in pat.nodes("IsNaN")) if g is not None]
        if not guards:
            return []
        tainted = _nonfinite_tensors(ctx, {pat.outs(g["where"])[0] for g in guards})
        plain, by_mask = [], {}
        for guard in guards:
            x = pat.ins(guard["softmax"])[0]
            if x not in tainted:
                plain.append(guard)
                continue
            masked = self._masked(pat, guard, x, tainted)
            if masked is not None:
                by_mask.setdefault(masked["mask"], []).append({**guard, **masked})
        found = [
            self.match(
                [pat.name(g["isnan"]), pat.name(g["where"])],
                f"NaN guard after Softmax {pat.name(g['softmax'])} does nothing (finite input) "
                "→ removed",
                freed_blockers(ctx, [pat.name(g["isnan"]), pat.name(g["where"])]),
                kind="drop",
                softmax=pat.name(g["softmax"]),
            )
            for g in plain
        ]
        for mask, sites in by_mask.items():
            names = [pat.name(g[k]) for g in sites for k in ("isnan", "where")]
            p = pat.spec(pat.outs(sites[0]["softmax"])[0])
            valid = TensorSpec(tuple(sites[0]["valid_shape"]))
            probe = probe_node(ctx, "Mul", [p, valid], [p])
            found.append(
                self.match(
                    [*names, *(pat.name(g["add"]) for g in sites)],
                    f"NaN guard after {len(sites)} Softmax(scores + {mask}) with −inf in the "
                    "mask → mask clamped to a finite floor, rows without a key zeroed by a Mul",
                    net_freed(ctx, names, [probe]),
                    kind="mask",
                    mask=mask,
                    axis=sites[0]["mask_axis"],
                    sites=[
                        {
                            "isnan": pat.name(g["isnan"]),
                            "where": pat.name(g["where"]),
                            "softmax": pat.name(g["softmax"]),
                            "add": pat.name(g["add"]),
                        }
                        for g in sites
                    ],
                )
            )
        return found

    @staticmethod
    def _guard(isnan: int, pat: Pattern) -> dict[str, Any] | None:
        """IsNaN(p) → Where(·, 0, p) with p a Softmax's output (or a reshape of it) read by
        nothing else."""
        p = pat.ins(isnan)[0]
        softmax, t = None, p
        while softmax is None:  # through the Reshapes a 4-D lift puts after the Softmax
            producer = pat.producer(t, "Softmax", *_RELABELS)
            if producer is None or (t != p and pat.sole_consumer(t) is None):
                return None
            if pat.op(producer) == "Softmax":
                softmax = producer
            t = pat.ins(producer)[0]
        where = pat.sole_consumer(pat.outs(isnan)[0], "Where")
        if softmax is None or where is None:
            return None
        cond, fill, kept = pat.ins(where)[:3]
        if cond != pat.outs(isnan)[0] or kept != p or pat.scalar(fill) != 0.0:
            return None
        if p in pat.outputs or set(pat.consumers(p)) != {isnan, where}:
            return None
        if pat.outs(where)[0] in pat.outputs:
            return None
        return {
            "isnan": isnan,
            "where": where,
            "softmax": softmax,
            "direct": p == pat.outs(softmax)[0],
        }

    @staticmethod
    def _masked(pat: Pattern, guard: dict, x: str, tainted: set[str]) -> dict | None:
        """x = scores + mask with only the mask non-finite, the Softmax its only reader: the
        mask, the Add, the mask's axis the Softmax runs over (None when the mask is broadcast
        along it) and the shape of the row-has-a-key tensor."""
        add = pat.producer(x, "Add")
        if add is None or pat.sole_consumer(x) != guard["softmax"] or not guard["direct"]:
            return None
        a, b = pat.ins(add)[:2]
        if (a in tainted) == (b in tainted):
            return None
        mask = a if a in tainted else b
        shape, mask_shape = pat.shape(x), pat.shape(mask)
        if shape is None or mask_shape is None or not pat.is_float(mask):
            return None
        rank = len(shape)
        axis = int(pat.attrs(guard["softmax"]).get("axis", -1 if pat.ctx.opset >= 13 else 1))
        axis %= rank
        if pat.ctx.opset < 13 and axis != rank - 1:
            return None  # the coerced 2-D Softmax of older opsets normalises axis..end
        k = axis - (rank - len(mask_shape))
        if k < 0 or mask_shape[k] == 1:
            return {"mask": mask, "add": add, "mask_axis": None, "valid_shape": list(mask_shape)}
        valid = list(mask_shape)
        valid[k] = 1
        return {"mask": mask, "add": add, "mask_axis": k, "valid_shape": valid}

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        if match.data["kind"] == "drop":
            return self._drop(ed, match.nodes)
        mask = ed.tensor(match.data["mask"])
        dtype = np.dtype(mask.dtype or np.float32)
        low = ed.const("mask_floor", np.array(np.finfo(dtype).min / 2, dtype))
        clamped = ed.op("Max", "mask_clamped", [mask, low], mask.shape, dtype)
        # Which keys are open (Not IsInf −∞), as 0/1, then whether a row has one: the
        # comparisons run on the host from the mask alone; the ReduceMax, if any, joins the
        # attention's segment rather than sitting between host ops in one of its own.
        shut = ed.op("IsInf", "mask_shut", [mask], mask.shape, np.bool_, detect_positive=0)
        is_open = ed.op("Not", "mask_open", [shut], mask.shape, np.bool_)
        keep = ed.op(
            "Cast", "mask_open_f", [is_open], mask.shape, dtype,
            to=helper.np_dtype_to_tensor_dtype(dtype),
        )  # fmt: skip
        if match.data["axis"] is not None:
            keep = self._reduce_max(ed, keep, match.data["axis"], dtype)
        for site in match.data["sites"]:
            add, softmax = ed.node_named(site["add"]), ed.node_named(site["softmax"])
            isnan, where = ed.node_named(site["isnan"]), ed.node_named(site["where"])
            if add is None or softmax is None or isnan is None or where is None:
                return False
            for k, t in enumerate(add.inputs):
                if t is mask:
                    add.inputs[k] = clamped
            y = where.outputs[0]
            ed.detach(isnan, where)
            ed.node("Mul", "softmax_row_keep", [softmax.outputs[0], keep], [y])
        return True

    @staticmethod
    def _reduce_max(ed: Editor, mask: gs.Tensor, axis: int, dtype: np.dtype) -> gs.Tensor:
        shape = list(mask.shape) if mask.shape else None
        if shape is not None:
            shape[axis] = 1
        if model_opset(ed.ctx) >= 18:
            axes = ed.const("mask_axis", np.array([axis], np.int64))
            return ed.op("ReduceMax", "mask_row_max", [mask, axes], shape, dtype, keepdims=1)
        return ed.op("ReduceMax", "mask_row_max", [mask], shape, dtype, axes=[axis], keepdims=1)

    @staticmethod
    def _drop(ed: Editor, guard: list[str]) -> bool:
        isnan, where = (ed.node_named(n) for n in guard)
        if isnan is None or where is None:
            return False
        p, y = isnan.inputs[0], where.outputs[0]
        producer = p.inputs[0]
        ed.detach(isnan, where)
        producer.outputs.clear()
        producer.outputs.append(y)
        return True
