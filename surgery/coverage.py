"""Accelerator coverage: which processor runs each node, why, and how many MLA segments result.

The placement comes from the target's op table (one source of truth shared with the quantizer
and the partitioner). MLA nodes are then grouped into the fewest connected, convex regions
(no path leaves a region and comes back through a non-MLA node) — each region is one `.elf`.
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any

import onnx

from surgery.errors import InvalidGraphError, NodeNotFoundError, TargetError
from surgery.graph import GraphView
from surgery.macs import node_macs_or_unknown
from surgery.qdq import DYNAMIC_QUANTIZATION_REASON, is_dynamic_quantization_op
from surgery.qoperator import QOPERATOR_LEFT_REASON, QOPERATOR_OPS, qoperator_form
from surgery.schema_check import raise_malformed
from surgery.targets import (
    PROCESSORS,
    ConstraintEvaluationError,
    NodeContext,
    Reason,
    Target,
    placeable_domain,
    resolve_target,
)

PLACEMENT_METADATA_KEY = "surgery.op_target"
"""Model metadata entry (JSON {node name or op type: MLA|CVU|APU}) that pins placements."""

NON_FOLDABLE_OPS = frozenset(
    {
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "If",
        "Loop",
        "Scan",
    }
)
"""Ops never evaluated at compile time: random, or control flow whose branches may differ."""


ORT_LAYOUT_DOMAINS = frozenset({"com.microsoft.nchwc", "com.ms.internal.nhwc"})
"""Domains of ONNX Runtime's layout-transformed ops (NCHWc blocked convolutions, internal
NHWC kernels) in a model saved at ORT_ENABLE_ALL."""

ORT_LAYOUT_REASON = (
    "an op of ONNX Runtime's CPU layout (saved at ORT_ENABLE_ALL): its blocked NCHWc tensors "
    "and reordered weights belong to the CPU that saved the model and have no standard form; "
    "save the model from ONNX Runtime at ORT_ENABLE_EXTENDED (or use the original model)"
)


@dataclass(slots=True)
class NodePlacement:
    """Where one node runs and why. Not frozen: a frozen dataclass sets every field through
    object.__setattr__ (3.3 µs per placement against 0.6), and check makes one per node."""

    index: int
    name: str
    op_type: str
    processor: str
    reasons: tuple[Reason, ...] = ()
    foldable: bool = False
    pinned: bool = False
    macs: int = 0
    precisions: tuple[str, ...] = ()
    suggested_rules: list[str] = field(default_factory=list)
    macs_unknown: bool = False
    """A matrix op whose MACs cannot be counted (unknown shapes); `macs` is then 0."""

    @property
    def is_blocker(self) -> bool:
        return self.processor != "MLA" and not self.foldable

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.name,
            "op_type": self.op_type,
            "processor": self.processor,
            "foldable": self.foldable,
            "macs": self.macs,
            "reasons": [r.message for r in self.reasons],
            "reason_codes": [r.code for r in self.reasons],
        }


@dataclass(frozen=True)
class Segment:
    """One connected MLA region: compiles to one `.elf`."""

    name: str
    nodes: list[str]
    inputs: list[str]
    outputs: list[str]
    macs: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nodes": self.nodes,
            "node_count": len(self.nodes),
            "inputs": self.inputs,
            "outputs": self.outputs,
            "macs": self.macs,
        }


@dataclass
class CoverageReport:
    target: str
    placements: list[NodePlacement]
    segments: list[Segment]
    dynamic_inputs: dict[str, list]

    @property
    def nodes_total(self) -> int:
        return len(self.placements)

    @property
    def mla_segments(self) -> int:
        return len(self.segments)

    @property
    def single_elf(self) -> bool:
        """One MLA segment, and inputs whose shapes are all known: a model with dynamic
        inputs cannot be quantized or compiled as it is (its shapes must be fixed first),
        however few nodes its one segment holds."""
        return len(self.segments) == 1 and not self.dynamic_inputs

    def count(self, processor: str, *, include_foldable: bool = True) -> int:
        return sum(
            1
            for p in self.placements
            if p.processor == processor and (include_foldable or not p.foldable)
        )

    @cached_property
    def total_macs(self) -> int:
        return sum(p.macs for p in self.placements)

    def macs_on(self, processor: str) -> int:
        return sum(p.macs for p in self.placements if p.processor == processor)

    @property
    def macs_unknown_nodes(self) -> int:
        """Matrix ops whose MACs are unknown (dynamic shapes): `mla_mac_fraction` leaves them
        out, so with any of them it is the share of the MACs that could be counted."""
        return sum(1 for p in self.placements if p.macs_unknown)

    @property
    def mla_mac_fraction(self) -> float:
        """Share of MACs on the MLA; for MAC-free models, the share of non-folded nodes."""
        total = self.total_macs
        if total:
            return self.macs_on("MLA") / total
        live = [p for p in self.placements if not p.foldable]
        return sum(p.processor == "MLA" for p in live) / len(live) if live else 0.0

    @cached_property
    def _blockers(self) -> tuple[NodePlacement, ...]:
        """Computed once: rules ask for the blockers dozens of times per `check`. A report's
        placements are not changed after it is built."""
        return tuple(p for p in self.placements if p.is_blocker)

    @property
    def blockers(self) -> list[NodePlacement]:
        """Placements that stop the model from being one MLA segment, in graph order."""
        return list(self._blockers)

    @cached_property
    def blocker_op_types(self) -> frozenset[str]:
        """Op types of the blockers (every rule's `may_free` asks)."""
        return frozenset(p.op_type for p in self._blockers)

    @cached_property
    def blocker_names(self) -> frozenset[str]:
        """Names of the blockers (a set, for the rules' membership tests)."""
        return frozenset(p.name for p in self._blockers)

    def blocker_groups(self) -> list[dict[str, Any]]:
        """Blockers grouped by their first reason (the one that decided against the MLA); a
        group's rules most nodes first, ties in the order the nodes list them (a rule that
        keeps the model whole before one that splits work off to the host)."""
        groups: dict[tuple[str, str], list[NodePlacement]] = {}
        for b in self.blockers:
            first = b.reasons[0] if b.reasons else Reason("unknown", "no reason recorded")
            key = (first.code, _generic(first.message))
            groups.setdefault(key, []).append(b)
        out = []
        for (code, message), nodes in groups.items():
            counts = Counter(r for n in nodes for r in n.suggested_rules)
            rule_nodes = dict(sorted(counts.items(), key=lambda item: -item[1]))
            out.append(
                {
                    "code": code,
                    "reason": message,
                    "count": len(nodes),
                    "op_types": sorted({n.op_type for n in nodes}),
                    "nodes": [n.name for n in nodes],
                    "suggested_rules": list(rule_nodes),
                    "suggested_rule_nodes": rule_nodes,
                }
            )
        return sorted(out, key=lambda g: -g["count"])

    def by_name(self, name: str) -> NodePlacement | None:
        return next((p for p in self.placements if p.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "target": self.target,
            "nodes_total": self.nodes_total,
            "processors": {p: self.count(p) for p in PROCESSORS},
            "foldable_nodes": sum(1 for p in self.placements if p.foldable),
            "mla_segments": self.mla_segments,
            "single_elf": self.single_elf,
            "macs_total": self.total_macs,
            "macs": {p: self.macs_on(p) for p in PROCESSORS},
            "mla_mac_fraction": round(self.mla_mac_fraction, 6),
            "macs_unknown_nodes": self.macs_unknown_nodes,
            "dynamic_inputs": self.dynamic_inputs,
            "segments": [s.to_dict() for s in self.segments],
            "blockers": [
                {
                    "node": b.name,
                    "op_type": b.op_type,
                    "processor": b.processor,
                    "reasons": [r.message for r in b.reasons],
                    "reason_codes": [r.code for r in b.reasons],
                    "suggested_rules": b.suggested_rules,
                }
                for b in self.blockers
            ],
            "blocker_groups": self.blocker_groups(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


_QUOTED = re.compile(r" \(?'[^']*'\)?")
_DYNAMIC_SHAPE = re.compile(r"(dynamic shape) \[[^\]]*\]")


def _generic(message: str) -> str:
    """Strip tensor names (reasons quote them, and only them) and dynamic shapes from a reason,
    so one cause is one group: every tensor with a dynamic height is one "dynamic shape"."""
    if "'" in message:
        message = _QUOTED.sub("", message)
    return _DYNAMIC_SHAPE.sub(r"\1", message) if "dynamic shape" in message else message


RuleSuggester = Callable[
    [onnx.ModelProto, Target, CoverageReport, GraphView, frozenset[str]], Mapping[str, list[str]]
]
SUGGESTERS: list[RuleSuggester] = []
"""Hook filled by the rewrite engine (surgery.rules.suggest): blocker node → rules that fix it.

Called with the model, target, the report, its GraphView and the constant tensors, so a
suggester reuses the analysis instead of redoing it."""


@cache
def _is_standard_op(op_type: str, domain: str) -> bool:
    try:
        return onnx.defs.has(op_type, domain)
    except Exception:  # pragma: no cover - very old onnx
        return False


def constant_tensors(
    view: GraphView, order: list[int] | None = None
) -> tuple[set[str], list[bool]]:
    """Tensors known before run time, and which nodes only compute such tensors (foldable)."""
    constants = set(view.initializers)
    # "" (an omitted optional input or output) counts as constant inside the loop, so whole
    # input tuples are tested at once; it is never reported as a constant tensor.
    had_empty = "" in constants
    constants.add("")
    foldable = [False] * len(view.nodes)
    op_types, node_inputs, node_outputs = view.op_types, view.node_inputs, view.node_outputs
    node_reads = view.node_reads
    for idx in order if order is not None else topo_order(view):
        op = op_types[idx]
        if op in NON_FOLDABLE_OPS:
            continue
        if op in ("Shape", "Size"):
            ins = [i for i in node_inputs[idx] if i]
            ok = bool(ins) and (ins[0] in constants or shape_known(view, idx, ins[0]))
        else:
            ok = constants.issuperset(node_reads[idx])
        if ok:
            foldable[idx] = True
            constants.update(node_outputs[idx])
    if not had_empty:
        constants.discard("")
    return constants, foldable


def shape_known(view: GraphView, idx: int, tensor: str) -> bool:
    """Whether the value of Shape (or Size) node `idx` of `tensor` is known before run time:
    the tensor's shape is static, or at least the part of it a Shape's start/end select."""
    t = view.tensor(tensor)
    if t.is_static:
        return True
    if view.op_types[idx] != "Shape" or t.shape is None:
        return False
    return all(isinstance(d, int) for d in t.shape[shape_slice(view.nodes[idx], len(t.shape))])


def shape_slice(node: onnx.NodeProto, rank: int) -> slice:
    """The dims of its input's shape a Shape node gives (its start and end attributes)."""
    start = next((a.i for a in node.attribute if a.name == "start"), 0)
    end = next((a.i for a in node.attribute if a.name == "end"), rank)
    return slice(start, end)


def topo_order(view: GraphView) -> list[int]:
    """Node indices in topological order (the stored order when it already is one)."""
    n = len(view.nodes)
    producer = view.producer
    if view.is_sorted:
        return list(range(n))
    indeg = [0] * n
    for idx, ins in enumerate(view.node_reads):
        for t in set(ins):  # consumers lists each reader of a tensor once
            if t in producer:
                indeg[idx] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    ready.reverse()
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for t in view.node_outputs[i]:
            for c in view.consumers.get(t, ()):
                indeg[c] -= 1
                if indeg[c] == 0:
                    ready.append(c)
    return order


def check_pins(view: GraphView, op_target: Mapping[str, str]) -> None:
    """A caller's pins must name a processor and a node or op type of the model: a pin that
    matches nothing would be ignored, and the caller would believe it applied."""
    for key, processor in op_target.items():
        if str(processor).upper() not in PROCESSORS:
            raise TargetError(
                f"op_target {key!r}: {processor!r} is not a processor",
                hint=f"use one of {', '.join(PROCESSORS)}",
            )
    known = {*view.names, *view.op_types}
    unknown = [key for key in op_target if key not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=3)
        raise NodeNotFoundError(
            f"op_target names no node or op type of the model: {', '.join(map(repr, unknown))}",
            hint=f"did you mean {' or '.join(close)}?" if close else "use node names or op types",
        )


def _pinned_placements(
    model: onnx.ModelProto, op_target: Mapping[str, str] | None
) -> dict[str, str]:
    pins: dict[str, str] = {}
    for prop in model.metadata_props:
        if prop.key == PLACEMENT_METADATA_KEY:
            try:
                pins.update(json.loads(prop.value))
            except (json.JSONDecodeError, TypeError, ValueError):
                raise InvalidGraphError(
                    f"model metadata {PLACEMENT_METADATA_KEY!r} is not a JSON object of node → processor"
                ) from None
    if op_target:
        pins.update(op_target)
    return {k: v.upper() for k, v in pins.items()}


def analyze_coverage(
    model: onnx.ModelProto,
    target: str | Target = "mlsoc",
    *,
    op_target: Mapping[str, str] | None = None,
    suggest: bool = True,
    view: GraphView | None = None,
    constants: tuple[set[str], list[bool]] | None = None,
) -> CoverageReport:
    """Assign every top-level node to MLA/CVU/APU with reasons, then segment the MLA nodes.

    `op_target` pins nodes (by name or op type) to a processor, as RKNN's option does; pins
    stored in the model's metadata (`surgery.op_target`) are honoured too. `constants` is
    `constant_tensors(view)` when the caller has already computed it.
    """
    tgt = resolve_target(target)
    view = view or GraphView(model)
    order = topo_order(view)
    known, foldable = constants if constants is not None else constant_tensors(view, order)
    frozen_constants = frozenset(known)
    place = NodePlacer(model, tgt, view, frozen_constants, op_target)
    placements = [
        NodePlacement(idx, name, op_type, "APU", (), True) if folds else place(idx)
        for idx, (name, op_type, folds) in enumerate(
            zip(view.names, view.op_types, foldable, strict=True)
        )
    ]
    segments = _segment(view, placements, frozen_constants, order)
    report = CoverageReport(tgt.name, placements, segments, dynamic_inputs(view))
    if suggest and SUGGESTERS and report.blockers:
        _attach_suggestions(model, tgt, report, view, frozen_constants)
    return report


def dynamic_inputs(view: GraphView) -> dict[str, list | None]:
    """Graph inputs whose shape is not static: their shape (None when the rank is unknown)."""
    return {
        t.name: list(t.shape) if t.shape is not None else None
        for t in map(view.tensor, view.graph_inputs)
        if not t.is_static
    }


class NodePlacer:
    """Places one non-foldable node: `analyze_coverage` places every node with it, and a
    caller that needs the placement of only a few nodes (fold's "do shapes wait for
    folding?") gets exactly the same answer for them without placing the rest."""

    def __init__(
        self,
        model: onnx.ModelProto,
        target: Target,
        view: GraphView,
        constants: frozenset[str],
        op_target: Mapping[str, str] | None,
    ) -> None:
        self.target = target
        self.view = view
        self.constants = constants
        self.pins = _pinned_placements(model, op_target)

    def __call__(self, idx: int) -> NodePlacement:
        view = self.view
        name, op_type, domain = view.names[idx], view.op_types[idx], view.domains[idx]
        counted = node_macs_or_unknown(view, idx)
        pins = self.pins
        pin = (pins.get(name) or pins.get(op_type)) if pins else None
        if is_dynamic_quantization_op(domain, op_type):
            reason = Reason("dynamic_quantization", DYNAMIC_QUANTIZATION_REASON)
            processor, reasons, precisions = "APU", [reason], ()
        elif op_type in QOPERATOR_OPS and qoperator_form(domain, op_type):
            reason = Reason("qoperator_quantization", QOPERATOR_LEFT_REASON)
            processor, reasons, precisions = "APU", [reason], ()
        elif domain in ORT_LAYOUT_DOMAINS:
            reason = Reason("ort_layout", ORT_LAYOUT_REASON)
            processor, reasons, precisions = "APU", [reason], ()
        elif not placeable_domain(domain, op_type):
            reason = Reason(
                "custom_op",
                f"{op_type} is a custom op (domain {domain}); it runs on the APU",
            )
            processor, reasons, precisions = "APU", [reason], ()
        else:
            try:
                decision = self.target.decide(
                    op_type,
                    NodeContext(view, idx, self.constants),
                    known_op=_is_standard_op(op_type, ""),
                )
            except ConstraintEvaluationError as exc:
                raise_malformed(view.model)  # a float perm is the model's problem
                raise exc.as_target_error(name, op_type) from None
            # The decision is this node's own: its reasons list is not copied.
            processor, reasons, precisions = (
                decision.processor,
                decision.reasons,
                tuple(decision.precisions),
            )
        if pin in PROCESSORS and pin != processor:
            processor, reasons = _apply_pin(pin, processor, reasons)
        return NodePlacement(
            idx,
            name,
            op_type,
            processor,
            tuple(reasons),
            False,
            pin is not None,
            counted or 0,
            precisions,
            macs_unknown=counted is None,
        )


def _apply_pin(pin: str, processor: str, reasons: list[Reason]) -> tuple[str, list[Reason]]:
    """The processor and reasons of a node pinned to `pin` where the table chose `processor`:
    a pin to the MLA cannot override the table (it adds why); other pins move the node."""
    if pin == "MLA":
        why = reasons[0].message if reasons else "not allowed"
        return processor, [
            *reasons,
            Reason("pinned", f"pinned to the MLA by op_target, but: {why}"),
        ]
    return pin, [
        Reason(
            "pinned",
            f"pinned to the {pin} (by op_target, or by a rule such as output-concat-to-host "
            f"through the model's metadata {PLACEMENT_METADATA_KEY})",
            "MLA",
        )
    ]


def attach_suggestions(
    model: onnx.ModelProto, target: str | Target, report: CoverageReport, view: GraphView
) -> None:
    """The rules' suggestions for the blockers of a report made with `suggest=False` (for a
    caller that first decides whether to keep that report)."""
    if SUGGESTERS and report.blockers:
        constants = frozenset(constant_tensors(view)[0])
        _attach_suggestions(model, resolve_target(target), report, view, constants)


def _attach_suggestions(
    model: onnx.ModelProto,
    target: Target,
    report: CoverageReport,
    view: GraphView,
    constants: frozenset[str],
) -> None:
    merged: dict[str, dict[str, None]] = {}  # ordered sets: the suggesters' order is advice
    for suggester in SUGGESTERS:
        for node, rules in suggester(model, target, report, view, constants).items():
            merged.setdefault(node, {}).update(dict.fromkeys(rules))
    for b in report.blockers:
        if b.name in merged and not pinned_off_the_mla(b):
            b.suggested_rules.extend(merged[b.name])


def pinned_off_the_mla(placement: NodePlacement) -> bool:
    """Whether the node is on the host only because a pin put it there: no rule undoes a pin
    (output-concat-to-host's, place-on-host's or the user's), so none is suggested for it."""
    return placement.pinned and all(r.code == "pinned" for r in placement.reasons)


def _segment(
    view: GraphView, placements: list[NodePlacement], constants: frozenset[str], order: list[int]
) -> list[Segment]:
    """Greedy convex grouping of MLA nodes in topological order.

    Each node carries `anc`, a bitmask of the (original) group ids that contain one of its
    ancestors. Joining node n to groups U keeps U convex iff no producer q of any member, with q
    outside U, has an ancestor in U — i.e. no path leaves U and re-enters it.
    """
    n = len(view.nodes)
    on_mla = [p.processor == "MLA" for p in placements]
    anc = [0] * n
    bit = [0] * n  # original-group bit of each MLA node
    parent: list[int] = []  # union-find over group ids
    absorbed: list[int] = []  # mask of original ids merged into each root
    members: list[set[int]] = []
    external: list[set[int]] = []  # producers outside the group, per root

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    group_of = [-1] * n
    producer_of = view.producer
    node_reads = view.node_reads
    for idx in order:
        if placements[idx].foldable:
            continue
        producers = {
            producer_of[t] for t in node_reads[idx] if t in producer_of and t not in constants
        }
        mask = 0
        for p in producers:
            mask |= anc[p] | bit[p]
        anc[idx] = mask
        if not on_mla[idx]:
            continue
        roots = {find(group_of[p]) for p in producers if group_of[p] >= 0}
        # Most nodes extend one group: only several candidates need ordering (largest first).
        candidates = sorted(roots, key=lambda g: -len(members[g])) if len(roots) > 1 else roots
        chosen: list[int] = []
        for g in candidates:
            trial = [*chosen, g]
            if _convex_after_join(
                trial, idx, producers, group_of, find, absorbed, external, anc, bit
            ):
                chosen = trial
        if not chosen:
            gid = len(parent)
            parent.append(gid)
            absorbed.append(1 << gid)
            members.append({idx})
            external.append(set(producers))
            group_of[idx] = gid
            bit[idx] = 1 << gid
            continue
        root = chosen[0]
        for g in chosen[1:]:
            parent[g] = root
            absorbed[root] |= absorbed[g]
            members[root] |= members[g]
            external[root] |= external[g]
        member_set = members[root]
        member_set.add(idx)
        group_of[idx] = root
        bit[idx] = 1 << root
        if len(chosen) > 1:
            external[root] = {q for q in external[root] if q not in member_set}
        external[root].update(q for q in producers if q not in member_set)
    roots = sorted(
        {find(group_of[i]) for i in range(n) if group_of[i] >= 0}, key=lambda g: min(members[g])
    )
    return [
        _describe_segment(view, placements, sorted(members[r]), f"MLA_{k}", constants)
        for k, r in enumerate(roots)
    ]


def _convex_after_join(
    groups, idx, producers, group_of, find, absorbed, external, anc, bit
) -> bool:
    mask = 0
    for g in groups:
        mask |= absorbed[g]
    in_union = lambda q: group_of[q] >= 0 and find(group_of[q]) in groups  # noqa: E731
    for q in producers:
        if not in_union(q) and anc[q] & mask:
            return False
    for g in groups:
        for q in external[g]:
            if not in_union(q) and q != idx and (anc[q] | bit[q]) & mask:
                return False
    return True


def _describe_segment(
    view: GraphView, placements, nodes: list[int], name: str, constants
) -> Segment:
    member = set(nodes)
    inputs: list[str] = []
    outputs: list[str] = []
    graph_outputs = set(view.graph_outputs)
    for i in nodes:
        for t in view.node_inputs[i]:
            if t and t not in constants and view.producer.get(t) not in member and t not in inputs:
                inputs.append(t)
        for t in view.node_outputs[i]:
            if t and (
                t in graph_outputs or any(c not in member for c in view.consumers.get(t, ()))
            ):
                outputs.append(t)
    return Segment(
        name=name,
        nodes=[view.names[i] for i in nodes],
        inputs=inputs,
        outputs=outputs,
        macs=sum(placements[i].macs for i in nodes),
    )
