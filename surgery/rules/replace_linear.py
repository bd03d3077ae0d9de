"""Fully connected layers as 1×1 (or full-kernel) convolutions: gemm-to-conv, matmul-to-conv.

The MLA runs 4-D tensors only, and a rank-2 Gemm or MatMul is the usual tail of a CNN
(`GlobalAveragePool → Flatten → Gemm`). A linear layer over channels is exactly a 1×1 Conv on
[N, K, 1, 1]; a linear layer over a flattened [N, C, H, W] map is exactly a Conv with an H×W
kernel (the flatten order C, H, W is the weight layout [M, C, H, W]). So the flatten is absorbed,
the layer runs on the MLA, and at most one Reshape back to [N, M] is left where a rank-2
consumer or the graph output needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    fmt_shape,
    net_freed,
    probe_node,
    probe_reshape,
)
from surgery.targets import Reason

_FLATTENS = ("Flatten", "Reshape", "Squeeze")
_NCHW_TO_NHWC = [0, 2, 3, 1]
_NHWC_TO_NCHW = [0, 3, 1, 2]


@dataclass
class LinearPlan:
    """How one linear layer becomes a Conv (everything `edit` needs, by tensor/node name)."""

    x: str
    """The tensor the rewrite reads."""
    layout: str
    """"nchw" (x is the 4-D map the layer flattened), "flat" (x is [N, K]: reshape to
    [N, K, 1, 1]) or "nhwc" (x is [N, H, W, K]: transpose to NCHW)."""
    conv_in: list[int]
    conv_out: list[int]
    kernel: list[int]
    out: str
    """The tensor that holds the layer's result (the MatMul/Gemm output or a fused bias Add's)."""
    out_shape: list[int]
    removed: list[str] = field(default_factory=list)
    detach: list[str] = field(default_factory=list)
    rewire: list[str] = field(default_factory=list)
    """Consumers of `out` that read the 4-D result directly (reshape-like consumers)."""
    back: str | None = None
    """"reshape" or "transpose" when `out` must keep its original layout."""
    absorbed_out: str | None = None
    """Output of an absorbed NHWC→NCHW Transpose consumer, written by the Conv directly."""
    bias: str | None = None


def _plan_input(pat: Pattern, a: str, k: int) -> tuple[str, str, list[int], list[int], list[str]]:
    """(x, layout, conv input shape, kernel, absorbed nodes) for the layer's input `a`."""
    shape = pat.shape(a)
    assert shape is not None
    if len(shape) == 4:
        src = pat.producer(a, "Transpose")
        if src is not None and pat.attrs(src).get("perm") == _NCHW_TO_NHWC:
            nchw = pat.shape(pat.ins(src)[0])
            if nchw is not None:
                return pat.ins(src)[0], "nchw", list(nchw), [1, 1], [pat.name(src)]
        n, h, w, _ = shape
        return a, "nhwc", [n, k, h, w], [1, 1], []
    flat = pat.producer(a, *_FLATTENS)
    if flat is not None:
        src = pat.ins(flat)[0]
        src_shape = pat.shape(src)
        if (
            src_shape is not None
            and len(src_shape) == 4
            and src_shape[0] == shape[0]
            and int(np.prod(src_shape[1:])) == k
            and (pat.op(flat) != "Flatten" or pat.attrs(flat).get("axis", 1) == 1)
        ):
            return src, "nchw", list(src_shape), list(src_shape[2:]), [pat.name(flat)]
    return a, "flat", [shape[0], k, 1, 1], [1, 1], []


def _rewirable(pat: Pattern, consumer: int) -> bool:
    """A consumer that gives the same result on the 4-D Conv output as on the 2-D one."""
    op = pat.op(consumer)
    if op == "Flatten":
        return pat.attrs(consumer).get("axis", 1) == 1
    if op == "Reshape":
        shape = pat.value(pat.ins(consumer)[1])
        return shape is not None and 0 not in shape.tolist()
    return False


def _plan_output(pat: Pattern, plan: LinearPlan) -> None:
    """Decide whether the result needs a Reshape/Transpose back to the original layout."""
    if plan.layout == "nhwc" or (plan.layout == "nchw" and len(plan.out_shape) == 4):
        user = pat.sole_consumer(plan.out, "Transpose")
        if user is not None and pat.attrs(user).get("perm") == _NHWC_TO_NCHW:
            plan.absorbed_out = pat.outs(user)[0]
            plan.removed.append(pat.name(user))
            plan.detach.append(pat.name(user))
        else:
            plan.back = "transpose"
        return
    users = pat.consumers(plan.out)
    plan.rewire = [pat.name(u) for u in users if _rewirable(pat, u)]
    if plan.out in pat.outputs or len(plan.rewire) < len(users):
        plan.back = "reshape"


def _fused_bias(pat: Pattern, y: str, m: int) -> tuple[int, str] | None:
    """A following Add of a constant that broadcasts along the output features only."""
    add = pat.sole_consumer(y, "Add")
    if add is None:
        return None
    other = pat.other_input(add, y)
    if other is None or not pat.is_const(other):
        return None
    shape = pat.view.tensor(other).shape
    y_rank = pat.view.tensor(y).rank
    if shape is None or y_rank is None or len(shape) > y_rank or not shape:
        return None
    if shape[-1] != m or any(d != 1 for d in shape[:-1]):
        return None
    return add, other


def _probes(ctx: RuleContext, pat: Pattern, plan: LinearPlan, m: int):
    """(main, helpers): placement of the Conv, and of the reshapes/transposes around it."""
    k = plan.conv_in[1]
    conv = probe_node(
        ctx,
        "Conv",
        [
            TensorSpec(tuple(plan.conv_in)),
            TensorSpec((m, k, *plan.kernel), constant=True),
            TensorSpec((m,), constant=True),
        ],
        [TensorSpec(tuple(plan.conv_out))],
        {"kernel_shape": plan.kernel},
    )
    helpers: list[Reason | None] = []
    x_shape = tuple(pat.shape(plan.x) or ())
    if plan.layout == "flat":
        helpers.append(probe_reshape(ctx, TensorSpec(x_shape), TensorSpec(tuple(plan.conv_in))))
    if plan.layout == "nhwc":
        helpers.append(_transpose_probe(ctx, x_shape, tuple(plan.conv_in), _NHWC_TO_NCHW))
    if plan.back == "reshape":
        helpers.append(
            probe_reshape(ctx, TensorSpec(tuple(plan.conv_out)), TensorSpec(tuple(plan.out_shape)))
        )
    if plan.back == "transpose":
        helpers.append(
            _transpose_probe(ctx, tuple(plan.conv_out), tuple(plan.out_shape), _NCHW_TO_NHWC)
        )
    return [conv], helpers


def _transpose_probe(ctx: RuleContext, src: tuple, dst: tuple, perm: list[int]) -> Reason | None:
    return probe_node(ctx, "Transpose", [TensorSpec(src)], [TensorSpec(dst)], {"perm": perm})


def _finish_plan(
    pat: Pattern, node: int, a: str, k: int, m: int, bias: str | None
) -> LinearPlan | None:
    """The full plan for the linear layer `node` reading `a` ([N, K] or [N, H, W, K])."""
    x, layout, conv_in, kernel, absorbed = _plan_input(pat, a, k)
    y = pat.outs(node)[0]
    removed = [pat.name(node)]
    fused = None if bias is not None else _fused_bias(pat, y, m)
    out = y
    if fused is not None:
        add, bias = fused
        out = pat.outs(add)[0]
        removed.append(pat.name(add))
    out_shape = pat.shape(out)
    if out_shape is None:
        return None
    spatial = [1, 1] if layout == "flat" or kernel != [1, 1] else conv_in[2:]
    plan = LinearPlan(
        x, layout, conv_in, [conv_in[0], m, *spatial], kernel, out, list(out_shape), bias=bias
    )
    for name in absorbed:  # the Flatten/Transpose before the layer goes when nothing else reads it
        if pat.private(pat.outs(pat.view.index_by_name[name])[0]):
            removed.append(name)
    plan.detach = list(removed)
    plan.removed = list(removed)
    _plan_output(pat, plan)
    return plan


def _weights(ed: Editor, plan: LinearPlan, w: np.ndarray, b: np.ndarray | None, dtype) -> tuple:
    """Conv weight [M, C, kh, kw] from the [M, K] matrix, and the bias vector."""
    m = w.shape[0]
    c = plan.conv_in[1]
    weight = w.reshape(m, c, *plan.kernel).astype(dtype)
    bias = np.zeros(m, dtype) if b is None else np.asarray(b, np.float64).reshape(-1).astype(dtype)
    return ed.const("conv_weight", weight), ed.const("conv_bias", bias)


def _build(ed: Editor, plan: LinearPlan, w: np.ndarray, b: np.ndarray | None) -> None:
    """Replace the planned nodes with [Reshape/Transpose →] Conv [→ Reshape/Transpose]."""
    x = ed.tensor(plan.x)
    out = ed.tensor(plan.out)
    dtype = x.dtype or np.float32
    weight, bias = _weights(ed, plan, w, b, dtype)
    rewire = [ed.node_named(n) for n in plan.rewire]
    absorbed_out = ed.tensor(plan.absorbed_out) if plan.absorbed_out else None
    ed.detach(*(n for n in (ed.node_named(n) for n in plan.detach) if n is not None))
    if plan.layout == "flat":
        shape = ed.const("to_4d", np.array(plan.conv_in, np.int64))
        x = ed.op("Reshape", "linear_to_4d", [x, shape], plan.conv_in, dtype)
    elif plan.layout == "nhwc":
        x = ed.op("Transpose", "linear_to_nchw", [x], plan.conv_in, dtype, perm=_NHWC_TO_NCHW)
    conv_out = absorbed_out or ed.var("linear_conv_out", dtype, plan.conv_out)
    ed.node("Conv", "linear_conv", [x, weight, bias], [conv_out], kernel_shape=plan.kernel)
    for node in rewire:
        if node is not None:
            node.inputs[0] = conv_out
    if plan.back == "reshape":
        shape = ed.const("to_2d", np.array(plan.out_shape, np.int64))
        ed.node("Reshape", "linear_back", [conv_out, shape], [out])
    elif plan.back == "transpose":
        ed.node("Transpose", "linear_back", [conv_out], [out], perm=_NCHW_TO_NHWC)


def _describe(plan: LinearPlan, op: str, name: str) -> str:
    how = {
        "nchw": f"reads the 4-D map {fmt_shape(plan.conv_in)} directly",
        "flat": "after a Reshape to 4-D",
        "nhwc": "between NHWC↔NCHW Transposes",
    }[plan.layout]
    kernel = "×".join(str(k) for k in plan.kernel)
    back = {"reshape": "; Reshape back to 2-D", "transpose": "; Transpose back", None: ""}
    return f"{op} {name} → {kernel} Conv ({how}){back[plan.back]}"


@register
class GemmToConv(GraphRule):
    """Rewrite a Gemm with a constant B as a Conv: alpha, beta, transB and the bias C fold into
    the Conv's weight and bias.

    A Gemm is rank 2 and the MLA runs 4-D tensors only; the same product as a Conv runs on the
    MLA. When the Gemm reads a flattened 4-D map (Flatten, Reshape or Squeeze of [N, C, H, W]),
    the Conv reads the map itself with an H×W kernel and the flatten goes away. A Reshape back
    to [N, M] is added only when a consumer or the graph output needs the 2-D tensor; Reshape or
    Flatten consumers read the 4-D result directly. transA=1 and a C that varies per row are
    left alone. alpha·B is rounded once, so results match to float rounding.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "gemm-to-conv"
    suggest_for = frozenset({"Gemm"})
    summary = "Gemm with constant weights → Conv (1×1, or H×W over a flattened map)."
    category = "replace"
    example = "surgery apply gemm-to-conv mobilenet_v2.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Gemm"):
            plan = self._plan(pat, node)
            if plan is None:
                continue
            m = plan.conv_out[1]
            main, helpers = _probes(ctx, pat, plan, m)
            found.append(
                self.match(
                    plan.removed,
                    _describe(plan, "Gemm", pat.name(node)),
                    net_freed(ctx, plan.removed, main, helpers),
                    plan=dict(vars(plan)),
                )
            )
        return found

    @staticmethod
    def _plan(pat: Pattern, node: int) -> LinearPlan | None:
        ins = pat.ins(node)
        attrs = pat.attrs(node)
        a_shape, b_shape = pat.shape(ins[0]), pat.shape(ins[1])
        if attrs.get("transA", 0) or a_shape is None or b_shape is None or len(a_shape) != 2:
            return None
        if not pat.is_const(ins[1]) or not pat.is_float(ins[0]):
            return None
        k, m = a_shape[1], b_shape[0] if attrs.get("transB", 0) else b_shape[1]
        c = ins[2] if len(ins) > 2 and ins[2] else None
        if c is not None and not _row_bias(pat, c, m):
            return None
        return _finish_plan(pat, node, ins[0], k, m, c)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        plan = LinearPlan(**match.data["plan"])
        gemm = ed.node_named(match.nodes[0])
        assert gemm is not None
        attrs = gemm.attrs
        b = ed.value(gemm.inputs[1])
        if b is None:
            return False
        b = np.asarray(b, np.float64)
        w = float(attrs.get("alpha", 1.0)) * (b if attrs.get("transB", 0) else b.T)
        bias = None
        if plan.bias is not None:
            c = ed.value(ed.tensor(plan.bias))
            if c is None:
                return False
            own_c = len(gemm.inputs) > 2 and plan.bias == gemm.inputs[2].name
            beta = float(attrs.get("beta", 1.0)) if own_c else 1.0
            bias = beta * np.broadcast_to(np.asarray(c, np.float64).reshape(-1), (w.shape[0],))
        _build(ed, plan, w, bias)
        return True


def _row_bias(pat: Pattern, c: str, m: int) -> bool:
    """C is the same for every row: a scalar, [M], [1, M] (or [N, M] with N = 1)."""
    shape = pat.view.tensor(c).shape
    if not pat.is_const(c) or shape is None or not all(isinstance(d, int) for d in shape):
        return False
    size = int(np.prod(shape)) if shape else 1
    return (size == 1 or (shape[-1] == m and size == m)) and len(shape) <= 2


@register
class MatMulToConv(GraphRule):
    """Rewrite a MatMul with a constant 2-D weight as a 1×1 Conv.

    [N, K] @ [K, M] is the Gemm case (a flattened 4-D input is read directly by an H×W Conv);
    a channels-last [N, H, W, K] @ [K, M] becomes Transpose → 1×1 Conv → Transpose, where a
    neighbouring NCHW↔NHWC Transpose is absorbed instead of added. A following Add of a
    per-feature constant becomes the Conv bias. Rank-3 [B, L, C] inputs (transformers) are left
    to the rank rules, which turn them 4-D first. Exact up to float rounding.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "matmul-to-conv"
    suggest_for = frozenset({"MatMul"})
    summary = "MatMul with a constant 2-D weight (rank-2 or channels-last 4-D input) → 1×1 Conv."
    category = "replace"
    example = "surgery apply matmul-to-conv ppocr_mobile_v2_cls.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("MatMul"):
            ins = pat.ins(node)
            a_shape, b_shape = pat.shape(ins[0]), pat.shape(ins[1])
            if a_shape is None or b_shape is None or len(b_shape) != 2:
                continue
            if len(a_shape) not in (2, 4) or not pat.is_const(ins[1]) or not pat.is_float(ins[0]):
                continue
            k, m = b_shape
            plan = _finish_plan(pat, node, ins[0], k, m, None)
            if plan is None:
                continue
            main, helpers = _probes(ctx, pat, plan, m)
            found.append(
                self.match(
                    plan.removed,
                    _describe(plan, "MatMul", pat.name(node)),
                    net_freed(ctx, plan.removed, main, helpers),
                    plan=dict(vars(plan)),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        plan = LinearPlan(**match.data["plan"])
        mm = ed.node_named(match.nodes[0])
        assert mm is not None
        b = ed.value(mm.inputs[1])
        bias = ed.value(ed.tensor(plan.bias)) if plan.bias else None
        if b is None or (plan.bias and bias is None):
            return False
        _build(ed, plan, np.asarray(b, np.float64).T, bias)
        return True
