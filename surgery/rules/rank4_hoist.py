"""last-axis-op-before-reshape: an op that works along the last axis only, found on a rank-5/6
tensor, moved before the Reshapes and Transposes that made that tensor (they keep the last axis).

Windowed attention partitions the token map with Reshape [B, H, W, C] → [B, H/ws, ws, W/ws,
ws, C] and Transpose(0, 1, 3, 2, 4, 5) and only then applies the qkv Linear (Twins' locally
grouped attention), so the Linear reads a tensor with five non-unit axes that fits no 4-D
layout: it stays on the host between two MLA segments with the movement around it. A Linear
over the last axis (MatMul by a constant matrix, a bias Add), a Slice of the last axis, a
LayerNorm or Softmax over it, or an elementwise op commutes with any Reshape or Transpose that
keeps the last axis where it is: f(M(x)) = M'(f(x)), M' the same movement with the new last
dimension. Applied before the movement, on the ≤ 4-D tensor the chain starts from, the op is
one the rank lifts carry, and what remains is data movement (`transpose-to-block-swaps`,
`slice-qkv`). Exact: the same arithmetic on the same numbers, in another order of the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import Editor, GraphRule, Pattern

MOVEMENT_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")
"""Nodes that only rearrange data; those that keep the last axis carry a hoisted op."""

ELEMENTWISE_UNARY = frozenset(
    {
        "Abs",
        "Ceil",
        "Clip",
        "Cos",
        "Elu",
        "Erf",
        "Exp",
        "Floor",
        "Gelu",
        "HardSigmoid",
        "HardSwish",
        "LeakyRelu",
        "Log",
        "Mish",
        "Neg",
        "Reciprocal",
        "Relu",
        "Round",
        "Sigmoid",
        "Sign",
        "Sin",
        "Softplus",
        "Sqrt",
        "Tanh",
    }
)
"""Ops of one tensor that treat every element alike (Clip's bounds must be constants)."""

ELEMENTWISE_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})

LAST_AXIS_OPS = frozenset(
    {"MatMul", "Slice", "LayerNormalization", "Softmax", "LogSoftmax"}
    | ELEMENTWISE_UNARY
    | ELEMENTWISE_BINARY
)

MAX_LIFTED_RANK = 4
"""The op is hoisted only off tensors above this rank, and only as far as the first tensor at
or below it: the rank lifts carry it from there."""


@dataclass
class Hoist:
    """One op to move: the node, which input is the data, and the movement above it."""

    node: str
    data_input: int
    chain: list[str]
    """Movement nodes from the top of the chain down to the op's data input."""
    top: str
    """The tensor the chain starts from (rank ≤ MAX_LIFTED_RANK): the hoisted op reads it."""
    result_shape: list[int]
    """The hoisted op's output: the top's shape with the op's last dimension."""
    shapes: list[list[int]]
    """Output shape of each chain node, top first, with the op's last dimension."""


def _axis_is_last(axis: int, rank: int) -> bool:
    return axis in (-1, rank - 1)


def _data_input(pat: Pattern, idx: int, rank: int) -> int | None:
    """Which input of node `idx` is the tensor it works along the last axis of (the others
    are constants that do not vary along the leading axes), or None."""
    op, ins = pat.op(idx), pat.ins(idx)
    if any(i and not pat.is_const(i) for i in ins[1:]) and op not in ELEMENTWISE_BINARY:
        return None
    if op in ELEMENTWISE_UNARY:
        return 0 if all(pat.is_const(i) for i in ins[1:] if i) else None
    if op == "MatMul":
        w = pat.shape(ins[1])
        return 0 if w is not None and len(w) == 2 and pat.is_const(ins[1]) else None
    if op in ELEMENTWISE_BINARY:
        if len(ins) != 2 or pat.is_const(ins[0]) == pat.is_const(ins[1]):
            return None
        k = 1 if pat.is_const(ins[0]) else 0
        const = pat.shape(ins[1 - k])
        if const is None or len(const) > rank or any(d != 1 for d in const[:-1]):
            return None
        return k
    if op == "Slice":
        axes = pat.value(ins[3]) if len(ins) > 3 and ins[3] else None
        if len(ins) < 3 or axes is None or pat.value(ins[1]) is None or pat.value(ins[2]) is None:
            return None
        return 0 if all(_axis_is_last(int(a), rank) for a in axes.reshape(-1)) else None
    if op in ("LayerNormalization", "Softmax", "LogSoftmax"):
        if not _axis_is_last(int(pat.attrs(idx).get("axis", -1)), rank):
            return None
        if op == "LayerNormalization" and not pat.unused_extra_outputs(idx):
            return None
        return 0
    return None


def _keeps_last_axis(pat: Pattern, idx: int, before: tuple, after: tuple) -> bool:
    """Whether movement node `idx` leaves the last axis as it is: a Transpose that does not
    move it, or a reshape whose input and output end in the same dimension (row-major order
    then keeps every element's last index)."""
    if not before or not after:
        return False
    if pat.op(idx) == "Transpose":
        perm = pat.attrs(idx).get("perm")
        return perm is not None and int(perm[-1]) == len(before) - 1
    return before[-1] == after[-1]


@register
class LastAxisOpBeforeReshape(GraphRule):
    """Move an op that works along the last axis only — MatMul by a constant matrix, Add /
    Mul / … with a constant that varies along the last axis at most, a Slice of the last
    axis, LayerNormalization / Softmax over it, an elementwise op — from a rank-5/6 tensor to
    before the Reshapes and Transposes that made it from a tensor of rank ≤ 4, when they all
    keep the last axis in place.

    f(M(x)) = M'(f(x)) for such an op f and movement M (M' is M with f's last dimension), so
    the op then reads the ≤ 4-D tensor and the movement carries its result. Exact. Only ops
    the target keeps off the MLA, with movement that feeds nothing else, are moved.
    """

    name = "last-axis-op-before-reshape"
    suggest_for = LAST_AXIS_OPS
    summary = (
        "An op along the last axis only (Linear, bias, Slice, LayerNorm, Softmax, elementwise) "
        "on a rank-5/6 tensor → before the Reshapes/Transposes that keep that axis."
    )
    category = "cleanup"
    example = "surgery apply last-axis-op-before-reshape twins_svt.onnx -o twins_hoisted.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for idx in pat.blocked(*LAST_AXIS_OPS):
            site = self._site(pat, idx)
            if site is None:
                continue
            found.append(
                self.match(
                    [site.node, *site.chain],
                    f"{pat.op(idx)} {site.node} on a rank-{len(pat.shape(pat.ins(idx)[site.data_input]))} "
                    f"tensor → before {len(site.chain)} movement node(s), on {site.top}",
                    [site.node],
                    hoist=dict(vars(site)),
                )
            )
        return found

    def _site(self, pat: Pattern, idx: int) -> Hoist | None:
        data_index = None
        for k, t in enumerate(pat.ins(idx)[:2]):
            if t and not pat.is_const(t):
                data_index = k
                break
        if data_index is None:
            return None
        data = pat.ins(idx)[data_index]
        shape, out = pat.shape(data), pat.shape(pat.outs(idx)[0])
        if shape is None or out is None or len(shape) <= MAX_LIFTED_RANK or not pat.is_float(data):
            return None
        if _data_input(pat, idx, len(shape)) != data_index or len(out) != len(shape):
            return None
        if tuple(out[:-1]) != tuple(shape[:-1]):
            return None  # a broadcast that grows the leading axes is not along the last axis
        chain, tensor = [], data
        while True:
            p = pat.producer(tensor, *MOVEMENT_OPS)
            if p is None or not pat.private(tensor):
                return None
            source = pat.ins(p)[0]
            before, after = pat.shape(source), pat.shape(tensor)
            if before is None or after is None or not _keeps_last_axis(pat, p, before, after):
                return None
            chain.append(p)
            tensor = source
            if len(before) <= MAX_LIFTED_RANK:
                break
        if len(pat.shape(tensor) or ()) < 2 or pat.is_const(tensor):
            return None
        last = out[-1]
        shapes = [[*pat.shape(pat.outs(p)[0])[:-1], last] for p in reversed(chain)]
        return Hoist(
            pat.name(idx),
            data_index,
            [pat.name(p) for p in reversed(chain)],
            tensor,
            [*pat.shape(tensor)[:-1], last],
            shapes,
        )

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        site = Hoist(**match.data["hoist"])
        op = ed.node_named(site.node)
        chain = [ed.node_named(n) for n in site.chain]
        if op is None or any(n is None for n in chain):
            return False
        top = ed.tensor(site.top)
        result = op.outputs[0]
        dtype = result.dtype or np.float32
        rank = len(site.result_shape)
        inputs = list(op.inputs)
        inputs[site.data_input] = top
        attrs = dict(op.attrs)
        if op.op in ("LayerNormalization", "Softmax", "LogSoftmax"):
            attrs["axis"] = -1
        if op.op == "Slice":
            inputs[3] = ed.const("hoisted_slice_axes", np.full(len(ed.value(inputs[3])), -1))
        if op.op in ELEMENTWISE_BINARY:
            k = 1 - site.data_input
            value = ed.value(inputs[k])
            if value is not None and value.ndim > rank:
                inputs[k] = ed.const("hoisted_operand", value.reshape(value.shape[-1:]))
        lifted = ed.var(f"{site.node}_hoisted", dtype, site.result_shape)
        ed.node(op.op, f"{site.node}_hoisted", inputs, [lifted], **attrs)
        ed.detach(op)
        current = lifted
        for k, (node, shape) in enumerate(zip(chain, site.shapes, strict=True)):
            out = result if k == len(chain) - 1 else ed.var(f"{node.name}_moved", dtype, shape)
            if node.op == "Transpose":
                ed.node(
                    "Transpose", f"{node.name}_moved", [current], [out], perm=node.attrs["perm"]
                )
            else:
                target = ed.const(f"{node.name}_moved_shape", np.array(shape, np.int64))
                ed.node("Reshape", f"{node.name}_moved", [current, target], [out])
            current = out
        ed.detach(*chain)
        return True
