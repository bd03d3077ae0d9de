"""`surgery fix`: apply rules until the model maps to one MLA segment, or nothing helps.

Each step re-checks coverage, asks every rule where it applies, and applies the rule whose
matches remove the most current blockers (cleanup rules run first whenever they match). A step
is kept only if it verifies and makes the model better by (segments, blockers, MLA MACs);
otherwise it is rolled back and that rule is not tried again on the same model state. As a last
resort, MLA islands under 1% of the MACs are pinned to the host (`place-on-host`).

A QDQ model is fixed as the float model it quantizes (`surgery.qdq.float_model`), whose
segments `check` and the compiler count: the rules rewrite float graphs, and between Q/DQ
pairs no pattern of theirs would match. The result is a float model, to be quantized again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from surgery.coverage import CoverageReport, dynamic_inputs, pinned_off_the_mla
from surgery.errors import SurgeryError, VerifyError
from surgery.fold import coverage_as_compiled
from surgery.graph import GraphView, shape_text
from surgery.model import input_shape_specs, load_model, recorded_input_shapes
from surgery.rules.base import Rule, RuleContext
from surgery.rules.engine import Reference, RewriteResult, apply_rule, rewritable_model
from surgery.rules.graph_edit import with_unique_node_names
from surgery.rules.registry import all_rules, get_rule
from surgery.rules.suggest import rule_matches
from surgery.targets import Target, resolve_target

StepCallback = Callable[[dict[str, Any]], None]


@dataclass
class FixResult:
    model: onnx.ModelProto
    target: str
    coverage_before: CoverageReport
    coverage_after: CoverageReport
    steps: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    float_source: onnx.ModelProto | None = None
    """The float model the steps rewrote when the input was quantized (`rewritable_model`):
    the input differs from it by its quantization, so the result is verified against it."""

    @property
    def single_elf(self) -> bool:
        return self.coverage_after.single_elf

    def to_dict(self, output: str | None = None) -> dict[str, Any]:
        before, after = self.coverage_before, self.coverage_after
        return {
            "target": self.target,
            "single_elf": after.single_elf,
            "mla_segments_before": before.mla_segments,
            "mla_segments_after": after.mla_segments,
            "mla_mac_fraction_before": round(before.mla_mac_fraction, 6),
            "mla_mac_fraction_after": round(after.mla_mac_fraction, 6),
            "blockers_before": len(before.blockers),
            "blockers_after": len(after.blockers),
            "steps": self.steps,
            "rejected": self.rejected,
            "output": output,
            "remaining_blockers": after.blocker_groups(),
            "notes": self.notes,
        }


LOOK_AHEAD_DEPTH = 2
"""Nested look-aheads `fix_model` may open (each runs a fix of its own from a worse step)."""

MOSTLY_HOST = 0.5
"""Below this share of its MACs on the MLA a model runs mostly on the host, however few its
segments: WavLM's two segments of layer norms hold 0.2 % of the MACs, and lifting its
transformer to 4-D (three segments, 100 %) is the better model."""


def _score(cov: CoverageReport) -> tuple[int, float, int, int, float]:
    """Lower is better: mostly on the host, then (while it is) the MAC share in whole percent,
    then the distance from one segment, then blockers, then MACs off the MLA.

    While a model runs mostly on the host, a segment that brings no MACs is no progress: more
    segments are worse, none included (r3d_18's rank-5 network went from 0 segments to 2 islands
    of 5,120 MACs, which counted as no farther from one segment than 0)."""
    mostly_host = int(cov.mla_mac_fraction < MOSTLY_HOST)
    segments = cov.mla_segments if mostly_host else abs(cov.mla_segments - 1)
    share = -round(cov.mla_mac_fraction, 2) if mostly_host else 0.0
    return (mostly_host, share, segments, len(cov.blockers), -cov.mla_mac_fraction)


def _outcome(cov: CoverageReport) -> tuple[int, int, float, int, int, float]:
    """How good a look-ahead's end is: matrix ops of unknown shape first, then `_score`.

    A model whose shapes are unknown has segments that are not comparable with those of a model
    whose shapes are known: an RT-DETR export whose padding arithmetic leaves every shape after
    the stem unknown counts one "segment" of two nodes with the rest on the host, and folding
    that arithmetic shows the real picture (most of the MACs on the MLA, in several segments).
    """
    return (cov.macs_unknown_nodes, *_score(cov))


def _judge(rule: Rule, before: CoverageReport, after: CoverageReport) -> str:
    """Whether to keep a step (it improves coverage; a cleanup: it keeps segments and
    blockers), look ahead at it (it makes coverage worse, maybe on the way to better) or
    reject it: "keep", "look ahead" or "reject".

    A cleanup that makes coverage worse, or a rewrite that removes blockers (or moves MACs to
    the MLA for as many blockers: an unrolled LSTM whose rank-3 input is still a blocker) but
    splits a segment, is worth fixing on from: lifting a transformer to 4-D can clear most blockers
    and leave a tanh-GELU's Pow(x, 3) between three segments, which pow2-to-mul then joins
    into one. A cleanup is looked ahead at once (folding comes first);
    such a rewrite only when no step improves coverage directly (`fix_model`'s detours), so a
    model the greedy path fixes is fixed as before.
    """
    if rule.category == "cleanup":
        if _score(after)[:4] <= _score(before)[:4]:
            return "keep"
        return "look ahead"
    if _score(after) < _score(before):
        return "keep"
    fewer = len(after.blockers) < len(before.blockers)
    more_macs = (
        len(after.blockers) == len(before.blockers)
        and after.mla_mac_fraction > before.mla_mac_fraction
    )
    return "look ahead" if fewer or more_macs else "reject"


def _unfolded(cov: CoverageReport) -> bool:
    """Nodes that compute constants still in the graph. Check places their consumers as if the
    values were known (a Resize whose sizes are Concat(Shape(x)[:2], …)), but the compiler reads
    the model as it is: such a Resize went to the host and split LR-ASPP's one segment in two."""
    return any(p.foldable for p in cov.placements)


def _candidates(
    rules: Sequence[Rule], ctx: RuleContext, tried: set[str]
) -> list[tuple[int, int, Rule, int]]:
    """(priority, -blockers removed, rule, matches) for every rule that applies."""
    out = []
    blockers = ctx.blocker_names
    order_of = {rule.name: k for k, rule in enumerate(rules)}
    for rule, matches in rule_matches(ctx, [r for r in rules if r.name not in tried]):
        order = order_of[rule.name]
        removed = len({b for m in matches for b in m.blockers} & blockers)
        if rule.category == "cleanup":
            out.append((0, -removed, rule, len(matches)))
        elif removed:
            out.append((1, -removed, rule, order))
    out.sort(key=lambda c: (c[0], c[1], c[3]))
    return out


def fix_model(
    model: onnx.ModelProto | str | os.PathLike,
    target: str | Target = "mlsoc",
    *,
    max_steps: int = 30,
    allow_approximate: bool = False,
    skip: Sequence[str] = (),
    on_step: StepCallback | None = None,
    on_rewrite: Callable[[RewriteResult], None] | None = None,
    inputs: Mapping[str, Any] | None = None,
    look_ahead: bool | int = True,
) -> FixResult:
    """Loop check → best rule → apply → verify → recheck until one MLA segment or no progress.

    `on_step` gets each accepted step's summary (for progress), `on_rewrite` the step itself
    (e.g. to store every step as a workspace version). A cleanup that makes coverage worse
    is kept when fixing on from it (`look_ahead`) ends better than the model before it: folding
    a transformer's shape arithmetic first turns unknown ranks into rank-3 blockers, which only
    the rank-4 rules then remove. "Better" puts known shapes first (`_outcome`). A branch
    looks ahead itself, one level less (`look_ahead` True means `LOOK_AHEAD_DEPTH` levels):
    folding can be the step before a canonical form that is worse by itself too (a Softmax
    NaN guard whose mask only folding made constant).
    """
    tgt = resolve_target(target)
    for name in skip:
        get_rule(name)  # unknown names are an error, not silently ignored
    if not isinstance(model, onnx.ModelProto) or not model.graph.value_info:
        loaded = load_model(model)  # a path, or a model not yet shape-inferred
    else:
        loaded = model
    loaded, float_notes = rewritable_model(loaded)
    start = with_unique_node_names(loaded)
    result = _fix(
        start, tgt, max_steps, allow_approximate, skip, on_step, on_rewrite, inputs, look_ahead
    )
    result.notes[:0] = float_notes
    result.float_source = loaded if float_notes else None
    if not result.coverage_after.blockers:
        result.coverage_after = _as_compiled(result.coverage_after, result.model, tgt)
    else:  # what `surgery check` says of the result, the rules matching its blockers included
        from surgery.check import check_model

        result.coverage_after = check_model(result.model, tgt)
    return result


def _as_compiled(report: CoverageReport, model: onnx.ModelProto, target: Target) -> CoverageReport:
    """The report as `surgery check` gives it: where shapes wait for folding, the coverage of
    the folded model, which is what a compile of this model would count. `model`'s nodes
    carry their coverage labels as names (fix works on such a model throughout)."""
    return coverage_as_compiled(model, report, target, [n.name for n in model.graph.node])


def _fix(
    start: onnx.ModelProto,
    tgt: Target,
    max_steps: int,
    allow_approximate: bool,
    skip: Sequence[str],
    on_step: StepCallback | None,
    on_rewrite: Callable[[RewriteResult], None] | None,
    inputs: Mapping[str, Any] | None,
    look_ahead: bool | int,
) -> FixResult:
    """`fix_model`'s loop on `start` (loaded, nodes named), its coverage that of the model as
    it is (unfolded)."""
    depth = LOOK_AHEAD_DEPTH if look_ahead is True else int(look_ahead)
    options = _FixOptions(allow_approximate, tuple(skip), inputs, depth - 1)
    rules = [
        cls()
        for cls in all_rules()
        if cls.auto and cls.name not in skip and (allow_approximate or cls.exactness == "exact")
    ]
    current = start
    ctx = RuleContext.build(current, tgt)
    result = FixResult(current, tgt.name, _as_compiled(ctx.coverage, start, tgt), ctx.coverage)
    reference: Reference | None = None  # computed on first use: nothing to run if nothing applies
    tried: set[str] = set()
    while len(result.steps) < max_steps:
        if ctx.coverage.single_elf and not ctx.coverage.blockers and not _unfolded(ctx.coverage):
            break
        applied = False
        detours: list[RewriteResult] = []
        for _, _, rule, _ in _candidates(rules, ctx, tried):
            if reference is None:
                reference = _reference_of(current, inputs)
            try:
                step = apply_rule(current, rule, tgt, reference=reference, ctx=ctx)
            except SurgeryError as exc:
                result.rejected.append({"rule": rule.name, "reason": exc.message})
                tried.add(rule.name)
                continue
            verdict = _judge(rule, ctx.coverage, step.coverage_after)
            if verdict == "look ahead" and depth > 0 and rule.category == "cleanup":
                branch = _fix_onwards(step, tgt, max_steps - len(result.steps) - 1, options)
                if branch is not None and _outcome(branch[0].coverage_after) < _outcome(
                    ctx.coverage
                ):
                    return _adopt(result, ctx.coverage, step, *branch, tgt, on_step, on_rewrite)
            elif verdict == "look ahead" and depth > 0:
                detours.append(step)
            if verdict != "keep":
                reason = (
                    "made coverage worse"
                    if rule.category == "cleanup"
                    else "no improvement in segments, blockers or MLA MACs"
                )
                result.rejected.append({"rule": rule.name, "reason": reason})
                tried.add(rule.name)
                continue
            _record(result, step, tgt, on_step, on_rewrite)
            current, reference = step.model, step.reference or reference
            ctx = RuleContext.build(current, tgt)
            # Cleanup rules run once each until a rewrite changes the model's structure (lifting
            # to 4-D can leave a same-shape Expand that only then is a no-op); any other rule
            # may be retried on the new model.
            cleanups = {r for r in tried | {rule.name} if get_rule(r).category == "cleanup"}
            tried = cleanups if rule.category == "cleanup" else set()
            applied = True
            break
        if not applied:
            best = _best_detour(detours, tgt, max_steps - len(result.steps) - 1, options)
            if best is not None and _outcome(best[1].coverage_after) < _outcome(ctx.coverage):
                return _adopt(result, ctx.coverage, *best, tgt, on_step, on_rewrite)
            break
    if (
        ctx.coverage.mla_segments > 1
        and "place-on-host" not in skip
        and len(result.steps) < max_steps
    ):
        current, ctx = _place_small_islands(
            result, current, ctx, tgt, reference, on_step, on_rewrite
        )
    if "output-concat-to-host" not in skip and len(result.steps) < max_steps:
        current, ctx = _output_concats_to_host(
            result, current, ctx, tgt, reference, on_step, on_rewrite
        )
    result.model = current
    result.coverage_after = ctx.coverage
    if not ctx.coverage.single_elf:
        if len(result.steps) >= max_steps:
            result.notes.append(
                f"stopped at {ctx.coverage.mla_segments} MLA segment(s) after the step limit "
                f"({max_steps}); raise it (--max-steps) to go on"
            )
        else:
            result.notes.append(_explain_stop(ctx.coverage))
    return result


@dataclass(frozen=True)
class _FixOptions:
    """The caller's choices a look-ahead branch inherits."""

    allow_approximate: bool
    skip: tuple[str, ...]
    inputs: Mapping[str, Any] | None
    look_ahead: int
    """How many levels a branch may still look ahead itself."""


def _reference_of(model: onnx.ModelProto, inputs: Mapping[str, Any] | None) -> Reference:
    """The model's own outputs, which every step is verified against. A model ONNX Runtime
    cannot run (an exporter bug such as Split's `num_outputs` in an opset-17 model) would
    have every rule rejected for the same reason, so that reason is the error."""
    try:
        return Reference.of(model, inputs)
    except SurgeryError as exc:
        reason = exc.message.removeprefix("parent model: ")
        dynamic = dynamic_inputs(GraphView(model)) if inputs is None else {}
        recorded = recorded_input_shapes(model, dynamic)
        sizes = (
            " ".join(input_shape_specs(recorded)) + " (the size its metadata records)"
            if recorded
            else "NAME=DIMS"
        )
        hint = (
            "its dynamic input dims were fed as 1 ("
            + ", ".join(f"{k}={shape_text(v)}" for k, v in dynamic.items())
            + f"): give real sizes with --input-shape {sizes}, or real inputs with --inputs"
            if dynamic
            else exc.hint  # e.g. an input too large to draw: its own remedy
            or "repair the export (re-export, or a newer opset) so that ONNX Runtime runs it"
        )
        raise VerifyError(
            f"fix verifies every rewrite against the model's own outputs, but {reason}",
            hint=hint,
        ) from None


def _best_detour(
    detours: list[RewriteResult], target: Target, max_steps: int, options: _FixOptions
) -> tuple[RewriteResult, FixResult, list[RewriteResult]] | None:
    """The detour whose fix onwards ends best (`_outcome`), with that branch. Every detour is
    followed, not the first that ends better than the model: the CRNN's BiLSTM reaches one
    segment with its host tail pinned (after a 4-D lift) or with the LSTMs unrolled onto the
    MLA (after recurrent-to-cells), and only the second puts the recurrence on the MLA."""
    best = None
    for step in detours:
        branch = _fix_onwards(step, target, max_steps, options)
        if branch is not None and (
            best is None or _outcome(branch[0].coverage_after) < _outcome(best[1].coverage_after)
        ):
            best = (step, *branch)
    return best


def _fix_onwards(
    step: RewriteResult, target: Target, max_steps: int, options: _FixOptions
) -> tuple[FixResult, list[RewriteResult]] | None:
    """Fix on from a step's model, looking ahead one level less: the branch's result and its
    steps (replayed through the callbacks only if the branch is adopted)."""
    if max_steps <= 0:
        return None
    rewrites: list[RewriteResult] = []
    branch = fix_model(
        step.model,
        target,
        max_steps=max_steps,
        allow_approximate=options.allow_approximate,
        skip=options.skip,
        on_rewrite=rewrites.append,
        inputs=options.inputs,
        look_ahead=options.look_ahead,
    )
    return branch, rewrites


def _adopt(
    result: FixResult,
    before: CoverageReport,
    step: RewriteResult,
    branch: FixResult,
    rewrites: list[RewriteResult],
    target: Target,
    on_step: StepCallback | None,
    on_rewrite: Callable[[RewriteResult], None] | None,
) -> FixResult:
    """Continue `result` with a cleanup step and the branch that fixed on from it."""
    for rewrite in (step, *rewrites):
        _record(result, rewrite, target, on_step, on_rewrite)
    end = branch.coverage_after
    known = (
        f" with the shapes of {before.macs_unknown_nodes - end.macs_unknown_nodes} more "
        "matrix op(s) known"
        if end.macs_unknown_nodes < before.macs_unknown_nodes
        else ""
    )
    result.steps[-len(rewrites) - 1]["look_ahead"] = (
        f"made coverage worse by itself; kept because the {len(rewrites)} step(s) after it "
        f"reach {end.mla_segments} MLA segment(s) and {len(end.blockers)} blocker(s){known}"
    )
    result.rejected.extend(branch.rejected)
    result.notes.extend(branch.notes)
    result.model = branch.model
    result.coverage_after = branch.coverage_after
    return result


def _explain_stop(cov: CoverageReport) -> str:
    """Why the loop ended short of one segment, in terms a user can act on."""
    ops = sorted({b.op_type for b in cov.blockers})
    control = [op for op in ops if op in ("If", "Loop", "Scan")]
    text = (
        f"stopped at {cov.mla_segments} MLA segment(s): no verified rule removes the remaining "
        f"blockers ({', '.join(ops[:12])}{' …' if len(ops) > 12 else ''})"
    )
    if control:
        text += (
            f"; {'/'.join(control)} control flow runs on the APU with its subgraphs (the network "
            "inside the branches is not placed on the MLA) — if an If's boolean input always has "
            "one value (Optimum's use_cache_branch), `surgery apply inline-if-branch --param "
            "value=true` makes that branch the graph; then run fix on that model"
        )
    integer = [op for op in ops if op in _INTEGER_OPS]
    if integer:
        text += (
            f"; the model is already quantized with ONNX Runtime's integer ops "
            f"({', '.join(integer)}), which the MLA does not run: start from the float model "
            "and quantize it with `surgery quantize`"
        )
    if cov.mla_segments == 0:
        text += "; nothing in the top-level graph can run on the MLA"
    return text


_INTEGER_OPS = frozenset(
    {
        "ConvInteger",
        "MatMulInteger",
        "DynamicQuantizeLinear",
        "DynamicQuantizeLSTM",
        "QLinearConv",
        "QLinearMatMul",
        "QLinearAdd",
        "QLinearMul",
    }
)
"""Ops of models quantized by ONNX Runtime's dynamic or operator-oriented quantization."""


def _place_small_islands(
    result: FixResult,
    current: onnx.ModelProto,
    ctx: RuleContext,
    target: Target,
    reference: Reference | None,
    on_step: StepCallback | None,
    on_rewrite: Callable[[RewriteResult], None] | None,
) -> tuple[onnx.ModelProto, RuleContext]:
    """Last resort: pin MLA islands under 1% of the MACs to the host so they stop being .elfs."""
    from surgery.rules.structure import small_islands

    if not small_islands(ctx.coverage, max_fraction=0.01):
        return current, ctx
    step = _try_rule(result, current, "place-on-host", target, reference, ctx)
    if step is None:
        return current, ctx
    _record(result, step, target, on_step, on_rewrite)
    pinned = step.coverage_before.mla_segments - step.coverage_after.mla_segments
    result.notes.append(
        f"place-on-host pinned {pinned} MLA island(s) under 1% of the MACs to the CVU/APU "
        f"(MLA share of MACs now {100 * step.coverage_after.mla_mac_fraction:.2f}%)"
    )
    return step.model, RuleContext.build(step.model, target)


def _output_concats_to_host(
    result: FixResult,
    current: onnx.ModelProto,
    ctx: RuleContext,
    target: Target,
    reference: Reference | None,
    on_step: StepCallback | None,
    on_rewrite: Callable[[RewriteResult], None] | None,
) -> tuple[onnx.ModelProto, RuleContext]:
    """Last: a graph output that is an MLA Concat (boxes ‖ scores) is concatenated on the host,
    so int8 gives each part its own scale; kept only when the segments do not grow."""
    from surgery.rules.structure import output_concat_tails

    if not output_concat_tails(ctx.coverage, current):
        return current, ctx
    step = _try_rule(result, current, "output-concat-to-host", target, reference, ctx)
    if step is None:
        return current, ctx
    if step.coverage_after.mla_segments > step.coverage_before.mla_segments:
        result.rejected.append(
            {"rule": "output-concat-to-host", "reason": "would add an MLA segment"}
        )
        return current, ctx
    _record(result, step, target, on_step, on_rewrite)
    result.notes.append(
        "output-concat-to-host: the output Concat runs on the host, so each of its parts "
        "(e.g. boxes and class scores) is quantized with its own scale"
    )
    return step.model, RuleContext.build(step.model, target)


def _try_rule(
    result: FixResult,
    current: onnx.ModelProto,
    rule: str,
    target: Target,
    reference: Reference | None,
    ctx: RuleContext,
) -> RewriteResult | None:
    """`rule` applied to `current`, or None with the reason in `result.rejected`."""
    try:
        return apply_rule(current, rule, target, reference=reference, ctx=ctx)
    except SurgeryError as exc:
        result.rejected.append({"rule": rule, "reason": exc.message})
        return None


def _record(
    result: FixResult,
    step: RewriteResult,
    target: Target,
    on_step: StepCallback | None,
    on_rewrite: Callable[[RewriteResult], None] | None,
) -> None:
    """Append `step` to `result.steps` with the counts `surgery check` gives before and after
    it: the loop judges the model as it is, but while shapes wait for folding that model's
    segments are not the compiled ones (yolov3u-tiny read "2→2" at a cleanup, then "2→3" at
    fold-constants, of a model check counts at 3 throughout)."""
    after = _as_compiled(step.coverage_after, step.model, target)
    if result.steps:
        last = result.steps[-1]
        segments, blockers, unknown = (
            last["segments_after"],
            last["blockers_after"],
            last["macs_unknown_nodes_after"],
        )
    else:
        before = result.coverage_before
        segments, blockers, unknown = (
            before.mla_segments,
            len(before.blockers),
            before.macs_unknown_nodes,
        )
    entry = {
        "step": len(result.steps) + 1,
        "rule": step.rule,
        "nodes": sorted({n for m in step.matches for n in m.nodes})[:50],
        "matches": len(step.matches),
        "verify": {
            "passed": step.verification.passed,
            "mode": step.verification.mode,
            "max_abs": step.verification.worst_max_abs,
            "max_rel": step.verification.worst_max_rel,
        },
        "segments_before": segments,
        "segments_after": after.mla_segments,
        "blockers_before": blockers,
        "blockers_after": len(after.blockers),
        "pinned_after": sum(pinned_off_the_mla(b) for b in after.blockers),
        "mla_mac_fraction_after": round(after.mla_mac_fraction, 6),
        "macs_unknown_nodes_before": unknown,
        "macs_unknown_nodes_after": after.macs_unknown_nodes,
    }
    result.steps.append(entry)
    if on_rewrite:
        on_rewrite(step)
    if on_step:
        on_step(entry)


def describe_step(step: dict[str, Any], *, ascii_only: bool = False) -> str:
    """One line for a recorded fix step (progress in the CLI and the MCP server), in the counts
    `surgery check` gives. Matrix ops whose shapes stay unknown even folded (a dynamic input)
    leave their MACs out of the count: the line says how many there are while there are some."""
    arrow, times, dash = ("->", "x", ",") if ascii_only else ("→", "×", " —")
    unknown_before, unknown_after = (
        step["macs_unknown_nodes_before"],
        step["macs_unknown_nodes_after"],
    )
    unknown = (
        f" ({unknown_before}{arrow}{unknown_after} matrix ops of unknown shape)"
        if unknown_before or unknown_after
        else ""
    )
    return (
        f"step {step['step']}: {step['rule']} {times}{step['matches']}{dash} segments "
        f"{step['segments_before']}{arrow}{step['segments_after']}{unknown}, blockers "
        f"{step['blockers_before']}{arrow}{step['blockers_after']}{pinned_text(step)}"
    )


def pinned_text(step: dict[str, Any]) -> str:
    """ " (n pinned to the host)" when blockers after the step are there only by a pin: a
    placement step (output-concat-to-host) adds them on purpose, not as a regression."""
    pinned = step.get("pinned_after", 0)
    return f" ({pinned} pinned to the host)" if pinned else ""
