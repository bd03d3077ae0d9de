"""expand-ort-fused-ops: ONNX Runtime's fused contrib ops written back as the standard ops they fuse.

A model saved from an ONNX Runtime session (`SessionOptions.optimized_model_filepath`) or by
Optimum's `ORTOptimizer` carries ORT's fusions as com.microsoft ops: `FusedConv` (Conv +
activation, + a residual input), `FusedGemm`, `FusedMatMul` (transposes and a scale),
`Gelu`/`BiasGelu`/`FastGelu`, `SkipLayerNormalization` (residual Add + LayerNorm),
`SkipSimplifiedLayerNormalization`/`SimplifiedLayerNormalization` (RMSNorm), and the
transformer optimizer's `Attention` and `EmbedLayerNormalization` (BERT). (ORT's CUDA-only
fusions such as `BiasAdd` are not expanded: its CPU build cannot run them to verify.)
No NPU compiler reads them: ORT's optimised MobileNetV2 (35 FusedConv) maps to no MLA segment.
Each op is the short standard graph it was fused from, built here as a function body from the
node's attributes and inlined (`inline_function`), so the MLA runs it and the other rules
(4-D lifting, GELU forms) see the ops they know. ONNX Runtime runs both forms: verification
compares them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from surgery.graph import FLOAT_TYPES, attribute_values
from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.expand_functions import ExpandFunctionOps
from surgery.rules.registry import register

_CONTRIB = "com.microsoft"


class _Unexpandable(Exception):
    """A fused op whose attributes or operands have no standard form here (the message)."""


class _Body:
    """A function body under construction: formal inputs `x0, x1, ...` (the node's inputs by
    position), outputs `y0, y1, ...`, and the ops between them."""

    def __init__(self, ctx: RuleContext, idx: int) -> None:
        self.ctx, self.idx = ctx, idx
        self.view = ctx.view
        self.inputs = list(ctx.view.node_inputs[idx])
        self.outputs = list(ctx.view.node_outputs[idx])
        self.attrs = attribute_values(ctx.view.nodes[idx])
        self.nodes: list[onnx.NodeProto] = []
        # The first typed operand (a fused op's output type is unknown to ONNX's inference,
        # so the next fused op's input may be untyped; its weights are typed): float if none.
        known = [t for t in (self.view.tensor(name).elem_type for name in self.inputs if name) if t]
        floats = [t for t in known if t in FLOAT_TYPES]
        if known and not floats:
            raise _Unexpandable("its operands are not float tensors")
        elem_type = floats[0] if floats else onnx.TensorProto.FLOAT
        self.float_type = elem_type
        self.dtype = helper.tensor_dtype_to_np_dtype(elem_type)

    def given(self, k: int) -> bool:
        return k < len(self.inputs) and bool(self.inputs[k])

    def wanted(self, k: int) -> bool:
        """Whether output `k` exists and something reads it (or it is a graph output)."""
        if k >= len(self.outputs) or not self.outputs[k]:
            return False
        name = self.outputs[k]
        return bool(self.view.consumers.get(name)) or name in self.view.graph_outputs

    def x(self, k: int) -> str:
        return f"x{k}"

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, **attrs) -> str:
        out = out or f"t{len(self.nodes)}"
        self.nodes.append(
            helper.make_node(
                op_type, list(inputs), [out], name=f"{op_type}_{len(self.nodes)}", **attrs
            )
        )
        return out

    def ops(self, op_type: str, inputs: Sequence[str], count: int, **attrs) -> list[str]:
        """An op with `count` outputs."""
        outs = [f"t{len(self.nodes)}_{k}" for k in range(count)]
        self.nodes.append(
            helper.make_node(
                op_type, list(inputs), outs, name=f"{op_type}_{len(self.nodes)}", **attrs
            )
        )
        return outs

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        if self.ctx.opset >= 13:
            return self.op("Unsqueeze", [x, self.const(list(axes), np.int64)])
        return self.op("Unsqueeze", [x], axes=list(axes))

    def rank(self, k: int) -> int | None:
        shape = self.view.tensor(self.inputs[k]).shape if self.given(k) else None
        return None if shape is None else len(shape)

    def layer_norm(self, x: str, gamma: str, beta: str | None, epsilon: float, out: str) -> None:
        """LayerNormalization over the last axis (its ReduceMean form below opset 17)."""
        if self.ctx.opset >= 17:
            inputs = [x, gamma, *([beta] if beta else [])]
            self.op("LayerNormalization", inputs, out, axis=-1, epsilon=epsilon)
            return
        centred = self.op("Sub", [x, self.mean_over_last_axis(x)])
        variance = self.mean_over_last_axis(self.op("Mul", [centred, centred]))
        std = self.op("Sqrt", [self.op("Add", [variance, self.const(epsilon)])])
        scaled = self.op("Mul", [self.op("Div", [centred, std]), gamma])
        if beta:
            self.op("Add", [scaled, beta], out)
        else:
            self.op("Identity", [scaled], out)

    def const(self, value: float | Sequence[float], dtype: np.dtype | None = None) -> str:
        array = np.asarray(value, dtype or self.dtype)
        out = f"t{len(self.nodes)}"
        self.nodes.append(
            helper.make_node(
                "Constant",
                [],
                [out],
                name=f"Constant_{len(self.nodes)}",
                value=numpy_helper.from_array(array, out),
            )
        )
        return out

    def reduce(
        self, op_type: str, x: str, axes: Sequence[int], keepdims: int, out: str | None = None
    ) -> str:
        """ReduceMean / ReduceSum over `axes`, which became an input (ReduceSum at opset 13,
        the others at 18)."""
        as_input = self.ctx.opset >= (13 if op_type == "ReduceSum" else 18)
        if as_input:
            return self.op(op_type, [x, self.const(list(axes), np.int64)], out, keepdims=keepdims)
        return self.op(op_type, [x], out, axes=list(axes), keepdims=keepdims)

    def mean_over_last_axis(self, x: str) -> str:
        return self.reduce("ReduceMean", x, [-1], keepdims=1)

    def positions(self) -> str:
        """0, 1, …, S - 1 for the sequence axis (1) of input 0."""
        length = self.op("Gather", [self.op("Shape", [self.x(0)]), self.const(1, np.int64)], axis=0)
        return self.op("Range", [self.const(0, np.int64), length, self.const(1, np.int64)])

    def function(self) -> onnx.FunctionProto:
        return helper.make_function(
            "surgery.expanded",
            self.view.op_types[self.idx],
            [f"x{k}" for k in range(len(self.inputs))],
            [f"y{k}" for k in range(len(self.outputs))],
            self.nodes,
            [helper.make_opsetid("", self.ctx.opset)],
        )


def _activation(body: _Body, x: str, out: str, kind: str, params: Sequence[float]) -> None:
    """`kind` (FusedConv / FusedGemm's activation attribute) applied to `x`, into `out`."""
    if kind in ("", None):
        body.op("Identity", [x], out)
    elif kind in ("Relu", "Sigmoid", "Tanh"):
        body.op(kind, [x], out)
    elif kind == "LeakyRelu":
        body.op("LeakyRelu", [x], out, alpha=float(params[0]) if params else 0.01)
    elif kind == "HardSigmoid":
        alpha, beta = (list(params) + [0.2, 0.5][len(params) :])[:2]
        body.op("HardSigmoid", [x], out, alpha=float(alpha), beta=float(beta))
    elif kind == "Clip" and len(params) >= 2:
        if body.ctx.opset >= 11:
            body.op("Clip", [x, body.const(params[0]), body.const(params[1])], out)
        else:
            body.op("Clip", [x], out, min=float(params[0]), max=float(params[1]))
    else:
        raise _Unexpandable(f"activation {kind!r} has no standard form here")


def _fused_conv(body: _Body) -> None:
    """act(Conv(X, W, B) + Z)."""
    conv_attrs = {
        k: v
        for k, v in body.attrs.items()
        if k in ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
    }
    inputs = [body.x(0), body.x(1), *([body.x(2)] if body.given(2) else [])]
    y = body.op("Conv", inputs, **conv_attrs)
    if body.given(3):
        y = body.op("Add", [y, body.x(3)])
    params = body.attrs.get("activation_params") or []
    _activation(body, y, "y0", body.attrs.get("activation") or "", params)


def _fused_gemm(body: _Body) -> None:
    """act(alpha·A'·B' + beta·C)."""
    gemm_attrs = {k: v for k, v in body.attrs.items() if k in ("alpha", "beta", "transA", "transB")}
    inputs = [body.x(0), body.x(1), *([body.x(2)] if body.given(2) else [])]
    y = body.op("Gemm", inputs, **gemm_attrs)
    params = [
        body.attrs[k]
        for k in ("activation_alpha", "activation_beta", "activation_gamma")
        if body.attrs.get(k) is not None
    ]
    _activation(body, y, "y0", body.attrs.get("activation") or "", params)


def _fused_matmul(body: _Body) -> None:
    """alpha · MatMul(A or its last two axes swapped, B likewise)."""
    if body.attrs.get("transBatchA") or body.attrs.get("transBatchB"):
        raise _Unexpandable("transBatchA/transBatchB (batch-axis transposes) are not expanded")
    operands = []
    for k, flag in ((0, "transA"), (1, "transB")):
        operand = body.x(k)
        if body.attrs.get(flag):
            shape = body.view.tensor(body.inputs[k]).shape
            if shape is None or len(shape) < 2:
                raise _Unexpandable(f"{flag} on an operand of unknown rank")
            rank = len(shape)
            perm = [*range(rank - 2), rank - 1, rank - 2]
            operand = body.op("Transpose", [operand], perm=perm)
        operands.append(operand)
    alpha = float(body.attrs.get("alpha", 1.0))
    if alpha == 1.0:
        body.op("MatMul", operands, "y0")
    else:
        body.op("Mul", [body.op("MatMul", operands), body.const(alpha)], "y0")


def _erf_gelu(body: _Body, x: str, out: str) -> None:
    """0.5·x·(1 + erf(x/√2)): the form exporters write below opset 20."""
    erf = body.op("Erf", [body.op("Div", [x, body.const(math.sqrt(2.0))])])
    body.op(
        "Mul", [body.op("Mul", [x, body.op("Add", [erf, body.const(1.0)])]), body.const(0.5)], out
    )


def _gelu(body: _Body) -> None:
    _erf_gelu(body, body.x(0), "y0")


def _bias_gelu(body: _Body) -> None:
    _erf_gelu(body, body.op("Add", [body.x(0), body.x(1)]), "y0")


def _fast_gelu(body: _Body) -> None:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), x = X + bias."""
    x = body.op("Add", [body.x(0), body.x(1)]) if body.given(1) else body.x(0)
    cube = body.op("Mul", [body.op("Mul", [x, x]), x])
    inner = body.op("Add", [x, body.op("Mul", [cube, body.const(0.044715)])])
    tanh = body.op("Tanh", [body.op("Mul", [inner, body.const(math.sqrt(2.0 / math.pi))])])
    half = body.op("Mul", [x, body.const(0.5)])
    body.op("Mul", [half, body.op("Add", [tanh, body.const(1.0)])], "y0")


def _skip_sum(body: _Body, bias_at: int) -> str:
    """input + skip (+ bias): what SkipLayerNormalization normalises, and its output 3."""
    total = body.op("Add", [body.x(0), body.x(1)])
    if body.given(bias_at):
        total = body.op("Add", [total, body.x(bias_at)])
    if body.wanted(3):
        body.op("Identity", [total], "y3")
    return total


def _refuse_statistics(body: _Body) -> None:
    if body.wanted(1) or body.wanted(2):
        raise _Unexpandable("its mean / inv_std_var outputs are read")


def _skip_layer_norm(body: _Body) -> None:
    """LayerNormalization(input + skip + bias, gamma, beta) over the last axis."""
    _refuse_statistics(body)
    total = _skip_sum(body, 4)
    epsilon = float(body.attrs.get("epsilon", 1e-12))
    beta = body.x(3) if body.given(3) else None
    body.layer_norm(total, body.x(2), beta, epsilon, "y0")


def _rms_norm(body: _Body, x: str, scale: str, epsilon: float) -> None:
    """x / √(mean(x²) + ε) · scale over the last axis."""
    mean_square = body.mean_over_last_axis(body.op("Mul", [x, x]))
    rms = body.op("Sqrt", [body.op("Add", [mean_square, body.const(epsilon)])])
    body.op("Mul", [body.op("Div", [x, rms]), scale], "y0")


def _skip_simplified_layer_norm(body: _Body) -> None:
    _refuse_statistics(body)
    total = _skip_sum(body, 3)
    _rms_norm(body, total, body.x(2), float(body.attrs.get("epsilon", 1e-12)))


def _simplified_layer_norm(body: _Body) -> None:
    if body.wanted(1):
        raise _Unexpandable("its inv_std_var output is read")
    shape = body.view.tensor(body.inputs[0]).shape
    axis = int(body.attrs.get("axis", -1))
    if axis != -1 and (shape is None or axis != len(shape) - 1):
        raise _Unexpandable(f"axis {axis} is not the last axis")
    _rms_norm(body, body.x(0), body.x(1), float(body.attrs.get("epsilon", 1e-5)))


def _attention(body: _Body) -> None:
    """Self-attention of ORT's BERT fusion: one input projected to Q, K, V by one weight,
    `num_heads` heads, softmax(Q·Kᵀ·scale + mask)·V, heads merged. The mask is a raw
    [batch, sequence] 0/1 mask or 1-D end positions (what EmbedLayerNormalization's mask_index
    gives); mask_filter_value is added where it is 0."""
    if any(body.given(k) for k in (4, 5, 6)) or body.wanted(1):
        raise _Unexpandable("past state or an attention bias")
    if body.attrs.get("unidirectional") or body.attrs.get("do_rotary"):
        raise _Unexpandable("causal or rotary attention")
    weights = body.view.tensor(body.inputs[1]).shape
    heads = int(body.attrs.get("num_heads", 0))
    sizes = body.attrs.get("qkv_hidden_sizes")
    if weights is None or len(weights) != 2 or not isinstance(weights[1], int) or not heads:
        raise _Unexpandable("weights of unknown shape")
    hidden = weights[1] // 3
    if (sizes and len(set(sizes)) != 1) or weights[1] % 3 or hidden % heads:
        raise _Unexpandable("Q, K and V of different widths")
    head = hidden // heads
    qkv = body.op("MatMul", [body.x(0), body.x(1)])
    if body.given(2):
        qkv = body.op("Add", [qkv, body.x(2)])
    if body.ctx.opset >= 13:
        parts = body.ops("Split", [qkv, body.const([hidden] * 3, np.int64)], 3, axis=-1)
    else:
        parts = body.ops("Split", [qkv], 3, axis=-1, split=[hidden] * 3)
    split_heads = body.const([0, 0, heads, head], np.int64)
    q, k, v = (
        body.op("Transpose", [body.op("Reshape", [t, split_heads])], perm=perm)
        for t, perm in zip(parts, ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3]), strict=True)
    )
    scale = float(body.attrs.get("scale") or 1.0 / math.sqrt(head))
    scores = body.op("Mul", [body.op("MatMul", [q, k]), body.const(scale)])
    if body.given(3):
        keep = _attention_keep_mask(body)
        masked = body.op("Sub", [body.const(1.0), keep])
        filler = float(body.attrs.get("mask_filter_value") or -10000.0)
        additive = body.op("Mul", [masked, body.const(filler)])
        scores = body.op("Add", [scores, body.unsqueeze(additive, [1, 2])])
    probabilities = body.op("Softmax", [scores], axis=-1)
    context = body.op("Transpose", [body.op("MatMul", [probabilities, v])], perm=[0, 2, 1, 3])
    body.op("Reshape", [context, body.const([0, 0, hidden], np.int64)], "y0")


def _attention_keep_mask(body: _Body) -> str:
    """[batch, sequence] floats, 1 where a key is attended: the raw mask, or positions before
    each row's end position."""
    rank = body.rank(3)
    source = body.view.producer.get(body.inputs[3])
    if (
        rank is None
        and source is not None
        and body.view.op_types[source] == "EmbedLayerNormalization"
    ):
        rank = 1  # its mask_index, [batch]: ONNX's inference does not type contrib outputs
    if rank == 2:
        return body.op("Cast", [body.x(3)], to=body.float_type)
    if rank != 1:
        raise _Unexpandable(f"a mask_index of rank {rank} (only [batch] or [batch, seq])")
    positions = body.positions()
    ends = body.unsqueeze(body.op("Cast", [body.x(3)], to=onnx.TensorProto.INT64), [1])
    before_end = body.op("Less", [body.unsqueeze(positions, [0]), ends])
    return body.op("Cast", [before_end], to=body.float_type)


def _embed_layer_norm(body: _Body) -> None:
    """LayerNorm(word[ids] + position[0..S) (or position_ids) + segment[segment_ids]); its
    mask_index output is each row's count of mask ones."""
    if body.attrs.get("mask_index_type") not in (None, 1):
        raise _Unexpandable("a mask_index_type other than 1")
    total = body.op("Gather", [body.x(2), body.x(0)], axis=0)
    positions = body.x(8) if body.given(8) else body.positions()
    total = body.op("Add", [total, body.op("Gather", [body.x(3), positions], axis=0)])
    if body.given(1) and body.given(4):
        total = body.op("Add", [total, body.op("Gather", [body.x(4), body.x(1)], axis=0)])
    epsilon = float(body.attrs.get("epsilon", 1e-12))
    body.layer_norm(total, body.x(5), body.x(6), epsilon, "y0")
    if body.wanted(1):
        if not body.given(7):
            raise _Unexpandable("its mask_index output is read but it has no mask")
        mask = body.op("Cast", [body.x(7)], to=onnx.TensorProto.INT32)
        body.reduce("ReduceSum", mask, [1], keepdims=0, out="y1")
    if body.wanted(2):
        body.op("Identity", [total], "y2")


_EXPANSIONS: dict[tuple[str, str], Callable[[_Body], None]] = {
    (_CONTRIB, "FusedConv"): _fused_conv,
    (_CONTRIB, "FusedGemm"): _fused_gemm,
    (_CONTRIB, "FusedMatMul"): _fused_matmul,
    (_CONTRIB, "Gelu"): _gelu,
    (_CONTRIB, "BiasGelu"): _bias_gelu,
    (_CONTRIB, "FastGelu"): _fast_gelu,
    (_CONTRIB, "SkipLayerNormalization"): _skip_layer_norm,
    (_CONTRIB, "SkipSimplifiedLayerNormalization"): _skip_simplified_layer_norm,
    (_CONTRIB, "Attention"): _attention,
    (_CONTRIB, "EmbedLayerNormalization"): _embed_layer_norm,
    ("", "SimplifiedLayerNormalization"): _simplified_layer_norm,  # ORT registers it in ONNX's
}
"""The fused ops expanded, by (domain, op type)."""

EXPANDED_OPS = frozenset(op for _, op in _EXPANSIONS)


def expansion(ctx: RuleContext, idx: int) -> onnx.FunctionProto:
    """The standard-op body of fused node `idx`; `_Unexpandable` says why there is none."""
    domain = ctx.view.domains[idx]
    key = ("" if domain in ("", "ai.onnx") else domain, ctx.view.op_types[idx])
    body = _Body(ctx, idx)
    _EXPANSIONS[key](body)
    return body.function()


@register
class ExpandOrtFusedOps(ExpandFunctionOps):
    """Replace ONNX Runtime's fused contrib ops by the standard ops they fuse.

    FusedConv → Conv (+ Add of its residual input) + its activation (Relu, Clip, Sigmoid,
    Tanh, LeakyRelu, HardSigmoid); FusedGemm → Gemm + activation; FusedMatMul → MatMul with
    its transposes and scale; com.microsoft Gelu / BiasGelu → the erf GELU, FastGelu → the
    tanh GELU (after its bias); SkipLayerNormalization → Add(s) + LayerNormalization (its
    ReduceMean form below opset 17); SkipSimplifiedLayerNormalization and
    SimplifiedLayerNormalization → the RMSNorm of their input; Attention (ORT's BERT
    self-attention: one QKV weight, a raw [batch, seq] mask or 1-D end positions) → MatMuls,
    head reshapes and a Softmax; EmbedLayerNormalization → Gathers, Adds and the LayerNorm,
    its mask_index the count of mask ones per row. These are
    what an ONNX Runtime session saves as its optimised model; the MLA runs none of them as
    fused, and all of the standard forms. An op whose statistics outputs are read, with
    batch-axis transposes, or (Attention) with past state, an attention bias, a causal or
    rotary form, stays. The bodies are inlined and folded as expand-function-ops
    inlines ONNX's own.
    """

    name = "expand-ort-fused-ops"
    summary = (
        "ONNX Runtime's fused contrib ops (FusedConv, FusedGemm, FusedMatMul, Gelu, FastGelu, "
        "SkipLayerNormalization, Attention, EmbedLayerNormalization, …) → the standard ops "
        "they fuse."
    )
    category = "cleanup"
    example = "surgery apply expand-ort-fused-ops model_ort_optimized.onnx -o expanded.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        view = ctx.view
        found = []
        if EXPANDED_OPS.isdisjoint(view.op_types):
            return found
        for idx, op in enumerate(view.op_types):
            domain = "" if view.domains[idx] in ("", "ai.onnx") else view.domains[idx]
            if (domain, op) not in _EXPANSIONS:
                continue
            try:
                body = expansion(ctx, idx)
            except _Unexpandable:
                continue
            name = view.names[idx]
            ops = sorted({n.op_type for n in body.node} - {"Constant", "Identity"})
            note = f"{op} {name} → {', '.join(ops)}"
            found.append(self.match([name], note, [name], body=body.SerializeToString()))
        return found
