"""broadcast-concat-to-add: a Linear (MatMul / 1×1 Conv) over a Concat one of whose parts is
a broadcast copy, computed as the sum of per-part products with the copy's product taken once."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    RESHAPES,
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    fmt_shape,
    net_freed,
    probe_node,
    probe_reshape,
    with_axis,
)

MAX_TRACED_ELEMENTS = 1 << 22
"""Largest broadcast part whose copy chain is traced element by element (16 MB of indices)."""


@dataclass(frozen=True)
class BroadcastPart:
    """A Concat input that is `source`, viewed as `aligned` (same rank as the part, 1 on every
    broadcast axis), broadcast to the part's shape by the nodes `chain` (Expand and views)."""

    source: str
    aligned: tuple[int, ...]
    chain: tuple[str, ...]


def broadcast_part(pat: Pattern, tensor: str) -> BroadcastPart | None:
    """`tensor` as a broadcast of a smaller tensor, when the private chain of Expands and
    reshapes producing it copies nothing but that tensor's elements along whole axes.

    The chain is run on an index tensor: an axis is broadcast when every slice along it holds
    the same indices, and the part is that tensor's broadcast exactly when the indices are
    np.broadcast_to of the source's, read in order. No op-by-op case analysis, so any mix of
    views around the Expand (a transformer lift's 4-D staging) is recognised."""
    shape = pat.shape(tensor)
    if shape is None or prod(shape) > MAX_TRACED_ELEMENTS:
        return None
    chain: list[int] = []
    current = tensor
    while True:
        p = pat.producer(current, "Expand", *RESHAPES)
        if p is None or (chain and not pat.private(current)):
            break
        chain.append(p)
        current = pat.ins(p)[0]
    if not any(pat.op(n) == "Expand" for n in chain):
        return None
    source = pat.ins(chain[-1])[0]
    source_shape = pat.shape(source)
    if source_shape is None or any(pat.shape(pat.outs(n)[0]) is None for n in chain):
        return None
    index = np.arange(prod(source_shape)).reshape(source_shape)
    traced = index
    for n in reversed(chain):
        out_shape = pat.shape(pat.outs(n)[0])
        try:
            if pat.op(n) == "Expand":
                traced = np.broadcast_to(traced, out_shape)
            else:
                traced = traced.reshape(out_shape)
        except ValueError:
            return None
    aligned = tuple(
        1 if np.array_equal(traced, traced.take([0], axis=a).repeat(d, axis=a)) else d
        for a, d in enumerate(shape)
    )
    if prod(aligned) != index.size or aligned == shape:
        return None
    if not np.array_equal(np.broadcast_to(index.reshape(aligned), shape), traced):
        return None
    # Read the source where a view before the Expand already has the aligned shape.
    first_expand = max(k for k, n in enumerate(chain) if pat.op(n) == "Expand")
    for k in range(first_expand, len(chain)):
        if pat.shape(pat.ins(chain[k])[0]) == aligned:
            chain = chain[: k + 1]
            break
    source = pat.ins(chain[-1])[0]
    return BroadcastPart(source, aligned, tuple(pat.name(n) for n in chain))


@dataclass(frozen=True)
class LinearOverConcat:
    """The Linear, its Concat, the contracted axis and how each Concat input is read."""

    linear: int
    concat: int
    axis: int
    widths: tuple[int, ...]
    parts: tuple[BroadcastPart | None, ...]


def linear_over_concat(pat: Pattern, concat: int) -> LinearOverConcat | None:
    """The 1×1 Conv (axis 1) or MatMul by a constant matrix (last axis) reading a Concat along
    the axis it contracts, when some Concat input is a broadcast copy and some is not."""
    y = pat.outs(concat)[0]
    linear = pat.sole_consumer(y, "Conv", "MatMul")
    shape = pat.shape(y)
    if linear is None or shape is None or pat.ins(linear)[0] != y:
        return None
    rank = len(shape)
    axis = pat.attrs(concat).get("axis", 0) % rank
    if not _contracts(pat, linear, axis, rank):
        return None
    widths, parts = [], []
    for part in pat.ins(concat):
        part_shape = pat.shape(part)
        if part_shape is None or len(part_shape) != rank:
            return None
        widths.append(part_shape[axis])
        found = broadcast_part(pat, part)
        parts.append(
            found if found is not None and found.aligned[axis] == part_shape[axis] else None
        )
    if all(p is None for p in parts) or all(p is not None for p in parts):
        return None
    return LinearOverConcat(linear, concat, axis, tuple(widths), tuple(parts))


def _contracts(pat: Pattern, linear: int, axis: int, rank: int) -> bool:
    """The Linear is a product by constant weights over exactly the Concat's axis."""
    ins = pat.ins(linear)
    if not pat.is_const(ins[1]) or not pat.is_float(ins[0]):
        return False
    weight = pat.shape(ins[1])
    if pat.op(linear) == "MatMul":
        return axis == rank - 1 and weight is not None and len(weight) == 2
    attrs = pat.attrs(linear)
    one = [1] * (rank - 2)
    return (
        axis == 1
        and rank == 4
        and weight is not None
        and tuple(weight[2:]) == (1, 1)
        and attrs.get("group", 1) == 1
        and list(attrs.get("strides", one)) == one
        and not any(attrs.get("pads", []))
        and (len(ins) < 3 or not ins[2] or pat.is_const(ins[2]))
    )


@register
class BroadcastConcatToAdd(GraphRule):
    """Rewrite Linear(Concat([x, broadcast(c)])) as Linear(x) + Linear(c), the second product
    computed once on c and added with broadcasting.

    A product over concatenated features is the sum of the products of each part with its
    rows of the weights. DPT's readout projection concatenates every patch token with the CLS
    token expanded over all of them (`torch.cat([x, cls.expand_as(x)], -1)`) before a Linear;
    the Expand (256 copies, past expand-to-concat's limit) stays on the host and splits the
    model. Here the CLS token's product is taken once and broadcast by the Add, so nothing
    is copied. Matched for a MatMul by a constant matrix over a Concat on the last axis and
    for a 1×1 Conv over a Concat on the channels (a transformer lifted to 4-D), when at least
    one part is a broadcast copy (an Expand, with any reshapes around it) and one is not.
    """

    name = "broadcast-concat-to-add"
    suggest_for = frozenset({"Expand", "Concat", "Reshape", "Unsqueeze", "Squeeze"})
    summary = "Linear(Concat([x, Expand(c)])) → Linear(x) + Linear(c): the copy's product once."
    category = "replace"
    example = "surgery apply broadcast-concat-to-add dpt.onnx -o dpt_readout.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for concat in pat.nodes("Concat"):
            shape = pat.shape(pat.outs(concat)[0])
            plan = linear_over_concat(pat, concat)
            if plan is None or shape is None:
                continue
            removed = [pat.name(concat)] + [n for p in plan.parts if p for n in p.chain]
            if not any(n in ctx.blocker_names for n in removed):
                continue
            found.append(
                self.match(
                    [pat.name(plan.linear), *removed],
                    f"{pat.op(plan.linear)} {pat.name(plan.linear)} over Concat "
                    f"{pat.name(concat)} {fmt_shape(shape)}: "
                    + ", ".join(
                        f"{fmt_shape(p.aligned)} broadcast part taken once" for p in plan.parts if p
                    ),
                    net_freed(ctx, removed, self._probes(ctx, pat, plan)),
                    axis=plan.axis,
                    widths=list(plan.widths),
                    parts=[
                        None if p is None else {"source": p.source, "aligned": list(p.aligned)}
                        for p in plan.parts
                    ],
                )
            )
        return found

    @staticmethod
    def _probes(ctx: RuleContext, pat: Pattern, plan: LinearOverConcat):
        """Placements of the nodes the rewrite emits: the full parts' Concat and product, each
        copied part's product (after a Reshape to its aligned view) and the Adds."""
        linear = pat.op(plan.linear)
        ins, y = pat.ins(plan.linear), pat.outs(plan.linear)[0]
        out = pat.spec(y)
        attrs = pat.attrs(plan.linear)
        elem = pat.elem_type(y)
        weight = pat.shape(ins[1])
        assert weight is not None and out.shape is not None
        concat_shape = pat.shape(pat.outs(plan.concat)[0])
        assert concat_shape is not None
        full = [t for t, p in zip(pat.ins(plan.concat), plan.parts, strict=True) if p is None]
        width = sum(w for w, p in zip(plan.widths, plan.parts, strict=True) if p is None)
        rest = TensorSpec(with_axis(concat_shape, plan.axis, width), elem)
        probes = []
        if len(full) > 1:
            probes.append(
                probe_node(ctx, "Concat", [pat.spec(t) for t in full], [rest], {"axis": plan.axis})
            )
        probes.append(
            probe_node(ctx, linear, [rest, _weight_spec(linear, weight, width)], [out], attrs)
        )
        for part, w in zip(plan.parts, plan.widths, strict=True):
            if part is None:
                continue
            source = pat.spec(part.source)
            aligned = TensorSpec(part.aligned, elem)
            if source.shape != part.aligned:
                probes.append(probe_reshape(ctx, source, aligned))
            small = TensorSpec(with_axis(part.aligned, plan.axis, out.shape[plan.axis]), elem)
            probes.append(
                probe_node(ctx, linear, [aligned, _weight_spec(linear, weight, w)], [small], attrs)
            )
            probes.append(probe_node(ctx, "Add", [out, small], [out]))
        return probes

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        linear, concat = ed.node_named(match.nodes[0]), ed.node_named(match.nodes[1])
        if linear is None or concat is None:
            return False
        axis, widths, parts = match.data["axis"], match.data["widths"], match.data["parts"]
        weight = ed.value(linear.inputs[1])
        assert weight is not None
        bias = linear.inputs[2:] if linear.op == "Conv" else []
        inputs, y = list(concat.inputs), linear.outputs[0]
        ed.detach(linear, concat)
        w_axis = 0 if linear.op == "MatMul" else 1
        offsets = np.cumsum([0, *widths])
        rows = [
            weight.take(range(offsets[k], offsets[k + 1]), axis=w_axis) for k in range(len(widths))
        ]
        full = [k for k, p in enumerate(parts) if p is None]
        if len(full) == 1:
            rest = inputs[full[0]]
        else:
            rest = ed.op(
                "Concat", "full_parts", [inputs[k] for k in full], None, y.dtype, axis=axis
            )
        w_rest = np.concatenate([rows[k] for k in full], axis=w_axis)
        attrs = dict(linear.attrs)
        total = ed.op(
            linear.op,
            linear.name,
            [rest, ed.const("full_weight", w_rest), *bias],
            None,
            y.dtype,
            **attrs,
        )
        copied = [k for k, p in enumerate(parts) if p is not None]
        for n, k in enumerate(copied):
            source = ed.tensor(parts[k]["source"])
            aligned = parts[k]["aligned"]
            if list(source.shape or []) != aligned:
                view = ed.const("broadcast_view", np.array(aligned, np.int64))
                source = ed.op("Reshape", "broadcast_source", [source, view], aligned, y.dtype)
            product = ed.op(
                linear.op,
                f"{linear.name}_once",
                [source, ed.const("copy_weight", rows[k])],
                None,
                y.dtype,
                **attrs,
            )
            last = n == len(copied) - 1
            out = y if last else ed.var("broadcast_sum", y.dtype)
            ed.node("Add", "broadcast_add", [total, product], [out])
            total = out
        return True


def _weight_spec(op: str, weight: tuple[int, ...], width: int) -> TensorSpec:
    shape = (width, weight[1]) if op == "MatMul" else (weight[0], width, *weight[2:])
    return TensorSpec(shape, 1, None, True)
