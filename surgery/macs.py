"""Multiply-accumulate counts per node, from inferred shapes.

Only matrix work counts (Conv, ConvTranspose, MatMul, Gemm, Einsum and opset 23's Attention,
two products): it is what the MLA exists for and what "MLA share of MACs" means. Elementwise
and data-movement ops count zero.
"""

from __future__ import annotations

import math

import onnx

from surgery.graph import GraphView


def _prod(dims) -> int | None:
    n = 1
    for d in dims:
        if not isinstance(d, int):
            return None
        n *= d
    return n


def node_macs_or_unknown(view: GraphView, idx: int) -> int | None:
    """MACs of a node; None for a matrix op whose shapes are not known (dynamic dims), which
    a MAC share must not silently count as 0."""
    op = view.op_types[idx]
    if op not in _MAC_OPS:
        return 0
    return _MAC_OPS[op](view, idx)


def _conv(view: GraphView, idx: int) -> int | None:
    ins = view.node_inputs[idx]
    if len(ins) < 2:
        return None
    w = view.tensor(ins[1]).shape
    y = view.tensor(view.node_outputs[idx][0]).shape
    if w is None or y is None:
        return None
    out = _prod(y)
    per = _prod(w[1:])  # (C_in / group) * kernel
    return None if out is None or per is None else out * per


def _conv_transpose(view: GraphView, idx: int) -> int | None:
    node: onnx.NodeProto = view.nodes[idx]
    x = view.tensor(node.input[0]).shape
    w = view.tensor(node.input[1]).shape if len(node.input) > 1 else None
    if x is None or w is None:
        return None
    n_in = _prod(x)
    per = _prod(w[1:])  # (C_out / group) * kernel, per input element
    return None if n_in is None or per is None else n_in * per


def _matmul(view: GraphView, idx: int) -> int | None:
    node: onnx.NodeProto = view.nodes[idx]
    a = view.tensor(node.input[0]).shape
    y = view.tensor(node.output[0]).shape
    if not a or y is None:
        return None
    k = a[-1]
    if not isinstance(k, int) and len(node.input) > 1:
        b = view.tensor(node.input[1]).shape  # the reduced axis is also b's second-to-last
        k = (b[-2] if len(b) > 1 else b[0]) if b else k
    out = _prod(y)
    return None if out is None or not isinstance(k, int) else out * k


def _gemm(view: GraphView, idx: int) -> int | None:
    node: onnx.NodeProto = view.nodes[idx]
    a = view.tensor(node.input[0]).shape
    y = view.tensor(node.output[0]).shape
    if a is None or y is None or len(a) != 2:
        return None
    trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
    k = a[0] if trans_a else a[1]
    out = _prod(y)
    return None if out is None or not isinstance(k, int) else out * k


def _einsum(view: GraphView, idx: int) -> int | None:
    node: onnx.NodeProto = view.nodes[idx]
    sizes: dict[str, int] = {}
    eq = next((x.s.decode() for x in node.attribute if x.name == "equation"), "").replace(" ", "")
    if "->" not in eq or "..." in eq:
        return None
    terms = eq.split("->")[0].split(",")
    for term, name in zip(terms, node.input, strict=False):
        shape = view.tensor(name).shape
        if shape is None or len(shape) != len(term):
            return None
        for letter, d in zip(term, shape, strict=True):
            if isinstance(d, int):
                sizes[letter] = d
    letters = set("".join(terms))
    if not letters <= sizes.keys():
        return None
    return math.prod(sizes[x] for x in letters)


def _attention(view: GraphView, idx: int) -> int | None:
    """Q·Kᵀ and P·V: per query head, Sq × Skv × (head size of Q + head size of V)."""
    node: onnx.NodeProto = view.nodes[idx]
    if len(node.input) < 3:
        return None
    q, k, v = (view.tensor(name).shape for name in node.input[:3])
    if q is None or k is None or v is None or len(q) != len(k) or len(q) not in (3, 4):
        return None
    if len(q) == 4:  # [B, heads, S, head size]
        per_head = (q[3], v[3])
        batch_heads, sq, skv = _prod(q[:2]), q[2], k[2]
    else:  # [B, S, heads × head size]
        attrs = {a.name: a.i for a in node.attribute}
        q_heads, kv_heads = attrs.get("q_num_heads"), attrs.get("kv_num_heads")
        if not q_heads or not kv_heads or not all(isinstance(d, int) for d in (q[2], v[2])):
            return None
        per_head = (q[2] // q_heads, v[2] // kv_heads)
        batch_heads, sq, skv = _prod([q[0], q_heads]), q[1], k[1]
    dims = (batch_heads, sq, skv, *per_head)
    if not all(isinstance(d, int) for d in dims):
        return None
    return batch_heads * sq * skv * (per_head[0] + per_head[1])


_MAC_OPS = {
    "Attention": _attention,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Einsum": _einsum,
}
