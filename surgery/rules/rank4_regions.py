"""Finding what to lift: connected regions of blocked nodes that can be carried as 4-D.

A node is a candidate when coverage blocks it, its op has a lift (`rank4_ops.SUPPORT`) that
admits it exactly, and lifting changes something: a data tensor is not 4-D, or the op is one the
lift re-expresses (Softmax/LayerNorm moved to the channel axis, Gather → Slice, Gemm → Conv, …),
or a 4-D Transpose that moves a batch axis of size 1 (the lift keeps axis 0 in place).
Candidates connected through tensors form a region; each region is one match. An MLA node at a
rank the target allows by exception (rk3588's rank-2 Gemm) that touches a region is lifted
with it, so the lift does not rebuild its operands on the host around it.

Regions are then sorted into the three rule families by what they contain, so each rule claims
its own regions and `surgery fix` sees them as separate, named steps:

- **transformer**: Layer/RMSNormalization, a MatMul/Gemm over tokens (input rank ≥ 3 or two run-time
  operands), or an attention Softmax (next to a MatMul of two run-time tensors);
- **classifier**: otherwise any Gemm or MatMul by a constant matrix ([N,C] heads);
- **ncl**: everything else (detection heads, 1-D conv stacks, rank-5 anchor heads).

A region's blockers are the nodes whose lifted form runs on the MLA according to the target's
own constraints (the layout constraints excepted: those are what the lift fixes). A reshape
that only hands a lifted tensor back to a graph output is part of its region but is not counted:
it stays as the trailing host stage. A region is dropped when the reshapes its edges would add
(non-4-D tensors entering or leaving it, graph outputs aside: their reshape is that trailing
stage) are at least as many as the blockers it removes: lifting a lone Sigmoid between two host
ops would only add work.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from surgery.coverage import topo_order
from surgery.graph import GraphView
from surgery.rules.base import RuleContext
from surgery.rules.rank4_ops import SUPPORT, NodeInfo
from surgery.targets import NodeContext

_EXIT_OPS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"}
_REEXPRESSED = {
    "Softmax",
    "LogSoftmax",
    "Hardmax",
    "LayerNormalization",
    "RMSNormalization",
    "Gather",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Gemm",
}
_LAYOUT_CHECKS = {"rank", "axis", "perm_keeps", "reduce_axes", "static_shape"}
_SOFTMAX = {"Softmax", "LogSoftmax"}
_SCORE_OPS = {"Add", "Sub", "Mul", "Div", "Where"}


@dataclass(frozen=True)
class Region:
    kind: str
    nodes: tuple[str, ...]
    """Node names in topological order."""
    blockers: tuple[str, ...]
    ops: tuple[str, ...]

    @property
    def reason(self) -> str:
        listed = ", ".join(self.ops[:6]) + (", …" if len(self.ops) > 6 else "")
        return (
            f"carry {len(self.nodes)} node(s) ({listed}) as 4-D; "
            f"{len(self.blockers)} blocker(s) move to the MLA"
        )


_CACHE: dict[int, tuple[weakref.ref, list[Region]]] = {}


def regions(ctx: RuleContext) -> list[Region]:
    """All liftable regions of the model (computed once per context, shared by the rules)."""
    hit = _CACHE.get(id(ctx))
    if hit is not None and hit[0]() is ctx:
        return hit[1]
    found = _find_regions(ctx)
    if len(_CACHE) > 8:
        _CACHE.clear()
    _CACHE[id(ctx)] = (weakref.ref(ctx), found)
    return found


def _find_regions(ctx: RuleContext) -> list[Region]:
    view = ctx.view
    order = topo_order(view)
    opset = ctx.opset
    infos: dict[int, NodeInfo] = {}
    # Only blockers are candidates: testing them first skips most of the graph.
    blocked = {p.index for p in ctx.coverage.blockers}
    for idx in order:
        if idx not in blocked:
            continue
        info = _candidate(ctx, idx, opset)
        if info is not None:
            infos[idx] = info
    exits = _exit_only(view, infos, order)
    passengers = _passengers(ctx, infos, opset)
    groups = _components(view, order, set(infos))
    found = []
    for members in groups:
        if all(i in passengers for i in members):
            continue
        counted = [
            i
            for i in members
            if i not in exits and i not in passengers and _lands_on_mla(ctx, infos[i])
        ]
        replaced = sum(1 for i in members if i in exits)  # output reshapes become the exit
        if len(counted) + replaced <= _boundary_cost(view, members, ctx.constants):
            continue
        found.append(
            Region(
                kind=_kind(view, members, infos),
                nodes=tuple(view.names[i] for i in members),
                blockers=tuple(view.names[i] for i in counted),
                ops=tuple(dict.fromkeys(view.op_types[i] for i in members)),
            )
        )
    return found


def _candidate(ctx: RuleContext, idx: int, opset: int) -> NodeInfo | None:
    if not ctx.coverage.placements[idx].is_blocker:
        return None
    info = _liftable(ctx, idx, opset)
    if info is None:
        return None
    if all(r == 4 for r in info.ranks()) and info.op not in _REEXPRESSED:
        return info if _moves_unit_batch(info) else None
    return info


def _moves_unit_batch(info: NodeInfo) -> bool:
    """A 4-D Transpose whose input has at most three non-unit axes.

    The MLA keeps axis 0 in place, but with three non-unit axes or fewer any permutation is a
    Transpose of slots 1–3 between two Reshapes that put a unit axis first: the lift carries
    the Transpose as a relabel and converts with such batch-keeping steps. torch's
    nn.MultiheadAttention (sequence-first inside) writes one per attention block:
    [1,H,L,d] → perm (2,0,1,3) → [L,1,H,d].
    """
    if info.op != "Transpose":
        return False
    shape = info.shape(info.input(0))
    return shape is not None and sum(1 for d in shape if d != 1) < 4


def _liftable(ctx: RuleContext, idx: int, opset: int) -> NodeInfo | None:
    """The node's lift info when its op has a lift that admits it exactly; else None."""
    view = ctx.view
    support = SUPPORT.get(view.op_types[idx])
    if support is None or view.domains[idx] not in ("", "ai.onnx"):
        return None
    info = NodeInfo(view, idx, ctx.constants, opset)
    try:
        admitted = support.accept(info)
    except (ValueError, IndexError, KeyError, TypeError):
        admitted = False  # an attribute or constant we do not understand: leave the node alone
    return info if admitted else None


def _passengers(ctx: RuleContext, infos: dict[int, NodeInfo], opset: int) -> set[int]:
    """MLA nodes at a rank the target allows by exception (rk3588's rank-2 Gemm) connected to a
    candidate by a tensor: they join its region (and are lifted) but remove no blocker.

    Left out, the lift would cut the region around such a node and rebuild its non-4-D tensors
    with Reshapes on the host, on both sides of an MLA node: more segments, not fewer. Found by
    walking out from the candidates, so a network whose MLA part is all 4-D costs nothing."""
    view = ctx.view
    placements = ctx.coverage.placements
    added: set[int] = set()
    rejected: set[int] = set()
    frontier = list(infos)
    while frontier:
        idx = frontier.pop()
        for t in (*view.node_inputs[idx], *view.node_outputs[idx]):
            if not t or t in ctx.constants:
                continue
            for other in (view.producer.get(t), *view.consumers.get(t, ())):
                if other is None or other in infos or other in rejected:
                    continue
                info = (
                    _passenger(ctx, other, opset) if placements[other].processor == "MLA" else None
                )
                if info is None:
                    rejected.add(other)
                    continue
                infos[other] = info
                added.add(other)
                frontier.append(other)
    return added


def _passenger(ctx: RuleContext, idx: int, opset: int) -> NodeInfo | None:
    """The lift info of an MLA node with a non-4-D tensor that a lift admits; else None."""
    view = ctx.view
    tensors = [t for t in (*view.node_inputs[idx], *view.node_outputs[idx]) if t]
    if all(view.tensor(t).rank == 4 or t in ctx.constants for t in tensors):
        return None
    info = _liftable(ctx, idx, opset)
    return info if info is not None and not all(r == 4 for r in info.ranks()) else None


def _exit_only(view: GraphView, infos: dict[int, NodeInfo], order: list[int]) -> set[int]:
    """Reshape-like nodes that only hand a tensor to graph outputs; dropped unless behind a lift."""
    outputs = set(view.graph_outputs)
    exits = set()
    for idx in order:
        info = infos.get(idx)
        if info is None or info.op not in _EXIT_OPS:
            continue
        outs = [t for t in info.outputs if t]
        if not outs or any(t not in outputs or view.consumers.get(t) for t in outs):
            continue
        if any(len(info.shape(t) or ()) == 4 for t in outs):
            continue
        exits.add(idx)
        producer = view.producer.get(info.input(0))
        if producer not in infos:
            del infos[idx]
    return exits


def _components(view: GraphView, order: list[int], members: set[int]) -> list[list[int]]:
    """Candidates connected by a tensor (producer–consumer, or two consumers of one tensor).

    Consumers of the same outside tensor share one region so it enters 4-D once.
    """
    parent = {i: i for i in members}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_user: dict[str, int] = {}
    for idx in order:
        if idx not in members:
            continue
        for t in view.node_inputs[idx]:
            p = view.producer.get(t)
            if p in members:
                parent[find(p)] = find(idx)
            if t:
                other = first_user.setdefault(t, idx)
                parent[find(other)] = find(idx)
    groups: dict[int, list[int]] = {}
    for idx in order:
        if idx in members:
            groups.setdefault(find(idx), []).append(idx)
    return list(groups.values())


def _boundary_cost(view: GraphView, members: list[int], constants: frozenset[str]) -> int:
    """Reshapes the lift adds at the edges: non-4-D tensors entering or leaving the region.

    A tensor that leaves only as a graph output costs nothing: its reshape back is a trailing
    host stage, which adds no segment (a `mean([2, 3])` → Linear head on rk3588, whose rank-2
    Gemm runs on the MLA, joins the body through such an exit).
    """
    inside = set(members)
    entering, leaving = set(), set()
    for idx in members:
        for t in view.node_inputs[idx]:
            if t and t not in constants and view.producer.get(t) not in inside:
                entering.add(t)
        for t in view.node_outputs[idx]:
            if any(c not in inside for c in view.consumers.get(t, ())):
                leaving.add(t)
    return sum(1 for t in entering | leaving if view.tensor(t).rank != 4)


def _lands_on_mla(ctx: RuleContext, info: NodeInfo) -> bool:
    """Would the lifted node run on the MLA? The target's constraints decide, not a list of ours."""
    emits = SUPPORT[info.op].emits
    if emits == "":
        return True
    if emits is not None:
        return ctx.target.supports(emits, "MLA")
    for rule in ctx.target.rules_for(info.op):
        if rule.processor != "MLA":
            continue
        if not rule.precisions:
            return False
        nctx = NodeContext(ctx.view, info.idx, ctx.constants, "MLA")
        return all(
            fn(nctx, params) is None
            for spec, (fn, params) in zip(rule.constraints, rule.checks, strict=True)
            if spec.check not in _LAYOUT_CHECKS
        )
    return False


def _kind(view: GraphView, members: Iterable[int], infos: dict[int, NodeInfo]) -> str:
    linear = False
    for idx in members:
        info = infos[idx]
        if info.op in ("LayerNormalization", "RMSNormalization"):
            return "transformer"
        if info.op == "MatMul" and info.is_const(info.input(0)):
            continue  # W · x mixes channels ([1,C,L] stays channel-first)
        if info.op in ("MatMul", "Gemm"):
            linear = True
            rank = len(info.shape(info.input(0)) or ())
            if rank >= 3 or len(info.data_inputs) > 1:
                return "transformer"
        if info.op in _SOFTMAX and _next_to_attention(view, idx, info.constants):
            return "transformer"
    return "classifier" if linear else "ncl"


def _is_attention_matmul(view: GraphView, idx: int | None, constants: frozenset[str]) -> bool:
    if idx is None or view.op_types[idx] != "MatMul":
        return False
    return all(t and t not in constants for t in view.node_inputs[idx][:2])


def _next_to_attention(view: GraphView, idx: int, constants: frozenset[str]) -> bool:
    """Softmax fed by scores = MatMul(q, kᵀ) (through scale/mask ops) or feeding MatMul(·, v)."""
    for out in view.node_outputs[idx]:
        if any(_is_attention_matmul(view, c, constants) for c in view.consumers.get(out, ())):
            return True
    current: int | None = idx
    for _ in range(4):
        data = [t for t in view.node_inputs[current][:2] if t and t not in constants]
        current = view.producer.get(data[0]) if data else None
        if current is None:
            return False
        if _is_attention_matmul(view, current, constants):
            return True
        if view.op_types[current] not in _SCORE_OPS:
            return False
    return False
