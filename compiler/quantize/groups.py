"""Elementwise groups: runs of elementwise ops that depend on one tensor become one MLA op.

With int8 (or int16) input x, any elementwise function f(x) with scalar constants is exactly a
lookup table of 2**bits entries, and a chain of per-channel Mul/Add/Sub/Div by constants is one
per-channel affine requantization. The MLA evaluates both in one step, so rounding between the
ops of such a run would be error the hardware never makes. The classic case is an exported
HardSwish, x · clip(x + 3, 0, 6) / 6: quantizing x · clip(…) costs log2(6) ≈ 2.6 bits because
that product spans six times the output's range.

A group has a single source tensor x (quantized, the LUT input); its internal tensors get no
Q/DQ; tensors read outside the group (or graph outputs) are its outputs and are quantized. The
integer executor evaluates the float ops between a group's DequantizeLinear and QuantizeLinear
as one table (kind "lut") or one per-channel affine map (kind "channel").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from compiler.defines import NodeQuantizationConfig
from surgery.graph import GraphView

__all__ = ["ElementwiseGroup", "find_groups"]

AFFINE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})
UNARY_OPS = frozenset(
    {
        "Relu",
        "Clip",
        "LeakyRelu",
        "Elu",
        "Selu",
        "Celu",
        "Sigmoid",
        "Tanh",
        "HardSigmoid",
        "HardSwish",
        "Softplus",
        "Softsign",
        "Swish",
        "Gelu",
        "QuickGelu",
        "Erf",
        "Exp",
        "Log",
        "Sqrt",
        "Reciprocal",
        "Neg",
        "Abs",
        "Pow",
        "Mish",
        "ThresholdedRelu",
    }
)
_RANK = {"affine": 0, "lut": 1, "channel": 1}


@dataclass
class ElementwiseGroup:
    source: str
    kind: str
    """"affine" (scalar constants only), "lut" (nonlinear, scalar constants) or "channel"
    (per-channel affine)."""
    nodes: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    members: list[int] = field(default_factory=list, repr=False)
    internal: list[str] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "kind": self.kind,
            "nodes": self.nodes,
            "outputs": self.outputs,
        }


def _combine(a: str, b: str) -> str | None:
    if {a, b} == {"lut", "channel"}:
        return None
    return a if _RANK[a] >= _RANK[b] else b


def _node_kind(
    view: GraphView, node: onnx.NodeProto, constants: set[str], dynamic: list[str]
) -> str | None:
    """The group kind this node contributes, or None when it cannot join a group."""
    consts = [i for i in node.input if i and i in constants]
    if node.op_type in UNARY_OPS:
        if node.input[0] in constants:
            return None
        return "lut" if all(_size(view, c) == 1 for c in consts) else None
    if node.op_type not in AFFINE_OPS:
        return None
    if len(dynamic) == 2:
        return "lut"  # x · f(x): joins only when both operands belong to the same group
    if len(dynamic) != 1:
        return None
    if all(_size(view, c) == 1 for c in consts):
        return "affine"
    return "channel"


def _size(view: GraphView, name: str) -> int:
    n = 1
    for d in view.initializers[name].dims:
        n *= d
    return n


def find_groups(
    view: GraphView,
    order: list[int],
    configs: dict[int, NodeQuantizationConfig],
    constants: set[str],
    fused: dict[str, str],
    *,
    gates_only: bool = False,
) -> tuple[list[ElementwiseGroup], set[str], set[int]]:
    """(groups, internal tensors without Q/DQ, member node indices).

    `gates_only` keeps just x·Sigmoid(x) and x·HardSigmoid(x) (SiLU, HardSwish), the runs the
    integer executor already evaluates as one table.
    """
    group_of: dict[str, int] = {}  # tensor → group id (tensors computed inside a group)
    open_for: dict[str, int] = {}  # source tensor → its open group id
    groups: list[ElementwiseGroup] = []
    member_of: dict[int, int] = {}
    outputs = set(view.graph_outputs)
    for idx in order:
        config = configs.get(idx)
        node = view.nodes[idx]
        if config is None or not node.output or len([o for o in node.output if o]) != 1:
            continue
        act = config.activation_quantization_scheme
        if act is None or act.is_float:
            continue
        dynamic = [i for i in node.input if i and i not in constants]
        if any(i in fused for i in dynamic) or not dynamic:
            continue
        kind = _node_kind(view, node, constants, dynamic)
        if kind is None:
            continue
        keys = {_key(i, group_of, open_for) for i in dynamic}
        if len(keys) != 1:
            continue
        key = keys.pop()
        gid = key if isinstance(key, int) else None
        if gid is not None and (
            _configs_differ(configs, member_of, gid, idx)
            or _combine(groups[gid].kind, kind) is None
        ):
            if len(set(dynamic)) != 1:
                continue
            gid = None  # start a new group; the shared input becomes an output of the old one
        if gid is None:
            groups.append(ElementwiseGroup(dynamic[0], kind))
            gid = len(groups) - 1
            open_for[dynamic[0]] = gid
        group = groups[gid]
        combined = _combine(group.kind, kind)
        assert combined is not None
        group.kind = combined
        group.nodes.append(view.names[idx])
        group.members.append(idx)
        member_of[idx] = gid
        group_of[node.output[0]] = gid
    for tensor, gid in group_of.items():
        readers = view.consumers.get(tensor, [])
        inside = readers and all(member_of.get(r) == gid for r in readers) and tensor not in outputs
        (groups[gid].internal if inside else groups[gid].outputs).append(tensor)
    kept = [g for g in groups if len(g.nodes) > 1 and (not gates_only or _is_gate(view, g))]
    internal = {t for g in kept for t in g.internal}
    members = {idx for g in kept for idx in g.members}
    return kept, internal, members


def _is_gate(view: GraphView, group: ElementwiseGroup) -> bool:
    """x · Sigmoid(x) or x · HardSigmoid(x), nothing else."""
    if len(group.members) != 2:
        return False
    gate, mul = (view.nodes[i] for i in group.members)
    return (
        gate.op_type in ("Sigmoid", "HardSigmoid")
        and mul.op_type == "Mul"
        and sorted(mul.input) == sorted([group.source, gate.output[0]])
    )


def _key(tensor: str, group_of: dict[str, int], open_for: dict[str, int]) -> int | tuple[str, str]:
    """The group a tensor belongs to (computed in it, or its source), else a fresh-source key."""
    if tensor in group_of:
        return group_of[tensor]
    if tensor in open_for:
        return open_for[tensor]
    return ("src", tensor)


def _configs_differ(
    configs: dict[int, NodeQuantizationConfig], member_of: dict[int, int], gid: int, idx: int
) -> bool:
    """Nodes of one group share a scheme (one table is built for one input/output format)."""
    first = next((m for m, g in member_of.items() if g == gid), None)
    return (
        first is not None
        and configs[first].activation_quantization_scheme
        != configs[idx].activation_quantization_scheme
    )
