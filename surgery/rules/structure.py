"""Structure and placement rules: cut the post-processing tail off, move tiny MLA islands home.

Detection, segmentation, pose and text-detection exports end in a decode tail (per-level
reshapes, DFL softmax-conv, anchor/stride arithmetic, score sigmoids, level concats, NMS) that
the MLA cannot run and that splits the network into extra segments. `cut-postprocess` finds that
tail from op placement and tensor ranks alone (never node names): it walks back from the graph
outputs over nodes that do not run on the MLA, or run there only as a small island, until it
reaches 4-D maps produced by the main MLA region. The body keeps everything up to those maps;
the tail becomes a post-processing model, and the cut is proven exact end to end.

`place-on-host` handles islands that are not post-processing: MLA segments other than the main
one with under 1% of the MACs are pinned to the CVU (or APU) through the model metadata
`surgery.op_target`, so check, quantize and compile all see one segment fewer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from pydantic import Field

from surgery.coverage import PLACEMENT_METADATA_KEY, CoverageReport, Segment, analyze_coverage
from surgery.errors import SurgeryError
from surgery.fold import folded_copy, shapes_wait_for_folding
from surgery.graph import behind_views
from surgery.model import load_model, save_model
from surgery.rules import graph_edit
from surgery.rules.base import WRITES_FILE, Match, Rule, RuleContext, RuleParams
from surgery.rules.engine import RuleFailedError
from surgery.rules.graph_edit import with_unique_node_names
from surgery.rules.registry import register
from surgery.targets import Target, resolve_target
from surgery.verify import OutputComparison, compare_arrays, make_inputs, ort_session, run_model

MAIN_BODY_FRACTION = 0.5
"""The largest MLA segment must hold at least this share of the MACs for islands to exist."""
MAX_ISLAND_FRACTION = 0.01
"""MLA segments (other than the largest) below this share of the model's MACs are islands."""

MAX_TAIL_FRACTION = 0.05
"""A tail with more of the MACs than this is part of the network, not post-processing."""


class CutError(SurgeryError):
    """No post-processing tail can be cut off, or the cut does not reproduce the model."""

    code = "cut_postprocess"


# --------------------------------------------------------------------------- islands


def main_segment(coverage: CoverageReport) -> Segment | None:
    """The MLA segment with the most MACs (ties: the most nodes)."""
    if not coverage.segments:
        return None
    return max(coverage.segments, key=lambda s: (s.macs, len(s.nodes)))


def small_islands(
    coverage: CoverageReport, max_fraction: float = MAX_ISLAND_FRACTION
) -> list[Segment]:
    """MLA segments other than the largest whose MACs are under `max_fraction` of the model's,
    when the largest holds most of the model's MLA work.

    Each such island costs an extra `.elf` and a round trip through DRAM for almost no
    accelerated work, so running it on the host is the better trade. Without a main body (no
    segment with half of the MACs, e.g. a model already quantized with integer ops the MLA does
    not run) there is nothing to trade for: pinning every island would report one `.elf` with
    almost nothing on the MLA. MAC-free models compare node counts instead.
    """
    main = main_segment(coverage)
    if main is None or len(coverage.segments) < 2:
        return []
    total = coverage.total_macs
    live = sum(1 for p in coverage.placements if not p.foldable)
    if (
        (main.macs < MAIN_BODY_FRACTION * total)
        if total
        else (len(main.nodes) < MAIN_BODY_FRACTION * sum(len(s.nodes) for s in coverage.segments))
    ):
        return []
    return [
        s
        for s in coverage.segments
        if s is not main
        and (s.macs < max_fraction * total if total else len(s.nodes) < max_fraction * live)
    ]


# --------------------------------------------------------------------------- cut-postprocess


@dataclass
class CutPlan:
    """Where the body ends: the 4-D maps it outputs and the tail nodes that move off."""

    cut: list[str]
    """Body outputs = post-processing inputs (4-D maps from the main MLA region)."""
    tail: list[str]
    """Nodes of the post-processing model (non-foldable ones)."""
    body_inputs: list[str]
    extra_inputs: list[str]
    """Graph inputs the tail reads directly (fed to the post model as well)."""
    blockers: list[str]
    islands: list[str]
    tail_ops: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "body_outputs": self.cut,
            "post_extra_inputs": self.extra_inputs,
            "tail_nodes": len(self.tail),
            "tail_ops": self.tail_ops,
            "blockers_removed": len(self.blockers),
            "islands_removed": self.islands,
        }


def plan_cut(
    ctx: RuleContext,
    max_island_fraction: float = MAX_ISLAND_FRACTION,
    max_tail_fraction: float = MAX_TAIL_FRACTION,
) -> tuple[CutPlan | None, str]:
    """Find the decode tail by walking back from the outputs; (None, why) when there is none.

    A tensor ends the walk (becomes a body output) when it is 4-D and produced by an MLA node
    outside the small islands; constants end it silently. Everything else it passes through —
    CVU/APU nodes, island nodes such as the DFL softmax-conv, MLA nodes with non-4-D outputs —
    is tail. A tail holding more than `max_tail_fraction` of the MACs is refused: that is the
    network itself (e.g. a transformer's rank-3 layers), not post-processing.
    """
    islands = small_islands(ctx.coverage, max_island_fraction)
    tail, cut, extra = _walk_tail(ctx, {n for s in islands for n in s.nodes})
    if not tail:
        return None, "the graph outputs are 4-D maps of the main MLA region; there is no tail"
    if not cut:
        return None, "no 4-D map from the main MLA region feeds the outputs; nothing to cut at"
    body = _ancestors(ctx, cut)
    why = _refusal(ctx, tail, body, max_tail_fraction)
    if why:
        return None, why
    view = ctx.view
    names = [view.names[i] for i in sorted(tail)]
    blockers = sorted(set(names) & ctx.blocker_names)
    removed = [s.name for s in islands if set(s.nodes) & set(names)]
    if not blockers and not removed:
        return None, "the tail already runs on the MLA; cutting it gains nothing"
    body_inputs = [t for t in view.graph_inputs if _reads_any(ctx, body, t)]
    ops = Counter(view.op_types[i] for i in sorted(tail))
    plan = CutPlan(cut, names, body_inputs, extra, blockers, removed, dict(ops.most_common()))
    return plan, ""


def _walk_tail(ctx: RuleContext, island_nodes: set[str]) -> tuple[set[int], list[str], list[str]]:
    """(tail nodes, body outputs, graph inputs the tail reads), walking back from the outputs."""
    view, placements = ctx.view, ctx.coverage.placements
    graph_inputs = set(view.graph_inputs)
    tail: set[int] = set()
    cut: list[str] = []
    extra: list[str] = []
    seen: set[str] = set()
    stack = list(reversed(view.graph_outputs))
    while stack:
        t = stack.pop()
        if not t or t in seen or t in ctx.constants:
            continue
        seen.add(t)
        if t in graph_inputs:
            extra.append(t)
            continue
        p = view.producer.get(t)
        if p is None:
            continue
        on_body = placements[p].processor == "MLA" and view.names[p] not in island_nodes
        if on_body and view.tensor(t).rank == 4:
            cut.append(t)
            continue
        tail.add(p)
        stack.extend(reversed([i for i in view.node_inputs[p] if i]))
    return tail, cut, extra


def _refusal(ctx: RuleContext, tail: set[int], body: set[int], max_tail_fraction: float) -> str:
    """Why this tail must not be cut off, or "" when it may."""
    overlap = sorted(body & tail)
    if overlap:
        name = ctx.view.names[overlap[0]]
        return f"the tail feeds back into the network (node {name!r}); no clean cut"
    coverage = ctx.coverage
    tail_macs = sum(coverage.placements[i].macs for i in tail)
    if coverage.total_macs and tail_macs > max_tail_fraction * coverage.total_macs:
        share = 100 * tail_macs / coverage.total_macs
        return (
            f"the part after the last 4-D maps holds {share:.0f}% of the MACs; "
            "that is the network itself, not post-processing"
        )
    return ""


def _ancestors(ctx: RuleContext, tensors: list[str]) -> set[int]:
    """Indices of the nodes that `tensors` depend on (run on every `check`: kept lean; empty
    input names need no filtering, nothing produces them)."""
    producer, node_inputs = ctx.view.producer, ctx.view.node_inputs
    found: set[int] = set()
    stack = list(tensors)
    while stack:
        p = producer.get(stack.pop())
        if p is None or p in found:
            continue
        found.add(p)
        stack.extend(node_inputs[p])
    return found


def _reads_any(ctx: RuleContext, nodes: set[int], tensor: str) -> bool:
    return any(tensor in ctx.view.node_inputs[i] for i in nodes)


@dataclass
class CutProof:
    """Original vs body→post on the same inputs: every original output, compared exactly."""

    passed: bool
    bitwise: bool
    outputs: list[OutputComparison]
    seed: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "mode": "exact",
            "bitwise_identical": self.bitwise,
            "seed": self.seed,
            "outputs": [
                {"name": o.name, "passed": o.passed, "max_abs": o.max_abs, "shape": list(o.shape_a)}
                for o in self.outputs
            ],
        }


@dataclass
class CutReport:
    plan: CutPlan
    post_inputs: list[str]
    post_outputs: list[str]
    segments_before: int
    body_segments: int
    body_blockers: int
    body_output_shapes: dict[str, list]
    proof: CutProof
    post_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.plan.to_dict(),
            "body_output_shapes": self.body_output_shapes,
            "post_inputs": self.post_inputs,
            "post_outputs": self.post_outputs,
            "mla_segments_before": self.segments_before,
            "body_mla_segments": self.body_segments,
            "body_single_segment": self.body_segments == 1,
            "body_blockers": self.body_blockers,
            "post_model": self.post_path,
            "proof": self.proof.to_dict(),
        }


def cut_postprocess(
    model: onnx.ModelProto,
    target: str | Target = "mlsoc",
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    max_island_fraction: float = MAX_ISLAND_FRACTION,
    max_tail_fraction: float = MAX_TAIL_FRACTION,
) -> tuple[onnx.ModelProto, onnx.ModelProto, CutReport]:
    """Split `model` into an MLA body (outputs: 4-D per-level maps) and a post-processing model.

    The report carries the proof: the original and body→post are run on the same inputs
    (`inputs`, or seeded random ones) and every original output must match exactly. Raises
    CutError when there is no tail to cut or the proof fails. Where shapes wait for folding,
    the cut is planned on the folded model, as check counts it: unfolded, the MACs after the
    arithmetic are unknown (fcos's GroupNorm heads read as a 0-MAC "tail" of 45 convs).
    """
    tgt = resolve_target(target)
    loaded = with_unique_node_names(load_model(model))
    ctx = planning_context(RuleContext.build(loaded, tgt))
    plan, why = plan_cut(ctx, max_island_fraction, max_tail_fraction)
    if plan is None:
        dynamic = ", ".join(ctx.coverage.dynamic_inputs)
        hint = (
            f"input(s) {dynamic} have dynamic dims; fix them with --input-shape"
            if dynamic
            else None
        )
        raise CutError(f"no post-processing tail to cut: {why}", hint=hint)
    return _cut(ctx, plan, inputs, seed, original=loaded)


def planning_context(ctx: RuleContext) -> RuleContext:
    """The context a cut is planned in: where shapes wait for folding, that of the folded
    model, as check counts it (unfolded, the MACs after the shape arithmetic are unknown and
    the "tail" reaches back into the network); `ctx` itself otherwise."""
    if not shapes_wait_for_folding(ctx.coverage):
        return ctx
    folded = folded_copy(ctx.model, [p.name for p in ctx.coverage.placements])
    return ctx if folded is None else RuleContext.build(folded, ctx.target)


def _cut(
    ctx: RuleContext,
    plan: CutPlan,
    inputs: Mapping[str, np.ndarray] | None,
    seed: int,
    *,
    original: onnx.ModelProto | None = None,
) -> tuple[onnx.ModelProto, onnx.ModelProto, CutReport]:
    """Split `ctx.model` at `plan`; body→post is proven against `original` (default: that
    model; the model as given when the plan was made on its folded copy)."""
    from surgery.split import split_model  # with edit's models: only where a cut is made

    model = ctx.model
    stem = model.graph.name or "model"
    body = split_model(model, plan.body_inputs, plan.cut, name=f"{stem}_body")
    post = _post_model(model, plan, f"{stem}_post")
    proof = prove_cut(original or model, body, post, inputs=inputs, seed=seed)
    if not proof.passed:
        worst = max(proof.outputs, key=lambda o: o.max_abs or 0.0)
        raise CutError(
            f"body→post does not reproduce output {worst.name!r} "
            f"(max abs {worst.max_abs}); the cut was not made"
        )
    body_cov = analyze_coverage(body, ctx.target, suggest=False)
    shapes = {o.name: _dims(o) for o in body.graph.output}
    report = CutReport(
        plan=plan,
        post_inputs=[i.name for i in post.graph.input],
        post_outputs=[o.name for o in post.graph.output],
        segments_before=ctx.coverage.mla_segments,
        body_segments=body_cov.mla_segments,
        body_blockers=len(body_cov.blockers),
        body_output_shapes=shapes,
        proof=proof,
    )
    return body, post, report


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value or d.dim_param or None for d in vi.type.tensor_type.shape.dim]


def _post_model(model: onnx.ModelProto, plan: CutPlan, name: str) -> onnx.ModelProto:
    """The tail as a model; constant chains that read body tensors (Shape→Gather…) are folded."""
    from surgery.split import SplitError, split_model

    outputs = [o.name for o in model.graph.output]
    inputs = plan.cut + plan.extra_inputs
    try:
        return split_model(model, inputs, outputs, name=name)
    except SplitError:
        pass
    return split_model(_folded(model), inputs, outputs, name=name)


def _folded(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = graph_edit.import_graph(model)
    graph_edit.fold_graph_constants(graph)
    return load_model(graph_edit.export_graph(graph, model))


def prove_cut(
    original: onnx.ModelProto,
    body: onnx.ModelProto,
    post: onnx.ModelProto,
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
) -> CutProof:
    """Run original and body→post on the same inputs and compare every original output."""
    feed = dict(inputs) if inputs is not None else make_inputs(original, seed=seed)
    expected = run_model(ort_session(original, label="original model"), feed)
    mid = run_model(ort_session(body, label="body model"), feed)
    got = run_model(ort_session(post, label="post-processing model"), {**feed, **mid})
    comparisons = []
    bitwise = True
    for name, ref in expected.items():
        value = got.get(name, mid.get(name))
        if value is None:
            comparisons.append(_missing(name, ref))
            bitwise = False
            continue
        comparisons.append(compare_arrays(ref, value, exact=True, name=name))
        bitwise = bitwise and ref.shape == value.shape and np.array_equal(ref, value)
    passed = bool(comparisons) and all(c.passed for c in comparisons)
    return CutProof(passed, bitwise, comparisons, None if inputs is not None else seed)


def _missing(name: str, ref: np.ndarray) -> OutputComparison:
    return OutputComparison(
        name=name,
        name_b=name,
        matched_by="name",
        shape_a=ref.shape,
        shape_b=(),
        dtype_a=str(ref.dtype),
        dtype_b="",
        passed=False,
        message=f"output {name!r} is produced by neither body nor post",
    )


class CutParams(RuleParams):
    post: str | None = Field(
        None,
        description="Write the post-processing model to this path (it is also kept in "
        "the match as `split_off`).",
        json_schema_extra=WRITES_FILE,
    )
    max_island_fraction: float = Field(
        MAX_ISLAND_FRACTION,
        gt=0,
        le=1,
        description="MLA segments under this share of the MACs count as decode (e.g. DFL).",
    )
    max_tail_fraction: float = Field(
        MAX_TAIL_FRACTION,
        gt=0,
        le=1,
        description="Refuse a tail holding more than this share of the MACs.",
    )


@dataclass
class CutMatch(Match):
    """A match whose report (body outputs, post model, proof) is part of the rule's result."""

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        report = self.data.get("report")
        plan = self.data.get("plan")
        if report is not None:
            out.update(report.to_dict())
        elif plan is not None:
            out.update(plan.to_dict())
        return out


@register
class CutPostprocess(Rule):
    """Cut the decode tail of a detection/segmentation/pose/text model into its own ONNX model.

    Walks back from the graph outputs over nodes that do not run on the MLA (per-level
    reshapes, concats, sigmoids, anchor and stride arithmetic, NMS/TopK) or run there only as a
    small island (the DFL softmax-conv), up to the 4-D maps of the main MLA region. The model
    becomes the body, whose outputs are those maps; the tail becomes the post-processing model
    (`--param post=PATH`). The result includes the proof that body→post reproduces every
    original output exactly. Never used by `surgery fix`: it changes the model's outputs."""

    name = "cut-postprocess"
    summary = "Cut the post-processing tail (box decode, sigmoid, concat, NMS) into its own model."
    category = "structure"
    changes_outputs = True
    auto = False
    Params = CutParams
    example = "surgery cut-postprocess yolov8n.onnx -o body.onnx --post post.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        assert isinstance(params, CutParams)
        planned = planning_context(ctx)
        plan, _ = plan_cut(planned, params.max_island_fraction, params.max_tail_fraction)
        if plan is None:
            return []
        reason = (
            f"{len(plan.tail)} post-processing node(s) move to a separate model; the body "
            f"ends at {len(plan.cut)} 4-D map(s)"
        )
        data = {"plan": plan, "planned": planned}
        return [CutMatch(self.name, plan.tail, reason, plan.blockers, data)]

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        assert isinstance(params, CutParams)
        match = matches[0]
        plan: CutPlan = match.data["plan"]
        planned: RuleContext = match.data["planned"]
        try:
            body, post, report = _cut(planned, plan, None, 0, original=ctx.model)
        except CutError as exc:
            raise RuleFailedError(f"rule {self.name!r}: {exc.message}") from None
        if params.post:
            report.post_path = str(save_model(post, Path(params.post)))
        match.split_off = post
        match.data["report"] = report
        if planned is ctx:
            tensors = graph.tensors()
            graph.outputs = [tensors[t] for t in plan.cut]
        else:  # planned on the folded model: the body is that model's, as cut_postprocess's
            _become(graph, graph_edit.import_graph(body))
        return [match]


def _become(graph: gs.Graph, other: gs.Graph) -> None:
    """Make `graph` (the engine's, edited in place) hold `other`'s nodes, inputs and outputs."""
    graph.nodes = other.nodes
    graph.inputs = other.inputs
    graph.outputs = other.outputs


# --------------------------------------------------------------------------- place-on-host


@dataclass
class IslandMove:
    """One small MLA segment and the processors its nodes are pinned to."""

    segment: str
    macs: int
    fraction: float
    pins: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "macs": self.macs,
            "mac_fraction": self.fraction,
            "pins": self.pins,
        }


def island_moves(
    coverage: CoverageReport, target: Target, max_fraction: float = MAX_ISLAND_FRACTION
) -> list[IslandMove]:
    """Where each small island goes: the CVU when the op has a CVU placement, else the APU."""
    total = coverage.total_macs
    op_of = {p.name: p.op_type for p in coverage.placements}
    moves = []
    for seg in small_islands(coverage, max_fraction):
        pins = {n: "CVU" if target.supports(op_of[n], "CVU") else "APU" for n in seg.nodes}
        fraction = seg.macs / total if total else 0.0
        moves.append(IslandMove(seg.name, seg.macs, fraction, pins))
    return moves


def merged_pins(model: onnx.ModelProto, new: Mapping[str, str]) -> str:
    """The `surgery.op_target` JSON: existing pins with `new` added (new ones win)."""
    pins: dict[str, str] = {}
    for prop in model.metadata_props:
        if prop.key == PLACEMENT_METADATA_KEY:
            try:
                loaded = json.loads(prop.value)
            except json.JSONDecodeError:
                loaded = None
            if not isinstance(loaded, dict):
                raise SurgeryError(
                    f"model metadata {PLACEMENT_METADATA_KEY!r} is not a JSON object; "
                    "fix or remove it before pinning more nodes"
                )
            pins.update(loaded)
    pins.update(new)
    return json.dumps(pins, sort_keys=True)


def place_on_host(
    model: onnx.ModelProto,
    target: str | Target = "mlsoc",
    *,
    max_fraction: float = MAX_ISLAND_FRACTION,
) -> tuple[onnx.ModelProto, list[IslandMove]]:
    """Pin the small MLA islands of `model` to the host (a copy; the graph is unchanged)."""
    tgt = resolve_target(target)
    loaded = with_unique_node_names(load_model(model))
    moves = island_moves(analyze_coverage(loaded, tgt, suggest=False), tgt, max_fraction)
    if not moves:
        return loaded, []
    pins = {n: p for m in moves for n, p in m.pins.items()}
    out = onnx.ModelProto()
    out.CopyFrom(loaded)
    props = {p.key: p.value for p in out.metadata_props}
    props[PLACEMENT_METADATA_KEY] = merged_pins(loaded, pins)
    del out.metadata_props[:]
    onnx.helper.set_model_props(out, props)
    return out, moves


class PlaceParams(RuleParams):
    max_fraction: float = Field(
        MAX_ISLAND_FRACTION,
        gt=0,
        le=1,
        description="Pin MLA segments (other than the largest) under this share of the MACs.",
    )


@dataclass
class PlacementMatch(Match):
    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        move = self.data.get("move")
        if move is not None:
            out.update(move.to_dict())
        return out


@register
class PlaceOnHost(Rule):
    """Pin small MLA islands to the host: every MLA segment other than the largest whose MACs
    are under 1% of the model's (`--param max_fraction=…`) is assigned to the CVU when its ops
    have a CVU placement on the target, otherwise to the APU. The pins go into the model
    metadata `surgery.op_target`, merged with existing ones, which check, quantize and compile
    all honour. The graph and its numbers do not change; each match removes one segment."""

    name = "place-on-host"
    summary = "Run tiny MLA islands (<1% of MACs) on the CVU/APU: one .elf fewer each."
    category = "placement"
    suggest_for = frozenset()  # it frees no blocker: check need not ask it
    Params = PlaceParams
    example = "surgery apply place-on-host yolov8n.onnx -o pinned.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        assert isinstance(params, PlaceParams)
        matches: list[Match] = []
        for move in island_moves(ctx.coverage, ctx.target, params.max_fraction):
            where = ", ".join(sorted(set(move.pins.values())))
            reason = (
                f"MLA segment {move.segment} ({len(move.pins)} node(s), "
                f"{100 * move.fraction:.3g}% of MACs) runs on the {where}: one .elf fewer"
            )
            matches.append(PlacementMatch(self.name, list(move.pins), reason, [], {"move": move}))
        return matches

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        attr = getattr(graph_edit, "GRAPH_METADATA_ATTR", None)
        if attr is None:
            raise RuleFailedError(
                f"rule {self.name!r} needs export_graph to carry metadata "
                "(graph_edit.GRAPH_METADATA_ATTR); use surgery.rules.structure.place_on_host()"
            )
        pins = {n: p for m in matches for n, p in m.data["move"].pins.items()}
        updates = dict(vars(graph).get(attr) or {})  # gs.Graph.__getattr__ logs misses
        updates[PLACEMENT_METADATA_KEY] = merged_pins(ctx.model, pins)
        setattr(graph, attr, updates)
        return matches


# --------------------------------------------------------------------------- output concat


BOUNDED_OPS = frozenset({"Sigmoid", "Softmax", "Tanh", "HardSigmoid"})
"""Ops whose output lies in a small fixed range (scores, probabilities)."""


def _bounded_source(tensor: str, producers: Mapping[str, onnx.NodeProto]) -> bool:
    """Whether `tensor` is a bounded op's output, through views."""
    node, _ = behind_views(tensor, producers)
    return node is not None and node.op_type in BOUNDED_OPS


def output_concat_tails(coverage: CoverageReport, model: onnx.ModelProto) -> list[list[str]]:
    """Per graph output that is an MLA Concat (or a view of one, through `VIEW_OPS`,
    read by nothing else) of a bounded part (a Sigmoid, Softmax or Tanh output: scores) beside
    an unbounded one: the Concat and those of its views that run on the MLA, output first.

    On the MLA the Concat's output is one int8 tensor with one scale, so a detector's boxes
    (hundreds of pixels) and class scores (0‥1) share steps sized for the boxes, and every
    score rounds to zero. On the host the MLA hands over each part with its own scale; as the
    graph's last op it costs no segment. Parts computed alike (all bounded, or none: a
    concatenation of per-level maps) share one scale well and stay."""
    where = {p.name: p.processor for p in coverage.placements}
    producers = {o: n for n in model.graph.node for o in n.output if o}
    readers: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    outputs = {o.name for o in model.graph.output}
    tails: list[list[str]] = []
    for out in model.graph.output:
        node, views = behind_views(out.name, producers)
        if node is None or node.op_type != "Concat" or len(set(node.input)) < 2:
            continue
        if any(readers.get(v.input[0], 0) != 1 or v.input[0] in outputs for v in views):
            continue  # a view's input is read elsewhere too: not a pure tail
        bounded = [_bounded_source(i, producers) for i in node.input]
        if all(bounded) or not any(bounded):
            continue  # parts alike (e.g. per-level maps) share one scale well
        if where.get(node.name) == "MLA":
            tails.append([n.name for n in (*views, node) if where.get(n.name) == "MLA"])
    return tails


@register
class OutputConcatToHost(Rule):
    """Pin a graph output's Concat (and the Reshape/Transpose views after it) to the host when
    it runs on the MLA: its parts then leave the MLA as separate tensors, each quantized with
    its own scale, and the host concatenates them in float. A detection head's boxes ‖ scores
    output keeps its scores (int8 steps sized for boxes of hundreds of pixels round them all
    to zero). Placement only, through `surgery.op_target` metadata: the graph and its numbers
    do not change, and the Concat being the last op, no segment is added. `surgery fix` runs
    it last."""

    name = "output-concat-to-host"
    summary = "Concatenate a graph output's parts on the host: each part keeps its own int8 scale."
    category = "placement"
    auto = False
    suggest_for = frozenset()  # it frees no blocker: check need not ask it
    example = "surgery apply output-concat-to-host yolov8n_fixed.onnx -o pinned.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        matches: list[Match] = []
        op_of = {p.name: p.op_type for p in ctx.coverage.placements}
        for chain in output_concat_tails(ctx.coverage, ctx.model):
            on_cvu = all(ctx.target.supports(op_of[n], "CVU") for n in chain)
            host = "CVU" if on_cvu else "APU"
            reason = f"the output Concat {chain[-1]} runs on the {host}: each part keeps its scale"
            pins = dict.fromkeys(chain, host)
            matches.append(PlacementMatch(self.name, chain, reason, [], {"pins": pins}))
        return matches

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        attr = getattr(graph_edit, "GRAPH_METADATA_ATTR", None)
        if attr is None:
            raise RuleFailedError(f"rule {self.name!r} needs export_graph to carry metadata")
        pins = {n: p for m in matches for n, p in m.data["pins"].items()}
        updates = dict(vars(graph).get(attr) or {})
        updates[PLACEMENT_METADATA_KEY] = merged_pins(ctx.model, pins)
        setattr(graph, attr, updates)
        return matches


__all__ = [
    "MAX_ISLAND_FRACTION",
    "CutError",
    "CutPlan",
    "CutPostprocess",
    "CutProof",
    "CutReport",
    "IslandMove",
    "OutputConcatToHost",
    "PlaceOnHost",
    "cut_postprocess",
    "island_moves",
    "main_segment",
    "output_concat_tails",
    "place_on_host",
    "plan_cut",
    "prove_cut",
    "small_islands",
]
